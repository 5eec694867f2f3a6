"""`minigpt train` and `minigpt checkpoint`: pretraining runs and their checkpoints."""
from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from minigpt.cli.common import add_command, parse_value, parse_yaml, positive_int
from minigpt.errors import MiniGPTError
from minigpt.paths import check_dir_path, remove_created


def read_config_file(path_text: str) -> dict[str, Any]:
    """The options mapping of a ``--config`` YAML file; a missing, invalid or non-mapping file is a one-line error."""
    path = Path(path_text)
    if not path.is_file():
        raise MiniGPTError(f"config file {path} does not exist")
    options = parse_yaml(path.read_text(), f"config file {path}") or {}
    if not isinstance(options, dict):
        raise MiniGPTError(f"config file {path} must hold a mapping of options")
    return options


def apply_sets(options: dict[str, Any], items: list[str] | None) -> dict[str, Any]:
    """Apply ``--set KEY=VALUE`` items to ``options`` in place (``model.FIELD=VALUE`` into ``options["model"]``)."""
    for item in items or []:
        if "=" not in item:
            raise MiniGPTError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        if key.startswith("model."):
            options.setdefault("model", {})[key[len("model."):]] = parse_value(value, f"--set {key}")
        else:
            options[key] = parse_value(value, f"--set {key}")
    return options


@contextmanager
def output_dir(path_text: str, flag: str = "--out-dir") -> Iterator[Path]:
    """Run the body that writes the output directory ``path_text``, checked first
    (:func:`~minigpt.paths.check_dir_path`). When the body fails, the directories the command made are taken back
    if they hold nothing but empty directories (:func:`~minigpt.paths.remove_created`): a failed command leaves no
    empty output behind, and a directory that existed before, or anything with a file in it, is kept. Raises what
    ``check_dir_path`` raises, and whatever the body raises."""
    created = check_dir_path(path_text, flag)
    try:
        yield Path(path_text)
    except BaseException:
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 made it
            remove_created(path_text, created)
        raise


def cmd_train(args: argparse.Namespace) -> int:
    """Train a model: AdamW, warmup + cosine schedule, evaluation in nats/token, perplexity and bits per byte.

    Options come from --config FILE.yaml, then flags, then --set key=value (model fields as model.KEY=VALUE). The
    model options are checked before the data is prepared; a run that fails before writing anything leaves no new
    --out-dir behind.
    """
    from minigpt.train.loop import TrainConfig, train

    options: dict[str, Any] = read_config_file(args.config) if args.config else {}
    flag_map = {"preset": "preset", "data": "data", "out_dir": "out_dir", "max_steps": "max_steps",
                "max_time": "max_time", "device": "device", "dtype": "dtype", "seed": "seed",
                "batch_size": "batch_size", "lr": "lr", "vocab_size": "vocab_size", "threads": "threads",
                "parallel": "parallel", "keep_checkpoints": "keep_checkpoints"}
    for flag, key in flag_map.items():
        value = getattr(args, flag)
        if value is not None:
            options[key] = value
    if args.resume:
        options["resume"] = True
    if args.compile:
        options["compile"] = True
    if args.activation_checkpointing:
        options["activation_checkpointing"] = True
    apply_sets(options, args.set)
    try:
        cfg = TrainConfig.from_dict(options)
    except (TypeError, ValueError) as e:
        raise MiniGPTError(f"invalid training config: {e}") from None
    with output_dir(cfg.out_dir):
        train(cfg)
    return 0


def _common_train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="model preset: tiny, small, medium")
    p.add_argument("--config", help="YAML file of training options")
    p.add_argument("--data", help="prepared data dir, bundled corpus name, or text/jsonl/parquet path")
    p.add_argument("--out-dir", dest="out_dir", help="run directory")
    p.add_argument("--max-steps", dest="max_steps", type=int)
    p.add_argument("--max-time", dest="max_time", type=float, help="seconds of training")
    p.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint in --out-dir")
    p.add_argument("--device", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--seed", type=int)
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--optimizer", choices=["adamw", "muon"],
                   help="adamw (default), or muon: Muon for the hidden matrices at --set muon_lr=... (default 0.02), "
                        "AdamW at --lr for embeddings, head, norms and biases")
    p.add_argument("--vocab-size", dest="vocab_size", type=int, help="tokenizer size if the data is prepared here")
    p.add_argument("--threads", type=positive_int, help="torch intra-op threads")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (compile time counts as training)")
    p.add_argument("--parallel", choices=["none", "ddp", "fsdp"],
                   help="data parallelism under torchrun: DDP, or FSDP2 sharding per transformer block")
    p.add_argument("--activation-checkpointing", dest="activation_checkpointing", action="store_true",
                   help="recompute block activations in the backward pass to save memory")
    p.add_argument("--keep-checkpoints", dest="keep_checkpoints", type=int, help="how many checkpoints to keep, the newest (0: all; default 2)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="any training option, or model.FIELD=VALUE for the model config (repeatable)")


def cmd_checkpoint_consolidate(args: argparse.Namespace) -> int:
    """Turn a training checkpoint (also a sharded FSDP one) into a single-file model directory for export/generate."""
    from minigpt.checkpoint.native import resolve_checkpoint
    from minigpt.train.state import consolidate

    src = Path(args.ckpt)
    ckpt = src if (src / "dcp").is_dir() else resolve_checkpoint(src)
    out = consolidate(ckpt, Path(args.out))
    print(f"wrote {out}")
    return 0


def register(sub) -> None:
    """Add this module's commands to the ``minigpt`` sub-parsers ``sub``."""
    p = add_command(sub, "train", cmd_train)
    _common_train_flags(p)

    ck = sub.add_parser("checkpoint", help="checkpoint tools").add_subparsers(dest="checkpoint_command", required=True)
    p = add_command(ck, "consolidate", cmd_checkpoint_consolidate)
    p.add_argument("ckpt", help="a run directory or a checkpoints/step_N directory")
    p.add_argument("out", help="output model directory")
