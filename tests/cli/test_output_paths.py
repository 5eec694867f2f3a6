"""`minigpt quantize`, `export` and `import` refuse, before reading or writing anything, an OUT whose replacement would
lose data: the source itself (or a path inside it, or a folder holding it), an existing file, or a folder of the
user's own files; an earlier output of theirs may be replaced, and a GGUF may overwrite a file that is not its
source. Each command runs in-process (``minigpt.cli.main``) on a tiny random model without a tokenizer."""
import hashlib
import types

import pytest
from conftest import assert_one_line_error, random_model

from minigpt.checkpoint.atomic import begin_atomic_dir, commit_atomic_dir
from minigpt.checkpoint.native import load_model, save_pretrained
from minigpt.cli import main
from minigpt.errors import MiniGPTError
from minigpt.model.quant import SCHEMES, is_quantized

SHAPE = dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32, multiple_of=16, vocab_size=64)
# Each command's arguments after SRC OUT; all three write a model directory.
COMMANDS = {"quantize": ("quantize", []), "export-hf": ("export", ["--format", "hf"]), "import": ("import", [])}


def cli(capsys, command, src, out, *extra):
    """Run ``minigpt COMMAND SRC OUT EXTRA`` in-process; the result looks like :func:`conftest.run_cli`'s."""
    code = main([command, str(src), str(out), *map(str, extra)])
    captured = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)


def snapshot(folder):
    """Every entry under ``folder`` (and the folder's siblings): name -> SHA-256 of its bytes (None: a folder)."""
    return {str(p.relative_to(folder.parent)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(folder.parent.rglob("*"))}


@pytest.fixture()
def src(tmp_path):
    """A float model directory written by minigpt (with its manifest), alone in ``tmp_path/models``."""
    return save_pretrained(random_model(SHAPE), tmp_path / "models" / "src")


@pytest.mark.parametrize("name", COMMANDS)
def test_a_folder_of_user_files_is_refused_and_kept(src, tmp_path, capsys, name):
    command, extra = COMMANDS[name]
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    before = snapshot(out)
    assert_one_line_error(cli(capsys, command, src, out, *extra), f"output {out} is a non-empty directory",
                          "has no manifest.json", "choose a new or empty directory")
    assert snapshot(out) == before and (out / "notes.txt").read_text() == "my notes"


def test_a_user_file_added_to_an_earlier_output_is_not_deleted(src, tmp_path, capsys):
    out = tmp_path / "q"
    assert cli(capsys, "quantize", src, out).returncode == 0
    (out / "notes.txt").write_text("my notes")
    before = snapshot(out)
    assert_one_line_error(cli(capsys, "quantize", src, out), "holds notes.txt, which its manifest.json does not list")
    assert snapshot(out) == before


@pytest.mark.parametrize("name", COMMANDS)
def test_the_source_as_output_is_refused_and_unchanged(src, capsys, name):
    command, extra = COMMANDS[name]
    before = snapshot(src)
    assert_one_line_error(cli(capsys, command, src, src, *extra), f"output {src} is the source {src}",
                          "choose another output path")
    # The same folder spelled through `..` and through a symbolic link.
    assert_one_line_error(cli(capsys, command, src, src / ".." / "src", *extra), "is the source")
    (src.parent / "link").symlink_to(src, target_is_directory=True)
    assert_one_line_error(cli(capsys, command, src, src.parent / "link", *extra), "is the source")
    (src.parent / "link").unlink()
    assert snapshot(src) == before and not is_quantized(load_model(src))


@pytest.mark.parametrize("name", COMMANDS)
def test_an_existing_file_as_output_is_refused_and_not_moved(src, tmp_path, capsys, name):
    command, extra = COMMANDS[name]
    out = tmp_path / "existing.txt"
    out.write_text("keep me")
    assert_one_line_error(cli(capsys, command, src, out, *extra), f"output {out} is an existing file, not a directory",
                          "remove the file")
    assert out.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.txt", "models"]  # no .existing.txt.old-PID


def test_an_output_inside_or_around_the_source_is_refused(src, capsys):
    before = snapshot(src)
    target = src / "model.safetensors"
    assert_one_line_error(cli(capsys, "export", src, target, "--format", "hf"), f"output {target} is inside the source",
                          "choose an output path outside it")
    assert_one_line_error(cli(capsys, "quantize", src, src / "int8"), "is inside the source")
    assert_one_line_error(cli(capsys, "import", src, src.parent), f"output {src.parent} contains the source")
    assert snapshot(src) == before


def test_a_gguf_is_not_exported_onto_itself(src, tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    assert cli(capsys, "export", src, gguf, "--format", "gguf").returncode == 0
    data = gguf.read_bytes()
    assert_one_line_error(cli(capsys, "export", gguf, gguf, "--format", "gguf", "--dtype", "q8_0"),
                          f"output {gguf} is the source {gguf}")
    assert_one_line_error(cli(capsys, "quantize", gguf, gguf), "is the source")
    assert gguf.read_bytes() == data
    # Another existing .gguf is overwritten, as llama.cpp's converter does.
    other = tmp_path / "other.gguf"
    other.write_bytes(b"old")
    assert cli(capsys, "export", gguf, other, "--format", "gguf").returncode == 0
    assert other.read_bytes() != b"old" and gguf.read_bytes() == data


def test_rerunning_a_command_onto_its_own_earlier_output_replaces_it(src, tmp_path, capsys):
    out = tmp_path / "q"
    for dtype in ("int8", "int4"):
        proc = cli(capsys, "quantize", src, out, "--dtype", dtype)
        assert proc.returncode == 0, proc.stderr
        assert load_model(out).quantization["method"] == SCHEMES[dtype]
    for command, extra in COMMANDS.values():
        if command != "quantize":
            for _ in range(2):
                proc = cli(capsys, command, src, tmp_path / command, *extra)
                assert proc.returncode == 0, proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(capsys, "quantize", src, empty).returncode == 0 and is_quantized(load_model(empty))


def test_commit_atomic_dir_refuses_to_replace_a_file_without_moving_it(tmp_path):
    final = tmp_path / "out"
    tmp = begin_atomic_dir(final)
    (tmp / "a.txt").write_text("new")
    final.write_text("keep me")
    with pytest.raises(MiniGPTError, match="is an existing file, not a directory"):
        commit_atomic_dir(tmp, final)
    assert final.read_text() == "keep me" and not list(tmp_path.glob(".out.old-*"))
    with pytest.raises(MiniGPTError, match="is an existing file"):
        begin_atomic_dir(final)
