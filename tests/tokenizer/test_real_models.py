"""Real models' tokenizers: every llama.cpp pre-tokenizer name against transformers' GGUF tokenizer (or against
llama.cpp's own regexes where transformers does not know the name), special tokens written in the text, the roles
of special tokens read from the model's files, and one-line errors for tokenizers that cannot be built."""
import json
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli

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
    regex = pytest.importorskip("regex")
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
    docs = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text(encoding="utf-8")
    for name in t["names"]:
        assert f"| `{name}` |" in docs, name


# ------------------------------------------------------------------------------------------------ special tokens
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|start_header_id|>",
          "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
CHAT_TEXT = ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello, 世界! It's 12345 🙂"
             "<|im_end|>\n<|im_start|>assistant\n<|im_start|x <|im_end|><|im_end|>")
LLAMA3_TEXT = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi, it's 2024 🙂<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|x<|end_of_text|>")


def hf_tokenizer_dir(directory: Path, specials: list[str], pre: str, files: dict) -> Path:
    """A Hugging Face tokenizer directory built from ``tokenizers`` objects: a byte-level BPE trained on the
    test corpus with ``pre``'s split pattern, ``specials`` appended as special added tokens, and ``files``
    (name -> JSON content) beside it."""
    from tokenizers import Tokenizer, decoders, models, trainers

    hf = Tokenizer(models.BPE(ignore_merges=pretokenizers.resolve(pre).ignore_merges))
    hf.pre_tokenizer = pretokenizers.build(pretokenizers.resolve(pre))
    hf.decoder = decoders.ByteLevel()
    from tokenizers import pre_tokenizers

    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(CORPUS * 20, trainer=trainer)
    hf.add_special_tokens(specials)
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content), encoding="utf-8")
    return directory


def chatml_dir(root: Path, **config) -> Path:
    from tokenizers import Tokenizer

    d = hf_tokenizer_dir(root / "chatml", CHATML, "qwen2", {})
    ids = {t: Tokenizer.from_file(str(d / "tokenizer.json")).token_to_id(t) for t in CHATML}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
                        "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False,
                        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False,
                                                          "rstrip": False, "normalized": False, "single_word": False}
                                                 for t, i in ids.items()}, **config}
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
    return d


def llama3_dir(root: Path) -> Path:
    from tokenizers import Tokenizer

    d = hf_tokenizer_dir(root / "llama3", LLAMA3, "llama-bpe", {})
    ids = {t: Tokenizer.from_file(str(d / "tokenizer.json")).token_to_id(t) for t in LLAMA3}
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|begin_of_text|>"],
         "eos_token_id": [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]}))
    return d


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
def test_special_tokens_in_text_match_transformers(kind, tmp_path):
    """``encode(text, special=True)`` gives transformers' ids (``split_special_tokens=False``, its default) on
    text full of special tokens, near misses (``<|im_start|x``) included; plain ``encode`` keeps them as text,
    like transformers with ``split_special_tokens=True``."""
    transformers = pytest.importorskip("transformers")
    from minigpt.checkpoint.native import load_tokenizer

    d, text = (chatml_dir(tmp_path), CHAT_TEXT) if kind == "chatml" else (llama3_dir(tmp_path), LLAMA3_TEXT)
    ours = load_tokenizer(d)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    special = ours.encode(text, special=True)
    assert special == theirs(text, add_special_tokens=False).input_ids
    plain = ours.encode(text)
    assert plain == theirs(text, add_special_tokens=False, split_special_tokens=True).input_ids
    assert len(special) < len(plain)
    assert set(ours.special_tokens) == set(CHATML if kind == "chatml" else LLAMA3)
    assert ours.decode(special) == text == ours.decode(plain)
    assert ours.encode(text, bos=False, eos=True, special=True) == special + [ours.eos_id]


