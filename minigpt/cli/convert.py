"""`minigpt quantize`, `export` and `import`: models between formats."""
from __future__ import annotations

import argparse

from minigpt.cli.common import add_command
from minigpt.errors import MiniGPTError


def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantize a model's weights to int8 or int4 and save it with its tokenizer and chat template.

    int8 (the default): per-output-channel symmetric scales. int4 (--dtype int4): groups of --group-size inputs, 32
    by default, each with a float16 scale: llama.cpp's Q4_0; the LM head and layers whose width does not divide into
    groups stay int8. The output keeps the tokenizer, special-token roles, stop ids and chat template; every command
    that takes a checkpoint loads the result as is. Prints the tensor bytes before and after (a tied embedding / LM
    head counted once).

    OUT may be new, empty, or an earlier output of minigpt (re-running replaces it); OUT that is, holds or lies
    inside the source, a file, or a directory of other files is refused before anything is read or written.
    """
    from minigpt.checkpoint.atomic import check_output_dir
    from minigpt.checkpoint.native import load_chat_template, load_model, load_tokenizer, resolve_checkpoint
    from minigpt.checkpoint.quantized import save_quantized
    from minigpt.model.quant import SCHEMES, quant_config, quantize_model, tensor_bytes

    if args.dtype == "int8" and args.group_size != 32:
        raise MiniGPTError("--group-size applies to --dtype int4 (int8 has one scale per output channel)")
    try:
        quant_config(SCHEMES[args.dtype], args.group_size)  # a bad group size fails before the model loads
    except ValueError as e:
        raise MiniGPTError(str(e)) from None
    src = resolve_checkpoint(args.ckpt)
    check_output_dir(args.out, [args.ckpt, src])  # nothing of the source or of the user's is replaced
    model = load_model(src)
    before = tensor_bytes(model)
    try:  # a layer whose input width the group size does not divide stays int8; nothing else is refused here
        quantize_model(model, SCHEMES[args.dtype], args.group_size)
    except ValueError as e:
        raise MiniGPTError(str(e)) from None
    try:
        tokenizer = load_tokenizer(src)
    except MiniGPTError:
        tokenizer = None
    path = save_quantized(model, args.out, tokenizer, load_chat_template(src))
    after = tensor_bytes(model)
    print(f"wrote {path} ({before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB of tensors)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Export a model to the Hugging Face or llama.cpp ecosystem.

    --format hf writes a LlamaForCausalLM directory (MistralForCausalLM for a sliding attention window,
    MixtralForCausalLM for a mixture of experts with experts on every layer and no shared expert; config.json, safetensors, sharded above --max-shard-size,
    generation_config.json, tokenizer files) that transformers loads offline. --format gguf writes a llama GGUF
    (OUT ending in .gguf is the file, else OUT/model.gguf) in float32, float16, bfloat16 or q8_0.

    OUT may be new, empty, or an earlier output of minigpt; a GGUF file may also replace an existing file. OUT that
    is, holds or lies inside the source, a file in place of the directory, or a directory of other files is refused
    before anything is read or written.
    """
    from minigpt.checkpoint.atomic import check_output_dir
    from minigpt.checkpoint.convert import export_gguf, export_hf
    from minigpt.checkpoint.native import resolve_checkpoint

    src = resolve_checkpoint(args.ckpt)
    if args.format == "hf":
        check_output_dir(args.out, [args.ckpt, src])
        path = export_hf(src, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size)
    else:
        path = export_gguf(src, args.out, dtype=args.dtype)
    print(f"wrote {path}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Import a model into a MiniGPT model directory.

    SRC: a Hugging Face directory (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM;
    single-file or sharded safetensors; fp32/fp16/bf16), a llama or qwen2 GGUF file, or a llama2.c .bin checkpoint
    (its tokenizer.model / tok*.bin is taken from the same folder). Every command that takes a checkpoint also accepts
    SRC directly. OUT may be new, empty, or an earlier output of minigpt; OUT that is, holds or lies inside SRC (or
    --tokenizer), a file, or a directory of other files is refused before anything is read or written.
    """
    import torch

    from minigpt.checkpoint.atomic import check_output_dir
    from minigpt.checkpoint.native import import_model, resolve_checkpoint

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    src = resolve_checkpoint(args.src)
    check_output_dir(args.out, [args.src, src, args.tokenizer])
    path = import_model(src, args.out, args.tokenizer, dtypes[args.dtype])
    print(f"wrote {path}")
    return 0


def register(sub) -> None:
    """Add this module's commands to the ``minigpt`` sub-parsers ``sub``."""
    p = add_command(sub, "quantize", cmd_quantize)
    p.add_argument("ckpt", help="run dir, checkpoint dir, HF model dir, .gguf or llama2.c .bin")
    p.add_argument("out", help="output model directory (quantized weights + their scales, tokenizer files)")
    p.add_argument("--dtype", default="int8", choices=["int8", "int4"],
                   help="int8: per-output-channel (default); int4: groups of --group-size (llama.cpp's Q4_0)")
    p.add_argument("--group-size", dest="group_size", type=int, default=32,
                   help="inputs per int4 scale, a multiple of 8 (default 32, as Q4_0)")

    p = add_command(sub, "export", cmd_export)
    p.add_argument("ckpt", help="run dir, checkpoint dir, HF model dir, .gguf or llama2.c .bin")
    p.add_argument("out", help="output directory (or .gguf file for --format gguf)")
    p.add_argument("--format", required=True, choices=["hf", "gguf"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "q8_0"],
                   help="weight type (q8_0: gguf only)")
    p.add_argument("--max-shard-size", dest="max_shard_size", default="5GB",
                   help="largest safetensors file for --format hf, e.g. 500MB (default 5GB)")

    p = add_command(sub, "import", cmd_import)
    p.add_argument("src", help="HF model dir, .gguf file or llama2.c .bin file")
    p.add_argument("out", help="MiniGPT model directory to write")
    p.add_argument("--tokenizer", help="tokenizer.json / tokenizer.model to use instead of the source's")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
