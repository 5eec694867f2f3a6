"""``load_model(..., quantize=...)``: a float source (GGUF above all) quantized tensor by tensor as it is read, equal
bit for bit to quantizing the float model, without the float model in memory."""
import json

import pytest
import torch
from conftest import random_model

from minigpt.checkpoint.convert import export_gguf
from minigpt.checkpoint.native import load_model, save_pretrained
from minigpt.infer.fastpath import load_for_inference
from minigpt.model.quant import SCHEMES, is_quantized, quantize_model
from minigpt.runtime import rss_bytes, run_in_child

SHAPE = {"vocab_size": 96, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 96,
         "max_seq_len": 32}


def _assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert a.quantization == b.quantization


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("source_kind,tie,dtype", [("gguf-q8_0", False, None), ("gguf-f32", True, torch.bfloat16),
                                                   ("native", True, None), ("native", False, torch.float16)])
def test_quantized_while_reading_equals_quantizing_the_float_model(tmp_path, scheme, source_kind, tie, dtype):
    model = random_model(SHAPE, seed=1, noise=0.02, tie_embeddings=tie, attention_bias=not tie)
    native = save_pretrained(model, tmp_path / "native")
    if source_kind == "native":
        source = native
    else:
        source = export_gguf(native, tmp_path / "m.gguf", dtype=source_kind.split("-")[1].replace("f32", "float32"))
    streamed = load_model(source, dtype=dtype, quantize=scheme)
    reference = quantize_model(load_model(source, dtype=dtype), SCHEMES[scheme])
    assert is_quantized(streamed) and not streamed.training
    _assert_same_model(streamed, reference)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(streamed(tokens), reference(tokens))
    # The inference loader takes the same path.
    plain = load_for_inference(source, dtype=dtype, quantize=scheme, fast=False)
    _assert_same_model(plain, reference)


def test_unknown_quantization_is_a_one_line_error(tmp_path):
    from minigpt.errors import MiniGPTError

    native = save_pretrained(random_model(SHAPE), tmp_path / "native")
    with pytest.raises(MiniGPTError, match="unknown quantization 'int3'"):
        load_model(native, quantize="int3")


BIG = {"vocab_size": 256, "dim": 256, "n_layers": 8, "n_heads": 4, "n_kv_heads": 4, "hidden_dim": 1024,
       "max_seq_len": 64}


def _vm_hwm() -> int:
    """Peak resident set size of this process in bytes since the last :func:`_reset_peak` (``VmHWM``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0, ``clear_refs`` value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_of_loading(gguf_path: str, warm_path: str, out: str) -> None:
    """In a fresh process: how far the peak RSS rises over the RSS before, loading ``gguf_path`` quantized while
    reading, then float32 and quantized after (each after a load of ``warm_path``, so that imports and the
    allocator's first pools are not counted)."""
    result = {}
    for kind in ("streamed", "float_first"):
        load = (lambda p: load_model(p, quantize="int8")) if kind == "streamed" else (
            lambda p: quantize_model(load_model(p)))
        load(warm_path)
        _reset_peak()
        before = rss_bytes()
        model = load(gguf_path)
        result[kind] = _vm_hwm() - before
        assert is_quantized(model)
        del model
    with open(out, "w") as f:
        json.dump(result, f)


def _can_reset_peak() -> bool:
    try:
        _reset_peak()
        return _vm_hwm() > 0
    except (OSError, StopIteration):
        return False


@pytest.mark.slow  # a child process (~7 s on 2 busy cores)
@pytest.mark.skipif(not _can_reset_peak(), reason="needs Linux's /proc/self/clear_refs and VmHWM")
def test_gguf_int8_load_never_holds_the_float_model(tmp_path):
    """Peak memory of ``load_model(gguf, quantize="int8")``, measured in a child process, stays well under the
    float32 model's bytes (it is about the int8 model, a quarter of them, plus one float32 tensor), where loading
    the float model first needs about twice them (the tensors read plus the model)."""
    big = save_pretrained(random_model(BIG, tie_embeddings=False), tmp_path / "big")
    warm = save_pretrained(random_model(SHAPE), tmp_path / "warm")
    gguf_path = export_gguf(big, tmp_path / "big.gguf")
    warm_path = export_gguf(warm, tmp_path / "warm.gguf")
    fp32_bytes = sum(p.numel() * 4 for p in random_model(BIG, tie_embeddings=False).parameters())
    out = tmp_path / "peak.json"
    run_in_child(_peak_of_loading, str(gguf_path), str(warm_path), str(out))
    growth = json.loads(out.read_text())
    print(f"peak RSS growth: {growth['streamed'] / 2**20:.1f} MiB quantized while reading, "
          f"{growth['float_first'] / 2**20:.1f} MiB float first, for a {fp32_bytes / 2**20:.1f} MiB float32 model")
    assert growth["streamed"] < 0.6 * fp32_bytes < growth["float_first"]


def test_load_model_and_tokenizer_follow_a_run_directorys_latest(tmp_path, tiny_data):
    """`from minigpt import load_model; load_model("runs/x")` loads the run's latest checkpoint, as the CLI does."""
    from minigpt.checkpoint.native import load_tokenizer
    from minigpt.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_data)
    model = random_model(dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=32), vocab_size=tok.vocab_size)
    run = tmp_path / "run"
    save_pretrained(model, run / "checkpoints" / "step_1", tok)
    (run / "latest").write_text("checkpoints/step_1\n")
    loaded = load_model(run)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert load_tokenizer(run).encode("To be, or not") == tok.encode("To be, or not")
    with pytest.raises(Exception, match="config.json is missing"):
        load_model(tmp_path)  # a directory that is neither a model nor a run stays an error