def test_special_encoding_is_linear_in_the_text(tmp_path):
    """Many specials and a long text: the same ids as encoding each chunk, so nothing is matched across chunks
    and no special is missed (the cost is one pass; no timing is asserted)."""
    from minigpt.checkpoint.native import load_tokenizer

    tok = load_tokenizer(chatml_dir(tmp_path))
    long_text = CHAT_TEXT * 200
    assert tok.encode(long_text, special=True) == tok.encode(CHAT_TEXT, special=True) * 200


# ------------------------------------------------------------------------------------------------ roles
def test_chatml_roles_come_from_its_files(tmp_path):
    """bos_token null means no BOS (not <|endoftext|> by name); eos from tokenizer_config.json; every
    eos_token_id of generation_config.json stops; all as transformers reads them."""
    transformers = pytest.importorskip("transformers")
    from minigpt.checkpoint.native import load_tokenizer

    d = chatml_dir(tmp_path)
    ours, theirs = load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
    im_end, eot = ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.unk_id) == (None, im_end, eot, None)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (None, im_end, eot)
    generation = transformers.GenerationConfig.from_pretrained(d)
    assert ours.stop_ids == (im_end, eot) and set(ours.stop_ids) == set(generation.eos_token_id)
    assert ours.add_bos is False


def test_special_tokens_map_overrides_a_config_without_added_tokens(tmp_path):
    """transformers' precedence: special_tokens_map.json overrides tokenizer_config.json only when the latter has
    no added_tokens_decoder (older files)."""
    transformers = pytest.importorskip("transformers")
    from minigpt.checkpoint.native import load_tokenizer

    d = chatml_dir(tmp_path, added_tokens_decoder=None)
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"},
                                                           "bos_token": "<|im_start|>"}))
    ours, theirs = load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.eos_id == ours.token_to_id("<|endoftext|>") and ours.bos_id == ours.token_to_id("<|im_start|>")
    config["added_tokens_decoder"] = {}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(d).eos_id == ours.token_to_id("<|im_end|>")


def test_llama3_end_of_turn_and_end_of_text_both_stop(tmp_path):
    """Llama 3: <|eot_id|> (tokenizer_config eos), <|end_of_text|> and <|eom_id|> (generation_config) stop; the
    same vocabulary in a GGUF stops on eos, eot / eom metadata and llama.cpp's end-of-generation names."""
    from minigpt.checkpoint.native import load_tokenizer
    from minigpt.tokenizer.interop import vocab_from_file

    ours = load_tokenizer(llama3_dir(tmp_path))
    eot, end, eom, bos = (ours.token_to_id(t) for t in ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
                                                         "<|begin_of_text|>"))
    assert (ours.bos_id, ours.eos_id) == (bos, eot)
    assert ours.stop_ids == (eot, end, eom)

    vocab = vocab_from_file(tmp_path / "llama3" / "tokenizer.json")
    assert vocab.pre == "llama-bpe"
    vocab.bos_id, vocab.eos_id, vocab.eot_id = bos, end, eot
    g = load_tokenizer(write_vocab_gguf(tmp_path / "l3.gguf", vocab))
    assert (g.bos_id, g.eos_id) == (bos, end) and set(g.stop_ids) == {end, eot, eom}
    assert g.encode(LLAMA3_TEXT, special=True) == ours.encode(LLAMA3_TEXT, special=True)


def test_names_are_only_a_fallback(tmp_path):
    """A bare tokenizer.json (no side files): BOS/EOS by name, and end-of-turn tokens found by name also stop."""
    from minigpt.tokenizer.tokenizer import Tokenizer

    d = hf_tokenizer_dir(tmp_path / "bare", CHATML, "qwen2", {})
    tok = Tokenizer.from_dir(d)
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    assert (tok.bos_id, tok.eos_id) == (eot, eot) and tok.stop_ids == (eot, im_end)


