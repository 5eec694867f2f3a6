"""int8 projections through FBGEMM's int8 x int8 product (:func:`minigpt.infer.fastpath.library.w8a8_linear`):
activations rounded to 8 bits per row, close to the float-activation product, each row independent of the others
and of how many rows share a call (a batch's or the engine's greedy text equals each prompt's alone), taken by
every int8 projection (eager and compiled) by default and by none under ``woq_kernel="aten"`` or ``"words"``,
and stories260K's greedy text equal to fp32's."""
import copy
import gc
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import CLI_ENV, random_model

from minigpt.infer.fastpath import Proj, library, prepare
from minigpt.infer.fastpath.kernels import _row_blocks, decode_linear
from minigpt.infer.fastpath.library import w8a8_available, w8a8_layout, w8a8_linear
from minigpt.infer.generate import generate_batch, generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.model.quant import dequantize_weight, quantize_weight

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(not w8a8_available(),
                                reason="no FBGEMM (not an x86 build of PyTorch) or a CPU without AVX512-VNNI")

SHAPE = dict(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)
make = partial(random_model, SHAPE, noise=0.05)

# Rounding x to 8 bits per row: step s = max|x| / 127, error uniform in +-s/2, RMS s / sqrt(12). For Gaussian rows
# of 96 values max|x| is ~2.5-3.3 standard deviations, so the relative error of x (and of the product, which sums
# those errors with independent weights) is ~0.6-0.8 %; bound 2 %. A wrong zero point or scale gives ~1 or more.
W8A8_BOUND = 0.02


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _head(out=48, n_in=96, bias=True):
    torch.manual_seed(0)
    q, s = quantize_weight(torch.randn(out, n_in))
    p = Proj(q, s, torch.randn(out) if bias else None)
    assert w8a8_layout(p)
    return p, dequantize_weight(q, s)


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_w8a8_product_is_close_to_the_float_activation_product(rows):
    p, dense = _head()
    x = torch.randn(rows, 1, 96)
    want = x @ dense.T + p.bias
    got = w8a8_linear(p, x)
    assert got.shape == (rows, 1, 48) and got.dtype == x.dtype
    err = rel(got, want)
    assert 0 < err < W8A8_BOUND  # 0: it would not be rounding the activations at all


def test_each_row_is_quantized_on_its_own():
    """A row's result is the same alone and beside a row 1000x larger: one shared activation scale would round the
    small row to a few levels (its error ~100 %)."""
    p, dense = _head(bias=False)
    x = torch.randn(4, 96)
    x[2] *= 1000.0
    batch = w8a8_linear(p, x)
    for i in range(4):
        assert torch.equal(batch[i], w8a8_linear(p, x[i:i + 1])[0])
    assert rel(batch[0], x[0] @ dense.T) < W8A8_BOUND


def test_a_matrix_without_a_packed_copy_is_refused_and_freed_ones_are_forgotten():
    library.w8a8_kernel()  # the kernel a compiled step would use (C++ where the runner library builds)
    p, _ = _head()
    with pytest.raises(RuntimeError, match="no packed copy"):
        torch.ops.minigpt.w8a8_mm(torch.randn(1, 96), p.weight.clone())
    key = library._packed_key(p.weight)
    assert key in library._PACKED
    del p
    gc.collect()
    assert key not in library._PACKED  # its memory may hold another matrix next


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler for the runner library")
def test_the_ops_kernel_is_the_runner_librarys_and_computes_what_the_python_one_does():
    """Compiled steps call `minigpt::w8a8_mm` ~120 times a token at 135M; its kernel is the C++ one of the runner
    library wherever that builds (a Python kernel made int8 decode ~1.4x slower). Same FBGEMM call on the same
    packed copy: the same bits as the Python kernel. A copy whose recorded shape is not the matrix's (memory
    reused by another matrix) and one withdrawn by the finalizer's function are refused, not used."""
    assert library.w8a8_kernel() == "c++"
    assert "w8a8_op.cpp" in torch._C._dispatch_dump("minigpt::w8a8_mm").split("CPU:")[1].splitlines()[0]
    p, _ = _head()
    for rows in (1, 5):
        x = torch.randn(rows, 96) * 20
        assert torch.equal(torch.ops.minigpt.w8a8_mm(x, p.weight), library._w8a8_mm(x, p.weight))
    key = library._packed_key(p.weight)
    torch.ops.minigpt.w8a8_adopt(key[0], 49, 96, p.w8a8, torch.ones(49))
    with pytest.raises(RuntimeError, match="of another matrix"):
        torch.ops.minigpt.w8a8_mm(torch.randn(1, 96), p.weight)
    library._forget(key)
    with pytest.raises(RuntimeError, match="no packed copy"):
        torch.ops.minigpt.w8a8_mm(torch.randn(1, 96), p.weight)


