"""Throughput cost of grammar-constrained decoding (``response_format: json_schema``) in the serving engine.

A random 4-layer, 256-wide model with a BPE vocabulary trained on Tiny Shakespeare (``VOCAB`` ids, first argument,
default 8000) decodes 8 requests x 64 tokens through :class:`minigpt.infer.engine.Engine`, with 0, 4 or 8 of them
under a JSON-schema grammar (:mod:`minigpt.infer.constrain`, llguidance); prints tokens/s medians of 5 interleaved
runs, the time spent computing masks, and one row's mask cost per token.

    OMP_NUM_THREADS=1 python scripts/bench_structured.py [VOCAB]
"""
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from minigpt.infer.constrain import GrammarConstraint, json_grammar
from minigpt.infer.engine import Engine
from minigpt.infer.sampling import SamplingParams
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer
from minigpt.tokenizer.tokenizer import train_tokenizer

torch.set_num_threads(1)
print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread", flush=True)
VOCAB = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
BATCH, TOKENS, R = 8, 64, 5
text = open(Path(__file__).resolve().parents[1] / "../shared/data/tinyshakespeare.txt").read()
t = time.time()
tok = train_tokenizer([text[i:i + 2000] for i in range(0, len(text), 2000)], VOCAB)
print(f"tokenizer {tok.vocab_size} ids in {time.time() - t:.1f} s", flush=True)
torch.manual_seed(0)
model = Transformer(ModelConfig(vocab_size=tok.vocab_size, dim=256, n_layers=4, n_heads=4, n_kv_heads=4,
                                max_seq_len=512, multiple_of=32)).eval()
engine = Engine(model, tok, max_batch_size=BATCH)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
          "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
grammar = json_grammar(SCHEMA)
prompt = tok.encode("First Citizen:")


SPENT = [0.0, 0]


class Timed:
    def __init__(self, proc):
        self.proc = proc

    def __call__(self, ids, logits):
        t0 = time.perf_counter()
        out = self.proc(ids, logits)
        SPENT[0] += time.perf_counter() - t0
        SPENT[1] += 1
        return out


def run(constrained: int):
    """BATCH requests, `constrained` of them under the grammar; returns (tokens generated, seconds)."""
    reqs = []
    t0 = time.perf_counter()
    for i in range(BATCH):
        procs = [Timed(GrammarConstraint(grammar, tok, tok.vocab_size, engine.stop_ids))] if i < constrained else []
        reqs.append(engine.submit(prompt, SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=i),
                                  logits_processors=procs))
    engine.run_until_idle()
    dt = time.perf_counter() - t0
    return sum(r.n_generated for r in reqs), dt


run(0); run(BATCH)  # warm up
out = {0: [], BATCH // 2: [], BATCH: []}
for _ in range(R):
    for k in out:
        n, dt = run(k)
        out[k].append(n / dt)
for k, v in out.items():
    print(f"{k}/{BATCH} rows constrained: median {statistics.median(v):,.0f} tokens/s (runs: "
          + ", ".join(f"{x:,.0f}" for x in v) + ")")
SPENT[:] = [0.0, 0]
t0 = time.perf_counter()
n, dt = run(BATCH)
print(f"all rows constrained: {SPENT[0] / SPENT[1] * 1e6:,.0f} us per masked token, {SPENT[0] / dt:.1%} of the "
      f"wall time ({n} tokens)")
# The mask alone: one constrained row's per-token cost (compute_bitmask + unpack + masked_fill).
c = GrammarConstraint(grammar, tok, tok.vocab_size, engine.stop_ids)
logits = torch.randn(tok.vocab_size)
t0 = time.perf_counter()
for _ in range(200):
    c([], logits)
print(f"mask of one row: {(time.perf_counter() - t0) / 200 * 1e6:,.0f} us per token (vocab {tok.vocab_size})")
