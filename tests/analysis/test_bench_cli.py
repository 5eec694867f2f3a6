"""The performance features from the command line: batched prompts, int8 (at load time and saved), speculative
decoding with a draft model, and a one-row `minigpt bench` smoke run (no timings asserted)."""
import json

import pytest
import torch
from conftest import TINY_MODEL, assert_one_line_error, run_cli

from minigpt.checkpoint.native import save_pretrained
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer
from minigpt.tokenizer.tokenizer import Tokenizer


def _ckpt(tiny_data, root, seed, **kw):
    torch.manual_seed(seed)
    tok = Tokenizer.from_dir(tiny_data)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **{**TINY_MODEL, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # a peaky distribution, so greedy text is not all one token
    return save_pretrained(model, root / f"model{seed}", tokenizer=tok)


@pytest.fixture(scope="module")
def ckpts(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("perf_cli")
    return _ckpt(tiny_data, root, 0), _ckpt(tiny_data, root, 1, n_layers=1)


GREEDY = ("--temperature", "0", "--max-new-tokens", "12")


def generate(ckpt, *args):
    proc = run_cli("generate", ckpt, *GREEDY, *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def expected(ckpt, prompt: str, **load) -> str:
    """What `minigpt generate --temperature 0 --max-new-tokens 12` prints, computed in-process with the plain
    model forward (subprocesses are slow to start; the comparison is the point)."""
    from minigpt.checkpoint.native import load_tokenizer
    from minigpt.infer.fastpath import load_for_inference
    from minigpt.infer.generate import generate_tokens
    from minigpt.infer.sampling import SamplingParams

    tok = load_tokenizer(ckpt)
    model = load_for_inference(ckpt, fast=False, **load)
    ids = tok.encode(prompt) or [tok.bos_id]
    stop = [i for i in (tok.eos_id, tok.bos_id) if i is not None]
    params = SamplingParams(max_tokens=12, temperature=0)
    return tok.decode(list(generate_tokens(model, ids, params, stop_ids=stop))) + "\n"


def test_batched_prompts_equal_single_runs(ckpts, tmp_path):
    target, _ = ckpts
    prompts = ["ROMEO:", "Good morrow, my lord, how fares", "O"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n\n")
    out = generate(target, "--prompt-file", tmp_path / "prompts.txt", "--batch", "--jsonl")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    assert [r["completion"] + "\n" for r in rows] == [expected(target, p) for p in prompts]
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)


def test_speculative_generation_equals_plain_greedy(ckpts):
    target, draft = ckpts
    proc = run_cli("generate", target, *GREEDY, "--prompt", "ROMEO:", "--draft", draft, "--draft-k", "3", "--stats")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected(target, "ROMEO:")
    assert "speculative:" in proc.stderr and "tokens/s" in proc.stderr


def test_quantize_command_and_int8_generation(ckpts, tmp_path):
    target, _ = ckpts
    proc = run_cli("quantize", target, tmp_path / "q")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"]["method"] == "int8_weight_only"
    from_saved = generate(tmp_path / "q", "--prompt", "ROMEO:")
    assert from_saved == expected(target, "ROMEO:", quantize="int8") and from_saved.strip()


def test_generate_errors(ckpts, tmp_path):
    target, draft = ckpts
    assert_one_line_error(run_cli("generate", target, "--prompt", "a", "--prompt", "b", "--draft", draft),
                          "--draft")
    (tmp_path / "empty.txt").write_text("\n\n")
    assert_one_line_error(run_cli("generate", target, "--prompt-file", tmp_path / "empty.txt", "--batch"),
                          "no non-empty line")


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused(ckpts, tmp_path):
    """Equal vocabulary sizes are not enough: two ids swapped in the draft's tokenizer.json make every proposal
    mean another token, so the call is refused in one line naming the first id that differs."""
    import shutil

    target, draft = ckpts
    other = tmp_path / "draft"
    shutil.copytree(draft, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    (other / "manifest.json").unlink(missing_ok=True)  # the edit is deliberate; the weights are untouched
    proc = run_cli("generate", target, *GREEDY, "--prompt", "ROMEO:", "--draft", other)
    assert_one_line_error(proc, "its tokenizer is not the model's (id 300 is")


def test_a_prompt_the_model_has_no_rows_for_is_a_one_line_error(tiny_data, tmp_path):
    """The tokenizer of the test data with a model of fewer embedding rows: a prompt that encodes to a missing
    row is refused in one line (it was an IndexError traceback from the embedding)."""
    tok = Tokenizer.from_dir(tiny_data)
    model = Transformer(ModelConfig(vocab_size=200, **TINY_MODEL)).eval()
    path = save_pretrained(model, tmp_path / "m", tokenizer=tok)
    text = "ROMEO: Good morrow, my lord, how fares the queen?"
    assert max(tok.encode(text)) >= 200
    assert_one_line_error(run_cli("generate", path, *GREEDY, "--prompt", text), "outside the model's vocabulary")


@pytest.mark.slow
def test_bench_smoke(tmp_path):
    pytest.importorskip("transformers")
    # The 300-token prefill is longer than the `tiny` preset's 256-token context: bench models must be built longer.
    proc = run_cli("bench", "--presets", "tiny", "--dtypes", "float32", "--rows", "decode-b1,prefill",
                   "--repeats", "1", "--warmup", "0", "--new-tokens", "4", "--prompt-len", "4",
                   "--prefill-len", "300", "--json", tmp_path / "b.json", "--out", tmp_path / "b.md")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "b.json").read_text())
    cells = {(m["row"], m["impl"]) for m in result["measurements"]}
    assert cells == {("decode-b1", "transformers"), ("decode-b1", "minigpt"), ("prefill", "transformers"),
                     ("prefill", "minigpt")}
    decode = next(m for m in result["measurements"] if m["row"] == "decode-b1" and m["impl"] == "transformers")
    assert decode["extra"]["same_tokens_as_minigpt"] is True  # identical weights, identical greedy tokens
    table = (tmp_path / "b.md").read_text()
    assert "| tiny | float32 | decode-b1 |" in table and "minigpt / tf" in table
    assert_one_line_error(run_cli("bench", "--presets", "huge"), "huge")


@pytest.mark.slow
def test_bench_bf16_rows_are_also_compared_with_transformers_fp32(tmp_path):
    pytest.importorskip("transformers")
    proc = run_cli("bench", "--presets", "tiny", "--dtypes", "bfloat16", "--rows", "decode-b1",
                   "--repeats", "1", "--warmup", "0", "--new-tokens", "4", "--prompt-len", "4",
                   "--json", tmp_path / "b.json", "--out", tmp_path / "b.md")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "b.json").read_text())
    assert {m["impl"] for m in result["measurements"]} == {"transformers", "transformers-fp32", "minigpt"}
    assert "minigpt / tf fp32" in (tmp_path / "b.md").read_text()


def test_bench_table_ratios():
    from minigpt.analysis.bench.table import format_table

    def m(dtype, impl, value):
        return {"preset": "small", "dtype": dtype, "row": "decode-b1", "impl": impl, "value": value,
                "min": value, "max": value, "extra": {}}

    table = format_table({"measurements": [
        m("float32", "transformers", 50.0), m("float32", "minigpt", 200.0),
        m("bfloat16", "transformers", 100.0), m("bfloat16", "transformers-fp32", 40.0),
        m("bfloat16", "minigpt", 300.0)]})
    lines = table.splitlines()
    assert lines[0].split(" | ")[-3:] == ["minigpt / tf", "minigpt / tf fp32", "notes |"]
    # float32 row: its own transformers column is the fp32 reference; bf16 row: 300/100 and 300/40.
    assert "| **4.00×** | **4.00×** |" in lines[2]
    assert "| **3.00×** | **7.50×** |" in lines[3]
