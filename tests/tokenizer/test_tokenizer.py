"""Tokenizer: exact round trips, special ids, save/load identity, streaming decode, sentencepiece models."""
import json
import random

import pytest

from minigpt.errors import MiniGPTError
from minigpt.tokenizer.tokenizer import SPECIAL_TOKENS, StreamDecoder, Tokenizer, train_tokenizer

CHINESE = "床前明月光，疑是地上霜。\n舉頭望明月，低頭思故鄉。"
EMOJI = "family 👩‍👩‍👧 flag 🇫🇷 thumbs 👍🏽 and 🎉!"
TRAIN_TEXTS = [
    "The quick brown fox jumps over the lazy dog.\nTo be, or not to be, that is the question.\n" * 5,
    (CHINESE + "\n") * 5,
    EMOJI * 3,
    "def f(x):\n    return x + 1\n\n\tindented\n" * 3,
]
ROUND_TRIP = [
    "Hello, world! It's 2024; numbers 3.14159 and 1e-9.",
    CHINESE,
    EMOJI,
    "👩‍👩‍👧",
    "   leading spaces, double  spaces,\ttabs\t\tand trailing   ",
    "\n\n\nnewlines\r\nCRLF\n \n  \n",
    "mixed 中文 English 日本語 한국어 العربية עברית",
    "zero\u200bwidth, combining e\u0301, replacement \ufffd, NUL \x00 end",
    "literal special tokens <|endoftext|> and <|pad|> are just text",
    "",
]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_tokenizer(TRAIN_TEXTS, vocab_size=350)


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_exact(bpe, text):
    ids = bpe.encode(text)
    assert all(isinstance(i, int) and 0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text


def test_round_trip_random_bytes(bpe):
    rng = random.Random(0)
    for n in (1, 7, 100, 1000):
        text = bytes(rng.randrange(256) for _ in range(n)).decode("utf-8", errors="replace")
        assert bpe.decode(bpe.encode(text)) == text


def test_round_trip_unseen_characters(bpe):
    # Characters absent from the training text still encode (as byte tokens) and decode exactly.
    text = "Ωμέγα ∮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ"
    assert bpe.decode(bpe.encode(text)) == text


def test_special_token_ids(bpe):
    assert SPECIAL_TOKENS == ["<|endoftext|>", "<|pad|>"]
    assert bpe.token_to_id("<|endoftext|>") == 0 and bpe.token_to_id("<|pad|>") == 1
    assert bpe.bos_id == bpe.eos_id == 0
    assert bpe.pad_id == 1
    assert bpe.vocab_size == 350
    ids = bpe.encode("hi", bos=True, eos=True)
    assert ids[0] == 0 and ids[-1] == 0 and ids[1:-1] == bpe.encode("hi")
    assert bpe.decode(ids) == "<|endoftext|>hi<|endoftext|>"


def test_literal_special_text_is_not_a_special_token(bpe):
    # A document containing the separator's spelling must not create a fake document boundary.
    ids = bpe.encode("a<|endoftext|>b<|pad|>")
    assert 0 not in ids and 1 not in ids


def test_vocab_size_validation():
    for bad in (0, 258, 2**32 + 1):
        with pytest.raises(ValueError, match="vocab_size"):
            train_tokenizer(["abc"], bad)
    with pytest.raises(ValueError, match="int"):
        train_tokenizer(["abc"], "300")


def test_small_corpus_gives_smaller_vocab():
    tok = train_tokenizer(["ab ab ab"], vocab_size=1000)
    assert 259 <= tok.vocab_size < 1000
    assert tok.decode(tok.encode("ab ba")) == "ab ba"


def test_encode_batch_matches_encode(bpe):
    texts = ROUND_TRIP[:6]
    assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]


def test_save_load_identity(bpe, tmp_path):
    path = bpe.save(tmp_path / "tokenizer.json")
    assert path == tmp_path / "tokenizer.json" and path.is_file()
    json.loads(path.read_text(encoding="utf-8"))  # plain tokenizer.json
    for loaded in (Tokenizer.from_file(path), Tokenizer.from_dir(tmp_path)):
        assert loaded.sha256 == bpe.sha256
        assert loaded.vocab_size == bpe.vocab_size
        assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (0, 0, 1)
        for text in ROUND_TRIP:
            assert loaded.encode(text) == bpe.encode(text)
    # Saving to a directory uses the canonical name; a second save/load keeps the hash.
    again = Tokenizer.from_file(Tokenizer.from_dir(tmp_path).save(tmp_path / "sub"))
    assert again.sha256 == bpe.sha256
    assert len(bpe.sha256) == 64


def test_sha256_differs_between_tokenizers(bpe):
    other = train_tokenizer(TRAIN_TEXTS[:1], vocab_size=300)
    assert other.sha256 != bpe.sha256


def test_from_dir_without_tokenizer(tmp_path):
    with pytest.raises(MiniGPTError) as e:
        Tokenizer.from_dir(tmp_path)
    msg = str(e.value)
    assert str(tmp_path) in msg and "tokenizer.json" in msg and "tokenizer.model" in msg


