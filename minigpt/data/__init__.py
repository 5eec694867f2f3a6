"""Training data: corpus sources read as streams (:mod:`~minigpt.data.sources`, :mod:`~minigpt.data.text`), their
preparation into token files (:mod:`~minigpt.data.prepare`, :mod:`~minigpt.data.pipeline`) and the reading of
prepared directories: splits, batches, evaluation windows, bits per byte (:mod:`~minigpt.data.loader`).

``minigpt.data.prepare`` is the module (``minigpt.data.prepare.prepare(...)`` prepares a corpus): its function is
not re-exported here, where it would hide the module of the same name.
"""
from minigpt.data.loader import META_FILE, BatchSampler, bits_per_byte, eval_windows, load_meta, load_split
from minigpt.data.prepare import DEFAULT_TOKENIZER_SAMPLE_BYTES, default_workers
from minigpt.data.sources import (
    BUNDLED,
    SOURCE_DEFAULT,
    SPLITS,
    Piece,
    Source,
    iter_documents,
    iter_pieces,
    iter_split,
    resolve_source,
)

__all__ = ["BUNDLED", "DEFAULT_TOKENIZER_SAMPLE_BYTES", "META_FILE", "SOURCE_DEFAULT", "SPLITS", "BatchSampler",
           "Piece", "Source", "bits_per_byte", "default_workers", "eval_windows", "iter_documents", "iter_pieces",
           "iter_split", "load_meta", "load_split", "resolve_source"]
