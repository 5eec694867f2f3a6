"""The compiled decode step as an AOTInductor package: compiled once per machine and shape, then loaded by later
processes in milliseconds and run with no Python between its kernels.

Why (measured on a 2-core Xeon, SmolLM-135M's shape, docs/benchmarks.md): the ``torch.compile`` step of
:mod:`~minigpt.infer.fastpath.aot` is driven by Inductor's generated Python wrapper, which allocates, reinterprets
and launches ~20 buffers and kernels per layer on every token (about 1-2 ms a token at 135M), and loading a saved
step imports Dynamo and Inductor and re-links its kernels (1.7-5 s before the first token). An AOTInductor package
(PyTorch's guide "AOTInductor: Ahead-Of-Time Compilation for Torch.Export-ed Models") holds the same graph lowered
by Inductor with its C++ wrapper, built into one shared library: the call is a single C++ function, and loading
is a ``dlopen`` through ``torch._C._aoti.AOTIModelPackageLoader`` that imports neither Dynamo nor Inductor.

How: :class:`StepModule` exposes every tensor the step reads (:func:`step_tensors`: stable names such as
``l3_wqkv_words``) as a buffer and runs :func:`~minigpt.infer.fastpath.step.static_step` over them; it is
exported with ``torch.export`` and compiled with ``torch._inductor.aoti_compile_and_package`` *without* its
constants (``aot_inductor.package_constants_in_so=False``): the package holds code only (~4 MB at 135M), and
:class:`PackagedStep` hands it the FastPath's own tensors by name (``load_constants(..., user_managed=True)``: no
copy), so one package serves every checkpoint of the same shapes, as a saved ``.step`` does; the cache length is
left dynamic in the export, so one package also serves every cache length (:func:`_dynamic_shapes`). Its file
name is :func:`~minigpt.infer.fastpath.aot.step_key` without the cache length (torch version, sources, CPU flags,
batch and new tokens, every weight's dtype, shape and strides, threads) with the suffix ``.pt2``, in the same
directory and under the same trust rules.

Costs: a first compile takes longer than the ``torch.compile`` step's (export plus a C++ build of the whole
graph: 76-157 s at 135M on 2 cores, against 15-45 s), paid once per machine and batch shape. CPU only (other devices, and
any failure of export or compilation, fall back to :mod:`~minigpt.infer.fastpath.aot`'s saved step with one warning).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
import types
import warnings
from pathlib import Path

import torch
from torch import nn

from minigpt.infer.fastpath.kernels import DECODE_ROWS_MAX, LayerWeights, Proj
from minigpt.infer.fastpath.step import simd_options, static_greedy_step, static_prefill, static_step

SUFFIX = ".pt2"
_SLOTS = ("weight", "scale", "bias", "words", "word_scale")  # Proj's tensors (w8a8 is FBGEMM's packed object)
_PROJECTIONS = ("wqkv", "wo", "w13", "w2")
# The prompt rows a prefill package takes at once (StepModule(prefill=True)): at least one more than the rows of a
# decode step's reduction loops, so that every product is a GEMM (a caller pads a shorter prompt: columns past it
# are written and then overwritten before any step reads them), at most what keeps the attention's scores small
# ([n_heads, rows, cache columns] floats per layer).
PREFILL_ROWS_MIN = DECODE_ROWS_MAX + 1
PREFILL_ROWS_MAX = 512


def step_projections(fp) -> dict:
    """The projections of FastPath ``fp`` by the prefix of their tensors' names in :func:`step_tensors`: ``head``,
    then ``l{i}_wqkv``, ``l{i}_wo``, ``l{i}_w13``, ``l{i}_w2`` per layer."""
    projections = {"head": fp.head}
    for i, lw in enumerate(fp.layers):
        projections.update({f"l{i}_{name}": getattr(lw, name) for name in _PROJECTIONS})
    if getattr(fp, "screen", None) is not None:  # the head's int8 screen (greedy steps)
        projections["screen"] = fp.screen.proj
    return projections


def step_tensors(fp) -> dict[str, torch.Tensor]:
    """Every tensor the compiled steps of FastPath ``fp`` read, by a stable name (``embedding``, ``cos``,
    ``head_weight``, ``l0_attn_norm``, ``l0_wqkv_words``, ..., and for the greedy step ``screen_words``,
    ``screen_scale``, ``screen_bound``): the packages' constants. A projection's ``weight``
    is left out when its ``words`` replace it (the step reads one or the other, see ``step._proj_args``)."""
    named = {"embedding": fp.embedding, "final_norm": fp.final_norm, "cos": fp.cos, "sin_signed": fp.sin_signed}
    for i, lw in enumerate(fp.layers):
        named[f"l{i}_attn_norm"], named[f"l{i}_ffn_norm"] = lw.attn_norm, lw.ffn_norm
    for prefix, p in step_projections(fp).items():
        for slot in _SLOTS:
            t = getattr(p, slot)
            if t is not None and not (slot == "weight" and p.words is not None):
                named[f"{prefix}_{slot}"] = t
    if getattr(fp, "screen", None) is not None:
        named["screen_bound"] = fp.screen.bound
    return named


class StepModule(nn.Module):
    """:func:`~minigpt.infer.fastpath.step.static_step` of FastPath ``fp`` as a module whose buffers are
    :func:`step_tensors` (not copies): what ``torch.export`` traces. ``forward(token [batch, seq], input_pos [1],
    pad [batch], k_cache, v_cache)`` -> ``(logits [batch, seq, vocab],)``, with ``greedy``
    :func:`~minigpt.infer.fastpath.step.static_greedy_step`'s ``(next, h)``, with ``prefill``
    :func:`~minigpt.infer.fastpath.step.static_prefill`'s cache columns only and ``(columns [seq],)`` (int64: the
    columns written; a package must return something); the new tokens' keys and values are
    written into ``k_cache`` / ``v_cache`` (per layer ``[batch, n_kv_heads, T, head_dim]``) at columns
    ``input_pos .. input_pos + seq - 1`` inside the graph.

    Why inside: outside, the caller made ``2 * n_layers`` small copies per token, each a dispatch through ATen
    (0.18 ms a token at SmolLM-135M's shape, ~4 % of an int4 step; session 57, docs/benchmarks.md). In the
    package the write is one scatter of the new columns per cache, in place on the caller's tensors (AOTInductor
    keeps a user input's in-place mutation on that input, bounds-checked). The ``torch.compile`` step keeps its
    writes outside: its nested compile regions corrupted the cache when they wrote it (step.static_step)."""

    def __init__(self, fp, greedy: bool = False, prefill: bool = False) -> None:
        super().__init__()
        self.__dict__["fp"] = fp  # not a submodule: only the step's structure (eps, geometry) is read from it
        self.greedy, self.prefill = greedy, prefill
        for name, t in step_tensors(fp).items():
            self.register_buffer(name, t, persistent=False)

    def _proj(self, prefix: str) -> Proj:
        return Proj(*(getattr(self, f"{prefix}_{slot}", None) for slot in _SLOTS))

    def forward(self, token, input_pos, pad, k_cache, v_cache):
        fp = self.fp
        # The same structure as fp, its tensors read through this module's buffers, so that export names them.
        layers = [LayerWeights(getattr(self, f"l{i}_attn_norm"), getattr(self, f"l{i}_ffn_norm"),
                               *(self._proj(f"l{i}_{name}") for name in _PROJECTIONS), lw.attn_norm_eps,
                               lw.ffn_norm_eps) for i, lw in enumerate(fp.layers)]
        view = types.SimpleNamespace(embedding=self.embedding, final_norm=self.final_norm, cos=self.cos,
                                     sin_signed=self.sin_signed, final_eps=fp.final_eps, geometry=fp.geometry,
                                     head=self._proj("head"), layers=layers)
        if self.greedy and not self.prefill:
            view.screen = types.SimpleNamespace(proj=self._proj("screen"), bound=self.screen_bound,
                                                native=fp.screen.native)
        columns = input_pos + torch.arange(token.shape[1], device=token.device)
        if self.prefill:  # the cache columns alone; the package returns the columns it wrote (it must return one)
            new_k, new_v = static_prefill(view, token, input_pos, pad, k_cache, v_cache, regions=False)
            first, rest = columns, []
        else:
            step = static_greedy_step if self.greedy else static_step
            first, new_k, new_v, *rest = step(view, token, input_pos, pad, k_cache, v_cache, regions=False)
        for cache_k, cache_v, k, v in zip(k_cache, v_cache, new_k, new_v):
            cache_k.index_copy_(2, columns, k)
            cache_v.index_copy_(2, columns, v)
        return (first, *rest)


# A compile killed midway (Ctrl-C in a first `generate --compile`) leaves its temporary file behind; one still
# being written by another process is younger than this.
PARTIAL_MAX_AGE_S = 24 * 3600


def remove_stale_partials(directory: Path, max_age_s: float = PARTIAL_MAX_AGE_S) -> list[Path]:
    """Delete the temporary files (``.partial-*.pt2``) of :func:`export_package` in ``directory`` last modified more
    than ``max_age_s`` seconds ago; returns those removed. Never raises for a file that vanished meanwhile."""
    removed, now = [], time.time()
    for leftover in directory.glob(f".partial-*{SUFFIX}"):
        try:
            if now - leftover.stat().st_mtime > max_age_s:
                leftover.unlink()
                removed.append(leftover)
        except FileNotFoundError:
            pass
    return removed


def _dynamic_shapes(example_args: tuple, prefill: bool = False) -> dict:
    """``torch.export``'s ``dynamic_shapes`` for the step's arguments: every shape static but the caches' length
    (dimension 2 of each ``[batch, n_kv_heads, T, head_dim]``), one symbol shared by all layers, and with ``prefill``
    the number of prompt rows (dimension 1 of ``token``, ``PREFILL_ROWS_MIN`` to ``PREFILL_ROWS_MAX``).

    Why: the cache length is the prompt plus the new tokens rounded up to ``CACHE_BUCKET``, so a static one made
    every new bucket (a longer prompt, another ``--max-new-tokens``) cost a first compile of 76-157 s at 135M on 2
    cores. Measured there (2 threads, cache of 192 columns, the same step exported both ways, 7 interleaved rounds
    of 128 greedy tokens): int4 76.37 against 74.18 tokens/s static, fp32 32.31 against 31.30 (1.03x both, within
    the host's noise), the same tokens and, for one step, the same logits to the bit."""
    length = torch.export.Dim("cache_len", min=2)
    _, _, _, k_cache, v_cache = example_args
    # A prefill package's prompt rows too: from PREFILL_ROWS_MIN, so that every product takes its many-rows path.
    rows = {1: torch.export.Dim("rows", min=PREFILL_ROWS_MIN, max=PREFILL_ROWS_MAX)} if prefill else None
    return {"token": rows, "input_pos": None, "pad": None, "k_cache": [{2: length}] * len(k_cache),
            "v_cache": [{2: length}] * len(v_cache)}


@contextlib.contextmanager
def _exporting():
    """No autograd, and none of the warnings torch 2.13's own pytree code raises many times over while exporting
    and packaging (``isinstance(treespec, LeafSpec)`` is deprecated): nothing a user of the package can act on."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        yield


def export_step(fp, example_args: tuple, greedy: bool = False, prefill: bool = False) -> torch.export.ExportedProgram:
    """``torch.export`` of :class:`StepModule` (``greedy``: the screened greedy step; ``prefill``: the prefill
    package's module) of FastPath ``fp`` for the shapes of ``example_args`` (``token``, ``input_pos``, ``pad``,
    ``k_cache``, ``v_cache``), the cache length left dynamic (:func:`_dynamic_shapes`), and with ``prefill`` the
    number of tokens too: what :func:`export_package` compiles. Raises whatever export raises."""
    with _exporting():
        return torch.export.export(StepModule(fp, greedy, prefill), example_args,
                                   dynamic_shapes=_dynamic_shapes(example_args, prefill), strict=False)


def export_package(fp, example_args: tuple, path: Path, greedy: bool = False, prefill: bool = False) -> None:
    """Export the step (:func:`export_step`) and compile it into an AOTInductor package at ``path``, written to a
    temporary file and renamed (readable by this user only); stale temporary files of killed compiles are removed
    first (:func:`remove_stale_partials`). Raises whatever export or Inductor raise."""
    # torch._inductor is one of torch's lazily imported modules: the heavy import happens here, when compiling.
    configs = {"aot_inductor.package_constants_in_so": False, "size_asserts": False, **simd_options()}
    if fp.compile_mode is not None:
        configs.update(torch._inductor.list_mode_options(fp.compile_mode))
    remove_stale_partials(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=".partial-", suffix=SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        exported = export_step(fp, example_args, greedy, prefill)
        with _exporting():
            torch._inductor.aoti_compile_and_package(exported, package_path=tmp, inductor_configs=configs)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class PackagedStep:
    """A step package (:func:`export_package`) bound to the tensors of FastPath ``fp``: called like the compiled
    step, ``(token, input_pos, pad, k_cache, v_cache) -> (logits, [], [])`` (a greedy step: ``(next, [], [], h)``),
    the new keys and values already written into the caches (:attr:`writes_cache`; see :class:`StepModule`).
    Raises ``ValueError`` when the
    package names a tensor ``fp`` does not have (a package of another structure), else whatever the loader raises
    for an unreadable file."""

    writes_cache = True  # the caller must not write the new columns again (FastPath._run_step)

    def __init__(self, path: Path, fp) -> None:
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        tensors = step_tensors(fp)
        names = list(self.loader.get_constant_fqns())
        unknown = sorted(set(names) - set(tensors))
        if unknown:
            raise ValueError(f"the package reads tensors this model does not have: {', '.join(unknown[:5])}")
        # user_managed: the library reads fp's own tensors (no copy); self.constants keeps them alive.
        self.constants = {name: tensors[name] for name in names}
        self.loader.load_constants(self.constants, False, True, True)

    def __call__(self, token, input_pos, pad, k_cache: list, v_cache: list):
        out = self.loader.boxed_run([token, input_pos, pad, *k_cache, *v_cache])
        return (out[0], [], [], *out[1:])

