"""`minigpt ablate` end to end on a tiny budget: runs train in child processes, parameters are matched, and the
report quotes each claim with a verdict next to a table and plots."""
import pytest

from minigpt.analysis.ablate import run as ablate
from minigpt.analysis.estimate import count_parameters


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


def test_ablate_writes_a_report_with_claims_and_plots(tmp_path, monkeypatch):
    from minigpt.data.sources import BUNDLED

    corpus = tmp_path / "slice.txt"
    corpus.write_text(BUNDLED["shakespeare"].path.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    monkeypatch.setitem(ablate.SCALES, "test", dict(preset="tiny", seq_len=16, batch_size=2, steps=2, lr=1e-3,
                                                    warmup_steps=1, eval_interval=1, eval_windows=2, vocab_size=300))
    settings = ablate.AblationSettings(out_dir=tmp_path / "runs", docs_dir=tmp_path / "docs", scale="test",
                                       threads=1, data=str(corpus), command="minigpt ablate tying")
    records = ablate.run_ablations(["tying"], settings)
    runs = records["comparisons"]["tying"]["runs"]
    assert [r["name"] for r in runs] == ["baseline", "untied"]
    assert all(r["result"]["step"] == 2 and r["peak_above_idle_mb"] > 0 for r in runs)
    assert set(runs[0]["context_eval"]) == {"1", "2", "4"}
    report = (tmp_path / "docs" / "ablations.md").read_text()
    for fragment in ("tied vs untied", "**Claim**", "**Our measurement**", "| tying | untied |",
                     "ablation-tying-loss.png", "minigpt ablate tying", "Noise floor"):
        assert fragment in report, fragment
    assert (tmp_path / "docs" / "ablation-tying-loss.png").stat().st_size > 1000
    again = ablate.run_ablations(["tying"], settings)  # finished runs are reused, not retrained
    assert again["comparisons"]["tying"]["runs"][1]["wall_s"] == runs[1]["wall_s"]
    with pytest.raises(Exception, match="unknown comparison"):
        ablate.run_ablations(["nope"], settings)
