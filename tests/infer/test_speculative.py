"""Speculative decoding: greedy output equals the target's own greedy output (any draft, any k), and the
accept/reject rule samples exactly from the target's distribution (chi-square tests with fixed seeds)."""
import math

import pytest
import torch
from conftest import random_model

from minigpt.errors import MiniGPTError
from minigpt.infer.fastpath import FastPath
from minigpt.infer.generate import generate_tokens
from minigpt.infer.sampling import SamplingParams, sampling_probs
from minigpt.infer.speculative import SpeculativeStats, accept_reject, greedy_accept, speculative_tokens
from minigpt.model.transformer import Transformer

torch.set_num_threads(1)


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0)


SHAPE = dict(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)


def make(seed=0, vocab=53, **kw) -> Transformer:
    # noise 0.05: peakier logits than the 0.02 init, a less uniform distribution to sample from
    return random_model(SHAPE, seed, noise=0.05, vocab_size=vocab, **kw)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed ``counts`` against expected ``probs`` (cells with expectation < 5 are merged,
    the usual validity rule); returns (statistic, degrees of freedom)."""
    n = counts.sum().item()
    expected = probs.double() * n
    order = torch.argsort(expected, descending=True)
    obs, exp = counts.double()[order], expected[order]
    big = exp >= 5
    obs = torch.cat([obs[big], obs[~big].sum().view(1)]) if (~big).any() else obs
    exp = torch.cat([exp[big], exp[~big].sum().view(1)]) if (~big).any() else exp
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def chi_square_critical(df: int, alpha: float = 1e-3) -> float:
    """Upper ``alpha`` quantile of chi-square(df) by the Wilson-Hilferty approximation (accurate to ~1 % for
    df >= 3; no scipy needed). z = 3.0902 is the standard normal's 0.999 quantile."""
    assert alpha == 1e-3
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("fast", [False, True], ids=["plain", "fast"])
def test_speculative_greedy_equals_plain_greedy(k, fast):
    target, draft = make(0), make(1, n_layers=1, dim=32)
    if fast:
        target, draft = FastPath(target), FastPath(draft)
    stats = SpeculativeStats()
    for prompt in ([1, 2, 3], [7], list(range(10, 30))):
        expected = list(generate_tokens(target, prompt, greedy(24)))
        assert list(speculative_tokens(target, draft, prompt, greedy(24), k=k, stats=stats)) == expected
    assert 0 <= stats.accepted <= stats.proposed and stats.rounds > 0


@pytest.mark.slow
def test_speculative_greedy_with_compiled_models_equals_plain_greedy():
    """Both models compiled: the verify and the draft's catch-up go through the compiled multi-token step
    (FastPath.decode_tokens), and greedy output still equals the target's own greedy output."""
    target, draft = FastPath(make(0), compile=True), FastPath(make(1, n_layers=1, dim=32), compile=True)
    plain = make(0)
    stats = SpeculativeStats()
    for prompt in ([1, 2, 3], list(range(10, 30))):
        expected = list(generate_tokens(plain, prompt, greedy(24)))
        assert list(speculative_tokens(target, draft, prompt, greedy(24), k=3, stats=stats)) == expected
    assert any(key[1] == 4 for key in target._compiled_shapes)  # the k + 1 = 4-token verify ran compiled


def test_speculative_decoding_runs_without_autograd():
    """Every forward of both models runs under inference_mode (no autograd graph over the verify and draft steps)."""
    target, draft = make(0), make(1, n_layers=1, dim=32)
    modes = []
    for model in (target, draft):
        forward = model.forward
        model.forward = lambda *a, _f=forward, **kw: (modes.append(torch.is_inference_mode_enabled()), _f(*a, **kw))[1]
    list(speculative_tokens(target, draft, [1, 2, 3], greedy(12), k=3))
    assert modes and all(modes)


def test_a_perfect_draft_is_always_accepted():
    target = make(0)
    stats = SpeculativeStats()
    out = list(speculative_tokens(target, make(0), [3, 4, 5], greedy(20), k=4, stats=stats))
    assert out == list(generate_tokens(target, [3, 4, 5], greedy(20)))
    assert stats.acceptance_rate == 1.0 and stats.rounds == 4  # 5 tokens per target forward


def test_stop_ids_and_budget():
    target, draft = make(0), make(1, n_layers=1, dim=32)
    expected = list(generate_tokens(target, [1, 2], greedy(30)))
    stop = expected[6]
    out = list(speculative_tokens(target, draft, [1, 2], greedy(30), k=3, stop_ids=[stop]))
    assert out == expected[:expected.index(stop)]
    assert len(list(speculative_tokens(target, draft, [1, 2], greedy(7), k=3))) == 7


def test_errors():
    with pytest.raises(MiniGPTError, match="shared tokenizer"):
        list(speculative_tokens(make(0), make(1, vocab=50), [1], greedy(4)))
    with pytest.raises(MiniGPTError, match="at least 1"):
        list(speculative_tokens(make(0), make(1), [1], greedy(4), k=0))
    with pytest.raises(MiniGPTError, match="context"):
        list(speculative_tokens(make(0), make(1), [1] * 80, greedy(10), k=8))