def test_sentencepiece_roles_and_special_text(shared_data):
    """stories260K (SentencePiece): <s> = 1 is BOS, </s> = 2 EOS and the only stop id, <unk> = 0, no pad,
    add_bos_token true (its tokenizer_config.json); "<s>" written in text is BOS with special=True and the text
    around it is encoded piece by piece, as transformers' legacy Llama tokenizer does."""
    import sentencepiece as spm

    from minigpt.checkpoint.native import load_tokenizer

    folder = shared_data / "models" / "stories260K" / "hf"
    ours = load_tokenizer(folder)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert (ours.bos_id, ours.eos_id, ours.unk_id, ours.pad_id, ours.stop_ids) == (1, 2, 0, None, (2,))
    assert ours.add_bos is True and ours.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2}
    assert ours.encode("<s>Once upon a time</s>", special=True) == [1] + sp.encode("Once upon a time") + [2]
    assert ours.encode("Lily said <s> hi", special=True) == sp.encode("Lily said ") + [1] + sp.encode(" hi")
    assert ours.encode("<s>Once") == sp.encode("<s>Once") and 1 not in ours.encode("<s>Once")


def test_import_keeps_roles_and_stop_ids(tmp_path):
    """A GGUF with eot metadata imported into a MiniGPT directory keeps its roles (written as
    tokenizer_config.json / generation_config.json) and its special tokens."""
    import torch

    from minigpt.checkpoint.native import import_model, load_tokenizer, model_state_dict
    from minigpt.model.config import ModelConfig
    from minigpt.model.transformer import Transformer
    from minigpt.tokenizer.interop import vocab_from_file

    ours = load_tokenizer(llama3_dir(tmp_path))
    vocab = vocab_from_file(tmp_path / "llama3" / "tokenizer.json")
    vocab.bos_id, vocab.eos_id, vocab.eot_id = ours.bos_id, ours.token_to_id("<|end_of_text|>"), ours.eos_id
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=ours.vocab_size, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                    hidden_dim=64, max_seq_len=32))
    gguf_io.write_gguf(model_state_dict(model), model.config, tmp_path / "m.gguf", vocab=vocab)
    before = load_tokenizer(tmp_path / "m.gguf")
    import_model(tmp_path / "m.gguf", tmp_path / "imported")
    after = load_tokenizer(tmp_path / "imported")
    assert (after.bos_id, after.eos_id, after.stop_ids) == (before.bos_id, before.eos_id, before.stop_ids)
    assert after.encode(LLAMA3_TEXT, special=True) == before.encode(LLAMA3_TEXT, special=True)


# ------------------------------------------------------------------------------------------------ errors
def tiny_gguf(path: Path, vocab: Vocab) -> Path:
    import torch

    from minigpt.checkpoint.native import model_state_dict
    from minigpt.model.config import ModelConfig
    from minigpt.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=len(vocab.tokens), dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                    hidden_dim=64, max_seq_len=32))
    return gguf_io.write_gguf(model_state_dict(model), model.config, path, vocab=vocab)


@pytest.mark.slow
@pytest.mark.parametrize("change,fragments", [
    ({"model": "bert"}, ["tokenizer model 'bert'", "'gpt2'", "--tokenizer FILE"]),
    ({"merges": None}, ["byte-level BPE vocabulary has no merges", "tokenizer.ggml.merges", "--tokenizer FILE"]),
    ({"model": "llama", "scores": None}, ["SentencePiece vocabulary has no scores", "--tokenizer FILE"]),
])
def test_import_of_an_unbuildable_tokenizer_fails_and_writes_nothing(change, fragments, byte_vocab, tmp_path):
    """`minigpt import` of a GGUF whose tokenizer cannot be built exits 1 with one line naming the file, what is
    unsupported and what to do, and leaves no output directory (it used to print `wrote DIR` without a
    tokenizer); `generate` on the same file fails with the same line."""
    byte_vocab.pre = "gpt-2"
    path = tiny_gguf(tmp_path / "m.gguf", Vocab(**{**byte_vocab.__dict__, **change}))
    proc = run_cli("import", path, tmp_path / "out")
    assert_one_line_error(proc, str(path), *fragments)
    assert not (tmp_path / "out").exists()
    assert_one_line_error(run_cli("generate", path, "--prompt", "hi", "--max-new-tokens", 2), str(path),
                          *fragments)


