"""MiniGPT's int8 x int8 kernel on its AVX2 path (``minigpt/infer/w8a8_kernel.cpp``, ``rows_avx2_bytes`` and
``rows_avx2``), which takes the int8 projections of decode steps on CPUs with AVX2 but not AVX512-VNNI (FBGEMM's
AVX2 product saturates there).

The kernel picks its path once per process, so each check runs in a child process with the path capped:
``MINIGPT_W8A8_ISA=avx2`` (the kernel), ``ATEN_CPU_CAPABILITY=avx2`` (PyTorch, and MiniGPT's reading of the CPU
flags: :func:`minigpt.runtime.cpu_flags`) and ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN: no native bf16), as on an
AVX2-only CPU. Checked: the exact integer product, FBGEMM's quantizer quirks, weights of -128 (a file may hold
them) and activations of -128 included; which projections take it; a row's decode logits the same alone and in a
batch; and prompts of many rows through it as well."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CLI_ENV

from minigpt.runtime import cpu_flags

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif("avx2" not in cpu_flags(), reason="the kernel's AVX2 path needs an AVX2 CPU"),
    pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                       reason="no C++ compiler for the runner library"),
]

PRODUCT = """
import torch
from minigpt.infer.fastpath import library
from minigpt.model.quant import quantize_weight
print(library.own_int8_isa())
# FBGEMM's quantizer: x + 128 rounded to float32 first, ties to even, NaN to the top, clipped to 0..255, then - 128
SPECIAL = [1.4999999, -2.4999998, 0.49999997, 2.5, -0.5, 127.4, -128.6, 300.0, -300.0, float("nan"), float("inf"),
           -float("inf")]

def exact(x, w, s):
    t = (x + 128.0).float()
    t = torch.where(t.isnan(), torch.full_like(t, 255.0), t).clamp(0, 255)
    return ((torch.round(t) - 128).double() @ w.double().T).float() * s

keep = []
for out, n_in in [(1, 1), (48, 96), (130, 577), (33, 17), (64, 1536)]:
    torch.manual_seed(out)
    q, s = quantize_weight(torch.randn(out, n_in))
    q.view(-1)[::7] = -128  # outside the quantizer's -127..127: a hostile or foreign file
    keep.append(q)
    torch.ops.minigpt.w8a8_register(q.data_ptr(), out, n_in, s)
    for rows in range(1, 7):
        x = torch.randn(rows, n_in) * 40
        flat = x.view(-1)
        flat[:len(SPECIAL)] = torch.tensor(SPECIAL)[:flat.numel()]
        got = torch.ops.minigpt.w8a8_mm(x, q)
        print(out, n_in, rows, torch.equal(got, exact(x, q, s)))
