"""`minigpt serve --compile`: the engine gets a compiled FastPath, so a request running alone (or, with
--compile-batch N, up to N together) decodes through the compiled step (minigpt.infer.mirror), compiled (or loaded)
before the server listens; adapters served by name keep the batched eager path, which applies them."""
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
from serve_helpers import ServerProcess, chat_model

import minigpt.cli.serve as cli_serve
import minigpt.serve.app as app_module
from minigpt.checkpoint.adapter import save_adapter
from minigpt.checkpoint.native import load_tokenizer
from minigpt.errors import MiniGPTError
from minigpt.infer.engine import Engine
from minigpt.infer.fastpath import FastPath
from minigpt.model.lora import apply_lora
from minigpt.serve.models import describe_engine, load_engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("served"))


def test_load_engine_compiles_before_serving(ckpt, monkeypatch):
    warmed = []
    monkeypatch.setattr(Engine, "warm_up", lambda self: warmed.append(self) or 0.0)
    engine = load_engine(ckpt, load_tokenizer(ckpt), device="cpu", compile=True, max_batch_size=2)
    assert warmed == [engine]
    assert isinstance(engine.model, FastPath) and engine.model.compiled and engine.model.aoti
    assert engine.mirror is not None and engine.mirror.sizes == (1,)
    line = describe_engine(engine, context_given=False)
    assert "a lone request decodes through the compiled step (batch sizes 1," in line
    c = engine.model.config
    mirror_mib = 2 * c.n_layers * c.n_kv_heads * c.head_dim * engine.max_seq_len * 4 / 2**20
    assert f"its mirror takes up to {mirror_mib:,.1f} MiB" in line

    three = load_engine(ckpt, load_tokenizer(ckpt), device="cpu", compile=3, max_batch_size=4)
    assert three.mirror.sizes == (1, 2, 3) and warmed[-1] is three
    assert "up to 3 running requests decode through the compiled step (batch sizes 1, 2, 3," in \
        describe_engine(three, context_given=False)

    plain = load_engine(ckpt, load_tokenizer(ckpt), device="cpu", max_batch_size=2)
    assert plain.mirror is None and not plain.model.compiled
    assert "compiled" not in describe_engine(plain, context_given=False)


def test_adapters_served_by_name_keep_the_eager_batched_path(ckpt, tmp_path, monkeypatch):
    from minigpt.checkpoint.native import load_model

    monkeypatch.setattr(Engine, "warm_up", lambda self: 0.0)
    model = load_model(ckpt)
    apply_lora(model, 2, 4, targets="q_proj,v_proj")
    folder = save_adapter(model, tmp_path / "a")
    engine = load_engine(ckpt, load_tokenizer(ckpt), adapters={"a": str(folder)}, device="cpu", base_name="m",
                         compile=True, max_batch_size=2)
    assert engine.mirror is None and engine.adapter_names == ["a"]


def test_the_serve_command_passes_compile(ckpt, monkeypatch):
    seen = {}
    monkeypatch.setattr(app_module, "serve", lambda source, **kw: seen.update(kw) or 0)
    parser = cli_serve.argparse.ArgumentParser()
    cli_serve.register(parser.add_subparsers())
    for argv, want in (([], 0), (["--compile"], 1), (["--compile-batch", "4"], 4),
                       (["--compile", "--compile-batch", "2"], 2)):
        args = parser.parse_args(["serve", str(ckpt), *argv])
        assert args.func(args) == 0 and seen["compile"] == want
    for bad in ("0", "17"):  # at least 1, at most --max-batch-size (16)
        args = parser.parse_args(["serve", str(ckpt), "--compile-batch", bad])
        with pytest.raises(MiniGPTError, match="--compile-batch must be between 1 and --max-batch-size"):
            args.func(args)


def complete(url: str, prompt: str, **body) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"prompt": prompt, "max_tokens": 24, "temperature": 0, **body}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_a_compiled_server_answers_as_the_eager_one(ckpt, tmp_path):
    prompts = ["the cat sat on", "why is the sky", "tell me about tea"]
    answers = []
    for args in ((), ("--compile-batch", "2")):
        srv = ServerProcess(ckpt, *args, log=tmp_path / f"serve{len(args)}.log", timeout=900)
        try:
            alone = [complete(srv.url, p)["choices"][0]["text"] for p in prompts]
            with ThreadPoolExecutor(3) as pool:  # together: groups of two through the mirror, three eagerly
                together = [r["choices"][0]["text"] for r in pool.map(partial(complete, srv.url), prompts)]
            answers.append(alone + together +
                           [complete(srv.url, prompts[0], temperature=0.8, seed=3)["choices"][0]["text"]])
        finally:
            assert srv.stop() == 0
        if args:
            assert "up to 2 running requests decode through the compiled step" in srv.output()
    assert answers[0] == answers[1]
