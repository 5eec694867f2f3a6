"""The compiled decode step (torch.compile over a static cache, positions and padding as tensors) computes what the
eager fast path computes, for plain and left-padded batches, and one graph serves every step. Kept apart from
test_perf.py because a compilation takes seconds."""
import torch

from minigpt.config import ModelConfig
from minigpt.fastpath import CACHE_BUCKET, FastPath
from minigpt.generate import generate_batch, generate_tokens
from minigpt.transformer import Transformer

torch.set_num_threads(1)


def make(seed=0, **kw) -> Transformer:
    torch.manual_seed(seed)
    base = dict(vocab_size=61, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=96, multiple_of=16)
    model = Transformer(ModelConfig(**{**base, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_compiled_decode_step_equals_plain_forward_and_batches():
    model = make()
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4]]
    alone = [list(generate_tokens(model, p, 10)) for p in prompts]
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
    assert [r.tokens for r in generate_batch(compiled, prompts, 10)] == alone
    assert [list(generate_tokens(compiled, p, 10)) for p in prompts] == alone
    assert compiled.compile_seconds > 0
    # Shapes seen: batch 2 (the pieces), batch 3 (the padded batch), batch 1 (alone) -- never one per position.
    assert compiled._compiled_shapes == {(2, CACHE_BUCKET), (3, CACHE_BUCKET), (1, CACHE_BUCKET)}
