"""Untrusted files: a crafted torch.distributed.checkpoint index must not run code in `checkpoint consolidate` or in
`train --resume`, even with a manifest that matches it (whoever writes the files writes the manifest); and the
claims of a model file's header (its context, its layer count, the lengths of its GGUF arrays) must not size an
allocation or a loop before they are checked against the bytes that back them (more in test_fuzz_files.py)."""
import json
import pickle
import resource
import struct
import subprocess
import sys

import pytest
import torch
from conftest import CLI_ENV, TINY_MODEL, assert_one_line_error, random_model, run_cli, some_slow, train_config

from minigpt.checkpoint.atomic import MANIFEST, sha256_file
from minigpt.checkpoint.convert import export_hf
from minigpt.checkpoint.dcp import read_index
from minigpt.checkpoint.native import model_state_dict, save_pretrained
from minigpt.checkpoint.quantized import save_quantized
from minigpt.errors import MiniGPTError
from minigpt.interop.gguf import write_gguf
from minigpt.model import transformer
from minigpt.model.config import ModelConfig
from minigpt.model.positions import sinusoidal_table
from minigpt.model.quant import quantize_model
from minigpt.model.rope import half_to_interleaved, rope_tables
from minigpt.train.loop import train


class _Payload:
    """Unpickling this calls ``exec``, which writes a marker file: what a hostile checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def _run(tiny_data, out_dir, **kw):
    return train(train_config(tiny_data, out_dir, **{**dict(batch_size=4, warmup_steps=1, max_steps=2, eval_interval=1000,
                                                           eval_windows=4, log_interval=1, ckpt_interval=2), **kw}))


def _poison(ckpt, marker):
    """Replace the checkpoint's DCP index by the payload and rewrite the manifest so it matches."""
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for rel in manifest:
        p = ckpt / rel
        manifest[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    _run(tiny_data, out)
    return out


def test_a_real_index_reads_back(trained_run):
    ckpt = next((trained_run / "checkpoints").glob("step_*"))
    meta = read_index(ckpt / "dcp" / ".metadata", "index")
    assert any(k.startswith("model.") for k in meta.state_dict_metadata)


@pytest.mark.slow
def test_consolidate_refuses_a_crafted_index(trained_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    ckpt = next((run / "checkpoints").glob("step_*"))
    marker = tmp_path / "marker"
    _poison(ckpt, marker)
    for target in (ckpt, run):  # the checkpoint itself, or the run directory
        proc = run_cli("checkpoint", "consolidate", target, tmp_path / "out")
        assert_one_line_error(proc, "refusing to load it")
        assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_resume_refuses_a_crafted_index(trained_run, tiny_data, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    marker = tmp_path / "marker"
    _poison(next((run / "checkpoints").glob("step_*")), marker)
    with pytest.raises(MiniGPTError, match="refusing to load it"):
        _run(tiny_data, run, max_steps=4, resume=True)
    assert not marker.exists()


def test_gguf_with_arrays_nested_100k_deep_is_one_line_error(tmp_path):
    import struct

    key = b"general.architecture"
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    body += struct.pack("<IQ", 9, 1) * 100_000 + struct.pack("<IQ", 0, 1) + b"\x00"  # ARRAY of ARRAY of ... of UINT8
    path = tmp_path / "nested.gguf"
    path.write_bytes(body)
    assert_one_line_error(run_cli("generate", path, "--prompt", "hi"), "nests arrays too deeply")
    assert_one_line_error(run_cli("import", path, tmp_path / "out"), "nests arrays too deeply")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ claims that must not size anything
# Hostile headers run in a child under this much address space (torch alone maps ~0.6 GB): a claim that drove an
# allocation fails there instead of exhausting the machine.
CHILD_MEMORY = 3 << 30
LOAD_AND_RUN = """
import json, sys, torch
from minigpt.checkpoint import load_model
model = load_model(sys.argv[1])
logits = model(torch.tensor([[1, 2, 3]]))
print(json.dumps({"max_seq_len": model.config.max_seq_len, "rows": model.rope_cos.shape[0],
                  "finite": bool(logits.isfinite().all())}))
"""


def run_limited(*args, timeout=120):
    """``python ARGS`` under :data:`CHILD_MEMORY` bytes of address space (one thread, offline)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))

    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=CLI_ENV,
                          preexec_fn=limit, timeout=timeout)


def _tiny_model():
    return random_model(TINY_MODEL, vocab_size=64)


def _llama2c_v1(model, path, seq_len):
    """A llama2.c version-1 file of ``model`` whose header claims ``seq_len`` positions (the format has no RoPE
    tables, so the claim costs no bytes)."""
    c, sd = model.config, model.state_dict()
    stack = lambda name, f=lambda w: w: torch.stack([f(sd[f"layers.{i}.{name}"]) for i in range(c.n_layers)])  # noqa: E731
    header = struct.pack("<Ii7iB", 0x616B3432, 1, c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                         c.vocab_size, seq_len, 1)
    arrays = [stack("attention_norm.weight"), stack("ffn_norm.weight"), sd["norm.weight"], sd["tok_embeddings.weight"],
              stack("attention.wq.weight", lambda w: half_to_interleaved(w, c.n_heads)),
              stack("attention.wk.weight", lambda w: half_to_interleaved(w, c.n_kv_heads)),
              stack("attention.wv.weight"), stack("attention.wo.weight"), stack("feed_forward.w1.weight"),
              stack("feed_forward.w2.weight"), stack("feed_forward.w3.weight")]
    path.write_bytes(header + bytes(256 - len(header)) + b"".join(a.float().numpy().tobytes() for a in arrays))
    return path


@pytest.mark.parametrize("source", some_slow(["llama2c", "hf", "gguf"], ("llama2c", "gguf")))
def test_a_context_of_2g_positions_loads_small_and_runs(tmp_path, source):
    """A llama2.c header, an HF ``max_position_embeddings`` or a GGUF ``context_length`` of 2^31 - 1 used to size
    68.7 GB of RoPE tables; the tables now cover the positions in use and grow on demand."""
    model, huge = _tiny_model(), 2**31 - 1
    if source == "llama2c":
        path = _llama2c_v1(model, tmp_path / "m.bin", huge)
    elif source == "hf":
        save_pretrained(model, tmp_path / "native")
        path = export_hf(tmp_path / "native", tmp_path / "hf")
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": huge}))
        (path / MANIFEST).unlink()
    else:
        claimed = ModelConfig.from_dict({**model.config.to_dict(), "max_seq_len": huge})
        path = write_gguf(model_state_dict(model), claimed, tmp_path / "m.gguf")
    proc = run_limited("-c", LOAD_AND_RUN, path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {"max_seq_len": huge, "rows": transformer.EAGER_POSITIONS, "finite": True}


def test_position_tables_grow_on_demand_to_the_same_rows(monkeypatch):
    """Past the eagerly computed rows, a forward grows the tables; every row equals the one a full table has, for
    plain, YaRN-scaled and sinusoidal positions, and the grown tables are ordinary tensors even when grown under
    inference_mode (so training can follow a generation)."""
    monkeypatch.setattr(transformer, "EAGER_POSITIONS", 40)
    for extra in ({}, {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_seq_len": 32}},
                  {"pos_encoding": "sinusoidal"}):
        config = ModelConfig(vocab_size=16, dim=12, n_layers=1, n_heads=2, max_seq_len=300, multiple_of=8, **extra)
        model = transformer.Transformer(config).eval()
        name = "pos_table" if extra.get("pos_encoding") == "sinusoidal" else "rope_cos"
        assert getattr(model, name).shape[0] == 40
        with torch.inference_mode():
            model(torch.tensor([[1, 2]]), start_pos=100, kv_cache=model.new_kv_cache(1, 102))
        assert getattr(model, name).shape[0] == 102 and not getattr(model, name).is_inference()
        model.ensure_positions(250)
        assert getattr(model, name).shape[0] == 250
        model.ensure_positions(290)
        assert getattr(model, name).shape[0] == 300  # doubled, capped at max_seq_len
        if name == "pos_table":
            assert torch.equal(model.pos_table, sinusoidal_table(300, 12))
        else:
            cos, sin = rope_tables(6, 300, config.rope_theta, config.rope_scaling)
            assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)


def test_a_config_claiming_2g_layers_is_refused_at_once(tmp_path):
    """Checked against the tensors before a single block is built (2^31 blocks would never finish building)."""
    save_pretrained(_tiny_model(), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "n_layers": 2**31 - 1}))
    (tmp_path / "m" / MANIFEST).unlink()
    assert_one_line_error(run_limited("-m", "minigpt", "export", tmp_path / "m", tmp_path / "out", "--format", "hf"),
                          "2147483647 layers", "need more tensors than the")


def test_gguf_array_longer_than_the_file_is_one_line_error(tmp_path):
    """An array of 2^64 - 1 bytes in 40: the gguf reader would loop over them (reads past the end return empty
    arrays, so its offset never advances)."""
    key = b"general.architecture"
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    body += struct.pack("<IIQ", 9, 0, 2**64 - 1) + bytes(4)  # ARRAY of UINT8, 2^64 - 1 of them
    path = tmp_path / "long.gguf"
    path.write_bytes(body)
    assert_one_line_error(run_limited("-m", "minigpt", "import", path, tmp_path / "out"),
                          "not a valid GGUF file or is truncated", "18446744073709551615 items")


@pytest.mark.parametrize("quantized", [False, True])
def test_a_vocabulary_claim_its_tensors_lack_is_refused_before_allocating(tmp_path, quantized):
    """2^40 embeddings claimed by config.json: the shapes are compared on the meta device, so the claim is a
    one-line error instead of a 32 TB allocation (float and int8-quantized directories alike)."""
    model = _tiny_model()
    if quantized:
        save_quantized(quantize_model(model), tmp_path / "m")
    else:
        save_pretrained(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "vocab_size": 2**40}))
    (tmp_path / "m" / MANIFEST).unlink()
    assert_one_line_error(run_limited("-m", "minigpt", "export", tmp_path / "m", tmp_path / "out", "--format", "hf"),
                          "has shape (64", "but the config implies (1099511627776")
