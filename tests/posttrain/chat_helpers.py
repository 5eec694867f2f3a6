"""Tiny synthetic chat data, a tiny BPE with the ChatML tokens, and a Hugging Face copy of a model, for the
post-training tests. No real conversation data is copied here: every message is generated from word lists."""
import json
import random
import shutil

import torch

from minigpt.checkpoint.native import load_model
from minigpt.interop import hf
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer
from minigpt.tokenizer.chat_template import CHATML_TEMPLATE, add_special_tokens
from minigpt.tokenizer.tokenizer import train_tokenizer

WORDS = ("the cat sat on a mat and then it ran to see why sky is blue what do you think about tea please "
         "answer briefly sure here are three ideas first second third 猫 喜欢 鱼 吗 是的").split()


def sentence(rng, n=None):
    return " ".join(rng.choice(WORDS) for _ in range(n or rng.randint(2, 9)))


def conversation(rng, turns=None, system=None):
    """``turns`` user/assistant exchanges (1-3 by default), optionally after a system message."""
    messages = [{"role": "system", "content": sentence(rng)}] if (system or (system is None and rng.random() < .3)) \
        else []
    for _ in range(turns or rng.randint(1, 3)):
        messages.append({"role": "user", "content": sentence(rng).capitalize() + "?"})
        messages.append({"role": "assistant", "content": sentence(rng) + "."})
    return messages


def conversations(n, seed=0, **kw):
    rng = random.Random(seed)
    return [conversation(rng, **kw) for _ in range(n)]


def chat_tokenizer(with_chat_tokens=True, vocab_size=300):
    rng = random.Random(0)
    texts = [sentence(rng, 12) for _ in range(300)]
    tok = train_tokenizer(texts, vocab_size)
    if with_chat_tokens:
        tok, _ = add_special_tokens(tok)
    return tok


def save_hf_tokenizer(tokenizer, directory, template=CHATML_TEMPLATE):
    """A directory ``transformers.AutoTokenizer`` loads: tokenizer.json + tokenizer_config.json with ``template``."""
    from minigpt.tokenizer.interop import hf_tokenizer_config

    directory.mkdir(parents=True, exist_ok=True)
    path = tokenizer.save(directory)
    ids = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id, "pad_token": tokenizer.pad_id}
    config, special_map = hf_tokenizer_config(path, ids, 256, template)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, ensure_ascii=False))
    return directory


def tiny_model(vocab_size, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=256)
    model = Transformer(ModelConfig(**{**cfg, **kw})).eval()
    with torch.no_grad():  # non-trivial norms
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


def hf_copy(model):
    """``transformers.LlamaForCausalLM`` with ``model``'s weights."""
    import transformers

    cfg = transformers.LlamaConfig(**{k: v for k, v in hf.config_to_hf(model.config).items()
                                      if k not in ("architectures", "model_type")})
    ref = transformers.LlamaForCausalLM(cfg).eval()
    sd = {hf.to_hf_key(k): v for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight")
    ref.load_state_dict(sd, strict=False)
    return ref


def crash_after(run, copy, step):
    """A copy of the finished run directory ``run`` as a process killed right after its step-``step`` checkpoint
    leaves it: no later checkpoint, ``latest`` at that one, no output model files yet."""
    shutil.copytree(run, copy)
    for ckpt in (copy / "checkpoints").glob("step_*"):
        if int(ckpt.name.removeprefix("step_")) > step:
            shutil.rmtree(ckpt)
    (copy / "latest").write_text(f"checkpoints/step_{step:07d}\n")
    for name in ("config.json", "model.safetensors", "manifest.json", "loss_curve.png"):
        (copy / name).unlink()
    shutil.rmtree(copy / "adapter", ignore_errors=True)
    return copy


TIMING = ("tokens_per_s", "mfu", "train_time", "memory")


def assert_same_run(a, b):
    """Run directories ``a`` and ``b`` hold bit-identical models (and adapters) and the same metrics rows, timing
    columns aside."""
    wa, wb = load_model(a).state_dict(), load_model(b).state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    if (a / "adapter").is_dir():
        from safetensors.torch import load_file

        ta, tb = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (a, b))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (a, b)]
    assert [r["step"] for r in rows[1]] == [r["step"] for r in rows[0]]  # no duplicated or missing step
    for ra, rb in zip(*rows):
        assert {k: v for k, v in ra.items() if k not in TIMING} == {k: v for k, v in rb.items() if k not in TIMING}


def record_results(monkeypatch, module, name, keep):
    """Wrap ``module.name`` (a function) so that ``keep(result)`` of each call is appended to the list returned."""
    seen = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.append(keep(result))
        return result

    monkeypatch.setattr(module, name, wrapper)
    return seen
