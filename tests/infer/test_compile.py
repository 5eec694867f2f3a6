"""The compiled decode step (torch.compile over a static cache, positions and padding as tensors) computes what the
eager fast path computes, for plain and left-padded batches, and one graph serves every step. Kept apart from
test_perf.py because a compilation takes seconds."""
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.infer.fastpath import CACHE_BUCKET, FastPath
from minigpt.infer.generate import generate_batch, generate_tokens
from minigpt.infer.sampling import SamplingParams
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer

torch.set_num_threads(1)


# Several layers: the compile regions are reused across layers, and each layer's cache is a separate input.
THREE_LAYERS = ModelConfig(vocab_size=61, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=64, multiple_of=16)


SHAPE = dict(vocab_size=61, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)
make = partial(random_model, SHAPE, noise=0.05)


def eager_and_compiled_int8_steps(build, tokens: torch.Tensor, prefill: int):
    """Logits of the decode steps after a ``prefill``-token prompt, ``[steps, batch, vocab]``, from the eager and the
    compiled int8 fast path of the model ``build()`` returns; also the compiled FastPath."""
    from minigpt.infer.fastpath import prepare

    outs = []
    with torch.inference_mode():
        for compiled in (False, True):
            fast = prepare(build(), compile=compiled, quantize="int8", woq_kernel="words")
            cache = fast.new_kv_cache(tokens.shape[0], tokens.shape[1])
            fast(tokens[:, :prefill], 0, cache)
            outs.append(torch.stack([fast.decode_step(tokens[:, i:i + 1], i, cache)
                                     for i in range(prefill, tokens.shape[1])]))
    return outs, fast


def three_layers_compiled(tokens: torch.Tensor):
    """The seeded THREE_LAYERS model's plain-forward logits of ``tokens``, its compiled FastPath and a 30-column
    cache of that FastPath."""
    torch.manual_seed(0)
    model = Transformer(THREE_LAYERS).eval()
    with torch.inference_mode():
        full = model(tokens)
    fast = FastPath(model, compile=True)
    return full, fast, fast.new_kv_cache(tokens.shape[0], 30)


@pytest.mark.slow
def test_compiled_decode_step_equals_plain_forward_and_batches():
    model = make()
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4]]
    greedy = SamplingParams(max_tokens=10, temperature=0)
    alone = [list(generate_tokens(model, p, greedy)) for p in prompts]
    tokens = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(tokens)
    compiled = FastPath(make(), compile=True)
    cache = compiled.new_kv_cache(2, 30)
    assert cache.max_seq_len == CACHE_BUCKET  # rounded up so that nearby lengths share the graph
    with torch.inference_mode():
        pieces = [compiled(tokens[:, :8], 0, cache)]
        for i in range(8, 30):
            pieces.append(compiled.decode_step(tokens[:, i:i + 1], i, cache)[:, None])
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)
    # Left-padded rows through the compiled step (padding as a tensor): equal to each prompt alone.
    assert [r.tokens for r in generate_batch(compiled, prompts, greedy)] == alone
    assert [list(generate_tokens(compiled, p, greedy)) for p in prompts] == alone
    assert compiled.compile_seconds > 0
    # Shapes seen: batch 2 (the pieces), batch 3 (the padded batch), batch 1 (alone) -- never one per position.
    assert compiled._compiled_shapes == {(2, 1, CACHE_BUCKET), (3, 1, CACHE_BUCKET), (1, 1, CACHE_BUCKET)}


@pytest.mark.slow
def test_compiled_int8_and_bf16_steps():
    """int8: the compiled step reads the weights as float32 words (int8_words) and must equal the eager int8 path
    up to summation order. bf16 weights: the compiled step keeps activations in float32 while the eager step rounds
    them to bf16 for the BLAS, so both are held to the bf16 tolerance against the fp32 model."""
    from minigpt.infer.fastpath import int8_words, prepare

    q = torch.randint(-127, 128, (8, 12), dtype=torch.int8)
    words = int8_words(q)
    assert words.dtype == torch.float32 and words.shape == (8, 3) and words.data_ptr() == q.data_ptr()
    assert words._base is None  # not a view: the compiled step must see float32, not trace back to int8
    bits = words.view(torch.int32)
    unpacked = torch.stack([((bits << (24 - 8 * j)) >> 24) for j in range(4)], dim=-1)  # [8, 3, 4]
    assert torch.equal(unpacked.reshape(8, 12), q.int())
    assert int8_words(q[:, :7]) is None and int8_words(q.float()) is None

    tokens = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = make()(tokens)[0, 8:]
        for kw, tol in ((dict(quantize="int8"), 1e-4), (dict(dtype=torch.bfloat16), 0.05)):
            outs = []
            for compiled in (False, True):
                fast = prepare(make(), compile=compiled, woq_kernel="words", **kw)
                cache = fast.new_kv_cache(1, 20)
                fast(tokens[:, :8], 0, cache)
                outs.append(torch.cat([fast.decode_step(tokens[:, i:i + 1], i, cache) for i in range(8, 20)]))
            if "quantize" in kw:
                torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=0)
                assert (outs[1] - ref).abs().max() < 0.05  # the quantization error itself
            else:
                assert (outs[0] - ref).abs().max() < tol and (outs[1] - ref).abs().max() < tol


