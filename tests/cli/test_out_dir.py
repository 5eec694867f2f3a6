"""Output directories of `sft`, `dpo`, `prepare`, `train` and `tokenizer train` under bad input: an --out-dir that
is a file is a one-line error, and a command that fails on its input leaves no directory it made, while an existing
one keeps the user's files. Everything here fails before a training step."""
import json

import pytest
import torch

from minigpt.checkpoint.native import save_pretrained
from minigpt.cli import main
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer
from minigpt.tokenizer.tokenizer import train_tokenizer

WORDS = "the cat sat on a mat and the dog ran to the red house while birds sang".split()
CHAT = json.dumps({"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]})
PAIR = json.dumps({"prompt": "the cat", "chosen": " sat", "rejected": " ran"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("s50_model")
    tok = train_tokenizer([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 4, 300)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                    hidden_dim=48, max_seq_len=64)).eval()
    return save_pretrained(model, root / "model", tok)


def one_line_error(capsys, *fragments) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in err[0], err[0]
    return err[0]


def run(*argv) -> int:
    return main([str(a) for a in argv])


def posttrain(command, model_dir, data, out, *extra) -> int:
    return run(command, "--model", model_dir, "--data", data, "--out-dir", out, "--max-steps", 1, "--device", "cpu",
               *extra)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "foo.txt").write_text("precious")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "chat_nonutf.jsonl").write_bytes(CHAT.encode() + b"\n" + b'{"messages": "\xff"}\n')
    too_long = json.dumps({"messages": [{"role": "user", "content": "cat " * 200}, {"role": "assistant", "content": "m"}]})
    (tmp_path / "chat_nothing_left.jsonl").write_bytes(too_long.encode() + b"\n" + b'{"messages": "\xff"}\n')
    (tmp_path / "pairs_nonutf.jsonl").write_bytes(b'{"prompt": "hi \xff", "chosen": "a", "rejected": "b"}\n')
    return tmp_path


@pytest.mark.parametrize("argv", [
    ("sft", "--model", "{model}", "--data", "{d}/empty.jsonl", "--max-steps", "1"),
    ("dpo", "--model", "{model}", "--data", "{d}/empty.jsonl", "--max-steps", "1"),
    ("prepare", "--data", "shakespeare"),
    ("train", "--data", "shakespeare", "--max-steps", "1"),
])
@pytest.mark.parametrize("under", [False, True])
def test_an_out_dir_that_is_a_file_is_a_one_line_error(files, model_dir, capsys, argv, under):
    out = files / "foo.txt" / "sub" if under else files / "foo.txt"
    args = [a.format(model=model_dir, d=files) for a in argv]
    assert main(args + ["--out-dir", str(out)]) == 1
    line = one_line_error(capsys, f"--out-dir {out}", "an existing file, not a directory")
    assert "Errno" not in line and "FileExistsError" not in line
    assert (files / "foo.txt").read_text() == "precious"


def test_tokenizer_train_under_a_file_is_refused_before_training(files, capsys):
    assert run("tokenizer", "train", "shakespeare", "--vocab-size", 300, "--out", files / "foo.txt" / "t.json") == 1
    one_line_error(capsys, "--out", "an existing file, not a directory")
    assert (files / "foo.txt").read_text() == "precious"


@pytest.mark.parametrize("command, data, fragment", [
    ("sft", "empty.jsonl", "no usable conversation"),
    ("sft", "missing.jsonl", "does not exist"),
    ("sft", "chat_nothing_left.jsonl", "2 skipped (not valid UTF-8 1 [line 2], too long 1)"),
    ("dpo", "empty.jsonl", "no usable preference pair"),
    ("dpo", "missing.jsonl", "does not exist"),
    ("dpo", "pairs_nonutf.jsonl", "not valid UTF-8 1 [line 1]"),
])
def test_a_failed_run_leaves_no_new_out_dir(files, model_dir, capsys, command, data, fragment):
    out = files / "runs" / "new"
    assert posttrain(command, model_dir, files / data, out) == 1
    one_line_error(capsys, fragment)
    assert not (files / "runs").exists()


@pytest.mark.parametrize("command, data", [("sft", "chat_nonutf.jsonl"), ("dpo", "pairs_nonutf.jsonl")])
def test_strict_names_the_line_that_is_not_utf8(files, model_dir, capsys, command, data):
    assert posttrain(command, model_dir, files / data, files / "out", "--strict") == 1
    line = one_line_error(capsys, str(files / data), "is not valid UTF-8", "(line ")
    assert line.endswith("(line 2)" if command == "sft" else "(line 1)")
    assert not (files / "out").exists()


def test_a_failed_run_keeps_an_existing_out_dir(files, model_dir, capsys):
    empty = files / "existing"
    empty.mkdir()
    assert posttrain("sft", model_dir, files / "empty.jsonl", empty) == 1
    one_line_error(capsys, "no usable conversation")
    assert empty.is_dir() and not any(empty.iterdir())
    earlier = files / "earlier"  # what an earlier run that failed early leaves: its metrics file
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text("{}\n")
    assert posttrain("dpo", model_dir, files / "empty.jsonl", earlier) == 1
    one_line_error(capsys)
    assert (earlier / "metrics.jsonl").read_text() == "{}\n"


def test_sft_that_fails_its_disk_check_leaves_no_out_dir(files, model_dir, capsys, monkeypatch):
    import collections

    from minigpt.train import state

    (files / "chat.jsonl").write_text(f"{CHAT}\n" * 4)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(state.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 0))
    assert posttrain("sft", model_dir, files / "chat.jsonl", files / "out") == 1
    one_line_error(capsys, "not enough free disk space")
    assert not (files / "out").exists()


def test_prepare_with_bad_input_leaves_no_out_dir(files, capsys):
    out = files / "p" / "out"
    assert run("prepare", "--data", "shakespeare", "--vocab-size", 10, "--out-dir", out) == 1
    one_line_error(capsys, "--vocab-size must be between 259")
    assert run("tokenizer", "train", "shakespeare", "--vocab-size", 10, "--out", out / "tok.json") == 1
    one_line_error(capsys, "--vocab-size must be between 259")
    assert run("prepare", "--data", files / "pairs_nonutf.jsonl", "--out-dir", out, "--workers", 1) == 1
    one_line_error(capsys, "is not valid UTF-8", "(line 1)")
    assert not (files / "p").exists()
    mine = files / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert run("prepare", "--data", files / "pairs_nonutf.jsonl", "--out-dir", mine, "--workers", 1) == 1
    one_line_error(capsys, "is not valid UTF-8")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("extra, fragment", [
    (("--preset", "bogus"), "unknown preset 'bogus'"),
    (("--set", "model.dim=-1"), "ModelConfig.dim"),
    (("--set", "seq_len=100000"), "exceeds the model's max_seq_len"),
    (("--vocab-size", 10), "invalid training config: vocab_size must be between 259"),
])
def test_train_checks_the_model_before_preparing_data(files, capsys, extra, fragment):
    out = files / "run"
    assert run("train", "--data", "shakespeare", "--out-dir", out, "--max-steps", 1, "--device", "cpu", *extra) == 1
    one_line_error(capsys, fragment)
    assert not out.exists()
