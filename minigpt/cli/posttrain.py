"""`minigpt sft` and `minigpt dpo`: supervised fine-tuning on chat data and preference optimization, full or LoRA."""
from __future__ import annotations

import argparse
from typing import Any

from minigpt.cli.common import add_command, positive_int
from minigpt.cli.train import apply_sets, output_dir, read_config_file
from minigpt.errors import MiniGPTError

# Flags that are options of the same name (None = not given: the --config file or the default decides).
RUN_OPTIONS = ("model", "data", "val_data", "out_dir", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets",
               "quantize", "max_steps", "max_time", "epochs", "lr", "warmup_steps", "batch_size", "grad_accum",
               "seq_len", "template", "log_interval", "eval_interval", "ckpt_interval", "keep_checkpoints", "device",
               "dtype", "seed", "threads", "parallel")


def _config(cls, args: argparse.Namespace, names: tuple[str, ...], switches: dict[str, tuple[str, Any]]):
    """``cls`` from --config FILE.yaml, then the flags ``names`` and the store-true ``switches`` (flag -> (option,
    value)) that were given, then --set KEY=VALUE; a bad option is a one-line error."""
    options: dict[str, Any] = read_config_file(args.config) if args.config else {}
    options.update({k: getattr(args, k) for k in names if getattr(args, k) is not None})
    options.update({key: value for flag, (key, value) in switches.items() if getattr(args, flag)})
    apply_sets(options, args.set)
    try:
        return cls.from_dict(options)
    except (TypeError, ValueError) as e:
        raise MiniGPTError(f"invalid training config: {e}") from None


COMMON_SWITCHES = {"strict": ("strict", True), "resume": ("resume", True), "compile": ("compile", True),
                   "activation_checkpointing": ("activation_checkpointing", True)}


def cmd_sft(args: argparse.Namespace) -> int:
    """Fine-tune a model on chat data (JSONL: OpenAI messages, TRL prompt-completion, Alpaca, ShareGPT), full or LoRA.

    The loss covers the assistant turns only, or a prompt-completion row's completion (--train-on-prompt: every
    token); conversations are packed several
    to a row without attending to each other (--no-pack: one per row, padded). Without a chat template in the model,
    ChatML is used and its <|im_start|>/<|im_end|> tokens are added. --out-dir receives a model directory that
    `minigpt generate` and `minigpt chat` read, and with --lora-rank the PEFT adapter in adapter/; it is also the
    run directory of the trainer `minigpt train` uses (metrics.jsonl, loss_curve.png, checkpoints/, --resume,
    torchrun DDP/FSDP). --quantize int8 trains LoRA adapters over an int8-quantized frozen base. --out-dir that is a
    file is refused; a run that fails before writing anything (unusable data, too little disk) leaves no new
    directory behind.

    Options come from --config FILE.yaml (any option by its name, e.g. lora_rank: 8, pack: false), then flags,
    then --set key=value.
    """
    from minigpt.posttrain.sft import SFTConfig, sft

    cfg = _config(SFTConfig, args, RUN_OPTIONS, {**COMMON_SWITCHES, "no_pack": ("pack", False),
                                                  "train_on_prompt": ("train_on_prompt", True)})
    with output_dir(cfg.out_dir):  # a run that fails before writing anything leaves no new --out-dir behind
        sft(cfg)
    return 0


