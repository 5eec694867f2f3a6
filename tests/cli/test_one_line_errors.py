"""Failures a user can cause or meet, each reported in one line: a full disk or read-only place while writing, a
short GGUF write, an unknown compile mode, `bench` options given before `model` (kept) or before another benchmark
(refused), an unknown option of a sub-command (its own usage), --threads or --max-new-tokens below 1, a file where a model directory was expected, an HF config.json with fields of the wrong kind."""
from __future__ import annotations

import errno
import json

import pytest
import torch
from conftest import random_model

from minigpt.checkpoint.atomic import save_tensors
from minigpt.checkpoint.native import model_state_dict, resolve_checkpoint
from minigpt.errors import MiniGPTError, describe_os_error
from minigpt.interop.hf import config_from_hf

SHAPE = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=32)
HF = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, num_hidden_layers=1,
          num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)


# ------------------------------------------------------------------------------------------ full or read-only disk
def test_a_full_disk_names_the_file_asked_for_not_its_temporary_sibling():
    e = OSError(errno.ENOSPC, "No space left on device", "out/.q.tmp-4242/model.safetensors")
    assert describe_os_error(e) == ("no space left on the device writing out/q/model.safetensors: free some space "
                                    "or write to another disk")
    e = OSError(errno.EROFS, "Read-only file system", "ro/.model.gguf.tmp-17")
    assert "ro/model.gguf" in describe_os_error(e) and "read-only" in describe_os_error(e)
    assert describe_os_error(OSError("odd")) == "OSError: odd"


def test_safetensors_failing_to_write_is_the_oserror_it_is(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from minigpt.checkpoint import atomic

    def full_disk(tensors, filename, metadata=None):  # safetensors' own words for a write that hit a full disk
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(atomic, "save_file", full_disk)
    with pytest.raises(OSError) as e:
        save_tensors({"w": torch.zeros(4)}, tmp_path / "model.safetensors")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "model.safetensors")

    def other(tensors, filename, metadata=None):
        raise SafetensorError("some tensors share memory")

    monkeypatch.setattr(atomic, "save_file", other)
    with pytest.raises(SafetensorError, match="share memory"):  # not an I/O failure: raised as it was
        save_tensors({"w": torch.zeros(4)}, tmp_path / "model.safetensors")


def test_a_tokenizer_that_cannot_be_written_leaves_nothing_and_says_why(tmp_path):
    import tokenizers

    from minigpt.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer(tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))

    class FullDisk:  # what tokenizers raises when the disk fills after a partial write
        def save(self, path, pretty=True):
            open(path, "wb").write(b"{" * 100)
            raise Exception("No space left on device (os error 28)")

    tok._hf = FullDisk()
    with pytest.raises(OSError) as e:
        tok.save(tmp_path / "tokenizer.json")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "tokenizer.json")
    assert list(tmp_path.iterdir()) == []


