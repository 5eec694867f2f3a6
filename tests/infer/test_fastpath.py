"""The inference fast path computes what the model computes: fused projections leave weights and outputs unchanged,
cached fast decoding equals the plain forward (fp32 within 1e-5; bf16 within a stated tolerance), batched
variable-length generation equals one prompt at a time, and int8 weight-only layers match their dequantized
matrices. Speed is measured by `minigpt bench`, never asserted here."""
from functools import partial

import pytest
import torch
from conftest import random_model

from minigpt.infer.fastpath import FastPath, prepare, supports
from minigpt.infer.generate import generate_batch, generate_tokens
from minigpt.infer.sampling import SamplingParams

torch.set_num_threads(1)

VOCAB = 97
CONFIGS = {
    "gqa": dict(n_kv_heads=2),
    "mha-bias-untied": dict(n_kv_heads=4, attention_bias=True, tie_embeddings=False),
    "mqa-geglu": dict(n_kv_heads=1, ffn="geglu"),
    "gelu-mlp": dict(n_kv_heads=2, ffn="gelu"),
    "head_dim-explicit": dict(n_kv_heads=2, head_dim=24),
    "rope-yarn": dict(n_kv_heads=2, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_seq_len": 16}),
}


SHAPE = dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, max_seq_len=64, multiple_of=16)
# Norms and biases that are not the identity (so none of them is a no-op).
make = partial(random_model, SHAPE, noise=0.02, norm_noise=0.1)