def test_from_file_errors(tmp_path):
    with pytest.raises(MiniGPTError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "nope.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(MiniGPTError, match="cannot read tokenizer"):
        Tokenizer.from_file(bad)


def test_foreign_tokenizer_json_specials_by_name(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, None)
    assert tok.encode("hello", bos=True, eos=True) == [1, 3, 2]


def _stream(tok, ids):
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return pieces


def test_stream_decoder_chinese_and_emoji(bpe):
    text = "月光 " + CHINESE + " 👩‍👩‍👧 ok 🇫🇷 " + "漢字 tail ß"
    ids = bpe.encode(text)
    pieces = _stream(bpe, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # The test is only meaningful if some character did span several tokens (so text was held back).
    assert pieces[:-1].count("") > 0


def test_stream_decoder_holds_back_partial_characters(bpe):
    # The four single-byte tokens of one 4-byte emoji, fed one at a time: nothing until the last byte.
    emoji = "🎉"
    byte_char = _byte_level_map()
    ids = [bpe.token_to_id(byte_char[b]) for b in emoji.encode("utf-8")]
    assert None not in ids and bpe.decode(ids) == emoji
    dec = StreamDecoder(bpe)
    assert [dec.push(i) for i in ids] == ["", "", "", emoji]
    assert dec.flush() == ""


def _byte_level_map():
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to U+0100 upwards.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def test_stream_decoder_flush_emits_incomplete_tail(bpe):
    ids = bpe.encode("a明")[:-1]  # drop the last byte-level piece of 明
    pieces = _stream(bpe, ids)
    assert "".join(pieces) == bpe.decode(ids)


def test_stream_decoder_window_stays_small(bpe):
    dec = StreamDecoder(bpe)
    for i in bpe.encode("word " * 200):
        dec.push(i)
    assert len(dec._ids) <= 4  # O(window), not O(sequence)


def test_sentencepiece_model(shared_data, tmp_path):
    import sentencepiece as spm

    hf_dir = shared_data / "models" / "stories260K" / "hf"
    tok = Tokenizer.from_dir(hf_dir)
    assert tok.backend == "sentencepiece"
    assert tok.vocab_size == 512
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, None)
    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    text = "Once upon a time, there was a little girl named Lily."
    assert tok.encode(text) == sp.encode(text)
    assert tok.encode(text, bos=True, eos=True) == [1] + sp.encode(text) + [2]
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch([text, "Hi"]) == [sp.encode(text), sp.encode("Hi")]
    # byte fallback: unseen characters round-trip too
    assert tok.decode(tok.encode("月 👩‍👩‍👧")) == "月 👩‍👩‍👧"
    # save copies the .model bytes; the hash survives
    saved = tok.save(tmp_path)
    assert saved.name == "tokenizer.model"
    assert saved.read_bytes() == (hf_dir / "tokenizer.model").read_bytes()
    assert Tokenizer.from_dir(tmp_path).sha256 == tok.sha256
    # a caller that asks for tokenizer.json still gets a loadable tokenizer.model
    assert tok.save(tmp_path / "ckpt" / "tokenizer.json") == tmp_path / "ckpt" / "tokenizer.model"
    assert Tokenizer.from_dir(tmp_path / "ckpt").sha256 == tok.sha256
    # streaming keeps the spaces sentencepiece would drop at the start of a fresh decode
    story = "Lily saw 月 and 👍 in the park. She was happy."
    pieces = _stream(tok, tok.encode(story))
    assert "".join(pieces) == tok.decode(tok.encode(story)) == story
    assert not any("\ufffd" in p for p in pieces)


def test_ids_past_the_vocabulary_decode_to_nothing_on_both_back_ends(shared_data, bpe):
    """A model whose embedding is padded past its tokenizer's vocabulary can sample a padding row: decoding it
    must not raise (SentencePiece's own decode does), and both back ends drop it as `tokenizers` does."""
    sp_tok = Tokenizer.from_dir(shared_data / "models" / "stories260K" / "hf")
    for tok in (sp_tok, bpe):
        ids = tok.encode("Once upon a time")
        padded = [ids[0], tok.vocab_size, *ids[1:], tok.vocab_size + 40_000, -1]
        assert tok.decode(padded) == tok.decode(ids) == "Once upon a time"
        assert "".join(_stream(tok, padded)) == "Once upon a time"


def test_vocabulary_difference_names_the_first_id_that_differs(shared_data, bpe, tmp_path):
    sp_tok = Tokenizer.from_dir(shared_data / "models" / "stories260K" / "hf")
    assert bpe.vocabulary_difference(Tokenizer.from_file(bpe.save(tmp_path))) is None
    assert sp_tok.vocabulary_difference(sp_tok) is None
    assert bpe.vocabulary_difference(sp_tok) == f"{bpe.vocab_size} against 512 token ids"