# the largest pairs vpmaddubsw adds: |w| = 128 times 127, two by two (32512, just below 16 bits' 32767)
q = torch.tensor([[-128] * 96, [127] * 96, [-128, 127] * 48, [127, -128] * 48], dtype=torch.int8)
s = torch.ones(4)
keep.append(q)
torch.ops.minigpt.w8a8_register(q.data_ptr(), 4, 96, s)
x = torch.tensor([[-127.0] * 96, [127.0] * 96, [-127.0, 127.0] * 48])
print("extremes", torch.equal(torch.ops.minigpt.w8a8_mm(x, q), exact(x, q, s)))
# a prompt's rows: quantized a share per thread (two threads, whatever the child's default), and one -128 in a late
# pass only (row 37 of 40)
torch.set_num_threads(2)
torch.manual_seed(7)
q, s = quantize_weight(torch.randn(130, 577))
keep.append(q)
torch.ops.minigpt.w8a8_register(q.data_ptr(), 130, 577, s)
x = torch.randn(40, 577).clamp(-5, 5) * 20  # no -128 but the one below
x[37, 5] = -300.0
print("prompt", torch.equal(torch.ops.minigpt.w8a8_mm(x, q), exact(x, q, s)))
"""


def _child(code: str, *args: str, capped: bool = True) -> list[str]:
    env = {**CLI_ENV, **({"MINIGPT_W8A8_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"} if capped else {})}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


@pytest.mark.parametrize("capped", [True, False])
def test_the_product_is_exact(capped):
    """The integer sums exact and FBGEMM's rounding of the activations, on the AVX2 path and (uncapped) on whatever
    path this CPU runs: both equal the reference computed in float64, for 1-6 rows (either path takes up to four
    per pass), inputs not a multiple of 32 (the AVX2 path's tail one by one), weights of -128, activations of -128
    (``rows_avx2_bytes`` would lose their sign: such passes widen to 16 bits), the largest pairs ``vpmaddubsw``
    adds (|w| = 128 times 127), and a prompt's 40 rows, quantized in shares across the threads, whose only -128
    lies in the last pass (the quantizer marks the row; ``product`` picks each pass's path from the marks)."""
    isa, *lines = _child(PRODUCT, capped=capped)
    assert isa == ("avx2" if capped else "avx512_vnni" if "avx512_vnni" in cpu_flags() else "avx2")
    assert len(lines) == 32 and all(line.endswith("True") for line in lines), lines


STEPS = """
import sys
import torch
sys.path.insert(0, "tests")
from conftest import random_model
from minigpt.infer.fastpath import prepare
from minigpt.infer.fastpath.library import OWN_INT8, w8a8_available
torch.manual_seed(0)
shape = dict(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)
fast = prepare(random_model(shape, noise=0.05), quantize="int8")
projections = [fast.head] + [q for lw in fast.layers for q in (lw.wqkv, lw.wo, lw.w13, lw.w2)]
print(w8a8_available(), all(p.w8a8 is OWN_INT8 for p in projections), fast.geometry.w8a8, fast.geometry.head_w8a8)
words = prepare(random_model(shape, noise=0.05), quantize="int8", woq_kernel="words")
print(any(p.w8a8 is not None for p in [words.head] + [q for lw in words.layers for q in (lw.wqkv, lw.w2)]))
tokens = torch.tensor([[5, 17, 3, 40], [9, 2, 60, 11], [33, 33, 1, 8]])
with torch.inference_mode():
    def logits(rows):
        cache = fast.new_kv_cache(rows.shape[0], 8)
        return torch.stack([fast.decode_step(rows[:, i:i + 1], i, cache) for i in range(rows.shape[1])], 1)
    batch = logits(tokens)
    print(all(torch.equal(logits(tokens[i:i + 1])[0], batch[i]) for i in range(3)))
    x = torch.randn(40, 64)
    head = fast.head
    want = (x @ head.weight.float().T) * head.scale  # float activations
    few, many = head(x[:3]), head(x)  # 3 rows and 40 (a prompt): the kernel, 8-bit activations
    err = lambda a, b: ((a - b).norm() / b.norm()).item()
    print(err(many, want) > 1e-4, err(many, want) < 0.02, torch.equal(many[:3], few))
    # a prompt's logits: those of its tokens one step at a time (each row quantized on its own)
    prompt = tokens[:1]
    cache = fast.new_kv_cache(1, 8)
    whole = fast(prompt, 0, cache)[0]
    print(torch.allclose(whole, logits(prompt)[0], rtol=1e-4, atol=1e-5))
"""


@pytest.mark.slow  # ~20-25 s in its child process on 2 cores; CI's slow stage runs it
def test_decode_steps_and_prompts_take_it():
    """On an AVX2 CPU without VNNI every int8 projection of a decode step goes through the kernel (none under
    ``woq_kernel="words"``); rows are quantized one by one, so a row's logits are the same alone and in a batch;
    many rows (a prompt) take the kernel too, in blocks of weight rows (``product``), with the same numbers for
    each row as when it is alone (within 2 % of float activations: their 8-bit rounding); a prompt's logits
    those of its tokens fed one step at a time, up to the attention's float sums."""
    lines = _child(STEPS)
    assert lines == ["False True True True", "False", "True", "True True True", "True"], lines


COMPILED = """
import sys
import torch
sys.path.insert(0, "tests")
from conftest import random_model
from minigpt.infer.fastpath import prepare
from minigpt.infer.fastpath.library import OWN_INT8
shape = dict(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)
tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
outs = []
with torch.inference_mode():
    for compile in (False, True):
        torch.manual_seed(0)
        fast = prepare(random_model(shape, noise=0.05), quantize="int8", compile=compile)
        assert fast.head.w8a8 is OWN_INT8 and fast.compiled == compile
        cache = fast.new_kv_cache(2, 12)
        fast(tokens[:, :6], 0, cache)
        outs.append(torch.stack([fast.decode_step(tokens[:, i:i + 1], i, cache) for i in range(6, 12)], 1))
print(((outs[1] - outs[0]).norm() / outs[0].norm()).item())
"""


@pytest.mark.slow  # compiles a step, ~30 s
def test_the_compiled_step_takes_it_and_equals_eager():
    """The compiled step (Inductor's AVX2 code) calls the kernel through ``minigpt::w8a8_mm`` on the same rows as
    eager decode steps: the logits agree up to the layers' own eager/compiled difference (as on VNNI CPUs,
    test_fastpath_w8a8.test_compiled_steps_equal_eager)."""
    (err,) = _child(COMPILED)
    assert float(err) < 2 ** -6


REAL = """
import copy, sys
import torch
from minigpt.checkpoint.native import load_model, load_tokenizer
from minigpt.infer.fastpath import prepare
from minigpt.infer.fastpath.library import OWN_INT8
folder, text = sys.argv[1], sys.argv[2]
model = load_model(folder)
tokens = torch.tensor([load_tokenizer(folder).encode(open(text, encoding="utf-8").read()[:4000], bos=True)[:257]])

def loss(fast):
    with torch.inference_mode():
        logits = fast(tokens[:, :-1], 0, fast.new_kv_cache(1, 256))
    return torch.nn.functional.cross_entropy(logits[0].float(), tokens[0, 1:]).item()

fp32 = loss(prepare(copy.deepcopy(model)))
fast = prepare(copy.deepcopy(model), quantize="int8")
projections = [fast.head] + [q for lw in fast.layers for q in (lw.wqkv, lw.wo, lw.w13, lw.w2)]
print(all(p.w8a8 is OWN_INT8 for p in projections))
kernel = loss(fast)
for p in projections:
    p.w8a8 = None  # the float path: int8 weights, float32 activations
print(fp32, kernel, loss(fast))
"""


def test_a_real_prompt_through_it_keeps_fp32s_loss(shared_data):
    """stories260K (a real checkpoint; its FFN's 172 inputs exercise the tail) on 256 tokens of TinyStories'
    validation text, one prompt: with every int8 projection's prompt rows through the kernel the next-token loss is
    within 0.02 nats of fp32's (measured 1.4025 against 1.3988; float32 activations on the same int8 weights
    1.3954), and differs from the float path's (the prompt went through the kernel)."""
    folder, text = shared_data / "models" / "stories260K" / "hf", shared_data / "tinystories_valid_head.txt"
    if not (folder / "config.json").is_file() or not text.is_file():
        pytest.skip(f"stories260K or TinyStories' validation text is not in {shared_data}")
    took, losses = _child(REAL, str(folder), str(text))
    fp32, kernel, float_path = map(float, losses.split())
    assert took == "True"
    assert abs(kernel - fp32) < 0.02 and abs(kernel - float_path) > 1e-4, (fp32, kernel, float_path)
