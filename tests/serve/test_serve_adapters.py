"""`minigpt serve BASE --adapter NAME=DIR ...`: the base and each LoRA adapter under its own model name, listed by
/v1/models, concurrent requests for different adapters answered as each merged model alone; unknown names 400."""
import copy
import json
import threading
import urllib.request

import pytest
import torch
from conftest import TINY_MODEL, assert_one_line_error, random_model, run_cli
from serve_helpers import InProcessServer

from minigpt.checkpoint.adapter import load_merged, save_adapter
from minigpt.checkpoint.native import save_pretrained
from minigpt.cli.serve import _adapters
from minigpt.errors import MiniGPTError
from minigpt.infer.engine import Engine
from minigpt.infer.metrics import parse_text
from minigpt.infer.sampling import SamplingParams
from minigpt.model.lora import apply_lora
from minigpt.serve.app import ServerState
from minigpt.serve.models import load_engine
from minigpt.tokenizer.tokenizer import Tokenizer

PROMPTS = [[5, 17, 93, 41, 8, 120, 77], [200, 3, 3, 64, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def served(tiny_data, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("adapters")
    tok = Tokenizer.from_dir(tiny_data)
    base = random_model({**TINY_MODEL, "max_seq_len": 256}, vocab_size=tok.vocab_size, noise=0.5)
    base_dir = save_pretrained(base, root / "base", tokenizer=tok)
    folders = {}
    for i, (name, targets) in enumerate((("poet", "q_proj,v_proj"), ("coder", "all-linear"))):
        m = copy.deepcopy(base)
        apply_lora(m, 4, 8, targets=targets)
        torch.manual_seed(i)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.3)
        folders[name] = str(save_adapter(m, root / name))
    engine = load_engine(base_dir, tok, adapters=folders, device="cpu", base_name="base", max_batch_size=4)
    srv = InProcessServer(ServerState(engine, tok, "base"))
    srv.tok, srv.base_dir, srv.folders = tok, base_dir, folders
    yield srv
    srv.stop()


def call(srv, path, body=None):
    req = urllib.request.Request(srv.url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def alone(srv, folder, prompt):
    """The text the model merged with ``folder`` (None: the base) generates alone for ``prompt``."""
    engine = Engine(load_merged(srv.base_dir, folder), srv.tok, max_batch_size=1).start()
    try:
        return "".join(e.text for e in engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0), 60))
    finally:
        engine.close()


def test_models_lists_the_base_and_each_adapter(served):
    status, body = call(served, "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["base", "poet", "coder"]
    assert [m.get("parent") for m in body["data"]] == [None, "base", "base"]


def test_a_model_is_retrieved_by_name(served):
    """GET /v1/models/{model} (OpenAI's retrieve, `client.models.retrieve`) was a 404 for every name."""
    _, listed = call(served, "/v1/models")
    for card in listed["data"]:
        assert call(served, f"/v1/models/{card['id']}") == (200, card)
    status, body = call(served, "/v1/models/org/nope")
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert "'org/nope'" not in body["error"]["message"] and '"org/nope" does not exist' in body["error"]["message"]


def test_concurrent_requests_for_different_adapters_answer_as_each_merged_model(served):
    jobs = [(model, p) for p in PROMPTS for model in ("base", "poet", "coder")]
    answers = [None] * len(jobs)

    def ask(i, model, prompt):
        answers[i] = call(served, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8,
                                                      "temperature": 0})

    threads = [threading.Thread(target=ask, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (model, prompt), (status, body) in zip(jobs, answers):
        assert status == 200 and body["model"] == model
        folder = None if model == "base" else served.folders[model]
        assert body["choices"][0]["text"] == alone(served, folder, prompt), model
    texts = {body["choices"][0]["text"] for _, body in answers[:3]}
    assert len(texts) > 1, "the adapters must change the answers"
    # A long prompt twice per model: the second time from the prefix cache (keyed by adapter), same answers.
    long = PROMPTS[0] * 6
    for model in ("poet", "coder", "base"):
        first, again = (call(served, "/v1/completions", {"model": model, "prompt": long, "max_tokens": 8,
                                                          "temperature": 0})[1]["choices"][0]["text"] for _ in "12")
        assert first == again == alone(served, None if model == "base" else served.folders[model], long)
    with urllib.request.urlopen(served.url + "/metrics", timeout=10) as r:
        samples = parse_text(r.read().decode())
    assert samples["minigpt_prefix_cache_hit_rate"] > 0 and samples["minigpt_prefix_cache_bytes"] > 0


def test_an_unknown_model_is_a_400_naming_the_served_ones(served):
    status, body = call(served, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
    assert status == 400
    err = body["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found" and "'poet'" in err["message"]


def test_adapter_flags(tmp_path):
    assert _adapters(None) == (None, {})
    assert _adapters(["some/dir"]) == ("some/dir", {})
    assert _adapters(["a=x", "b=y/z"]) == (None, {"a": "x", "b": "y/z"})
    assert _adapters(["org/lora=y/z"]) == (None, {"org/lora": "y/z"})  # was read as one folder to merge
    (tmp_path / "k=v").mkdir()
    assert _adapters([str(tmp_path / "k=v")]) == (str(tmp_path / "k=v"), {})
    for bad, message in ((["a=x", "a=y"], "given twice"), (["d1", "d2"], "only one --adapter DIR"),
                         (["a="], "no folder")):
        with pytest.raises(MiniGPTError, match=message):
            _adapters(bad)
    assert_one_line_error(run_cli("serve", tmp_path, "--adapter", "a=x", "--adapter", "b"), "do not mix")
    assert_one_line_error(run_cli("serve", tmp_path, "--no-prefix-cache", "--prefix-cache-bytes", "1MiB"),
                          "contradict")
