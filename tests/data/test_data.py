"""Data preparation: sources, streaming, splits, byte/token accounting, errors, batching."""
import json
import math
import random

import numpy as np
import pytest
import torch

from minigpt.data import sources
from minigpt.data.loader import BatchSampler, bits_per_byte, eval_windows, load_meta, load_split
from minigpt.data.prepare import prepare
from minigpt.data.sources import BUNDLED, iter_documents, iter_pieces, resolve_source
from minigpt.errors import MiniGPTError
from minigpt.tokenizer.tokenizer import Tokenizer, train_tokenizer

VOCAB = 320
EOT = 0


def _lines(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    words = ["the", "king", "queen", "月光", "明月", "故鄉", "sword", "crown", "🎉", "👩‍👩‍👧", "love", "night"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 9))) for _ in range(n)]


def _docs(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    lines = _lines(4 * n, seed)
    return ["\n".join(lines[4 * i: 4 * i + rng.randint(1, 4)]) for i in range(n)]


def _split_docs(out_dir, split):
    """Decode a prepared split back into its documents (they are separated by EOT)."""
    tok = Tokenizer.from_dir(out_dir)
    ids = np.asarray(load_split(out_dir, split)).tolist()
    assert ids[-1] == EOT
    docs, cur = [], []
    for i in ids:
        if i == EOT:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    return docs


def _nbytes(texts) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


def _check_multi_doc(out_dir, meta, docs, val_fraction=0.1):
    train, val = _split_docs(out_dir, "train"), _split_docs(out_dir, "val")
    assert sorted(train + val) == sorted(docs)  # every document exactly once, verbatim
    for split, got in (("train", train), ("val", val)):
        assert meta[split]["documents"] == len(got)
        assert meta[split]["bytes"] == _nbytes(got)
        assert meta[split]["tokens"] == len(load_split(out_dir, split))
    assert meta["train"]["bytes"] + meta["val"]["bytes"] == _nbytes(docs)
    assert abs(len(val) / len(docs) - val_fraction) < 0.06
    return train, val


# ------------------------------------------------------------------------------------------------ plain text
@pytest.fixture
def single_txt(tmp_path):
    text = "\n".join(_lines(600)) + "\n"
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path, text


def test_prepare_single_document_txt(single_txt, tmp_path):
    path, text = single_txt
    out = tmp_path / "out"
    meta = prepare(path, out, vocab_size=VOCAB)
    raw = text.encode("utf-8")
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == VOCAB and meta["eot_id"] == EOT
    assert meta["train"]["documents"] == meta["val"]["documents"] == 1
    assert meta["train"]["bytes"] + meta["val"]["bytes"] == len(raw)
    # val is the last ~10% of the bytes, starting right after a newline
    cut = meta["train"]["bytes"]
    assert raw[cut - 1:cut] == b"\n"
    assert int(0.9 * len(raw)) <= cut <= int(0.9 * len(raw)) + 200
    train, val = _split_docs(out, "train"), _split_docs(out, "val")
    assert train == [raw[:cut].decode()] and val == [raw[cut:].decode()]
    for split in ("train", "val"):
        mm = load_split(out, split)
        assert mm.dtype == np.uint16 and len(mm) == meta[split]["tokens"]
    assert load_meta(out) == meta
    tok = Tokenizer.from_dir(out)
    assert tok.sha256 == meta["tokenizer_sha256"]
    # chunked tokenization (cut at newlines) gives the ids of tokenizing the split in one piece
    assert np.asarray(load_split(out, "train")).tolist() == tok.encode(raw[:cut].decode(), eos=True)


def test_prepare_is_deterministic(single_txt, tmp_path):
    path, _ = single_txt
    metas = [prepare(path, tmp_path / name, vocab_size=VOCAB, chunk_bytes=512) for name in ("a", "b")]
    assert metas[0] == metas[1]
    for name in ("train.bin", "val.bin", "tokenizer.json", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert not list((tmp_path / "a").glob("*.tmp*"))  # temporaries renamed or removed


def test_tokenizer_trained_on_train_split_only(tmp_path):
    # The last 10% of the text (val) is a word that appears nowhere else; a leak would make it a merge.
    path = tmp_path / "leak.txt"
    path.write_text("\n".join(_lines(400)) + "\n" + "zqxv zqxv zqxv\n" * 60, encoding="utf-8")
    meta = prepare(path, tmp_path / "out", vocab_size=VOCAB)
    assert meta["val"]["bytes"] > 0
    assert "zqxv" in _split_docs(tmp_path / "out", "val")[0]
    vocab = json.loads((tmp_path / "out" / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    assert not any("zq" in t or "qx" in t or "xv" in t for t in vocab)
    # ... whereas training on everything does learn it, so the check above is meaningful
    full = train_tokenizer([path.read_text(encoding="utf-8")], VOCAB)
    assert full.token_to_id("zq") is not None or full.token_to_id("zqxv") is not None


def test_prepare_with_given_tokenizer(single_txt, tmp_path):
    path, text = single_txt
    tok = train_tokenizer([text], VOCAB)
    meta = prepare(path, tmp_path / "out", tokenizer=tok)
    assert meta["tokenizer_sha256"] == tok.sha256
    assert Tokenizer.from_dir(tmp_path / "out").sha256 == tok.sha256
    with pytest.raises(ValueError, match="exactly one"):
        prepare(path, tmp_path / "x", tokenizer=tok, vocab_size=VOCAB)


def test_prepare_txt_with_separator(tmp_path):
    docs = _docs(300)
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(docs) + "\n\n", encoding="utf-8")
    meta = prepare(path, tmp_path / "out", vocab_size=VOCAB, doc_sep="\n\n")
    assert meta["doc_sep"] == "\n\n"
    _check_multi_doc(tmp_path / "out", meta, docs)


def test_iter_documents_separator_across_chunks(tmp_path):
    rng = random.Random(1)
    path = tmp_path / "t.txt"
    for trial in range(20):
        text = "".join(rng.choice(["a", "b\n", "\n", "月", "🎉", "\n\n", " "]) for _ in range(rng.randint(0, 300)))
        if not text:
            continue
        path.write_text(text, encoding="utf-8")
        expected = [d for d in text.split("\n\n") if d]
        for chunk in (16, 17, 40, 1 << 20):
            assert list(iter_documents(path, doc_sep="\n\n", chunk_bytes=chunk)) == expected, (trial, chunk)
            pieces = list(iter_documents(path, doc_sep=None, chunk_bytes=chunk))
            assert "".join(pieces) == text
            assert all(len(p) <= chunk for p in pieces)


def test_single_document_pieces_cut_at_newlines(single_txt):
    path, text = single_txt
    pieces = list(iter_pieces(path, chunk_bytes=256))
    assert "".join(p.text for p in pieces) == text
    assert all(p.doc_index == 0 for p in pieces) and [p.doc_end for p in pieces].count(True) == 1
    assert all(p.text.endswith("\n") for p in pieces)


def test_bundled_corpora_resolve():
    assert set(BUNDLED) == {"shakespeare", "tang-poems"}
    shakespeare, poems = resolve_source("shakespeare"), resolve_source("tang-poems")
    assert shakespeare.kind == "text" and shakespeare.doc_sep is None and shakespeare.path.is_file()
    assert poems.doc_sep == "\n\n" and poems.path.is_file()
    assert (sources.CORPORA_DIR / "LICENSES.md").is_file()
    first = next(iter_documents("tang-poems"))
    assert first.startswith("帝京篇十首 一\n太宗皇帝\n") and "\n\n" not in first


# ------------------------------------------------------------------------------------------------ records
def test_prepare_jsonl(tmp_path):
    docs = _docs(200, seed=2) + ["tab\tand\r\nCRLF", "long " * 50]
    path = tmp_path / "c.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": 1}, ensure_ascii=False) + "\n")
        f.write("\n")  # blank lines are ignored
        f.write(json.dumps({"text": ""}) + "\n")  # empty documents are skipped
    meta = prepare(path, tmp_path / "out", vocab_size=VOCAB, chunk_bytes=64)  # long docs cut into pieces
    _check_multi_doc(tmp_path / "out", meta, docs)


