"""The inference fast path: fused projections, a lean functional forward, a GQA-aware single-token attention, and
an optional ``torch.compile``\\ d decode step over a static KV cache.

:class:`FastPath` wraps a :class:`~minigpt.model.transformer.Transformer` (fp32, bf16, int8 or int4 weight-only) and computes
the same function as its ``forward`` -- to float rounding: fp32 logits agree within ``1e-5`` (tested) -- with fewer
kernels per token:

* **Fused projections** (as in vLLM and gpt-fast). ``wq``/``wk``/``wv`` become one ``[(n_heads + 2 n_kv_heads)
  head_dim, dim]`` matrix and the gate/up pair ``w1``/``w3`` one ``[2 hidden_dim, dim]`` matrix. The fusion happens
  once, here, and the model's own parameters are re-pointed to *row slices* of the fused matrix (a row slice of a
  contiguous matrix is itself contiguous), so no weight is stored twice and ``state_dict()`` keeps the checkpoint and
  Hugging Face key layout unchanged. One GEMM instead of three saves two kernel launches per layer, which is most of
  the cost of a decode step on small models, and feeds the BLAS wider matrices. (Training gains nothing consistent
  from it on this CPU -- 0.89-1.03x a step in `scripts/train_fusion_ab.py` runs, GEMM-bound -- so the training path
  is left unfused.)
* **One RoPE for q and k**: both are rotated in a single pass over the fused projection output by the model's own
  formula, :func:`~minigpt.model.rope.rope_rotate` (``rotate_half``'s sign folded into a sine table signed once).
* **GQA decode** (q_len 1): the ``n_heads`` queries are viewed as ``[batch, n_kv_heads, n_rep, head_dim]``, so the
  scores of a whole query group against its KV head are one product and the keys are never repeated
  (``repeat_interleave`` would copy the cache ``n_rep`` times per step).
* **Last position only** in prefill (``last_only``): generation needs the logits of one position, so the LM head
  gets one row, and so does most of the last layer: it still projects every position's key and value (the cache
  needs them), but its attention, output projection and FFN run for the last query alone. Exact, not an
  approximation: no other position's output of the last layer reaches those logits.
* **float32 activations** whatever the weight dtype (:data:`ACT_DTYPE`): bf16, int8 and int4 are storage formats of the
  weights, converted as they are read; the KV cache and the residual stream stay float32.
* **Compiled decode step** (``compile=True``), the one that is fast on a CPU:

  - static shapes: the cache (:class:`LayerKVCache`, one tensor per layer) has a fixed length rounded up to
    :data:`CACHE_BUCKET`; the write position and the per-row left padding are tensors; each query attends to every
    column under a mask. One graph serves every step of every generation of a given batch size and cache length.
    (Because every column costs, a generation through an AOTInductor package, which serves every length, starts
    its cache at the prompt and grows it: :func:`~minigpt.infer.generate.grown_cache_for`.)
  - matrix-vector products written as reductions (:func:`decode_linear`), which Inductor turns into its own
    vectorised loops: ~2x the bandwidth of MKL's ``gemv`` on one core, bf16 converted in the loop, a float matrix
    split into row blocks that one loop reads side by side, int8 read as float32 words and unpacked with shifts
    (:func:`int8_words`; int4's packed bytes likewise, 8 nibbles a word, the group scales applied once per word);
    attention likewise, fused with the mask and the softmax. Exceptions: on CPUs with AVX512-VNNI int8 weights go
    through FBGEMM's int8 x int8 product on activations rounded to 8 bits per row (:func:`~minigpt.infer.fastpath.library.w8a8_linear`, eager
    decode steps too), and on AVX-512 CPUs int4 weights through ATen's weight-only kernels on bf16 activations
    (:func:`~minigpt.infer.fastpath.library.aten_woq_layout`); ``woq_kernel="words"`` or
    ``MINIGPT_WOQ_KERNEL=words`` keeps the loops. A bf16 AOTInductor package's float products go through MiniGPT's
    C++ kernel instead (:mod:`~minigpt.infer.fastpath.float_mv`: the same speed, half the compile time).
  - each layer is one ``torch.compiler.nested_compile_region`` (:func:`~minigpt.infer.fastpath.step.step_layer`), compiled once and reused by
    every layer, and the per-layer caches are separate graph inputs, so compile time does not grow with depth
    (`small`: ~10 s cold, against ~85 s for the unrolled graph). The graph only reads the cache: it returns each
    layer's new key and value and :meth:`FastPath.decode_step` writes them (an in-graph write next to these
    regions corrupted the cache of multi-layer models under torch 2.13). The AOTInductor package's export calls
    the layers inline instead (:func:`~minigpt.infer.fastpath.step.decode_layer`): export would run Dynamo over
    each region call, and the package's code comes out the same.
  - per-call overhead trimmed: Dynamo's guards on the weights are dropped (:mod:`~minigpt.infer.fastpath.step`: a
    FastPath never rebinds them, and checking ~100 tensors per call cost ~0.3 ms), and so are Inductor's
    per-tensor size asserts; one region per layer rather than two halves the wrapper's Python work. Each FastPath
    compiles its own copy of the step's code object.
  - a few tokens per row at once (:meth:`FastPath.decode_tokens`, e.g. the k + 1 tokens a speculative verify
    scores): the same step with ``seq`` new tokens, each attending to the cache and, causally, to the new ones; up
    to :data:`DECODE_ROWS_MAX` rows in all the weights are still read once (a 5-token `small` step: 7.1 ms against
    3.8 ms for one token, where the eager forward takes 14.8 ms).

  - saved per machine and shape and loaded by later processes (:mod:`~minigpt.infer.fastpath.aot`); with
    ``aoti=True`` (``minigpt generate --compile`` on a CPU) as an AOTInductor package
    (:mod:`~minigpt.infer.fastpath.aoti`): Inductor's C++ wrapper instead of its Python one, loaded without
    importing Dynamo or Inductor.

  Compile time is measured (:attr:`FastPath.compile_seconds`, the first call of each new shape).

Architectures outside the fast path (non-RoPE positions, LayerNorm, post-norm, mixture of experts, dynamic NTK
RoPE, a sliding attention window shorter than the context, QK-norm, logit soft-capping) are run through the model's own ``forward``: :func:`supports` says which.

The block is the model's (:func:`~minigpt.model.transformer.pre_norm_residual` with
:func:`~minigpt.model.norm.rms_norm`, :func:`~minigpt.model.rope.rope_rotate` and
:func:`~minigpt.model.ffn.ffn_hidden`), called over the fused weights by the eager forward and by the compiled step
alike; what is the fast path's own is the projections (:mod:`~minigpt.infer.fastpath.kernels`), the attention cores
and the compiled step (:mod:`~minigpt.infer.fastpath.step`). The per-layer cache is
:class:`~minigpt.infer.kv_cache.LayerKVCache`.
"""
from minigpt.infer.fastpath.kernels import (
    ACT_DTYPE,
    DECODE_ROWS_MAX,
    LayerWeights,
    Proj,
    decode_linear,
    fuse_projections,
    int8_words,
    module_proj,
)
from minigpt.infer.fastpath.wrapper import CACHE_BUCKET, FastPath, load_for_inference, prepare, supports
from minigpt.infer.kv_cache import LayerKVCache

__all__ = ["ACT_DTYPE", "CACHE_BUCKET", "DECODE_ROWS_MAX", "FastPath", "LayerKVCache", "LayerWeights", "Proj",
           "decode_linear", "fuse_projections", "int8_words", "load_for_inference", "module_proj", "prepare",
           "supports"]