def cmd_dpo(args: argparse.Namespace) -> int:
    """Direct Preference Optimization (Rafailov et al. 2023) of a (usually SFT) model on preference pairs, full or LoRA.

    PREFS is JSONL in TRL's preference format: {"prompt", "chosen", "rejected"} as strings, or as message lists
    (rendered with the model's chat template; "chosen"/"rejected" may also be plain strings after a message-list
    prompt). Answers are scored by their summed token log-probabilities against a frozen reference, the starting
    model (with LoRA: the same model with its adapters disabled; --precompute-ref: its log-probs computed once up
    front, saving the memory of a second model). --loss ipo: the IPO loss (Azar et al. 2023). --sft-weight W adds W
    times the chosen answers' negative log-likelihood per token (TRL's "sft" loss term; RPO). metrics.jsonl logs
    TRL's rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected.
    The run directory, --resume, --config and torchrun work as for `minigpt sft`.
    """
    from minigpt.posttrain.dpo import DPOConfig, dpo

    cfg = _config(DPOConfig, args, RUN_OPTIONS + ("beta", "loss", "sft_weight"),
                  {**COMMON_SWITCHES, "precompute_ref": ("precompute_ref", True)})
    with output_dir(cfg.out_dir):  # as in sft
        dpo(cfg)
    return 0


def _add_lora_and_loop_options(p) -> None:
    p.add_argument("--lora-rank", dest="lora_rank", type=int, help="LoRA rank r (default: full fine-tuning)")
    p.add_argument("--lora-alpha", dest="lora_alpha", type=float, help="LoRA alpha (scale alpha / r; default 16)")
    p.add_argument("--lora-dropout", dest="lora_dropout", type=float, help="dropout on the LoRA input (default 0.05)")
    p.add_argument("--lora-targets", dest="lora_targets",
                   help="comma-separated HF module names (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj) "
                        "or all-linear (default)")
    p.add_argument("--max-steps", dest="max_steps", type=int, help="optimizer steps (default: --epochs epochs)")
    p.add_argument("--max-time", dest="max_time", type=float, help="seconds of training")
    p.add_argument("--epochs", type=int, help="epochs when neither --max-steps nor --max-time is given (default 1)")
    p.add_argument("--warmup-steps", dest="warmup_steps", type=int, help="default: 3%% of the steps")
    p.add_argument("--quantize", choices=["int8"],
                   help="with --lora-rank: quantize the frozen base's block projections to int8 (QLoRA-style)")


def cmd_lora_merge(args: argparse.Namespace) -> int:
    """Merge a LoRA adapter (a PEFT folder: ours from `minigpt sft --lora-rank`, or one trained with PEFT) into its
    base model and write a plain model directory whose logits equal the base with the adapter applied.

    The tokenizer and chat template come from the adapter's folder when it has them (an SFT output's adapter/ sits
    next to them), else from the base (:func:`~minigpt.checkpoint.adapter.tokenizer_source`, as generate, chat and
    serve choose them); the model is written without a tokenizer when neither has one. A tokenizer there that
    cannot be read is an error, not a silent fall-back to the base's, whose vocabulary may lack the adapter's tokens.
    """
    from minigpt.checkpoint.adapter import load_merged, tokenizer_source
    from minigpt.checkpoint.native import load_chat_template, load_tokenizer, resolve_checkpoint, save_pretrained
    from minigpt.tokenizer.tokenizer import TokenizerMissing

    base = resolve_checkpoint(args.base)
    model = load_merged(base, args.adapter)
    words = tokenizer_source(base, args.adapter)
    try:
        tokenizer = load_tokenizer(words)
    except TokenizerMissing:
        tokenizer = None
    template = load_chat_template(words)
    path = save_pretrained(model, args.out_dir, tokenizer, template)
    print(f"wrote {path}")
    return 0


