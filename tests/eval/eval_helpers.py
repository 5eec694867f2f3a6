"""Models and lm-eval runs shared by the evaluation tests."""
import json
from pathlib import Path

import torch

from minigpt.checkpoint.convert import export_hf
from minigpt.checkpoint.native import save_pretrained
from minigpt.model.config import ModelConfig
from minigpt.model.transformer import Transformer
from minigpt.tokenizer.tokenizer import train_tokenizer

DATA_DIR = Path(__file__).resolve().parent / "data"
PARITY_TASKS = ["arc_easy", "hellaswag", "lambada_openai", "winogrande", "piqa"]

def random_gqa_model(root: Path, max_seq_len: int = 256) -> tuple[Path, Path]:
    """A random-init GQA MiniGPT (byte-level BPE of 400 tokens learned on the test slices): ``(native dir, HF
    export)``. Norm weights are perturbed so that they are not all ones."""
    texts = [line for f in sorted(DATA_DIR.glob("*.jsonl")) for line in f.read_text(encoding="utf-8").splitlines()]
    tokenizer = train_tokenizer(texts, 400)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                         hidden_dim=96, max_seq_len=max_seq_len)
    model = Transformer(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    save_pretrained(model, root / "native", tokenizer)
    export_hf(root / "native", root / "hf")
    return root / "native", root / "hf"


def stories_export(shared_data: Path, out: Path, bos: bool) -> Path:
    """stories260K exported as a HF directory AutoTokenizer reads without protobuf. Its tokenizer prepends BOS like
    Llama's (the export keeps what the llama2.c model was trained with: post-processor template and
    ``add_bos_token: true``); without ``bos`` both are taken out again, to test a tokenizer that adds nothing."""
    export_hf(shared_data / "models" / "stories260K" / "hf", out)
    if not bos:
        tokenizer = json.loads((out / "tokenizer.json").read_text())
        assert tokenizer["post_processor"]["type"] == "TemplateProcessing"
        tokenizer["post_processor"] = None
        (out / "tokenizer.json").write_text(json.dumps(tokenizer))
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["add_bos_token"] = False
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        (out / "manifest.json").unlink()  # the edited files no longer match their recorded hashes
    return out


def run_lm_eval(hf_dir: Path, tasks: list[str], num_fewshot: int, root: Path, monkeypatch, model_cls=None) -> dict:
    """lm-eval's ``hf`` model (or ``model_cls``) on our task YAMLs over the test slices, offline, per-item samples
    logged."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # lm-eval's perplexity bootstrap, in-process
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from minigpt.eval.harness import LM_EVAL_NAMES, write_task_dir

    task_dir = write_task_dir(DATA_DIR, root / "lm_eval_tasks", cache_dir=root / "datasets_cache")
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    model = (model_cls or HFLM)(pretrained=str(hf_dir), batch_size=4, device="cpu")
    return lm_eval.simple_evaluate(model=model, tasks=[LM_EVAL_NAMES[t] for t in tasks], task_manager=manager,
                                   num_fewshot=num_fewshot, log_samples=True, bootstrap_iters=10)


def lm_eval_loglikelihoods(sample: dict) -> list[tuple[float, bool]]:
    """``(loglikelihood, is_greedy)`` of each request of one lm-eval logged sample."""
    return [(float(ll), bool(greedy)) for ll, greedy in sample["filtered_resps"]]
