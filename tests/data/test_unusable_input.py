"""Hostile data for the loaders and `prepare`: a JSONL line that is not UTF-8 is a bad line like any other (skipped
and counted with its line number, or a one-line error naming file and line when strict), and a prepare that fails
leaves no directory it made behind, while an existing one keeps what the user put there."""
import json

import pytest

from minigpt.data.chat import SkipReport, read_conversations
from minigpt.data.preference import read_preferences
from minigpt.data.prepare import prepare
from minigpt.errors import MiniGPTError
from minigpt.tokenizer.tokenizer import train_tokenizer

CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
PAIR = json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"})


def write_with_bad_line(path, good: str) -> None:
    """Three good lines around a line holding 0xff (line 2) and a blank line, then one more good line (line 5)."""
    path.write_bytes(good.encode() + b"\n" + good[:-2].encode() + b"\xff\"}\n" + good.encode() + b"\n\n"
                     + good.encode() + b"\n")


@pytest.mark.parametrize("read, good, name", [(read_conversations, CHAT, "chat.jsonl"),
                                              (read_preferences, PAIR, "prefs.jsonl")], ids=["sft", "dpo"])
def test_a_line_that_is_not_utf8_is_skipped_and_counted_with_its_line(tmp_path, read, good, name):
    path = tmp_path / name
    write_with_bad_line(path, good)
    report = SkipReport()
    assert len(read(path, report=report)) == 3
    assert dict(report.skipped) == {"not valid UTF-8": 1} and report.lines == {"not valid UTF-8": [2]}
    assert report.summary(name) == f"{name}: 3 conversations, 1 skipped (not valid UTF-8 1 [line 2])"
    with pytest.raises(MiniGPTError) as e:
        read(path, strict=True)
    message = str(e.value)
    assert str(path) in message and "line 2" in message and "not valid UTF-8" in message and "\n" not in message
    assert "byte offset" in message  # the wording of prepare's message for the same problem


def test_a_summary_lists_a_few_line_numbers(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b"".join(CHAT.encode() + b"\n" + b"\xfe\n" for _ in range(7)))
    report = SkipReport()
    read_conversations(path, report=report)
    assert report.summary("c") == "c: 7 conversations, 7 skipped (not valid UTF-8 7 [lines 2, 4, 6, 8, 10, ...])"


def test_other_skips_keep_their_summary(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(f"{CHAT}\n{{oops\n{CHAT}\n", encoding="utf-8")
    report = SkipReport()
    read_conversations(path, report=report)
    assert report.summary("c") == "c: 2 conversations, 1 skipped (invalid JSON 1)" and report.lines == {"invalid JSON": [2]}


def corpus(path, bad: bool):
    lines = [json.dumps({"text": f"document number {i} says hello to the world"}) for i in range(40)]
    path.write_bytes("\n".join(lines).encode() + (b"\n{\"text\": \"bad \xff\"}\n" if bad else b"\n"))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([f"document number {i} says hello to the world" for i in range(40)], 300)


@pytest.mark.parametrize("given_tokenizer", [False, True])  # fails in the tokenizer pass / after tokenizer.json
def test_a_failed_prepare_removes_the_directories_it_made(tmp_path, tokenizer, given_tokenizer):
    src = corpus(tmp_path / "bad.jsonl", bad=True)
    out = tmp_path / "new" / "deeper" / "out"
    kw = {"tokenizer": tokenizer} if given_tokenizer else {"vocab_size": 300}
    with pytest.raises(MiniGPTError, match="not valid UTF-8"):
        prepare(str(src), out, workers=1, **kw)
    assert not (tmp_path / "new").exists()


def test_a_failed_prepare_keeps_an_existing_directory_and_its_files(tmp_path, tokenizer):
    src = corpus(tmp_path / "bad.jsonl", bad=True)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(MiniGPTError, match="not valid UTF-8"):
        prepare(str(src), out, tokenizer=tokenizer, workers=1)
    assert (out / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MiniGPTError):
        prepare(str(src), empty, vocab_size=300, workers=1)
    assert empty.is_dir()


def test_a_new_directory_with_a_stranger_file_is_not_removed(tmp_path, tokenizer, monkeypatch):
    """Cleaning up removes only prepare's own files: a file someone else wrote meanwhile keeps the directory."""
    from minigpt.data import prepare as prepare_mod

    src = corpus(tmp_path / "bad.jsonl", bad=True)
    out = tmp_path / "out"
    real = prepare_mod._remove_stale_temporaries

    def and_a_stranger(directory):
        (directory / "stranger.txt").write_text("not prepare's")
        return real(directory)

    monkeypatch.setattr(prepare_mod, "_remove_stale_temporaries", and_a_stranger)
    with pytest.raises(MiniGPTError):
        prepare(str(src), out, tokenizer=tokenizer, workers=1)
    assert sorted(p.name for p in out.iterdir()) == ["stranger.txt"]


def test_bad_arguments_fail_before_the_directory_is_made(tmp_path):
    src = corpus(tmp_path / "good.jsonl", bad=False)
    with pytest.raises(ValueError, match="vocab_size must be between"):
        prepare(str(src), tmp_path / "out", vocab_size=10, workers=1)
    with pytest.raises(MiniGPTError):
        prepare(str(tmp_path / "missing.jsonl"), tmp_path / "out", vocab_size=300, workers=1)
    assert not (tmp_path / "out").exists()
    (tmp_path / "file.txt").write_text("x")
    for out in (tmp_path / "file.txt", tmp_path / "file.txt" / "sub"):
        with pytest.raises(MiniGPTError, match="existing file, not a directory"):
            prepare(str(src), out, vocab_size=300, workers=1)
    assert (tmp_path / "file.txt").read_text() == "x"


def test_a_good_prepare_still_writes_its_files(tmp_path):
    out = tmp_path / "a" / "b"
    meta = prepare(str(corpus(tmp_path / "good.jsonl", bad=False)), out, vocab_size=300, workers=1)
    assert meta["train"]["documents"] > 0
    assert {"train.bin", "val.bin", "meta.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