# Activations at FBGEMM's rounding quirk (it rounds x + 128 to float32 before rounding to an integer: 1.4999999 gives
# 2, not 1), at ties, past the int8 range and not finite.
SPECIAL = [1.4999999, -2.4999998, 0.49999997, 2.5, -0.5, 127.4, -128.6, 300.0, -300.0, float("nan"), float("inf"),
           -float("inf")]


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler for the runner library")
@pytest.mark.parametrize("shape", [(1, 1), (48, 96), (130, 577), (192, 576)])
def test_decode_rows_take_minigpts_kernel_with_fbgemms_bits(shape):
    """Up to 4 rows go through MiniGPT's own kernel (minigpt/infer/w8a8_kernel.cpp), which reads the int8 matrix
    where it lies, so the native runner packs nothing when it opens a bundle; its numbers are FBGEMM's to the bit,
    the quirks of FBGEMM's quantizer included (a kernel that rounds x itself fails on SPECIAL's first values)."""
    assert library.w8a8_kernel() == "c++"
    assert torch.ops.minigpt.w8a8_isa() == "avx512_vnni"  # w8a8_available (this module's skip) requires VNNI
    out, n_in = shape
    torch.manual_seed(out)
    p = Proj(*quantize_weight(torch.randn(out, n_in)), None)
    assert w8a8_layout(p)
    for rows in (1, 2, 3, 4, 5):  # 5: FBGEMM's packed copy, through the same op
        x = torch.randn(rows, n_in) * 40
        flat = x.view(-1)
        flat[:len(SPECIAL)] = torch.tensor(SPECIAL)[:flat.numel()]
        got = torch.ops.minigpt.w8a8_mm(x, p.weight)
        assert got.isfinite().all()  # the NaN and infinities are clipped to the int8 range, as FBGEMM clips them
        assert torch.equal(got, library._w8a8_mm(x, p.weight)), rows


FALLBACK = """
import sys, warnings
from pathlib import Path
from minigpt.infer.fastpath import library
from minigpt.infer.fastpath.library import build_runner
from minigpt.infer.launcher import NativeError, install_w8a8_kernel
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    print(library.w8a8_kernel(), "|", "; ".join(str(w.message) for w in seen))
try:
    install_w8a8_kernel(build_runner(Path(sys.argv[1])))
except NativeError as e:
    print("refused |", e)
"""


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler for the runner library")
def test_without_the_runner_library_the_python_kernel_runs_and_a_runner_is_refused():
    """With the compile cache off (where the library would be built) the op gets the Python kernel, with a
    warning saying so and why; a runner library loaded afterwards must not take over (its kernel would not know
    the packed copies made here), so installing it is refused with that reason. (The library comes from the
    test session's compile cache.)"""
    cache = os.environ["MINIGPT_COMPILE_CACHE"]
    env = {**CLI_ENV, "MINIGPT_COMPILE_CACHE": "off"}
    out = subprocess.run([sys.executable, "-c", FALLBACK, cache], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    chosen, refused = out.stdout.strip().splitlines()
    assert chosen.startswith("python |") and "slower" in chosen and "compile cache is off" in chosen
    assert refused.startswith("refused |") and "another CPU kernel" in refused


def test_float_weights_are_refused():
    assert not w8a8_layout(Proj(torch.randn(8, 16)))
    assert not w8a8_layout(Proj(torch.randn(8, 16).bfloat16()))


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_which_projections_take_it(quantize):
    """By default every int8 projection (int4 models: their int8 head and layers); under "aten" and "words" and
    for float weights none."""
    def projections(fast):
        return [fast.head] + [q for lw in fast.layers for q in (lw.wqkv, lw.wo, lw.w13, lw.w2)]

    def taken(fast):
        return [p.w8a8 is not None for p in projections(fast)]

    default = prepare(make(), quantize=quantize)
    int8 = [p.scale.dim() == 1 for p in projections(default)]  # int4 models keep int8 where groups do not fit
    assert int8[0] and (all(int8) if quantize == "int8" else not all(int8))
    assert taken(default) == int8
    assert default.geometry.w8a8 == any(int8[1:]) and default.geometry.head_w8a8
    assert not any(taken(prepare(make(), quantize=quantize, woq_kernel="aten")))
    assert not any(taken(prepare(make(), quantize=quantize, woq_kernel="words")))
    assert not any(taken(prepare(make())))  # float weights


def test_a_cpu_without_vnni_keeps_int8_off_fbgemm(monkeypatch):
    """Without VNNI, FBGEMM's 16-bit pair sums would saturate on these activations: int8 goes to MiniGPT's own
    kernel where its AVX2 path runs (tests/infer/test_w8a8_avx2.py; here the kernel reports VNNI, so not), else to
    the other kernels."""
    monkeypatch.setattr(library, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert not w8a8_available()
    fast = prepare(make(), quantize="int8")
    assert fast.head.w8a8 is None and not fast.geometry.w8a8


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["w8a8", "auto"])
def test_compiled_steps_equal_eager(kernel):
    """The compiled step calls FBGEMM through the ``minigpt::w8a8_mm`` op on the same rows as eager decode steps:
    the logits agree up to the layers' own eager/compiled difference (~6e-3 for ATen's path,
    test_fastpath_woq_aten)."""
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    outs = []
    with torch.inference_mode():
        for compile in (False, True):
            fast = prepare(make(), quantize="int8", compile=compile, woq_kernel=kernel)
            assert fast.head.w8a8 is not None and fast.compiled == compile
            cache = fast.new_kv_cache(2, 12)
            fast(tokens[:, :6], 0, cache)
            outs.append(torch.stack([fast.decode_step(tokens[:, i:i + 1], i, cache) for i in range(6, 12)], 1))
    assert outs[1].shape == (2, 6, 61)
    assert rel(outs[1], outs[0]) < 2 ** -6


PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [4], [20, 21, 22, 23, 24]]


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])  # compiled: ~14 s
def test_a_batch_changes_no_rows_logits(compile):
    """Rows are quantized one by one, so a row's decode logits are the same alone and in a batch (FBGEMM's own
    dynamic quantization, one scale for the whole batch, fails this), and a batch's greedy text is each prompt's."""
    tokens = torch.tensor([[5, 17, 3, 40], [9, 2, 60, 11], [33, 33, 1, 8]])
    with torch.inference_mode():
        fast = prepare(make(), quantize="int8", compile=compile)
        assert fast.geometry.w8a8

        def logits(rows):
            cache = fast.new_kv_cache(rows.shape[0], 8)
            return torch.stack([fast.decode_step(rows[:, i:i + 1], i, cache) for i in range(rows.shape[1])], 1)

        batch = logits(tokens)
        for i in range(3):
            torch.testing.assert_close(logits(tokens[i:i + 1])[0], batch[i], atol=0, rtol=0)
        params = SamplingParams(max_tokens=10, temperature=0)
        alone = [list(generate_tokens(fast, p, params)) for p in PROMPTS]
        assert [r.tokens for r in generate_batch(fast, PROMPTS, params)] == alone


