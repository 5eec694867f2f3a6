"""What one ``minigpt serve`` serves, by the names clients send in ``model``: the base model (merged with one
LoRA adapter, ``--adapter DIR``) or the base and several LoRA adapters over it (``--adapter name=DIR``, batched
together per row: :mod:`minigpt.infer.adapters`), with the engine built around them and the ``/v1/models`` list.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from minigpt.checkpoint.adapter import load_merged, read_adapter
from minigpt.errors import MiniGPTError, shown_json
from minigpt.infer.engine import Engine
from minigpt.infer.fastpath import FastPath
from minigpt.runtime import DTYPES, pick_device, run_in_thread
from minigpt.serve.schemas import ApiError, bad_request
from minigpt.tokenizer.tokenizer import Tokenizer


def load_engine(ckpt: Path, tokenizer: Tokenizer, adapter: Optional[str] = None,
                adapters: Optional[dict[str, str]] = None, device: str = "auto", dtype: str = "float32",
                base_name: Optional[str] = None, compile: int = 0, **engine_kw: Any) -> Engine:
    """The engine serving the model at ``ckpt``: with the PEFT folder ``adapter`` merged in, or with the PEFT
    folders ``adapters`` (name -> folder) served per request over the unmerged base (``base_name``: the base's
    model name, which no adapter may take). ``compile``: up to that many running requests (0: none; ``True``: one)
    decode through the compiled step of `minigpt generate --compile` (saved per machine and batch size as an
    AOTInductor package on a CPU), compiled or loaded here for batch sizes 1, 2, 4, ... up to it
    (:meth:`Engine.warm_up`; ignored with ``adapters``, which the compiled step does not apply). ``engine_kw``
    go to :class:`Engine`. Raises :class:`MiniGPTError` for an unreadable model or adapter, an adapter made for another
    base, an adapter name that is blank or holds control characters, or a tokenizer larger than the model's
    vocabulary.

    Built in a thread that ends (:func:`~minigpt.runtime.run_in_thread`), so that the engine's worker is the
    process's one OpenMP team."""
    return run_in_thread(_build_engine, ckpt, tokenizer, adapter, adapters, device, dtype, base_name, compile,
                         **engine_kw)


def _build_engine(ckpt: Path, tokenizer: Tokenizer, adapter: Optional[str], adapters: Optional[dict[str, str]],
                  device: str, dtype: str, base_name: Optional[str], compile: int, **engine_kw: Any) -> Engine:
    if adapter is not None and adapters:
        raise MiniGPTError("--adapter DIR (merged) and --adapter NAME=DIR (served by name) do not mix; name them all")
    if base_name in (adapters or {}):
        raise MiniGPTError(f"adapter name '{base_name}' is the base model's name; choose another")
    for name in adapters or {}:
        # A newline or other control character would split the start-up and log lines that name the adapters, and
        # a blank name cannot be told apart from another in /v1/models.
        if not name.strip() or not name.isprintable():
            raise MiniGPTError(f"adapter name {name!r} must be printable text, not blank; choose another")
    model = load_merged(ckpt, adapter, device=pick_device(device), dtype=DTYPES[dtype])
    if tokenizer.vocab_size > model.config.vocab_size:
        raise MiniGPTError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                           f"{model.config.vocab_size} embeddings")
    weights = {name: read_adapter(model, folder) for name, folder in (adapters or {}).items()}
    if compile and not weights:
        model = FastPath(model, compile=True, aoti=True)  # AOTInductor packages on a CPU, torch.compile elsewhere
    engine = Engine(model, tokenizer, adapters=weights or None, mirror_rows=max(int(compile), 1), **engine_kw)
    engine.warm_up()
    return engine


def describe_engine(engine: Engine, context_given: bool) -> str:
    """The start-up line of ``minigpt serve`` on the engine's memory: slots, context, prefix cache, adapters, and
    the compiled step's compile (or load) time."""
    capped = "" if engine.max_seq_len == engine.model_context or context_given else (
        f"; the model's {engine.model_context:,} tokens do not fit half the free memory: --context sets it")
    prefix = f"{engine.prefix.budget_bytes / 2**20:,.1f} MiB" if engine.prefix else "off"
    line = (f"KV cache: {engine.max_batch_size} slots x {engine.max_seq_len:,} tokens = "
            f"{engine.kv_cache_bytes / 2**20:,.1f} MiB (context {engine.max_seq_len:,}{capped}); prefix cache: {prefix}")
    if engine.adapter_names:
        line += "; adapters: " + ", ".join(engine.adapter_names)
    mirror = engine.mirror
    if mirror is not None:
        rows = "a lone request decodes" if mirror.max_rows == 1 else f"up to {mirror.max_rows} running requests decode"
        line += f"; {rows} through the compiled step (batch sizes {', '.join(map(str, mirror.sizes))}, compiled " \
                f"or loaded in {engine.model.compile_seconds:.1f} s; its mirror takes up to " \
                f"{mirror.max_bytes() / 2**20:,.1f} MiB)"
    return line


def resolve_model(model: Any, base_name: str, adapter_names: list[str]) -> Optional[str]:
    """The adapter a request's ``model`` field names: None for the base model (or no ``model``), else the adapter's
    name. Raises an :class:`~minigpt.serve.schemas.ApiError` 400 ``model_not_found`` (OpenAI's error body) for any
    other name, or a non-string."""
    if model is None or model == base_name:
        return None
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model in adapter_names:
        return model
    served = ", ".join(f"'{n}'" for n in [base_name, *adapter_names])
    # Quoted cut short: the error echoes what the client sent, which may be megabytes.
    raise bad_request(f"the model {shown_json(model)} does not exist; this server serves {served}", "model",
                      "model_not_found")


def model_list(base_name: str, adapter_names: list[str], created: int) -> dict[str, Any]:
    """The body of ``GET /v1/models``: OpenAI's list of model objects, the base first, then each adapter with
    ``parent`` naming the base (as vLLM lists its LoRA modules)."""
    cards = [{"id": base_name, "object": "model", "created": created, "owned_by": "minigpt"}]
    cards += [{"id": name, "object": "model", "created": created, "owned_by": "minigpt", "parent": base_name}
              for name in adapter_names]
    return {"object": "list", "data": cards}


def model_card(model_id: str, base_name: str, adapter_names: list[str], created: int) -> dict[str, Any]:
    """The body of ``GET /v1/models/{model}`` (OpenAI's retrieve-model): the object :func:`model_list` lists under
    that ``id``. Raises :class:`~minigpt.serve.schemas.ApiError` 404 (``model_not_found``, as OpenAI answers) for
    a name this server does not serve."""
    for card in model_list(base_name, adapter_names, created)["data"]:
        if card["id"] == model_id:
            return card
    served = ", ".join(f"'{n}'" for n in [base_name, *adapter_names])
    raise ApiError(404, f"the model {shown_json(model_id)} does not exist; this server serves {served}",
                   "invalid_request_error", "model", "model_not_found")
