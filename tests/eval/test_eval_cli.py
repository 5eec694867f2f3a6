"""`minigpt eval` on the command line: table, lm-eval results layout, report, one-line errors."""
import json

import pytest
from conftest import assert_one_line_error, run_cli
from eval_helpers import DATA_DIR, random_gqa_model

from minigpt.eval.report import write_report


@pytest.fixture(scope="module")
def native_model(tmp_path_factory):
    native, _ = random_gqa_model(tmp_path_factory.mktemp("cli_model"))
    return native


def test_eval_writes_table_results_json_and_report(native_model, tmp_path):
    text = tmp_path / "valid.txt"
    text.write_text("Once upon a time there was a cat.\nThe cat sat on the mat.\nThe end.\n", encoding="utf-8")
    out, report = tmp_path / "results.json", tmp_path / "report"
    proc = run_cli("eval", native_model, "--tasks", f"arc_easy,winogrande,lambada_openai,bpb:{text}",
                   "--data-dir", DATA_DIR, "--limit", "3", "--num-fewshot", "1", "--batch-size", "4",
                   "--output", out, "--samples", "--report", report)
    assert proc.returncode == 0, proc.stderr
    assert "| arc_easy | 1 | acc_norm |" in proc.stdout and "| winogrande | 1 | acc |" in proc.stdout
    results = json.loads(out.read_text())
    arc = results["results"]["arc_easy"]
    assert set(arc) == {"alias", "acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"}
    assert results["n-samples"]["arc_easy"] == {"original": 8, "effective": 3}
    assert results["n-shot"]["arc_easy"] == 1 and results["higher_is_better"]["arc_easy"]["acc"] is True
    assert set(results["results"]["lambada_openai"]) >= {"perplexity,none", "acc,none"}
    bpb = results["results"][f"bpb:{text}"]
    assert 0 < bpb["bits_per_byte,none"] and bpb["word_perplexity,none"] > 1
    assert results["chance"]["winogrande"] == 0.5 and results["config"]["bos"] is False
    assert len(results["samples"]["arc_easy"]) == 3 and len(results["samples"]["arc_easy"][0]["arguments"]) == 4
    assert (report / "results.md").read_text().count("| arc_easy |") == 2
    assert (report / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_report(results, tmp_path / "compared", reference=results)
    assert "| Reference |" in (tmp_path / "compared" / "results.md").read_text()


def test_eval_errors_are_one_line(native_model, tmp_path):
    assert_one_line_error(run_cli("eval", native_model, "--tasks", "arc_medium"), "unknown task 'arc_medium'")
    broken = tmp_path / "data"
    broken.mkdir()
    lines = (DATA_DIR / "piqa_validation.jsonl").read_text(encoding="utf-8").splitlines()
    lines[1] = lines[1].replace('"label": ', '"labels": ')
    (broken / "piqa_validation.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    proc = run_cli("eval", native_model, "--tasks", "piqa", "--data-dir", broken)
    assert_one_line_error(proc, f"{broken / 'piqa_validation.jsonl'}:2:", "missing field 'label'")


@pytest.mark.slow
def test_output_paths_and_reference_are_checked_before_the_evaluation(tmp_path):
    """A bad --output, --report or --reference used to fail only after the whole evaluation had run. Here the
    model does not even exist: the path error must come first."""
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "bad.json").write_text("{not json")
    missing = tmp_path / "no_model"
    for extra, fragment in [(["--output", tmp_path], "is a folder; give a file path"),
                            (["--output", tmp_path / "a_file" / "out.json"], "is an existing file, not a directory"),
                            (["--report", tmp_path / "a_file"], "is a file; give a folder"),
                            (["--reference", tmp_path / "bad.json"], "cannot read --reference")]:
        proc = run_cli("eval", missing, "--tasks", "arc_easy", *extra)
        assert_one_line_error(proc, fragment)