def _add_data_and_run_options(p) -> None:
    """Flags sft and dpo share: data strictness, template, logging, device, dtype, seed."""
    p.add_argument("--strict", action="store_true", help="stop at the first unusable data line instead of skipping")
    p.add_argument("--template", help="Jinja chat template file, or 'chatml' for the built-in ChatML, which writes "
                                      "tools (default: the model's own, else ChatML)")
    p.add_argument("--log-interval", dest="log_interval", type=int)
    p.add_argument("--eval-interval", dest="eval_interval", type=int)
    p.add_argument("--device", help="auto, cpu, cuda, mps")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--seed", type=int)
    p.add_argument("--config", help="YAML file of options (the names of SFTConfig / DPOConfig fields)")
    p.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint in --out-dir")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (compile time counts as training; rows are padded to --seq-len, "
                        "so one graph serves every step)")
    p.add_argument("--threads", type=positive_int, help="torch intra-op threads")
    p.add_argument("--parallel", choices=["none", "ddp", "fsdp"], help="data parallelism under torchrun")
    p.add_argument("--activation-checkpointing", dest="activation_checkpointing", action="store_true",
                   help="recompute block activations in the backward pass to save memory")
    p.add_argument("--grad-accum", dest="grad_accum", type=int, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--ckpt-interval", dest="ckpt_interval", type=int, help="steps between checkpoints (default 500)")
    p.add_argument("--keep-checkpoints", dest="keep_checkpoints", type=int, help="how many checkpoints to keep, the newest (0: all; default 2)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any option (repeatable)")


def register(sub) -> None:
    """Add this module's commands to the ``minigpt`` sub-parsers ``sub``."""
    p = add_command(sub, "sft", cmd_sft)
    p.add_argument("--model", help="model to fine-tune: run dir, model dir, HF dir, .gguf or .bin")
    p.add_argument("--data", help="training conversations, JSONL")
    p.add_argument("--val-data", dest="val_data", help="validation conversations, JSONL (loss on assistant tokens)")
    p.add_argument("--out-dir", dest="out_dir", help="output model and run directory")
    _add_lora_and_loop_options(p)
    p.add_argument("--lr", type=float, help="peak learning rate (default 2e-5 full, 2e-4 LoRA)")
    p.add_argument("--batch-size", dest="batch_size", type=int, help="rows per step (default 8)")
    p.add_argument("--seq-len", dest="seq_len", type=int, help="row length; longer conversations are skipped")
    p.add_argument("--no-pack", dest="no_pack", action="store_true", help="one conversation per row, padded")
    p.add_argument("--train-on-prompt", dest="train_on_prompt", action="store_true",
                   help="score every token, not only the assistant's")
    _add_data_and_run_options(p)

    p = add_command(sub, "dpo", cmd_dpo)
    p.add_argument("--model", metavar="SFT_CHECKPOINT",
                   help="model to train (usually an SFT output): run dir, model dir, HF dir, .gguf or .bin")
    p.add_argument("--data", metavar="PREFS", help="preference pairs, JSONL {prompt, chosen, rejected}")
    p.add_argument("--val-data", dest="val_data", help="validation pairs, JSONL (the same metrics, prefixed val_)")
    p.add_argument("--out-dir", dest="out_dir", help="output model and run directory")
    p.add_argument("--beta", type=float, help="strength of the pull towards the reference (default 0.1)")
    p.add_argument("--loss", choices=["sigmoid", "ipo"], help="sigmoid: DPO (default); ipo: IPO, Azar et al. 2023")
    p.add_argument("--sft-weight", dest="sft_weight", type=float,
                   help="weight of an SFT term on the chosen answers (default 0: none; TRL's 'sft' loss, RPO)")
    p.add_argument("--precompute-ref", dest="precompute_ref", action="store_true",
                   help="compute the reference log-probs once before training instead of keeping a reference model")
    _add_lora_and_loop_options(p)
    p.add_argument("--lr", type=float, help="peak learning rate (default 1e-6 full, 5e-6 LoRA)")
    p.add_argument("--batch-size", dest="batch_size", type=int, help="pairs per step (default 8)")
    p.add_argument("--seq-len", dest="seq_len", type=int, help="longest prompt + answer; longer pairs are skipped")
    _add_data_and_run_options(p)

    lora = sub.add_parser("lora", help="LoRA adapter tools").add_subparsers(dest="lora_command", required=True)
    p = add_command(lora, "merge", cmd_lora_merge)
    p.add_argument("base", help="the base model: run dir, model dir, HF dir, .gguf or .bin")
    p.add_argument("adapter", help="a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--out-dir", dest="out_dir", help="output model and run directory")
