"""Data at scale: worker processes, bounded memory, interrupted runs, Hugging Face streaming, the 1 GB run (slow)."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import CLI_ENV, run_cli

from minigpt.data import pipeline, sources
from minigpt.data import prepare as data
from minigpt.data.loader import load_split
from minigpt.data.prepare import prepare
from minigpt.data.sources import BUNDLED
from minigpt.errors import MiniGPTError
from minigpt.runtime import parse_size
from minigpt.tokenizer.tokenizer import Tokenizer, train_tokenizer

VOCAB = 320
OUTPUTS = ("train.bin", "val.bin", "meta.json", "tokenizer.json")
SHAKESPEARE_LINES = BUNDLED["shakespeare"].path.read_text(encoding="utf-8").splitlines(keepends=True)


def write_corpus(path: Path, n_bytes: int, seed: int = 0, doc_sep: str = "") -> int:
    """Write at least ``n_bytes`` of Tiny Shakespeare lines, reshuffled by a seeded RNG for every copy; return
    the size written. ``doc_sep`` is inserted between blocks of 20 lines to make several documents."""
    rng = random.Random(seed)
    lines = list(SHAKESPEARE_LINES)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < n_bytes:
            rng.shuffle(lines)
            if doc_sep:
                text = doc_sep.join("".join(lines[i:i + 20]) for i in range(0, len(lines), 20)) + doc_sep
            else:
                text = "".join(lines)
            f.write(text)
            written += len(text.encode("utf-8"))
    return written


def outputs(d: Path) -> dict:
    return {name: (d / name).read_bytes() for name in OUTPUTS}


def leftovers(d: Path) -> list:
    return sorted(p.name for p in d.iterdir() if ".tmp" in p.name)


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(["".join(SHAKESPEARE_LINES[:4000])], VOCAB).save(path)
    return path


@pytest.fixture
def many_jobs(monkeypatch):
    """Small jobs and no in-process warm-up, so that a few hundred kB of text exercise the worker pool."""
    monkeypatch.setattr(pipeline, "_JOB_CHARS", 8192)
    monkeypatch.setattr(pipeline, "_INPROCESS_CHARS", 0)


# ------------------------------------------------------------------------------------------------ workers
@pytest.mark.slow
def test_workers_give_identical_output_in_bounded_memory(tmp_path, many_jobs, monkeypatch):
    """--workers 2 writes the bytes --workers 1 writes, with a bounded queue and Python memory far below the corpus.

    Several documents, so train and val jobs interleave; the tokenizer is trained in process and loaded by the
    workers. tracemalloc counts every Python and numpy allocation of this process (deterministic, unlike RSS), so
    keeping the corpus, all its ids or an unbounded queue of jobs in memory would show up in the peak.
    """
    corpus = tmp_path / "docs.txt"
    size = write_corpus(corpus, 2_000_000, doc_sep="\n\n\n")
    in_flight = []
    submit = pipeline.TokenizePipeline._submit

    def spy(self, split):
        submit(self, split)
        in_flight.append(len(self.in_flight))

    monkeypatch.setattr(pipeline.TokenizePipeline, "_submit", spy)
    logs = {1: [], 2: []}
    kwargs = dict(vocab_size=VOCAB, doc_sep="\n\n\n", chunk_bytes=4096)
    meta1 = prepare(corpus, tmp_path / "w1", workers=1, log=logs[1].append, **kwargs)
    tracemalloc.start()
    try:
        meta2 = prepare(corpus, tmp_path / "w2", workers=2, log=logs[2].append, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert meta1 == meta2 and meta1["val"]["documents"] > 10
    assert outputs(tmp_path / "w1") == outputs(tmp_path / "w2")
    assert "2 worker processes" in logs[2][-1] and "the main process" in logs[1][-1]
    assert re.search(r"\d+\.\d+ MB/s", logs[2][-1])
    assert max(in_flight) <= 2 * 2  # jobs in flight are bounded, whatever the corpus size
    # About 0.4 MB here (imports, buffers, tokenizer), the same for a corpus 3 times larger; holding the text alone
    # would take more than the whole corpus size.
    assert peak < size / 2, f"peak {peak / 1e6:.2f} MB of Python allocations for a {size / 1e6:.1f} MB corpus"
    assert not leftovers(tmp_path / "w2")


def test_bad_worker_and_sample_arguments(tmp_path, small_tok):
    with pytest.raises(MiniGPTError, match="workers must be"):
        prepare("shakespeare", tmp_path / "o", tokenizer=small_tok, workers=0)
    with pytest.raises(MiniGPTError, match="tokenizer sample"):
        prepare("shakespeare", tmp_path / "o", vocab_size=VOCAB, tokenizer_sample_bytes=-1)
    assert parse_size("200MB") == 200_000_000 and parse_size("64KiB") == 65536 and parse_size("0") == 0
    with pytest.raises(MiniGPTError, match="--tokenizer-sample-bytes"):
        parse_size("lots", "--tokenizer-sample-bytes")
    assert 1 <= data.default_workers() <= 8


def test_progress_lines_without_a_terminal(tmp_path, small_tok, monkeypatch, capsys):
    monkeypatch.setattr(data, "_PROGRESS_INTERVAL_S", 0.0)
    monkeypatch.setattr(pipeline, "_JOB_CHARS", 100_000)
    meta = prepare("shakespeare", tmp_path / "out", tokenizer=small_tok, progress=True, workers=1)
    err = capsys.readouterr().err  # not a terminal here: plain lines instead of a bar
    assert re.search(r"^prepare: tokenizing: [\d.]+ MB of 1\.1 MB \(\d+%\), [\d.]+ MB/s$", err, re.M), err
    mb = (meta["train"]["bytes"] + meta["val"]["bytes"]) / 1e6
    assert re.search(rf"^prepare: tokenized {mb:.1f} MB of text into \d+ tokens in .* MB/s, the main process", err,
                     re.M), err


def test_tokenizer_sample_bytes(tmp_path):
    # The sample is the first N bytes of the train split: a word that only occurs later is never merged.
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(SHAKESPEARE_LINES[:3000]) + "zqxv zqxv zqxv\n" * 3000 + "".join(SHAKESPEARE_LINES[:600]),
                      encoding="utf-8")
    meta = prepare(corpus, tmp_path / "sampled", vocab_size=VOCAB, tokenizer_sample_bytes=50_000)
    vocab = Tokenizer.from_dir(tmp_path / "sampled")._hf.get_vocab()
    assert not any("zq" in t or "xv" in t for t in vocab)
    full = prepare(corpus, tmp_path / "full", vocab_size=VOCAB, tokenizer_sample_bytes=0)
    assert any("zq" in t or "xv" in t for t in Tokenizer.from_dir(tmp_path / "full")._hf.get_vocab())
    assert meta["train"]["bytes"] == full["train"]["bytes"]  # the sample limits training, not the data


# ------------------------------------------------------------------------------------------------ interruptions
@pytest.mark.slow
def test_exception_midway_leaves_nothing_and_rerun_matches(tmp_path, small_tok, monkeypatch):
    corpus = tmp_path / "c.txt"
    write_corpus(corpus, 300_000)
    reference = tmp_path / "ref"
    prepare(corpus, reference, tokenizer=small_tok, workers=1)
    out = tmp_path / "out"
    prepare(corpus, out, tokenizer=small_tok, workers=1)  # a previous good run, then an interrupted one over it
    monkeypatch.setattr(pipeline, "_JOB_CHARS", 20_000)
    calls = []
    job = pipeline._tokenize_job

    def failing_job(*args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # Ctrl-C half-way
        return job(*args)

    monkeypatch.setattr(pipeline, "_tokenize_job", failing_job)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, out, tokenizer=small_tok, workers=1)
    # nothing replaced until every split was written: the previous run's files, tokenizer and meta.json stand
    assert not leftovers(out) and outputs(out) == outputs(reference)
    assert len(load_split(out, "train")) == len(load_split(reference, "train"))
    monkeypatch.setattr(pipeline, "_tokenize_job", job)
    prepare(corpus, out, tokenizer=small_tok, workers=1)
    assert outputs(out) == outputs(reference)


def test_a_failed_prepare_over_a_prepared_directory_changes_nothing(tmp_path, small_tok, monkeypatch):
    """Re-preparing over a good directory with a newly trained tokenizer, failing once the tokenizer is trained
    (a worker error while tokenizing), keeps the old tokenizer, token files and meta.json, which still agree."""
    corpus = tmp_path / "c.txt"
    write_corpus(corpus, 100_000)
    out = tmp_path / "out"
    prepare(corpus, out, tokenizer=small_tok, workers=1)
    before = outputs(out)

    def failing_job(*args):
        raise OSError("worker died")

    monkeypatch.setattr(pipeline, "_tokenize_job", failing_job)
    with pytest.raises(OSError, match="worker died"):
        prepare(corpus, out, vocab_size=300, workers=1)
    assert outputs(out) == before and not leftovers(out)


def test_leftover_temporaries_are_removed(tmp_path, small_tok):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("train.bin.tmp99999", "val.bin.tmp99999", "meta.json.tmp", "tokenizer.json.tmp"):
        (out / name).write_bytes(b"\x00partial")
    (out / ".tokenizer.tmp-abc123").mkdir()  # a killed run's staged tokenizer
    (out / ".tokenizer.tmp-abc123" / "tokenizer.json").write_text("{}")
    (out / "meta.json").write_text('{"stale": true}')
    logs = []
    prepare("shakespeare", out, tokenizer=small_tok, log=logs.append)
    assert not leftovers(out) and "stale" not in (out / "meta.json").read_text()
    assert not list(out.glob(".tokenizer.tmp-*"))
    assert any("removed 5 temporary file" in line for line in logs)


def test_concurrent_prepare_into_one_directory_is_refused(tmp_path, small_tok):
    out = tmp_path / "out"
    out.mkdir()
    with data._DirLock(out):
        with pytest.raises(MiniGPTError, match="another `minigpt prepare` is writing to"):
            prepare("shakespeare", out, tokenizer=small_tok)


KILLED_RUN = """
import sys
from minigpt.data import pipeline
from minigpt.data import prepare as data
pipeline._JOB_CHARS, pipeline._INPROCESS_CHARS = 8192, 0  # many jobs, pool from the first one
data.prepare(sys.argv[1], sys.argv[2], tokenizer=sys.argv[3], workers=2)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_killed_prepare_can_be_rerun(tmp_path, small_tok):
    """SIGKILL a real prepare process while its 2 workers run: they exit too, and a re-run matches a clean run."""
    corpus = tmp_path / "c.txt"
    write_corpus(corpus, 1_000_000)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, corpus, out, small_tok], env=CLI_ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    workers = []
    while proc.poll() is None and time.monotonic() < deadline:
        workers = [pid for pid in _children(proc.pid) if b"spawn_main" in _cmdline(pid)]
        if len(workers) == 2 and list(out.glob("train.bin.tmp*")):
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait(timeout=60)
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    if proc.returncode != -signal.SIGKILL:
        pytest.skip(f"prepare ended (rc {proc.returncode}) before it could be killed: {stderr[-300:]}")
    assert leftovers(out) and not (out / "meta.json").exists()
    deadline = time.monotonic() + 120  # a worker may still be importing torch before it notices
    while any(_cmdline(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_cmdline(pid) for pid in workers), "orphaned tokenizer workers outlived their parent"
    prepare(corpus, out, tokenizer=small_tok, workers=1)
    assert not leftovers(out)
    prepare(corpus, tmp_path / "ref", tokenizer=small_tok, workers=1)
    assert outputs(out) == outputs(tmp_path / "ref")


def _children(pid: int) -> list:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return kids


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()  # empty for a zombie
    except OSError:
        return b""


# ------------------------------------------------------------------------------------------------ hf: streaming
@pytest.fixture
def local_hf_dataset(tmp_path, monkeypatch):
    """A local dataset folder (train.parquet, validation.parquet) as `datasets` writes it; never the network."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    rng = random.Random(5)
    docs = ["".join(rng.sample(SHAKESPEARE_LINES, rng.randint(2, 6))).strip() for _ in range(300)]
    docs = [doc for doc in docs if doc]  # prepare skips empty documents
    d = tmp_path / "hfds"
    d.mkdir()
    datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))}).to_parquet(str(d / "train.parquet"))
    datasets.Dataset.from_dict({"text": docs[:40]}).to_parquet(str(d / "validation.parquet"))
    return d, docs


def _decoded_docs(out_dir: Path) -> list:
    tok = Tokenizer.from_dir(out_dir)
    eot = json.loads((out_dir / "meta.json").read_text())["eot_id"]
    docs = []
    for split in ("train", "val"):
        ids = np.asarray(load_split(out_dir, split)).tolist()
        cur = []
        for i in ids:
            if i == eot:
                docs.append(tok.decode(cur))
                cur = []
            else:
                cur.append(i)
    return docs


def test_hf_streaming_local_dataset(local_hf_dataset, tmp_path, small_tok):
    d, docs = local_hf_dataset
    src = sources.resolve_source(f"hf:{d}")
    assert src.kind == "hf_stream" and type(src.dataset).__name__ == "IterableDataset"
    meta = prepare(f"hf:{d}", tmp_path / "out", tokenizer=small_tok)
    assert meta["source"] == f"hf:{d}"
    assert sorted(_decoded_docs(tmp_path / "out")) == sorted(docs)
    assert meta["train"]["documents"] + meta["val"]["documents"] == len(docs)
    # hf:NAME::SPLIT picks a split without naming a config
    meta = prepare(f"hf:{d}::validation", tmp_path / "val", tokenizer=small_tok, val_fraction=0.2)
    assert sorted(_decoded_docs(tmp_path / "val")) == sorted(docs[:40])


def test_hf_streaming_errors(local_hf_dataset, tmp_path, monkeypatch):
    import datasets

    d, _ = local_hf_dataset
    with pytest.raises(MiniGPTError, match="split 'test'"):
        sources.resolve_source(f"hf:{d}::test")
    with pytest.raises(MiniGPTError, match="expected hf:NAME"):
        sources.resolve_source("hf:")
    nocol = tmp_path / "nocol"
    nocol.mkdir()
    datasets.Dataset.from_dict({"body": ["a", "b"]}).to_parquet(str(nocol / "train.parquet"))
    with pytest.raises(MiniGPTError, match="no 'text' column \\(columns: body\\)"):
        sources.resolve_source(f"hf:{nocol}")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/corpus' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(MiniGPTError, match="need network access.*OfflineModeIsEnabled"):
        sources.resolve_source("hf:someone/corpus:en")


def test_cli_hf_streaming(local_hf_dataset, tmp_path, small_tok):
    d, docs = local_hf_dataset
    proc = run_cli("prepare", "--data", f"hf:{d}", "--out-dir", tmp_path / "out", "--tokenizer", small_tok,
                   "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["train"]["documents"] > 200
    assert re.search(r"^prepare: tokenized [\d.]+ MB of text .* MB/s", proc.stderr, re.M)


# ------------------------------------------------------------------------------------------------ 1 GB (slow)
def _tree_memory(root: int) -> tuple:
    """(sum of RSS, sum of PSS) in bytes over ``root`` and all its descendants, read from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    rss = pss = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            rss += int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024
            pss += int(re.search(r"Pss:\s+(\d+) kB", Path(f"/proc/{pid}/smaps_rollup").read_text()).group(1)) * 1024
        except (OSError, AttributeError):
            pass  # the process ended in between
    return rss, pss


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_prepare_1gb_bounded_memory(tmp_path, small_tok):
    try:
        _prepare_1gb(tmp_path, small_tok)
    finally:  # pytest keeps the last few temporary directories: do not leave 1.6 GB behind
        for path in [tmp_path / "big.txt", *(tmp_path / "out").glob("*.bin*")]:
            path.unlink(missing_ok=True)


def _prepare_1gb(tmp_path, small_tok):
    corpus = tmp_path / "big.txt"
    t0 = time.perf_counter()
    size = write_corpus(corpus, 1_000_000_000, seed=1)
    print(f"\ngenerated {size / 1e6:.0f} MB in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    # 2 workers, whatever the default here: their memory is what must stay bounded
    proc = subprocess.Popen([sys.executable, "-m", "minigpt", "prepare", "--data", corpus, "--out-dir",
                             tmp_path / "out", "--tokenizer", small_tok, "--workers", "2"], env=CLI_ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        rss, pss = _tree_memory(proc.pid)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.25)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, stderr
    report = re.search(r"^prepare: (tokenized .*)$", stderr, re.M).group(1)
    assert "prepare: tokenizing: " in stderr  # periodic progress lines, stderr being a pipe
    meta = json.loads(stdout)
    assert meta["train"]["bytes"] + meta["val"]["bytes"] == size
    assert len(load_split(tmp_path / "out", "train")) == meta["train"]["tokens"]
    print(f"{report}\nwall {wall:.0f} s; peak memory of the process tree: RSS sum {peak_rss / 1e9:.2f} GB, "
          f"PSS sum {peak_pss / 1e9:.2f} GB")
    assert peak_rss < 1.5e9