def test_prompt_ids_outside_the_vocabulary_are_refused_before_any_forward():
    """A tokenizer with more ids than the model has embedding rows: the forward would fail with a bare index error
    deep in the embedding; every generation entry point refuses the prompt first, naming the id."""
    from minigpt.infer.generate import generate_batch
    from minigpt.infer.sampling import InvalidRequest

    model = make(0)  # 53 ids
    for run in (lambda p: list(generate_tokens(model, p, greedy(3))),
                lambda p: generate_batch(model, [[1, 2], p], greedy(3)),
                lambda p: list(speculative_tokens(model, make(1), p, greedy(3), k=2))):
        with pytest.raises(InvalidRequest, match="token id 53, outside the model's vocabulary of 53 ids"):
            run([1, 53, 2])
        with pytest.raises(InvalidRequest, match="token id -1"):
            run([-1, 2])
        run([1, 52])  # the last row is fine


def test_greedy_accept_rule():
    logits = torch.full((4, 6), -1.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = logits[3, 5] = 1.0  # argmax per position: 2 4 1 5
    assert greedy_accept(logits, torch.tensor([2, 4, 1])) == (3, 5)
    assert greedy_accept(logits, torch.tensor([2, 3, 1])) == (1, 4)
    assert greedy_accept(logits, torch.tensor([0, 4, 1])) == (0, 2)


def test_accept_reject_samples_the_target_distribution():
    """Toy distributions over 6 tokens: the first token a round emits (x_1 if accepted, else the residual draw)
    must follow p_1, and with an exact draft the bonus token must follow p_{k+1}."""
    g = torch.Generator().manual_seed(1234)
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                      [0.05, 0.05, 0.10, 0.20, 0.30, 0.30],
                      [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
    q = torch.tensor([[0.10, 0.10, 0.20, 0.20, 0.20, 0.20],   # a poor draft: heavy rejection and residual use
                      [0.30, 0.20, 0.20, 0.10, 0.10, 0.10]])
    n, counts, accepted = 5000, torch.zeros(6), 0
    for _ in range(n):
        draft = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(2)])
        m, nxt = accept_reject(p, q, draft, g)
        first = int(draft[0]) if m >= 1 else nxt
        counts[first] += 1
        accepted += m
    stat, df = chi_square(counts, p[0])
    assert stat < chi_square_critical(df), (stat, counts / n)
    # Acceptance of x_1 is sum_x min(p, q) = 1 - TV(p, q): the rate matches the theory within sampling error.
    expected_first = torch.minimum(p[0], q[0]).sum().item()
    assert accepted / n > expected_first - 0.03

    counts = torch.zeros(6)
    for _ in range(2500):
        draft = torch.stack([torch.multinomial(p[i], 1, generator=g)[0] for i in range(2)])
        m, nxt = accept_reject(p, p[:2], draft, g)
        assert m == 2
        counts[nxt] += 1
    stat, df = chi_square(counts, p[2])
    assert stat < chi_square_critical(df), (stat, counts / 2500)


@pytest.mark.slow
def test_speculative_sampling_matches_the_target_end_to_end():
    """Through the real models: the first sampled token of `speculative_tokens` (temperature 0.9, top-k 8) follows
    the target's filtered next-token distribution."""
    vocab = 11
    target, draft = make(0, vocab=vocab, n_layers=1, dim=32), make(5, vocab=vocab, n_layers=1, dim=16)
    prompt = [1, 2, 3]
    with torch.inference_mode():
        probs = sampling_probs(target(torch.tensor([prompt]))[0, -1], SamplingParams(temperature=0.9, top_k=8))
    counts = torch.zeros(vocab)
    for seed in range(1000):
        params = SamplingParams(max_tokens=1, temperature=0.9, top_k=8, seed=seed)
        first = next(speculative_tokens(target, draft, prompt, params, k=2))
        counts[first] += 1
    stat, df = chi_square(counts, probs)
    assert stat < chi_square_critical(df), (stat, df)


def test_speculative_report(tiny_data, tmp_path):
    """`minigpt bench speculative`'s report on saved checkpoints: greedy outputs identical, counters consistent."""
    from minigpt.analysis.bench.reports import speculative_report
    from minigpt.checkpoint.native import save_pretrained
    from minigpt.tokenizer.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(tiny_data).vocab_size
    target = save_pretrained(make(0, vocab=vocab), tmp_path / "t")
    draft = save_pretrained(make(1, vocab=vocab, n_layers=1, dim=32), tmp_path / "d")
    r = speculative_report(str(target), str(draft), str(tiny_data), k=3, n_prompts=2, prompt_len=8, new_tokens=10)
    assert r["identical_outputs"] == "2/2"
    assert 0 <= r["acceptance_rate"] <= 1 and 1 <= r["tokens_per_target_forward"] <= 4
