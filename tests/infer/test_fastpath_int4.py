"""The fast path over int4 weights: the packed-word matrix-vector kernel of the compiled step equals the dequantized
product (1, several and more than DECODE_ROWS_MAX rows), the compiled int4 decode equals the eager int4 model, and
on Karpathy's trained stories260K the int4 logits stay within a stated tolerance of fp32 (and greedy decoding is
compared with fp32's for 32 tokens)."""
import copy
import json
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.infer.fastpath import DECODE_ROWS_MAX, Proj, decode_linear, int8_words, prepare
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.model.quant import METHOD_INT4, dequantize_weight_int4, quantize_model, quantize_weight_int4

torch.set_num_threads(1)

SHAPE = dict(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)
make = partial(random_model, SHAPE, noise=0.05)


@pytest.mark.slow
def test_int4_word_kernel_equals_dequantized_product(float32_prefill):
    """decode_linear over an int4 Proj reads the packed bytes as float32 words (8 nibbles each) and must equal x
    times the dequantized matrix: eagerly for 1 row (per-row reductions) and compiled, as the decode step compiles
    it, for DECODE_ROWS_MAX + 1 rows (one GEMM on the unpacked matrix; the compiled per-row reductions are in the
    decode test below). Groups of 16 (two words a group; the decode test below has 32, Q4_0's four)."""
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    packed, scale = quantize_weight_int4(w, 16)
    words = int8_words(packed)
    assert words is not None and words.shape == (40, 12) and words.data_ptr() == packed.data_ptr()
    bias = torch.randn(40)
    dense = dequantize_weight_int4(packed, scale, 16)
    step = torch.compile(lambda p, x: decode_linear(p, x), dynamic=False, fullgraph=True)
    for rows, run in ((1, decode_linear), (DECODE_ROWS_MAX + 1, step)):
        x = torch.randn(rows, 1, 96)
        want = x @ dense.T + bias
        torch.testing.assert_close(run(Proj(None, scale, bias, words), x), want, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(Proj(packed, scale, bias)(x), want, atol=1e-4, rtol=1e-5)  # eager


@pytest.mark.slow
def test_compiled_int4_decode_equals_eager_int4(float32_prefill):
    """The compiled int4 step (batch 2, fused wqkv / w13 of packed rows) equals the eager int4 fast path and the
    quantized model's own forward, step by step."""
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = quantize_model(make(), METHOD_INT4)(tokens)[:, 8:]
        outs = []
        for compiled in (False, True):
            fast = prepare(make(), quantize="int4", compile=compiled, woq_kernel="words")
            cache = fast.new_kv_cache(2, 16)
            fast(tokens[:, :8], 0, cache)
            outs.append(torch.stack([fast.decode_step(tokens[:, i:i + 1], i, cache) for i in range(8, 16)], 1))
    wqkv = fast.layers[0].wqkv
    assert fast.compiled and wqkv.words is not None and wqkv.group_size == 32
    # The compiled step reads each word's group scale from a per-word copy (int4_word_scales), the GEMM path the groups.
    assert wqkv.word_scale.shape == wqkv.words.shape and wqkv.word_scale.dtype == torch.float16
    assert torch.equal(wqkv.word_scale[:, ::4], wqkv.scale)
    torch.testing.assert_close(outs[0], ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=0)


def _stories(shared_data):
    folder = shared_data / "models" / "stories260K"
    if not (folder / "hf" / "config.json").is_file():
        pytest.skip(f"stories260K is not in {folder}")
    from minigpt.checkpoint.native import load_model

    return load_model(folder / "hf"), json.loads((folder / "reference_outputs.json").read_text())


GREEDY_32 = SamplingParams(max_tokens=32, temperature=0)


def test_int4_logits_within_tolerance_on_stories260k(shared_data):
    """stories260K (dim 64, hidden 172: w2 stays int8, as llama.cpp falls back for rows that do not divide into
    blocks; the head int8) teacher-forced on its own fp32 greedy continuation from BOS. Tolerance: 0.2 relative
    (Frobenius norm over all positions and the vocabulary). Why: rounding to 16 levels of step |d| = max|w|/8
    adds noise of RMS |d| / sqrt(12) per weight, ~7.6 % of a Gaussian weight's RMS for a group of 32; 25 such
    layers feed a residual stream whose norm layers rescale the noise rather than compound it; measured 0.138
    (int8: 0.009). A wrong nibble order or scale gives ~1."""
    model, ref = _stories(shared_data)
    fp32 = list(generate_tokens(prepare(copy.deepcopy(model)), [1], GREEDY_32))
    assert fp32 == ref["greedy"]["generated_ids"][:32]
    q4 = quantize_model(copy.deepcopy(model), METHOD_INT4)
    seq = torch.tensor([[1] + fp32])
    with torch.inference_mode():
        a, b = model(seq), q4(seq)
    assert ((b - a).norm() / a.norm()).item() < 0.2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9  # the next-token choice, position by position


@pytest.mark.xfail(strict=True, reason="measured: int4 (Q4_0 groups of 32) greedy from BOS equals fp32 for the "
                   "first 27 tokens and differs at token 27 (0-based), where fp32's top-2 logits are 0.22 apart "
                   "(13.06 vs 12.84); the 260K-parameter model is too narrow (dim 64) for 4-bit groups there. "
                   "llama.cpp's own Q4_0 of this model (llama-quantize from its F32 GGUF; llama-simple, greedy, "
                   "from BOS) writes the same 32 tokens as ours: '...play outside in the sun. One day' where both "
                   "F32 runs write '...in the park. One'")
def test_int4_greedy_equals_fp32_for_32_tokens_on_stories260k(shared_data):
    model, _ = _stories(shared_data)
    fp32 = list(generate_tokens(prepare(copy.deepcopy(model)), [1], GREEDY_32))
    int4 = list(generate_tokens(prepare(copy.deepcopy(model), quantize="int4", compile=False), [1], GREEDY_32))
    assert int4[:27] == fp32[:27]  # the part that holds (see the xfail reason)
    assert int4 == fp32


def test_int4_in_groups_of_8_is_greedy_identical_to_fp32_for_32_tokens_on_stories260k(shared_data):
    """The same int4 code with groups of 8 (`minigpt quantize --dtype int4 --group-size 8`: a float16 scale per 8
    weights, 6 bits a weight instead of Q4_0's 4.5) keeps stories260K's greedy text for 32 tokens. Measured on this
    model (relative logit error, first differing token): groups of 32 0.138 / 27, 16 0.106 / 20, 8 0.099 / none --
    the first difference is not monotone in the error, so this is one measured setting, not a rule."""
    model, ref = _stories(shared_data)
    fp32 = list(generate_tokens(prepare(copy.deepcopy(model)), [1], GREEDY_32))
    q4 = quantize_model(copy.deepcopy(model), METHOD_INT4, group_size=8)
    assert q4.layers[0].attention.wq.group_size == 8
    fast = prepare(q4, quantize="int4", compile=False)
    assert fast.layers[0].wqkv.group_size == 8
    int4 = list(generate_tokens(fast, [1], GREEDY_32))
    assert int4 == fp32 == ref["greedy"]["generated_ids"][:32]
