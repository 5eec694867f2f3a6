"""`minigpt ablate` end to end on a tiny budget: runs train in child processes (several seeds, in parallel when the
cores allow), parameters are matched, and the report quotes each claim with a verdict next to a table with 95 %
intervals and plots."""
import pytest

from minigpt.analysis.ablate import run as ablate
from minigpt.analysis.estimate import count_parameters
from minigpt.errors import MiniGPTError


def test_parameter_matching_equalises_non_embedding_or_active_counts():
    scale = ablate.SCALES["tiny"]
    base = ablate.variant_config(ablate.BASE, scale, 2048)
    target = count_parameters(base)
    for comp in ("ffn", "heads", "norm", "positions"):
        for v in ablate.COMPARISONS[comp].variants:
            cfg = ablate.variant_config(v, scale, 2048)
            # within one unit of FFN width (at most 3 * dim parameters per layer)
            assert abs(count_parameters(cfg)["non_embedding"] - target["non_embedding"]) <= 3 * cfg.dim * cfg.n_layers
    gelu = ablate.variant_config(ablate.Variant("gelu", {"ffn": "gelu"}), scale, 2048)
    assert count_parameters(gelu)["non_embedding"] == target["non_embedding"]  # 2 * 576 == 3 * 384
    moe = ablate.variant_config(ablate.COMPARISONS["moe"].variants[1], scale, 2048)
    # the router adds parameters, so the experts narrow by a unit: within one unit of width of k experts
    assert abs(count_parameters(moe)["active"] - target["active"]) <= 2 * 3 * moe.dim * moe.n_layers / 2
    assert count_parameters(moe)["total"] > target["total"]
    untied = ablate.variant_config(ablate.COMPARISONS["tying"].variants[1], scale, 2048)
    assert count_parameters(untied)["total"] == target["total"] + 2048 * base.dim


