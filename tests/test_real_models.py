"""Real models' tokenizers: every llama.cpp pre-tokenizer name against transformers' GGUF tokenizer (or against
llama.cpp's own regexes where transformers does not know the name), special tokens written in the text, the roles
of special tokens read from the model's files, and one-line errors for tokenizers that cannot be built."""
import json
from pathlib import Path

import pytest
import regex

import minigpt.interop.gguf as gguf_io
from minigpt.tokenizer import pretokenizers
from minigpt.tokenizer.interop import CONTROL, NORMAL, Vocab

gguf = pytest.importorskip("gguf")

# Digits of every length, contractions in both cases, runs of spaces, tabs, CRLF, accents, CJK, Cyrillic,
# Arabic, Hangul, emoji with a skin-tone modifier (two code points), punctuation runs and code.
TEXT = ("Hello, World! It's 2024; we'll pay $1,234,567.89 - don't WORRY, I'M fine.\tcafé naïve Ünïcödé\n\n"
        "  日本語のテキスト、中文字符。한국어 텍스트 Привет, мир! مرحبا بالعالم 🙂👍🏽 x=1+2;   end\r\n"
        "THE END'S 1234567890 ((a)) ... camelCaseWord McDonald's iPhone XMLHttpRequest\n")
CORPUS = [TEXT, TEXT.lower(), TEXT.upper(), "12 123 1234 12345 123456 0.5 3.14159 2,000,000"]


@pytest.fixture(scope="module")
def byte_vocab() -> Vocab:
    """A byte-level BPE whose merges were learned *without* pre-splitting, so they cross word, digit and space
    boundaries: any difference in how text is split changes the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from minigpt.data.sources import BUNDLED

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    shakespeare = BUNDLED["shakespeare"].path.read_text(encoding="utf-8")[:30000]
    hf.train_from_iterator(CORPUS * 20 + shakespeare.split("\n\n"), trainer=trainer)
    d = json.loads(hf.to_str())
    vocab = d["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [CONTROL if t == "<|endoftext|>" else NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]]
    return Vocab(model="gpt2", tokens=tokens, types=types, merges=merges, bos_id=0, eos_id=0)


def write_vocab_gguf(path: Path, vocab: Vocab) -> Path:
    """A GGUF holding only a llama architecture tag and the tokenizer metadata (no tensors)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    gguf_io._add_vocab(writer, vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_split(text: str, regexes) -> list[str]:
    """llama.cpp's ``unicode_regex_split``: each regex in turn splits every piece into its matches and the text
    between them (an independent implementation with the ``regex`` package)."""
    pieces = [text]
    for pattern in regexes:
        out = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(pattern, piece):
                if m.start() > pos:
                    out.append(piece[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


def transformers_splits() -> dict:
    """The pre-tokenizer names transformers' GGUF loader knows; every other name gets GPT-2's ByteLevel there."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return {}
    return GGUF_PRE_TOKENIZER_SPLITS


GPT2_SPLITS = pretokenizers.resolve("gpt-2").splits


def _reference(name: str) -> str:
    if name in transformers_splits() or pretokenizers.resolve(name).splits == GPT2_SPLITS:
        return "transformers"
    return "llama.cpp"


# ------------------------------------------------------------------------------------------------ pre-tokenizers
@pytest.mark.parametrize("name", pretokenizers.known_names())
def test_pre_tokenizer_matches_its_reference(name, byte_vocab, tmp_path, capsys):
    """Ids of our tokenizer built from a GGUF with this ``tokenizer.ggml.pre`` equal transformers' GGUF tokenizer
    for the names transformers knows (and for GPT-2's pattern, its default); for the other names, our split
    pieces equal llama.cpp's regex list applied with llama.cpp's splitting rule."""
    from minigpt.checkpoint.native import load_tokenizer

    byte_vocab.pre = name
    path = write_vocab_gguf(tmp_path / "tok.gguf", byte_vocab)
    ours = load_tokenizer(path)
    assert "warning" not in capsys.readouterr().err
    if _reference(name) == "transformers":
        transformers = pytest.importorskip("transformers")
        theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
        assert ours.encode(TEXT) == theirs(TEXT, add_special_tokens=False).input_ids
    else:
        entry = pretokenizers.table()["types"][pretokenizers.resolve(name).kind]
        # llama.cpp's own spelling of each regex; a pseudo-property that selects a hand-written splitter
        # (\p{AFMoE_digits}) stands for the regex llama.cpp routes to the same splitter.
        llama_cpp = [r["regex"] if "handler" not in r or r["split"] == r["regex"] else r["split"]
                     for r in entry["regexes"]]
        pieces = [p for p, _ in ours._hf.pre_tokenizer.pre_tokenize_str(TEXT)]
        assert pieces == [_byte_level(p) for p in llama_cpp_split(TEXT, llama_cpp)]
    assert ours.decode(ours.encode(TEXT)) == TEXT


def _byte_level(text: str) -> str:
    from tokenizers import pre_tokenizers

    (piece, _), = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    return piece


def test_pre_tokenizers_differ_on_the_test_text(byte_vocab, tmp_path):
    """The parity above is not vacuous: the families split the test text into different ids."""
    from minigpt.checkpoint.native import load_tokenizer

    seen = {}
    for name in ("gpt-2", "llama-bpe", "qwen2", "tekken", "gpt-4o", "deepseek-llm", "default", "bloom"):
        byte_vocab.pre = name
        seen[name] = tuple(load_tokenizer(write_vocab_gguf(tmp_path / f"{name}.gguf", byte_vocab)).encode(TEXT))
    assert len(set(seen.values())) == len(seen), seen


@pytest.mark.parametrize("pre,why", [("no-such-pre", "not in llama.cpp's table"), (None, "no tokenizer.ggml.pre"),
                                     ("kimi-k2", "hand-written code")])
def test_unknown_pre_tokenizer_warns_once_and_falls_back_to_gpt2(pre, why, byte_vocab, tmp_path, capsys):
    """An unknown name loads with GPT-2's pattern (what transformers does too) and exactly one warning line that
    names the file and the consequence."""
    from minigpt.checkpoint.native import load_tokenizer

    gpt2 = Vocab(**{**byte_vocab.__dict__, "pre": "gpt-2"})
    expected = load_tokenizer(write_vocab_gguf(tmp_path / "gpt2.gguf", gpt2)).encode(TEXT)
    byte_vocab.pre = pre
    path = write_vocab_gguf(tmp_path / "tok.gguf", byte_vocab)
    capsys.readouterr()
    assert load_tokenizer(path).encode(TEXT) == expected
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: ") and str(path) in line and why in line and "GPT-2" in line


def test_table_lists_every_name_with_its_source_line():
    """Each name points at a line of llama-vocab.cpp (or at the later commit that added it), and docs/models.md
    has one row per name."""
    t = pretokenizers.table()
    assert t["source"]["path"] == "src/llama-vocab.cpp" and len(t["source"]["commit"]) == 40
    for name, entry in t["names"].items():
        assert entry["type"] in t["types"], name
        assert entry["line"] or entry.get("commit"), name
    for kind, entry in t["types"].items():
        assert entry["line"] > 0 and all(r["line"] > entry["line"] for r in entry["regexes"]), kind
    docs = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text(encoding="utf-8")
    for name in t["names"]:
        assert f"| `{name}` |" in docs, name