def test_prepare_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(200, seed=3)
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), path, row_group_size=32)
    meta = prepare(path, tmp_path / "out", vocab_size=VOCAB)
    _check_multi_doc(tmp_path / "out", meta, docs)


def test_prepare_saved_dataset(tmp_path):
    import datasets

    docs = _docs(200, seed=4)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "ds"))
    src = resolve_source(tmp_path / "ds")
    assert src.kind == "hf_disk"
    meta = prepare(src, tmp_path / "out", vocab_size=VOCAB)
    _check_multi_doc(tmp_path / "out", meta, docs)


# ------------------------------------------------------------------------------------------------ errors
def test_missing_and_empty_files(tmp_path):
    with pytest.raises(MiniGPTError, match="no such file"):
        resolve_source(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(MiniGPTError, match="is empty"):
        prepare(empty, tmp_path / "out", vocab_size=VOCAB)
    other = tmp_path / "x.docx"
    other.write_bytes(b"PK")
    with pytest.raises(MiniGPTError, match="unsupported corpus file type"):
        resolve_source(other)
    with pytest.raises(MiniGPTError, match="did you mean 'shakespeare'"):
        resolve_source("shakespear")


def test_unknown_hub_name(monkeypatch):
    import datasets

    def fail(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(MiniGPTError, match="unknown corpus 'someone/no-such-corpus'.*offline"):
        resolve_source("someone/no-such-corpus")


def test_non_utf8_reports_byte_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    prefix = "héllo 月光 🎉\n" * 10  # multi-byte characters straddle the 16-byte chunks
    path.write_bytes(prefix.encode("utf-8") + b"caf\xe9 au lait\n")
    offset = len(prefix.encode("utf-8")) + 3
    for chunk in (16, 1 << 20):
        with pytest.raises(MiniGPTError) as e:
            list(iter_pieces(path, chunk_bytes=chunk))
        assert f"not valid UTF-8: byte offset {offset}" in str(e.value) and "e9" in str(e.value)
    with pytest.raises(MiniGPTError, match=f"byte offset {offset}"):
        prepare(path, tmp_path / "out", vocab_size=VOCAB)


def test_jsonl_errors(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(MiniGPTError) as e:
        prepare(path, tmp_path / "out", vocab_size=VOCAB)
    assert f"{path}:2" in str(e.value) and '"text"' in str(e.value) and "body" in str(e.value)
    path.write_text('{"text": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(MiniGPTError, match=":2: not valid JSON"):
        list(iter_documents(path))
    with pytest.raises(MiniGPTError, match="only applies to .txt"):
        list(iter_documents(path, doc_sep="\n"))


def test_empty_validation_split(tmp_path):
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(5)), encoding="utf-8")
    with pytest.raises(MiniGPTError, match="val split .* would be empty"):
        prepare(path, tmp_path / "out", vocab_size=VOCAB, val_fraction=1e-9)
    one_line = tmp_path / "one.txt"
    one_line.write_text("a single line without a newline at the end", encoding="utf-8")
    tok = train_tokenizer(["abc"], 300)
    meta = prepare(one_line, tmp_path / "out2", tokenizer=tok)  # no newline: cut at a character boundary
    assert meta["val"]["bytes"] > 0
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("line one\nline two\n", encoding="utf-8")  # the last newline ends the text
    with pytest.raises(MiniGPTError, match="val split .* would be empty"):
        prepare(tiny, tmp_path / "out3", tokenizer=tok, val_fraction=0.01)


def test_load_split_errors(tmp_path):
    with pytest.raises(MiniGPTError, match="minigpt prepare"):
        load_split(tmp_path, "train")
    with pytest.raises(MiniGPTError, match="does not exist.*minigpt prepare"):
        load_meta(tmp_path / "nowhere")
    with pytest.raises(ValueError):
        load_split(tmp_path, "test")


def test_uint32_for_large_vocab(tmp_path, monkeypatch):
    path = tmp_path / "t.txt"
    path.write_text("\n".join(_lines(50)) + "\n", encoding="utf-8")
    tok = train_tokenizer([path.read_text(encoding="utf-8")], 300)
    monkeypatch.setattr(Tokenizer, "vocab_size", property(lambda self: 70000))
    meta = prepare(path, tmp_path / "out", tokenizer=tok)
    assert meta["dtype"] == "uint32" and load_split(tmp_path / "out", "train").dtype == np.uint32


# ------------------------------------------------------------------------------------------------ batching
def test_batch_sampler_shapes_and_shift():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = BatchSampler(tokens, batch_size=4, seq_len=16, seed=0).next()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # consecutive tokens: y is x shifted by one
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(y.max()) <= 999


def test_batch_sampler_resume_is_exact():
    tokens = np.random.default_rng(0).integers(0, 300, 5000).astype(np.uint16)
    a = BatchSampler(tokens, 8, 32, seed=123)
    for _ in range(3):
        a.next()
    state = a.state_dict()
    assert state["batches_drawn"] == 3 and state["generator_state"].dtype == torch.uint8
    expected = [a.next() for _ in range(3)]
    b = BatchSampler(tokens, 8, 32, seed=999)
    b.load_state_dict(state)
    for (xe, ye), (xg, yg) in zip(expected, [b.next() for _ in range(3)]):
        assert torch.equal(xe, xg) and torch.equal(ye, yg)
    assert b.batches_drawn == 6
    # same seed, fresh sampler: same stream; different seed: different stream
    c, d = BatchSampler(tokens, 8, 32, seed=123), BatchSampler(tokens, 8, 32, seed=124)
    assert torch.equal(c.next()[0], BatchSampler(tokens, 8, 32, seed=123).next()[0])
    assert not torch.equal(c.next()[0], d.next()[0])


def test_batch_sampler_too_short():
    with pytest.raises(ValueError, match="has 16 tokens"):
        BatchSampler(np.zeros(16, dtype=np.uint16), 2, 16, seed=0)
    BatchSampler(np.zeros(17, dtype=np.uint16), 2, 16, seed=0).next()  # exactly seq_len + 1 is enough


def test_eval_windows():
    tokens = np.arange(1001, dtype=np.uint16)
    x, y = eval_windows(tokens, seq_len=10, max_windows=1000)
    assert x.shape == (100, 10) and x.dtype == torch.int64
    assert torch.equal(x.flatten(), torch.arange(1000)) and torch.equal(y, x + 1)  # tiles, no overlap
    x2, y2 = eval_windows(tokens, seq_len=10, max_windows=7)
    x3, _ = eval_windows(tokens, seq_len=10, max_windows=7)
    assert x2.shape == (7, 10) and torch.equal(x2, x3)
    starts = x2[:, 0].tolist()
    assert starts == sorted(set(starts)) and all(s % 10 == 0 for s in starts)
    assert starts[0] == 0 and starts[-1] >= 800  # spread over the whole split
    with pytest.raises(ValueError):
        eval_windows(np.zeros(10, dtype=np.uint16), seq_len=10, max_windows=1)


def test_prepared_split_feeds_sampler(single_txt, tmp_path):
    path, _ = single_txt
    prepare(path, tmp_path / "out", vocab_size=VOCAB)
    val = load_split(tmp_path / "out", "val")
    x, y = BatchSampler(val, 2, 8, seed=0).next()
    assert int(x.max()) < VOCAB
    ex, ey = eval_windows(val, 8, 4)
    assert ex.shape == (4, 8)


def test_bits_per_byte():
    assert bits_per_byte(math.log(2), 100, 100) == pytest.approx(1.0)
    assert bits_per_byte(2.0, 300, 1200) == pytest.approx(2.0 * 300 / 1200 / math.log(2))
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 10, 0)


def test_prepare_with_sentencepiece_tokenizer(shared_data, tmp_path):
    path = tmp_path / "stories.txt"
    path.write_text("\n".join(["Once upon a time, there was a little girl named Lily."] * 50) + "\n", encoding="utf-8")
    tok = Tokenizer.from_dir(shared_data / "models" / "stories260K" / "hf")
    meta = prepare(path, tmp_path / "out", tokenizer=tok)
    assert meta["eot_id"] == tok.eos_id == 2 and meta["tokenizer_file"] == "tokenizer.model"
    assert Tokenizer.from_dir(tmp_path / "out").sha256 == tok.sha256 == meta["tokenizer_sha256"]
    assert np.asarray(load_split(tmp_path / "out", "val"))[-1] == 2