@pytest.mark.slow  # a dozen short training runs, ~16 s (make test-slow, its own CI stage)
def test_ablate_writes_a_report_with_intervals_claims_and_plots(tmp_path, monkeypatch):
    """Two seeds per variant, two runs at a time (1 thread each), the Muon comparison: each variant's runs, the
    per-seed aggregate, the interval columns and verdicts of the report, and reuse of finished runs."""
    from minigpt.data.sources import BUNDLED

    corpus = tmp_path / "slice.txt"
    corpus.write_text(BUNDLED["shakespeare"].path.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    monkeypatch.setitem(ablate.SCALES, "test", dict(preset="tiny", seq_len=16, batch_size=2, steps=2, lr=1e-3,
                                                    warmup_steps=1, eval_interval=1, eval_windows=2, vocab_size=300))
    monkeypatch.setattr(ablate, "usable_cores", lambda: 2)
    settings = ablate.AblationSettings(out_dir=tmp_path / "runs", docs_dir=tmp_path / "docs", scale="test",
                                       threads=1, seeds=2, jobs=2, data=str(corpus),
                                       command="minigpt ablate optimizer --seeds 2")
    records = ablate.run_ablations(["optimizer"], settings)
    variants = records["comparisons"]["optimizer"]["runs"]
    assert [v["name"] for v in variants] == ["baseline", "muon"]
    for v in variants:
        assert [r["spec"]["train"]["seed"] for r in v["runs"]] == [1337, 1338]
        assert all(r["result"]["step"] == 2 and r["peak_above_idle_mb"] > 0 for r in v["runs"])
        assert v["bpb"] == {str(r["spec"]["train"]["seed"]): r["result"]["val_bpb"] for r in v["runs"]}
        assert v["result"]["val_bpb"] == pytest.approx(sum(v["bpb"].values()) / 2)
    assert [r["spec"]["train"].get("optimizer", "adamw") for r in variants[1]["runs"]] == ["muon", "muon"]
    assert variants[0]["runs"][0]["result"]["val_bpb"] != variants[0]["runs"][1]["result"]["val_bpb"]  # seeds differ
    assert set(variants[0]["context_eval"]) == {"1", "2", "4"}
    report = (tmp_path / "docs" / "ablations.md").read_text()
    for fragment in ("AdamW vs Muon", "**Claim**", "**Our measurement**", "| optimizer | muon |", " ± ",
                     "vs baseline (95 %)", "ablation-optimizer-loss.png", "minigpt ablate optimizer --seeds 2",
                     "seeds 1337, 1338", "Noise and verdicts", "2 run(s) at a time"):
        assert fragment in report, fragment
    assert any(w in report for w in ("(resolved)", "unresolved", "equal within"))
    assert (tmp_path / "docs" / "ablation-optimizer-loss.png").stat().st_size > 1000
    again = ablate.run_ablations(["optimizer"], settings)  # finished runs are reused, not retrained
    assert again["comparisons"]["optimizer"]["runs"][1]["wall_s"] == variants[1]["wall_s"]
    with pytest.raises(Exception, match="unknown comparison"):
        ablate.run_ablations(["nope"], settings)


def test_jobs_times_threads_beyond_the_cores_is_refused(monkeypatch):
    monkeypatch.setattr(ablate, "usable_cores", lambda: 2)
    ablate.AblationSettings(threads=1, jobs=2).check()
    ablate.AblationSettings(threads=2, jobs=1).check()
    with pytest.raises(MiniGPTError, match=r"--jobs 2 x --threads 2 = 4 threads exceeds the 2 usable cores"):
        ablate.AblationSettings(threads=2, jobs=2).check()
    with pytest.raises(MiniGPTError, match="--seeds must be at least 1"):
        ablate.AblationSettings(seeds=0).check()
    with pytest.raises(MiniGPTError, match="give one"):
        ablate.AblationSettings(steps=10, tokens=1000).check()


def test_jobs_beyond_the_cores_is_a_one_line_cli_error():
    from conftest import assert_one_line_error, run_cli

    proc = run_cli("ablate", "norm", "--jobs", "4096", "--threads", "1")
    assert_one_line_error(proc, "--jobs 4096", "usable cores")


def test_token_budget_sets_the_steps():
    assert ablate.parse_tokens("500k") == 500_000 and ablate.parse_tokens("2M") == 2_000_000
    assert ablate.parse_tokens("1.5e6") == 1_500_000 and ablate.parse_tokens(1024) == 1024
    for bad in ("lots", "0", "-5", "2X"):
        with pytest.raises(MiniGPTError, match="--tokens"):
            ablate.parse_tokens(bad)
    b = ablate.AblationSettings(scale="tiny", tokens=1_000_000).budget()  # tiny: batch 8 x context 128
    assert b["steps"] == 977 and b["steps"] * 8 * 128 >= 1_000_000 > (b["steps"] - 1) * 8 * 128
    assert b["eval_interval"] == 162 and b["warmup_steps"] == ablate.SCALES["tiny"]["warmup_steps"]
    assert ablate.AblationSettings(scale="tiny", tokens=2048).budget()["warmup_steps"] == 1


def test_every_new_option_has_a_comparison_with_a_claim():
    from minigpt.analysis.ablate.verdicts import CLAIMS, VERDICTS

    names = {v.name for c in ablate.COMPARISONS.values() for v in c.variants}
    assert {"relu2", "gelu", "relu", "layernorm", "post-norm", "alibi", "learned", "sinusoidal", "gqa", "qk-norm",
            "softcap-15", "muon", "untied"} <= names
    assert ablate.COMPARISONS["optimizer"].variants[1].train == {"optimizer": "muon"}
    assert set(ablate.COMPARISONS) - {"positions"} <= set(VERDICTS) and set(ablate.COMPARISONS) <= set(CLAIMS)


def _fake_variant(variant, bpb_by_seed, rng):
    name = variant.name
    model = ablate.variant_config(variant, ablate.SCALES["tiny"], 2048)
    n = count_parameters(model)
    runs = [{"name": name, "spec": {"train": {"seed": seed, "out_dir": f"runs/{name}-{seed}"}}, "wall_s": 10.0,
             "result": {"val_bpb": bpb, "val_ppl": 2 ** bpb, "val_loss": bpb * 0.7, "tokens_per_s": 2000.0,
                        "step": 120}, "metrics": [], "peak_above_idle_mb": 300.0}
            for seed, bpb in bpb_by_seed.items()]
    ctx = {f: {"val_loss": 2.0 + rng.random() * 0.1, "val_bpb": 3.0} for f in ("1", "2", "4")}
    for r in runs:
        r["context_eval"] = ctx
    return ablate.aggregate(name, [{**r, "parameters": n, "model": model.to_dict(), "activation_mb_estimate": 90.0,
                                    "kv_bytes_per_token_fp32": 2048} for r in runs])


def test_report_renders_a_verdict_for_every_comparison(tmp_path, monkeypatch):
    """Synthetic measurements (3 seeds each) through the whole report: every comparison gets its claim and a verdict
    in the words of the interval rule -- a shift shared by the seeds is resolved, a small one is equal within the
    bound, a noisy one is not resolved."""
    import random

    from minigpt.analysis.ablate import report

    for plot in ("plot_loss_curves", "plot_context", "plot_attention"):
        monkeypatch.setattr(report, plot, lambda *a, **k: None)
    rng = random.Random(0)
    base = {1337: 3.10, 1338: 3.14, 1339: 3.12}
    shifts = {"post-norm": 0.10, "layernorm": 0.001, "relu": 0.05, "gelu": 0.03, "muon": -0.08}
    comparisons = {}
    for name, comp in ablate.COMPARISONS.items():
        runs = []
        for v in comp.variants:
            if v.name == "baseline":
                values = base
            elif v.name in shifts:
                values = {s: b + shifts[v.name] + rng.uniform(-0.002, 0.002) for s, b in base.items()}
            else:
                values = {s: b + rng.uniform(-0.05, 0.05) for s, b in base.items()}
            runs.append(_fake_variant(v, values, rng))
        tp = {r["name"]: 2000.0 + rng.random() for r in runs} | {"baseline-again": 2001.0}
        comparisons[name] = {"title": comp.title, "budget": comp.budget, "runs": runs, "throughput": tp}
    comparisons["norm"]["norm_bench"] = {"a": 1e-3, "b": 1.1e-3, "c": 0.5e-3, "d": 0.6e-3}
    records = {"settings": {"scale": "tiny", "seed": 1337, "equal_within": 0.01, "jobs": 1, "command": "x"},
               "budget": ablate.SCALES["tiny"], "comparisons": comparisons, "wall_s": 60.0,
               "machine": {"date": "today", "cpu": "cpu", "cores": 2, "threads": 2, "torch": "2.13",
                           "load_before": [0.5], "load_end": [0.5]}}
    text = report.write_report(records, tmp_path).read_text()
    assert text.count("**Claim**") == len(ablate.COMPARISONS)  # every comparison, positions included
    assert text.count("**Our measurement**") == len(ablate.COMPARISONS)
    assert "post-norm is worse than pre-norm by 0.10" in text and "resolved)" in text  # shared shift: resolved
    assert "LayerNorm and RMSNorm are equal within ±0.010 bpb" in text  # tiny shift: equal within the bound
    assert "muon is better than baseline by 0.08" in text and "**Supported**" in text
    assert "not resolved" in text  # the noisy variants
    assert "seeds 1337, 1338, 1339" in text and "3.1200 ± " in text
