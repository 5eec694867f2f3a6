"""`minigpt prepare` and `minigpt tokenizer`: corpora into token shards, tokenizers."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from minigpt.cli.common import add_command
from minigpt.errors import MiniGPTError
from minigpt.paths import check_dir_path


def cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenize a corpus into train.bin / val.bin token shards (numpy memmaps) plus meta.json.

    --data is a bundled corpus (shakespeare, tang-poems), a .txt / .jsonl / .parquet file, a directory saved by
    `datasets`, a dataset name, or hf:NAME[:CONFIG][:SPLIT] to stream a Hugging Face dataset (hub names need
    network access; a local directory of parquet/jsonl files works offline). Without --tokenizer a byte-level BPE
    of --vocab-size tokens is trained on the first --tokenizer-sample-bytes of the training split and saved as
    tokenizer.json in --out-dir.

    The input is streamed with bounded memory whatever its size, and tokenized in --workers processes (the output
    is byte-identical for any number). Progress goes to stderr (a bar on a terminal, else a line every 15 s), then
    one line with the throughput in MB/s of input text; stdout gets the meta.json contents. An interrupted run can
    simply be re-run, and one that fails leaves a directory prepared before as it was: the new tokenizer and token
    files are renamed into place only when every split is complete. Options and the source are
    checked before --out-dir is created, and a run that fails removes the directory again if it made it.
    """
    from minigpt.data import prepare as data
    from minigpt.tokenizer.tokenizer import Tokenizer

    check_dir_path(args.out_dir, "--out-dir")
    if not args.tokenizer:
        _check_vocab_size(args.vocab_size)
    tok = Tokenizer.from_file(args.tokenizer) if args.tokenizer else None
    sample = (data.DEFAULT_TOKENIZER_SAMPLE_BYTES if args.tokenizer_sample_bytes is None
              else _parse_size(args.tokenizer_sample_bytes, "--tokenizer-sample-bytes"))
    meta = data.prepare(args.data, args.out_dir, tokenizer=tok, vocab_size=None if tok else args.vocab_size,
                        val_fraction=args.val_fraction, seed=args.seed, workers=args.workers,
                        tokenizer_sample_bytes=sample, progress=True)
    print(json.dumps(meta, indent=2))
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    """Train a byte-level BPE tokenizer (special tokens <|endoftext|>, <|pad|>) on text files; writes tokenizer.json.

    --out is the file to write (an existing directory: tokenizer.json in it); a path under a file is refused before
    training.
    """
    from minigpt.data.sources import iter_documents, resolve_source
    from minigpt.tokenizer.tokenizer import train_tokenizer

    out = Path(args.out)
    check_dir_path(out.parent, f"--out {out}: its folder")  # before the training, which can take long

    def texts():
        for f in args.files:
            yield from iter_documents(resolve_source(f))

    _check_vocab_size(args.vocab_size)
    tok = train_tokenizer(texts(), args.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(out)
    print(f"wrote {args.out} ({tok.vocab_size} tokens)")
    return 0


def register(sub) -> None:
    """Add this module's commands to the ``minigpt`` sub-parsers ``sub``."""
    p = add_command(sub, "prepare", cmd_prepare)
    p.add_argument("--data", required=True, help="bundled corpus name or path")
    p.add_argument("--out-dir", dest="out_dir", required=True)
    p.add_argument("--tokenizer", help="an existing tokenizer.json (else one is trained)")
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=4096)
    p.add_argument("--val-fraction", dest="val_fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1234, help="seed of the document-level validation split")
    p.add_argument("--workers", type=int,
                   help="tokenizer processes (default: the usable CPU cores up to 8, or 1 with 2 cores or fewer)")
    p.add_argument("--tokenizer-sample-bytes", dest="tokenizer_sample_bytes", metavar="SIZE",
                   help="train the tokenizer on the first SIZE bytes of the training split, e.g. 500MB or 2GB; "
                        "0 = all of it (default 200MB)")

    tok = sub.add_parser("tokenizer", help="tokenizer tools").add_subparsers(dest="tokenizer_command", required=True)
    p = add_command(tok, "train", cmd_tokenizer_train)
    p.add_argument("files", nargs="+", help="text files or bundled corpus names")
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=4096)
    p.add_argument("--out", default="tokenizer.json")


def _check_vocab_size(vocab_size: int) -> None:
    """:func:`~minigpt.tokenizer.tokenizer.check_vocab_size` worded with the flag. Raises :class:`MiniGPTError`."""
    from minigpt.tokenizer.tokenizer import check_vocab_size

    try:
        check_vocab_size(vocab_size, "--vocab-size")
    except ValueError as e:
        raise MiniGPTError(str(e)) from None


def _parse_size(text, what: str) -> int:
    # minigpt.runtime imports torch: loaded when a command needs it, so that `import minigpt.cli` stays torch-free
    # (the native launcher, minigpt.cli.quick, runs before torch is imported).
    from minigpt.runtime import parse_size

    return parse_size(text, what)