def test_the_engine_gives_each_request_its_text_alone():
    """The serving engine prefills late requests beside others' rows (more than 8 in one call): with FBGEMM for
    few rows only and a bf16 GEMM above, the 2-token prompt's greedy text differed from its text alone."""
    from minigpt.infer.engine import Engine

    fast = prepare(make(), quantize="int8")
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = [*PROMPTS, [7] * 9, [3, 9]]
    with torch.inference_mode():
        alone = [list(generate_tokens(fast, p, params)) for p in prompts]
        engine = Engine(fast, max_batch_size=4)
        requests = [engine.submit(p, params) for p in prompts]
        engine.run_until_idle()
    assert [r.output_ids for r in requests] == alone


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("out", [96, 200])
def test_float_products_split_into_row_blocks_equal_the_matmul(rows, out):
    """decode_linear's float matrix-vector product in row blocks (fused by Inductor into one loop over several weight
    streams) computes ``x W^T``; a row count that does not split stays whole."""
    torch.manual_seed(0)
    w = torch.randn(out, 64)
    x = torch.randn(rows, 1, 64)
    torch.testing.assert_close(decode_linear(Proj(w), x), x @ w.T, atol=1e-5, rtol=1e-5)


def test_row_blocks():
    assert [_row_blocks(3072, rows) for rows in (1, 2, 3, 4, 8)] == [8, 4, 2, 2, 1]
    assert _row_blocks(200, 1) == 1 and _row_blocks(96, 1) == 2 and _row_blocks(49152, 1) == 8


GREEDY_32 = SamplingParams(max_tokens=32, temperature=0)


def test_stories260k_greedy_text_equals_fp32(shared_data):
    """A real checkpoint: with 8-bit activations in every int8 projection (and the int8 head of the int4 model)
    the first 32 greedy tokens from BOS are fp32's (measured over 200: the first difference at token 61, the same
    as ATen's bf16-activation kernel and float activations)."""
    folder = shared_data / "models" / "stories260K" / "hf"
    if not (folder / "config.json").is_file():
        pytest.skip(f"stories260K is not in {folder}")
    from minigpt.checkpoint.native import load_model

    model = load_model(folder)
    want = list(generate_tokens(prepare(copy.deepcopy(model)), [1], GREEDY_32))
    fast = prepare(copy.deepcopy(model), quantize="int8")
    assert fast.geometry.w8a8
    assert list(generate_tokens(fast, [1], GREEDY_32)) == want
    # int4 (not greedy-identical to fp32 here, see test_fastpath_int4): the int8 head does not change its text
    fast = prepare(copy.deepcopy(model), quantize="int4")
    assert fast.head.w8a8 is not None
    with_it = list(generate_tokens(fast, [1], GREEDY_32))
    fast.head.w8a8 = None  # the same model with float activations into its int8 head
    assert list(generate_tokens(fast, [1], GREEDY_32)) == with_it
