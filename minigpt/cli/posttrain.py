"""`minigpt sft` and `minigpt dpo`: supervised fine-tuning on chat data and preference optimization, full or LoRA."""
from __future__ import annotations

import argparse

from minigpt.cli.common import add_command


def cmd_sft(args: argparse.Namespace) -> int:
    """Fine-tune a model on chat conversations (JSONL: OpenAI messages, Alpaca or ShareGPT), full or with LoRA.

    The loss covers the assistant turns only (--train-on-prompt: every token); conversations are packed several
    to a row without attending to each other (--no-pack: one per row, padded). Without a chat template in the model,
    ChatML is used and its <|im_start|>/<|im_end|> tokens are added. --out-dir receives a model directory that
    `minigpt generate` and `minigpt chat` read, metrics.jsonl, and with --lora-rank the PEFT adapter in adapter/.
    """
    from minigpt.posttrain.sft import SFTConfig, sft

    options = {k: getattr(args, k) for k in ("model", "data", "val_data", "out_dir", "lora_rank", "lora_alpha",
                                             "lora_dropout", "lora_targets", "max_steps", "max_time", "epochs", "lr",
                                             "warmup_steps", "batch_size", "seq_len", "template", "log_interval",
                                             "eval_interval", "device", "dtype", "seed")
               if getattr(args, k) is not None}
    sft(SFTConfig(**options, pack=not args.no_pack, train_on_prompt=args.train_on_prompt, strict=args.strict))
    return 0


def cmd_dpo(args: argparse.Namespace) -> int:
    """Direct Preference Optimization (Rafailov et al. 2023) of a (usually SFT) model on preference pairs, full or LoRA.

    PREFS is JSONL in TRL's preference format: {"prompt", "chosen", "rejected"} as strings, or as message lists
    (rendered with the model's chat template; "chosen"/"rejected" may also be plain strings after a message-list
    prompt). Answers are scored by their summed token log-probabilities against a frozen reference, the starting
    model (with LoRA: the same model with its adapters disabled; --precompute-ref: its log-probs computed once up
    front, saving the memory of a second model). --loss ipo: the IPO loss (Azar et al. 2023). metrics.jsonl logs
    TRL's rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected.
    """
    from minigpt.posttrain.dpo import DPOConfig, dpo

    options = {k: getattr(args, k) for k in ("model", "data", "val_data", "out_dir", "beta", "loss", "lora_rank",
                                             "lora_alpha", "lora_dropout", "lora_targets", "max_steps", "max_time",
                                             "epochs", "lr", "warmup_steps", "batch_size", "seq_len", "template",
                                             "log_interval", "eval_interval", "device", "dtype", "seed")
               if getattr(args, k) is not None}
    dpo(DPOConfig(**options, precompute_ref=args.precompute_ref, strict=args.strict))
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


def cmd_lora_merge(args: argparse.Namespace) -> int:
    """Merge a LoRA adapter (a PEFT folder: ours from `minigpt sft --lora-rank`, or one trained with PEFT) into its
    base model and write a plain model directory whose logits equal the base with the adapter applied.

    The tokenizer and chat template come from the adapter's folder when it has them (an SFT output's adapter/ sits
    next to them), else from the base.
    """
    from pathlib import Path

    from minigpt.checkpoint.adapter import load_merged
    from minigpt.checkpoint.native import load_chat_template, load_tokenizer, resolve_checkpoint, save_pretrained
    from minigpt.errors import MiniGPTError

    base = resolve_checkpoint(args.base)
    model = load_merged(base, args.adapter)
    tokenizer, template = None, None
    for where in (Path(args.adapter), Path(args.adapter).parent, base):
        try:
            tokenizer = load_tokenizer(where)
            template = load_chat_template(where)
            break
        except MiniGPTError:
            continue
    path = save_pretrained(model, args.out_dir, tokenizer, template)
    print(f"wrote {path}")
    return 0


def _add_data_and_run_options(p) -> None:
    """Flags sft and dpo share: data strictness, template, logging, device, dtype, seed."""
    p.add_argument("--strict", action="store_true", help="stop at the first unusable data line instead of skipping")
    p.add_argument("--template", help="Jinja chat template file (default: the model's own, else ChatML)")
    p.add_argument("--log-interval", dest="log_interval", type=int)
    p.add_argument("--eval-interval", dest="eval_interval", type=int)
    p.add_argument("--device", help="auto, cpu, cuda, mps")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int)


def register(sub) -> None:
    """Add this module's commands to the ``minigpt`` sub-parsers ``sub``."""
    p = add_command(sub, "sft", cmd_sft)
    p.add_argument("--model", required=True, help="model to fine-tune: run dir, model dir, HF dir, .gguf or .bin")
    p.add_argument("--data", required=True, help="training conversations, JSONL")
    p.add_argument("--val-data", dest="val_data", help="validation conversations, JSONL (loss on assistant tokens)")
    p.add_argument("--out-dir", dest="out_dir", required=True, help="output model directory")
    _add_lora_and_loop_options(p)
    p.add_argument("--lr", type=float, help="peak learning rate (default 2e-5 full, 2e-4 LoRA)")
    p.add_argument("--batch-size", dest="batch_size", type=int, help="rows per step (default 8)")
    p.add_argument("--seq-len", dest="seq_len", type=int, help="row length; longer conversations are skipped")
    p.add_argument("--no-pack", dest="no_pack", action="store_true", help="one conversation per row, padded")
    p.add_argument("--train-on-prompt", dest="train_on_prompt", action="store_true",
                   help="score every token, not only the assistant's")
    _add_data_and_run_options(p)

    p = add_command(sub, "dpo", cmd_dpo)
    p.add_argument("--model", required=True, metavar="SFT_CHECKPOINT",
                   help="model to train (usually an SFT output): run dir, model dir, HF dir, .gguf or .bin")
    p.add_argument("--data", required=True, metavar="PREFS", help="preference pairs, JSONL {prompt, chosen, rejected}")
    p.add_argument("--val-data", dest="val_data", help="validation pairs, JSONL (the same metrics, prefixed val_)")
    p.add_argument("--out-dir", dest="out_dir", required=True, help="output model directory")
    p.add_argument("--beta", type=float, help="strength of the pull towards the reference (default 0.1)")
    p.add_argument("--loss", choices=["sigmoid", "ipo"], help="sigmoid: DPO (default); ipo: IPO, Azar et al. 2023")
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
    p.add_argument("--out-dir", dest="out_dir", required=True, help="output model directory")