def cached_pieces(model, tokens: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """Logits of ``tokens`` computed as prefill (10) + single-token steps + a multi-token chunk, through a cache."""
    b, t = tokens.shape
    cache = model.new_kv_cache(b, t)
    step = model.decode_step if isinstance(model, FastPath) else None
    mask = (lambda end: None) if attention_mask is None else (lambda end: attention_mask[:, :end])
    pieces = [model(tokens[:, :10], 0, cache, mask(10))]
    for i in range(10, 17):
        x = tokens[:, i:i + 1]
        pieces.append(step(x, i, cache, mask(i + 1))[:, None] if step else model(x, i, cache, mask(i + 1)))
    pieces.append(model(tokens[:, 17:], 17, cache, mask(t)))
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("case", list(CONFIGS), ids=list(CONFIGS))
def test_fast_path_equals_plain_forward_fp32(case):
    model = make(**CONFIGS[case])
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        full = model(tokens)
        fast = FastPath(model)
        assert fast.fused and fast.reason is None
        # Fusion re-points the projections at row views of one matrix: same keys, same numbers, no copy.
        assert list(model.state_dict()) == list(state)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        attn = model.layers[0].attention
        assert attn.wk.weight.untyped_storage().data_ptr() == attn.wq.weight.untyped_storage().data_ptr()
        torch.testing.assert_close(model(tokens), full, atol=0, rtol=0)  # the model itself is unchanged
        torch.testing.assert_close(fast(tokens), full, atol=1e-5, rtol=0)
        torch.testing.assert_close(cached_pieces(fast, tokens), full, atol=1e-5, rtol=0)
        torch.testing.assert_close(fast(tokens, last_only=True)[:, 0], full[:, -1], atol=1e-5, rtol=0)


def test_fast_path_with_padding_mask_equals_plain_forward():
    model = make(n_kv_heads=2)
    tokens = torch.randint(0, VOCAB, (3, 30), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(tokens)
    mask[0, :7], mask[2, :3] = 0, 0  # left padding of different lengths
    with torch.inference_mode():
        ref = cached_pieces(model, tokens, mask)
        fast = cached_pieces(FastPath(model), tokens, mask)
    real = mask.bool()
    torch.testing.assert_close(fast[real], ref[real], atol=1e-5, rtol=0)


def test_last_only_prefill_still_caches_every_key_and_value():
    """``last_only`` runs the last layer's attention, output projection and FFN for the last position alone, but the
    cache must still receive every position's keys and values: prefill chunks with ``last_only`` (from position 0,
    and at ``start_pos > 0``, plain and left-padded) give the last logits of the plain forward, and the decode steps
    after them continue exactly as after a full prefill."""
    model = make(n_kv_heads=2)
    tokens = torch.randint(0, VOCAB, (3, 30), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(tokens)
    mask[0, :7], mask[2, :3] = 0, 0
    with torch.inference_mode():
        for attention_mask in (None, mask):
            ref = cached_pieces(model, tokens, attention_mask)
            fast = FastPath(model)
            cache = fast.new_kv_cache(3, 30)
            until = (lambda end: None) if attention_mask is None else (lambda end, m=attention_mask: m[:, :end])
            first = fast(tokens[:, :12], 0, cache, until(12), last_only=True)
            second = fast(tokens[:, 12:20], 12, cache, until(20), last_only=True)
            steps = [fast.decode_step(tokens[:, i:i + 1], i, cache, until(i + 1)) for i in range(20, 30)]
            assert first.shape == second.shape == (3, 1, VOCAB)
            torch.testing.assert_close(first[:, 0], ref[:, 11], atol=1e-5, rtol=0)
            torch.testing.assert_close(second[:, 0], ref[:, 19], atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.stack(steps, 1), ref[:, 20:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch", [2, 1], ids=["batch 2 (F.linear)", "one row (torch.mv)"])
def test_fast_path_bf16_within_tolerance(batch):
    """bf16 weights and activations: the fast path and the plain bf16 forward round differently (fused GEMMs,
    another op order), so both are compared with the fp32 logits. Tolerance: 0.05 absolute on logits of magnitude
    ~1, i.e. a few bf16 ulps (2^-8 relative) accumulated over two layers. One row per decode step takes the
    matrix-vector kernel, several the matrix product."""
    model = make(n_kv_heads=2)
    tokens = torch.randint(0, VOCAB, (batch, 30), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = model(tokens)
        plain_bf16 = make(n_kv_heads=2).to(torch.bfloat16)(tokens).float()
        fast = prepare(make(n_kv_heads=2), dtype=torch.bfloat16)
        assert fast.dtype == torch.bfloat16
        out = cached_pieces(fast, tokens).float()
    plain_err = (plain_bf16 - ref).abs().max().item()
    fast_err = (out - ref).abs().max().item()
    assert fast_err < 0.05, fast_err
    assert fast_err < 3 * plain_err + 1e-3, (fast_err, plain_err)


def test_unsupported_architectures_fall_back_to_the_model():
    model = make(n_kv_heads=2, pos_encoding="alibi")
    assert supports(model.config) == "pos_encoding=alibi"
    tokens = torch.randint(0, VOCAB, (1, 12))
    with torch.inference_mode():
        fast = FastPath(model)
        assert not fast.fused
        torch.testing.assert_close(fast(tokens), model(tokens), atol=0, rtol=0)
        assert list(generate_tokens(fast, [1, 2, 3], greedy(5))) == list(generate_tokens(model, [1, 2, 3], greedy(5)))
    with pytest.raises(ValueError, match="alibi"):
        FastPath(model, strict=True)


# ------------------------------------------------------------------------------------------------ batching
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [4], [20, 21, 22, 23, 24]]


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0)


@pytest.mark.parametrize("fast", [False, True], ids=["plain", "fast"])
def test_batched_variable_length_greedy_equals_one_by_one(fast):
    model = make(n_kv_heads=2)
    gen = FastPath(model) if fast else model
    budgets = [12, 5, 12, 3]
    alone = [list(generate_tokens(gen, p, greedy(n))) for p, n in zip(PROMPTS, budgets)]
    results = generate_batch(gen, PROMPTS, greedy(max(budgets)), row_max_tokens=budgets)
    assert [r.tokens for r in results] == alone
    assert [r.finish_reason for r in results] == ["length"] * 4
    # Same prompts in another order and batch composition: each row is still computed as if alone.
    results = generate_batch(gen, PROMPTS[::-1], greedy(max(budgets)), row_max_tokens=budgets[::-1])
    assert [r.tokens for r in results] == alone[::-1]


def test_batch_rows_stop_independently_at_stop_ids():
    model = make(n_kv_heads=2)
    alone = [list(generate_tokens(model, p, greedy(10))) for p in PROMPTS]
    stop = alone[1][3]  # row 1 meets this id at step 3; other rows stop at it too if they produce it
    results = generate_batch(model, PROMPTS, greedy(10), stop_ids=[stop])
    for r, a in zip(results, alone):
        if stop in a:
            assert r.tokens == a[:a.index(stop)] and r.finish_reason == "stop"
        else:
            assert r.tokens == a and r.finish_reason == "length"


def test_batch_stop_strings_cut_the_text(tiny_tokenizer_model):
    model, tok = tiny_tokenizer_model
    prompts = [tok.encode("ROMEO:"), tok.encode("Good morrow, my lord")]
    alone = [tok.decode(list(generate_tokens(model, p, greedy(20)))) for p in prompts]
    stop = alone[0][2:5]  # a string that row 0 produces
    results = generate_batch(model, prompts, greedy(20).replace(stop=(stop,)), tokenizer=tok)
    assert results[0].finish_reason == "stop" and results[0].text == alone[0][:alone[0].index(stop)]
    if stop not in alone[1]:
        assert results[1].text == alone[1] and results[1].finish_reason == "length"


@pytest.fixture(scope="module")
def tiny_tokenizer_model(tiny_data):
    from minigpt.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_data)
    return make(vocab_size=tok.vocab_size, n_kv_heads=2), tok


def test_batch_errors_are_clear():
    from minigpt.errors import MiniGPTError

    model = make()
    with pytest.raises(MiniGPTError, match="at least one prompt"):
        generate_batch(model, [], greedy(4))
    with pytest.raises(MiniGPTError, match="empty"):
        generate_batch(model, [[1], []], greedy(4))
    with pytest.raises(MiniGPTError, match="2 entries for 3 prompts"):
        generate_batch(model, [[1], [2], [3]], greedy(4), row_max_tokens=[4, 4])
    with pytest.raises(MiniGPTError, match="tokenizer"):
        generate_batch(model, [[1]], greedy(4).replace(stop=("x",)))
    with pytest.raises(MiniGPTError, match="context"):
        generate_batch(model, [[1] * 60, [2]], greedy(10))


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])  # compiled: ~9 s
def test_fast_path_grows_the_lazy_rope_tables(monkeypatch, compile):
    """Models keep RoPE rows for the first EAGER_POSITIONS positions and grow them on demand; the fast path copies
    the tables at build time, so it must grow them too (prefill past them, and a compiled step's cache)."""
    from minigpt.model import transformer

    monkeypatch.setattr(transformer, "EAGER_POSITIONS", 16)
    model = make(max_seq_len=64)
    assert model.rope_cos.shape[0] == 16
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(tokens)
        fast = FastPath(model, compile=compile)
        cache = fast.new_kv_cache(1, 48)
        got = fast(tokens[:, :39], 0, cache)
        step = fast.decode_step(tokens[:, 39:40], 39, cache)
    torch.testing.assert_close(got, ref[:, :39], atol=1e-5, rtol=0)
    torch.testing.assert_close(step, ref[:, 39], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_compiled_steps_stay_right_when_a_longer_cache_grows_the_rope_tables(monkeypatch):
    """A compiled step made while the tables held 64 rows, then a 128-position cache that grows them: the steps
    compiled before the growth are dropped (they captured the old tables), and decoding on the old cache length and
    on the new one both give the eager model's logits, at positions past the old tables too."""
    from minigpt.model import transformer

    monkeypatch.setattr(transformer, "EAGER_POSITIONS", 16)
    model = make(max_seq_len=128)
    tokens = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        fast = FastPath(model, compile=True)
        short = fast.new_kv_cache(1, 8)  # bucketed to 64 positions: the tables grow to 64
        fast(tokens[:, :20], 0, short)
        first = fast.decode_step(tokens[:, 20:21], 20, short)
        assert fast._compiled_shapes == {(1, 1, 64)} and fast.cos.shape[0] == 64
        long = fast.new_kv_cache(1, 100)  # 128 positions: the tables grow, the old step goes
        assert fast.cos.shape[0] == 128 and fast._compiled_shapes == set()
        fast(tokens[:, :110], 0, long)
        late = fast.decode_step(tokens[:, 110:111], 110, long)
        again = fast.decode_step(tokens[:, 21:22], 21, short)
        assert fast._compiled_shapes == {(1, 1, 64), (1, 1, 128)}
        ref = model(tokens)
    torch.testing.assert_close(first, ref[:, 20], atol=1e-5, rtol=0)
    torch.testing.assert_close(late, ref[:, 110], atol=1e-5, rtol=0)
    torch.testing.assert_close(again, ref[:, 21], atol=1e-5, rtol=0)


def test_weights_mapped_off_a_cache_line_move_to_aligned_memory(tmp_path):
    """A safetensors file's tensors start wherever its header ends; the fast path moves each float matrix it reads
    unfused onto a 64-byte boundary (kernels.align_parameter), keeping the tied head and embedding one tensor and
    the logits unchanged."""
    from minigpt.checkpoint.native import load_model, save_pretrained
    from minigpt.tokenizer.tokenizer import train_tokenizer

    ALIGN = 64  # bytes: a cache line
    tok = train_tokenizer(["the cat sat on the mat, and then it ran"] * 20, 300)
    model = random_model({**SHAPE, "vocab_size": tok.vocab_size}, noise=0.02).to(torch.bfloat16)
    save_pretrained(model, tmp_path / "m", tok)
    loaded = load_model(tmp_path / "m", dtype=torch.bfloat16)
    assert loaded.output.weight is loaded.tok_embeddings.weight
    off = [n for n, p in loaded.named_parameters() if p.data_ptr() % ALIGN]
    assert "tok_embeddings.weight" in off or any(".wo." in n or ".w2." in n for n in off), off  # the premise
    x = torch.randint(0, tok.vocab_size, (1, 12))
    with torch.no_grad():
        ref = loaded(x)
    fp = FastPath(loaded)
    projs = [fp.head] + [q for lw in fp.layers for q in (lw.wqkv, lw.wo, lw.w13, lw.w2)]
    assert all(p.weight.data_ptr() % ALIGN == 0 for p in projs)
    assert loaded.output.weight is loaded.tok_embeddings.weight
    assert fp.head.weight.data_ptr() == loaded.tok_embeddings.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(loaded(x), ref)


def test_a_one_token_greedy_prompt_goes_through_the_decode_step(monkeypatch):
    """Greedy after a single prompt token: that token is one decode step (decode_next, compiled where the fast
    path is), never the prefill forward; the tokens are the plain model's."""
    from minigpt.infer import generate as gen_mod

    model = make(n_kv_heads=2)
    want = {t: list(generate_tokens(model, [t], greedy(10))) for t in (1, 5)}
    fp = FastPath(model)

    def no_prefill(*a, **k):
        raise AssertionError("a one-token greedy prompt went through the prefill forward")

    monkeypatch.setattr(gen_mod, "prefill", no_prefill)
    assert {t: list(generate_tokens(fp, [t], greedy(10))) for t in want} == want
    with pytest.raises(AssertionError, match="prefill"):  # sampling still needs the prompt's logits
        list(generate_tokens(fp, [1], SamplingParams(max_tokens=3, temperature=0.8, seed=0)))