@pytest.mark.slow
def test_compiled_int8_step_above_the_matrix_vector_batch(float32_prefill):
    """More rows than DECODE_ROWS_MAX: the compiled int8 step unpacks the words into a matrix for one GEMM, and
    must still equal the eager int8 path row for row."""
    from minigpt.infer.fastpath import DECODE_ROWS_MAX

    tokens = torch.randint(0, 61, (DECODE_ROWS_MAX + 1, 12), generator=torch.Generator().manual_seed(4))
    outs, _ = eager_and_compiled_int8_steps(make, tokens, prefill=8)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_int8_step_on_widths_without_a_word_view():
    """An input width that is not a multiple of 4 (``dim`` 30) has no float32-word view (``int8_words`` is None):
    those projections fall back to converting int8 rows in the loop, the others (``w2``, input width 64) still read
    words, and the compiled step must equal the eager int8 path."""
    tokens = torch.randint(0, 61, (2, 14), generator=torch.Generator().manual_seed(5))
    outs, fast = eager_and_compiled_int8_steps(lambda: make(dim=30, n_heads=3, n_kv_heads=1), tokens, prefill=8)
    layer = fast.layers[0]
    assert layer.wqkv.words is None and layer.w13.words is None and layer.w2.words is not None
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_step_with_several_layers_writes_the_cache_it_reads():
    """Three layers (the compile regions are reused across layers): compiled steps equal the plain forward, and
    the cache they leave behind is the one an eager forward continues from (an in-graph cache write once left
    garbage in the new column for every model of more than one layer)."""
    tokens = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(2))
    full, compiled, cache = three_layers_compiled(tokens)
    with torch.inference_mode():
        pieces = [compiled(tokens[:, :10], 0, cache)]
        for i in range(10, 14):
            pieces.append(compiled.decode_step(tokens[:, i:i + 1], i, cache)[:, None])
        pieces.append(compiled(tokens[:, 14:], 14, cache))  # eager, multi-token, over the compiled steps' columns
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_compiled_steps_run_inside_and_outside_inference_mode():
    """generate_batch runs under inference_mode; the step's reused position buffer, first made there, must still
    be writable by a later step outside it (an inference tensor is not)."""
    model = make(n_layers=2)
    tokens = torch.randint(0, 61, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = model(tokens)
    fast = FastPath(model, compile=True)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    first = generate_batch(fast, [tokens[0, :4].tolist()], greedy)[0].tokens  # creates the buffers in inference_mode
    assert len(first) == 2
    cache = fast.new_kv_cache(1, 8)
    with torch.no_grad():
        fast(tokens[:, :6], 0, cache)
        step = fast.decode_step(tokens[:, 6:7], 6, cache)
    torch.testing.assert_close(step, full[:, 6], atol=1e-5, rtol=0)


@pytest.mark.slow  # three compiled shapes, 21-31 s (make test-slow, CI's second stage)
def test_compiled_multi_token_step_equals_plain_forward():
    """decode_tokens: several new tokens per row through the compiled step (a speculative verify), each attending to
    the cache and to the new tokens up to its own, equals the plain forward; the cache it leaves is the one the
    following steps read. Three layers, fp32 and int8 (vs the eager int8 path), batch 2 with one left-padded row."""
    from minigpt.infer.fastpath import prepare

    tokens = torch.randint(0, 61, (1, 22), generator=torch.Generator().manual_seed(5))
    full, fast, cache = three_layers_compiled(tokens)
    with torch.inference_mode():
        pieces = [fast(tokens[:, :10], 0, cache), fast.decode_tokens(tokens[:, 10:15], 10, cache)]
        pieces.append(fast.decode_step(tokens[:, 15:16], 15, cache)[:, None])
        pieces.append(fast.decode_tokens(tokens[:, 16:22], 16, cache))
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)
        assert {key[1] for key in fast._compiled_shapes} == {1, 5, 6}
        try:
            fast.decode_tokens(tokens[:, :5], cache.max_seq_len - 4, cache)
        except ValueError as e:
            assert "do not fit" in str(e)
        else:
            raise AssertionError("tokens past the cache must be refused")

    # int8 and left padding: row 0 is padded by 3 columns; compiled multi-token steps equal eager int8 forwards:
    # to summation order through the generated loops, to bf16 rounding of the activations through ATen's kernels
    # (library.aten_woq_layout: x and each product rounded to 8 significant bits, 3 layers of 4 products and the
    # head; measured 0.0024 relative, bound 2^-6).
    prompts = torch.randint(1, 61, (2, 12), generator=torch.Generator().manual_seed(6))
    for kernel in ("words", "aten"):
        outs = int8_multi_token_steps(prepare, prompts, kernel)
        if kernel == "words":
            torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=0)
        else:
            assert ((outs[1] - outs[0]).norm() / outs[0].norm()).item() < 2 ** -6


def int8_multi_token_steps(prepare, prompts: torch.Tensor, kernel: str) -> list[torch.Tensor]:
    """Eager and compiled (``woq_kernel=kernel``) int8 logits of 4 new tokens per row after an 8-token prompt whose
    row 0 is left-padded by 3 columns."""
    outs = []
    with torch.inference_mode():
        for compiled in (False, True):
            torch.manual_seed(0)
            fast = prepare(Transformer(THREE_LAYERS).eval(), compile=compiled, quantize="int8", woq_kernel=kernel)
            cache = fast.new_kv_cache(2, 20)
            mask = torch.ones(2, 8, dtype=torch.long)
            mask[0, :3] = 0
            fast(prompts[:, :8], 0, cache, mask)
            if compiled:
                pad = torch.tensor([3, 0])
                outs.append(fast.decode_tokens(prompts[:, 8:12], 8, cache, pad))
            else:
                mask = torch.cat([mask, torch.ones(2, 4, dtype=torch.long)], 1)
                outs.append(fast(prompts[:, 8:12], 8, cache, mask))
    return outs