def test_import_with_an_unknown_pre_tokenizer_warns_once_and_imports(byte_vocab, tmp_path):
    byte_vocab.pre = "brand-new-model"
    path = tiny_gguf(tmp_path / "m.gguf", byte_vocab)
    proc = run_cli("import", path, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("warning: ") and "'brand-new-model'" in line
    assert (tmp_path / "out" / "tokenizer.json").is_file() and proc.stdout.strip() == f"wrote {tmp_path / 'out'}"


def test_import_of_a_gguf_without_tokenizer_writes_the_model_alone(tmp_path):
    from minigpt.checkpoint.native import model_state_dict
    from minigpt.model.config import ModelConfig
    from minigpt.model.transformer import Transformer

    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                    max_seq_len=32))
    path = gguf_io.write_gguf(model_state_dict(model), model.config, tmp_path / "m.gguf")
    proc = run_cli("import", path, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert_one_line_error(run_cli("generate", tmp_path / "out", "--prompt", "hi"), "no tokenizer in")


# ------------------------------------------------------------------------------------------------ tensor types
def _dequantizable_types() -> set[str]:
    """Every block type gguf-py can dequantize, found by asking it."""
    import numpy as np

    out = set()
    for t in gguf.GGMLQuantizationType:
        if t not in gguf.GGML_QUANT_SIZES or t.name in ("F64", "I8", "I16", "I32", "I64"):
            continue
        block, size = gguf.GGML_QUANT_SIZES[t]
        try:
            gguf.quants.dequantize(np.zeros((1, size), np.uint8), t)
        except NotImplementedError:
            continue
        out.add(t.name)
    return out


def test_every_type_gguf_dequantizes_is_read():
    assert set(gguf_io.READ_TYPES) == _dequantizable_types()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random bytes make some fp16 scales inf / NaN
@pytest.mark.parametrize("qname", [t for t in gguf_io.READ_TYPES if t not in ("F32", "F16", "BF16")])
def test_quantized_tensors_load_as_gguf_dequantizes_them(qname, tmp_path, monkeypatch):
    """Every matrix of a model stored as random blocks of ``qname``: the model loads, and each weight equals
    gguf-py's own ``gguf.quants.dequantize`` of the stored bytes (q/k rows un-permuted as llama.cpp permuted them)."""
    import numpy as np
    import torch

    from minigpt.checkpoint.native import load_model, model_state_dict
    from minigpt.model.config import ModelConfig
    from minigpt.model.rope import interleaved_to_half
    from minigpt.model.transformer import Transformer

    qtype = gguf.GGMLQuantizationType[qname]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    original = gguf_io._add_tensor

    def random_blocks(writer, name, array, _):
        if array.ndim < 2:
            return original(writer, name, array, gguf.GGMLQuantizationType.F32)
        rng = np.random.default_rng(len(name))
        raw = rng.integers(0, 256, (array.shape[0], array.shape[1] // block * size), dtype=np.uint8)
        writer.add_tensor(name, raw, raw_dtype=qtype)

    config = ModelConfig(vocab_size=64, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=256, max_seq_len=16)
    model = Transformer(config)
    monkeypatch.setattr(gguf_io, "_add_tensor", random_blocks)
    path = gguf_io.write_gguf(model_state_dict(model), config, tmp_path / "m.gguf")
    monkeypatch.setattr(gguf_io, "_add_tensor", original)
    loaded = load_model(path).state_dict()
    for t in gguf.GGUFReader(path).tensors:
        if len(t.shape) < 2:
            continue
        assert t.tensor_type == qtype
        expected = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, qtype), np.float32))
        key = gguf_io.from_gguf_key(t.name)
        if key.endswith("wq.weight"):
            expected = interleaved_to_half(expected, config.n_heads)
        elif key.endswith("wk.weight"):
            expected = interleaved_to_half(expected, config.n_kv_heads)
        torch.testing.assert_close(loaded[key], expected, rtol=0, atol=0, equal_nan=True, msg=key)