def test_a_gguf_write_cut_short_is_one_message_and_leaves_no_file(tmp_path, monkeypatch):
    import gguf

    from minigpt.interop.gguf import write_gguf

    def short(self, *a, **k):  # numpy's tofile on a full disk: an OSError without errno
        raise OSError("11008 requested and 2920 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short)
    model = random_model(SHAPE)
    with pytest.raises(MiniGPTError, match="stopped short .* is the disk full"):
        write_gguf(model_state_dict(model), model.config, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ options
def test_an_unknown_compile_mode_fails_before_anything_runs():
    from minigpt.infer.fastpath import FastPath

    with pytest.raises(MiniGPTError, match="unknown compile mode 'bogus'; choose one of default"):
        FastPath(random_model(SHAPE), compile=True, compile_mode="bogus")
    assert FastPath(random_model(SHAPE), compile=True, compile_mode="max-autotune-no-cudagraphs").compile_mode


def test_bench_options_before_model_are_kept():
    from minigpt.cli import build_parser

    args = build_parser().parse_args(["bench", "--model", "/m", "--presets", "tiny", "--no-transformers", "model"])
    assert (args.model, args.presets, args.transformers) == ("/m", "tiny", False)
    args = build_parser().parse_args(["bench", "--presets", "tiny", "model", "--presets", "small"])
    assert (args.presets, args.repeats, args.transformers) == ("small", 5, True)  # after wins; the rest defaults


@pytest.mark.parametrize("before, command", [
    (["--threads", "4"], ["serve", "--threads", "2"]),  # serve has its own --threads, which would overwrite it
    (["--json", "out.json", "--repeats", "3"], ["quant", "ckpt", "--data", "d"]),
    (["--presets", "tiny"], ["speculative", "t", "d", "--data", "d"]),
])
def test_bench_model_options_before_another_benchmark_are_refused(before, command, capsys):
    """Options of the model benchmark given before `serve`/`quant`/`speculative` were dropped without a word."""
    from minigpt.cli import main

    assert main(["bench", *before, *command]) == 1
    err = capsys.readouterr().err.strip()
    flags = ", ".join(b for b in before if b.startswith("--"))
    assert err == (f"error: {flags} before `{command[0]}` belong to the model benchmark (`minigpt bench`); give the "
                   f"options of `minigpt bench {command[0]}` after `{command[0]}`")


@pytest.mark.parametrize("command, usage", [
    (["bench", "serve", "--bogus"], "usage: minigpt bench serve"),
    (["lora", "merge", "b", "a", "--out-dir", "o", "--bogus"], "usage: minigpt lora merge"),
    (["train", "--bogus"], "usage: minigpt train"),
    (["--bogus", "train"], "usage: minigpt [-h]"),
])
def test_an_unknown_option_shows_the_usage_of_its_command(command, usage, capsys):
    """argparse reports an option no sub-command knows from the top-level parser, whose usage lists only the
    commands; the command's own usage says which options there are."""
    from minigpt.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(command)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(usage) and "error: unrecognized arguments: --bogus" in err


def test_the_command_line_is_built_without_importing_torch():
    """`minigpt --help` and usage errors answer at once: building the parser used to import torch (1.7 s)."""
    import subprocess
    import sys

    code = "import sys; from minigpt.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("command", [["serve", "m"], ["chat", "m"], ["sft", "--model", "m", "--data", "d"],
                                     ["train"], ["bench", "serve"], ["bench"], ["bench", "quant", "c", "--data", "d"],
                                     ["bench", "speculative", "t", "d", "--data", "d"]])
def test_threads_below_one_is_a_usage_error(command, capsys):
    from minigpt.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, "--threads", "0"])
    assert e.value.code == 2 and "argument --threads: must be at least 1, got 0" in capsys.readouterr().err
    assert build_parser().parse_args([*command, "--threads", "2"]).threads == 2


def test_chat_takes_generates_name_for_the_answer_length():
    """`minigpt chat M --max-new-tokens 8` (generate's flag) was a usage error; it is chat's --max-tokens."""
    from minigpt.cli import build_parser

    assert build_parser().parse_args(["chat", "m", "--max-new-tokens", "8"]).max_tokens == 8
    assert build_parser().parse_args(["chat", "m", "--max-tokens", "9"]).max_tokens == 9


@pytest.mark.parametrize("n", [0, -5])
def test_max_new_tokens_below_one_is_one_message_naming_the_flag(n, capsys):
    from minigpt.cli import main

    assert main(["generate", "no-such-model", "--prompt", "hi", "--max-new-tokens", str(n)]) == 1
    assert capsys.readouterr().err == f"error: --max-new-tokens must be at least 1, got {n}\n"


# ------------------------------------------------------------------------------------------ model sources
def test_a_file_that_is_not_a_model_is_not_reported_missing(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(MiniGPTError, match="notes.txt is not a model file"):
        resolve_checkpoint(tmp_path / "notes.txt")
    with pytest.raises(MiniGPTError, match="nothing does not exist"):
        resolve_checkpoint(tmp_path / "nothing")
    (tmp_path / "m" / "config.json").mkdir(parents=True)
    with pytest.raises(MiniGPTError, match="config.json is not a file"):
        resolve_checkpoint(tmp_path / "m")


@pytest.mark.parametrize("change, message", [
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of names"),
    ({"hidden_size": None}, "hidden_size is missing"),
    ({"intermediate_size": "64"}, "intermediate_size must be an integer, got '64'"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps must be a number"),
])
def test_hf_config_fields_of_the_wrong_kind_are_named(change, message):
    with pytest.raises(MiniGPTError, match=message):
        config_from_hf({**HF, **change})


def test_hf_config_nulls_read_as_absent():
    # transformers writes null for unset optional fields (head_dim, num_key_value_heads of many configs).
    config = config_from_hf({**HF, "head_dim": None, "num_key_value_heads": None, "rms_norm_eps": None})
    assert (config.head_dim, config.n_kv_heads, config.norm_eps) == (8, 4, 1e-6)
    assert json.loads(json.dumps(config.to_dict()))["dim"] == 32
