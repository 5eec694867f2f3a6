"""JSON and YAML that a user, a request or a model's files control, nested thousands of levels deep or holding an
integer of thousands of digits: ``json.loads`` raises ``RecursionError`` (not a ``ValueError``) for the first, a
plain ``ValueError`` (not a ``JSONDecodeError``) for the second, so handlers of bad JSON let them through as
tracebacks; PyYAML raises ``RecursionError`` too, and its ``YAMLError`` for a typo in a ``--set`` value was not
caught at all. Every reader below must turn them into its ordinary bad-input answer."""
import json

import pytest

from minigpt.analysis.estimate import resolve_config
from minigpt.checkpoint.adapter import read_adapter_config
from minigpt.checkpoint.atomic import verify_manifest
from minigpt.checkpoint.native import load_config
from minigpt.cli.train import apply_sets, read_config_file
from minigpt.data.chat import SkipReport, read_conversations
from minigpt.data.loader import load_meta
from minigpt.data.sources import iter_documents
from minigpt.errors import MiniGPTError, json_loads
from minigpt.interop.hf import is_hf_dir
from minigpt.serve.tools import parse_tool_calls
from minigpt.tokenizer.roles import roles_from_dir
from minigpt.train import state as train_state

DEEP = "[" * 100_000 + "]" * 100_000
BIG_INT = "9" * 5_000
GOOD_CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})


@pytest.mark.parametrize("text", [DEEP, '{"a": ' + DEEP + "}", BIG_INT, "{bad"])
def test_json_loads_fails_with_a_value_error(text):
    with pytest.raises(ValueError):
        json_loads(text)
    assert json_loads('{"a": [1, 2]}') == {"a": [1, 2]}


@pytest.mark.parametrize("bad", [DEEP, '{"messages": ' + BIG_INT + "}"])
def test_a_hostile_chat_line_is_skipped_or_named(tmp_path, bad):
    path = tmp_path / "sft.jsonl"
    path.write_text(GOOD_CHAT + "\n" + bad + "\n" + GOOD_CHAT + "\n")
    report = SkipReport()
    assert len(read_conversations(path, report=report)) == 2
    assert report.kept == 2
    with pytest.raises(MiniGPTError, match=r"sft.jsonl:2: invalid JSON"):
        read_conversations(path, strict=True)


@pytest.mark.parametrize("bad", [DEEP, '{"text": ' + BIG_INT + "}"])
def test_a_hostile_pretraining_line_is_named(tmp_path, bad):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "hello"}\n' + bad + "\n")
    with pytest.raises(MiniGPTError, match=r"corpus.jsonl:2: not valid JSON"):
        list(iter_documents(path))


@pytest.mark.parametrize("content", [DEEP, BIG_INT, "5", "[1]"])
def test_model_files_that_are_deep_huge_or_not_objects(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    assert is_hf_dir(tmp_path) is False  # a TypeError for "5" before
    with pytest.raises(MiniGPTError, match="config.json"):
        load_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text(content)
    with pytest.raises(MiniGPTError, match="adapter_config.json"):
        read_adapter_config(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(content)
    with pytest.raises(MiniGPTError, match="tokenizer_config.json"):
        roles_from_dir(tmp_path, lambda token: None, 100)
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(MiniGPTError, match="manifest.json"):
        verify_manifest(tmp_path)
    (tmp_path / "meta.json").write_text(content if content in (DEEP, BIG_INT) else "{bad")
    with pytest.raises(MiniGPTError, match="meta.json"):
        load_meta(tmp_path)


def test_a_torn_metrics_line_that_is_deep_counts_as_torn(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n' + DEEP)
    train_state.truncate_metrics(metrics, 5)
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n'


@pytest.mark.parametrize("text", [
    "<tool_call>" + "[" * 100_000,                       # Hermes-style block, a model's output nested deep
    '{"name": "f", "parameters": ' + "{\"a\": " * 50_000,  # Llama-3-style bare JSON
])
def test_a_model_answer_nested_deep_is_text_not_a_crash(text):
    content, calls = parse_tool_calls(text, ["f"])
    assert calls == [] and content == text


@pytest.mark.parametrize("value, match", [
    ("[", r"--set lr is not valid YAML"),            # a typo: a traceback before
    pytest.param("[" * 100_000, r"--set lr is nested too deeply", marks=pytest.mark.slow),  # ~5 s to read
    (BIG_INT, r"--set lr is not usable YAML"),
])
def test_a_bad_set_value_is_one_error_naming_the_key(value, match):
    with pytest.raises(MiniGPTError, match=match):
        apply_sets({}, [f"lr={value}"])
    assert apply_sets({}, ["lr=0.001", "model.dim=64"]) == {"lr": 0.001, "model": {"dim": 64}}


@pytest.mark.slow
def test_a_deep_yaml_config_is_one_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("model: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(MiniGPTError, match="deep.yaml is nested too deeply"):
        read_config_file(str(path))
    with pytest.raises(MiniGPTError, match="deep.yaml is nested too deeply"):
        resolve_config(None, str(path), {})
