"""LoRA adapters on disk in PEFT's format, so that ``peft.PeftModel.from_pretrained(hf_model, DIR)`` reads ours and
:func:`load_adapter` reads PEFT's.

A PEFT LoRA folder (``peft`` 0.13 - 0.21, ``PeftModel.save_pretrained``) holds

* ``adapter_config.json``: a ``LoraConfig`` (``peft_type: "LORA"``, ``task_type: "CAUSAL_LM"``, ``r``, ``lora_alpha``,
  ``lora_dropout``, ``target_modules``, ``bias: "none"``, ``fan_in_fan_out: false``, ``use_rslora``,
  ``rank_pattern`` / ``alpha_pattern`` for modules whose rank / alpha differ from ``r`` / ``lora_alpha``,
  ``modules_to_save`` for fully trained modules, ``base_model_name_or_path``...);
* ``adapter_model.safetensors``: for each adapted module of the Hugging Face model ``NAME`` (e.g.
  ``model.layers.0.self_attn.q_proj``) the tensors ``base_model.model.NAME.lora_A.weight`` ``[r, in]`` and
  ``...lora_B.weight`` ``[out, r]`` (PEFT drops the adapter name, ``default``, when saving), and for each module in
  ``modules_to_save`` its full weight, ``base_model.model.model.embed_tokens.weight`` / ``base_model.model.lm_head.weight``.

Module names go through :mod:`minigpt.interop.hf`'s renaming, so only this module knows PEFT's key layout.
Unsupported PEFT features (DoRA, trained biases, ``fan_in_fan_out`` Conv1D layouts, other adapter types) are refused
by name.
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from minigpt.checkpoint.atomic import atomic_dir, save_tensors
from minigpt.checkpoint.native import load_model
from minigpt.errors import MiniGPTError, read_json_object
from minigpt.interop.hf import from_hf_key, to_hf_key
from minigpt.model.lora import HF_TARGETS, LoRALinear, lora_layers, merge_lora
from minigpt.model.quant import Int8Linear
from minigpt.model.transformer import resize_token_embeddings

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModelForCausalLM.base_model (LoraModel) .model (the transformers model)
# Our full modules that an adapter may carry whole (PEFT's modules_to_save), by their Hugging Face name.
SAVEABLE_MODULES = {"embed_tokens": "tok_embeddings", "lm_head": "output"}
_LORA_KEY = re.compile(r"^(.+)\.lora_([AB])\.weight$")
# Our whole weights with a row per token: an adapter may carry more rows than its base (tokens added in training).
VOCAB_WEIGHTS = ("tok_embeddings.weight", "output.weight")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _hf_module(name: str) -> str:
    """Our module name -> the Hugging Face module name (``layers.0.attention.wq`` -> ``model.layers.0.self_attn.q_proj``)."""
    return to_hf_key(f"{name}.weight")[: -len(".weight")]


def _our_module(hf_name: str) -> str:
    try:
        return from_hf_key(f"{hf_name}.weight")[: -len(".weight")]
    except KeyError:
        raise MiniGPTError(f"adapter module {hf_name!r} has no MiniGPT counterpart") from None


def adapter_state_dict(model: nn.Module, modules_to_save: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's key names (see the module docstring), detached and contiguous.

    ``modules_to_save``: Hugging Face names from :data:`SAVEABLE_MODULES` whose whole weight is included.
    """
    sd = {}
    for name, layer in lora_layers(model).items():
        hf_name = _hf_module(name)
        sd[f"{PREFIX}{hf_name}.lora_A.weight"] = layer.lora_A.weight
        sd[f"{PREFIX}{hf_name}.lora_B.weight"] = layer.lora_B.weight
    for hf_name in modules_to_save:
        ours = SAVEABLE_MODULES[hf_name]
        sd[f"{PREFIX}{to_hf_key(f'{ours}.weight')}"] = model.get_submodule(ours).weight
    return {k: v.detach().contiguous() for k, v in sd.items()}


def adapter_config(model: nn.Module, base_model_name_or_path: Optional[str] = None,
                   modules_to_save: Iterable[str] = ()) -> dict[str, Any]:
    """``adapter_config.json`` contents for the adapters of ``model``: PEFT's ``LoraConfig`` fields.

    ``target_modules`` is the list of short names when every block has the same targets, else a regular expression
    matching exactly the adapted module names (PEFT full-matches a string against each module name). The most common
    rank / alpha become ``r`` / ``lora_alpha``; the others go to ``rank_pattern`` / ``alpha_pattern`` by full module
    name. Raises :class:`MiniGPTError` when ``model`` has no adapters.
    """
    layers = lora_layers(model)
    if not layers:
        raise MiniGPTError("the model has no LoRA adapters to save")
    hf_names = {name: _hf_module(name) for name in layers}
    ranks = Counter(m.lora_rank for m in layers.values())
    alphas = Counter(m.lora_alpha for m in layers.values())
    r, lora_alpha = ranks.most_common(1)[0][0], alphas.most_common(1)[0][0]
    short = sorted({n.rsplit(".", 1)[1] for n in hf_names.values()})
    n_layers = len(model.layers)
    every = {f"model.layers.{i}.{p}" for i in range(n_layers) for p in _short_paths(short)}
    if set(hf_names.values()) == every:
        target_modules: Any = short
    else:
        target_modules = "^(" + "|".join(re.escape(n) for n in sorted(hf_names.values())) + ")$"
    dropouts = {m.lora_dropout.p if isinstance(m.lora_dropout, nn.Dropout) else 0.0 for m in layers.values()}
    use_rslora = {m.use_rslora for m in layers.values()}
    if len(use_rslora) > 1:
        raise MiniGPTError("adapters mixing rank-stabilized and plain LoRA scaling cannot be saved in one PEFT config")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": lora_alpha,
        "lora_dropout": max(dropouts),
        "target_modules": target_modules,
        "exclude_modules": None,
        "bias": "none",
        "lora_bias": False,
        "fan_in_fan_out": False,
        "use_rslora": use_rslora.pop(),
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": list(modules_to_save) or None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {hf_names[n]: m.lora_rank for n, m in layers.items() if m.lora_rank != r},
        "alpha_pattern": {hf_names[n]: m.lora_alpha for n, m in layers.items() if m.lora_alpha != lora_alpha},
    }


def _short_paths(short: list[str]) -> list[str]:
    """HF short names -> their path inside a block (``q_proj`` -> ``self_attn.q_proj``)."""
    return [_hf_module(f"layers.0.{HF_TARGETS[s]}").split(".", 3)[3] for s in short]


def save_adapter(model: nn.Module, directory: str | Path, base_model_name_or_path: Optional[str] = None,
                 modules_to_save: Iterable[str] = ()) -> Path:
    """Atomically write ``model``'s LoRA adapters (and ``modules_to_save``) as a PEFT folder; returns it."""
    modules_to_save = list(modules_to_save)
    unknown = [m for m in modules_to_save if m not in SAVEABLE_MODULES]
    if unknown:
        raise MiniGPTError(f"cannot save {unknown} whole; modules_to_save may hold {', '.join(SAVEABLE_MODULES)}")
    config = adapter_config(model, base_model_name_or_path, modules_to_save)
    tensors = adapter_state_dict(model, modules_to_save)
    with atomic_dir(directory) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        save_tensors(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
    return Path(directory)


def read_adapter_config(directory: str | Path) -> dict[str, Any]:
    """``adapter_config.json`` of a PEFT LoRA folder, checked for features MiniGPT implements.

    Raises :class:`MiniGPTError` for a missing or invalid file, a non-LoRA adapter, DoRA, trained biases, or
    ``fan_in_fan_out``.
    """
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise MiniGPTError(f"{directory} is not a PEFT adapter folder: {CONFIG_NAME} is missing")
    config = read_json_object(path, what=" (a PEFT LoraConfig)")
    if config.get("peft_type") != "LORA":
        raise MiniGPTError(f"{path}: peft_type {config.get('peft_type')!r} is not supported; only LORA")
    refused = {"use_dora": (config.get("use_dora"), False), "bias": (config.get("bias", "none"), "none"),
               "lora_bias": (config.get("lora_bias", False), False),
               "fan_in_fan_out": (config.get("fan_in_fan_out", False), False)}
    for key, (value, supported) in refused.items():
        if value and value != supported:
            raise MiniGPTError(f"{path}: {key}={value!r} is not supported (MiniGPT loads plain LoRA: {key}="
                               f"{supported!r})")
    # The values used later, checked here so that a wrong type is one line naming the file, not a TypeError.
    for key in ("lora_alpha", "r"):
        value = config.get(key)
        if key in config and (value is None or isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise MiniGPTError(f"{path}: {key} must be a positive number, got {value!r}")
    for key in ("alpha_pattern", "rank_pattern"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise MiniGPTError(f"{path}: {key} must be an object mapping module names to values, "
                               f"got {config[key]!r}")
    for key, value in (config.get("alpha_pattern") or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise MiniGPTError(f"{path}: alpha_pattern[{key!r}] must be a positive number, got {value!r}")
    return config


def _pattern_value(pattern: dict[str, Any], hf_name: str, default: Any) -> Any:
    """PEFT's rank/alpha pattern lookup: the first key ``k`` for which ``hf_name`` matches ``(.*\\.)?k$``."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", hf_name):
            return value
    return default


def load_adapter(model: nn.Module, directory: str | Path) -> list[str]:
    """Wrap ``model``'s layers in :class:`LoRALinear` with the adapter weights of the PEFT folder ``directory``
    (and copy any ``modules_to_save`` weights), in place; the base stays frozen, the adapters trainable.

    Rank per module comes from the tensors' shapes (so ``rank_pattern`` needs no parsing); alpha from
    ``lora_alpha`` or ``alpha_pattern``. An adapter whose saved embedding / LM-head rows (``[V', dim]``) cover a
    vocabulary larger than the base's ``V`` (``minigpt sft`` adding the ChatML tokens, or a PEFT run after
    ``resize_token_embeddings``) first grows the base to ``V'`` rows
    (:func:`~minigpt.model.transformer.resize_token_embeddings`, tied weights staying tied) and then takes the saved
    rows, as PEFT does after the base is resized to the adapter's tokenizer; ``model.config.vocab_size`` becomes
    ``V'``. An untied base given only embedding rows gets mean-initialised LM-head rows. Returns our names of
    the adapted modules. Raises :class:`MiniGPTError` for an unreadable folder, an unsupported feature, a tensor
    with no MiniGPT counterpart, or a shape that does not fit the base model (one line naming the tensor and both
    shapes): any dimension but the vocabulary's differing, fewer vocabulary rows than the base's, or saved
    embedding and LM-head rows of different vocabularies.
    """
    config, pairs, whole, weights = _read_tensors(directory)
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise MiniGPTError("the model already has LoRA adapters; merge_lora first to load another")
    vocab_size = _adapter_vocab_size(model, whole, weights)
    if vocab_size is not None:
        resize_token_embeddings(model, vocab_size)  # the new rows are overwritten below
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for hf_name, ab in sorted(pairs.items()):
        names.append(_attach(model, hf_name, ab, config, weights))
    for name, value in whole.items():
        target = model.get_submodule(name.rsplit(".", 1)[0]).weight
        with torch.no_grad():
            target.copy_(value)
        target.requires_grad_(True)
    return names


def _adapter_vocab_size(model: nn.Module, whole: dict[str, torch.Tensor], weights: Path) -> Optional[int]:
    """The vocabulary size the whole tensors ``whole`` (our names) need the base ``model`` grown to, or None when
    they fit it as it is. Raises :class:`MiniGPTError` for a tensor that fits neither way."""
    grown = {}
    for name, value in whole.items():
        try:
            target = model.get_submodule(name.rsplit(".", 1)[0]).weight
        except AttributeError:
            raise MiniGPTError(f"{weights}: {name} does not exist in the base model") from None
        got, want = tuple(value.shape), tuple(target.shape)
        if name in VOCAB_WEIGHTS and len(got) == len(want) == 2:
            grown[name] = got[0]
            if got[1] != want[1]:
                raise MiniGPTError(f"{weights}: {name} has shape {got} but the base model's is {want} (adapter made "
                                   "for a base model of another width?)")
            if got[0] < want[0]:
                raise MiniGPTError(f"{weights}: {name} has shape {got}, {got[0]} vocabulary rows, but the base model's "
                                   f"is {want}; an adapter cannot shrink the vocabulary (adapter made for another "
                                   "base model?)")
        elif got != want:
            raise MiniGPTError(f"{weights}: {name} has shape {got} but the base model's is {want} (adapter made for "
                               "a different base model?)")
    if len(set(grown.values())) > 1:
        raise MiniGPTError(f"{weights}: the saved rows disagree on the vocabulary size: "
                           + ", ".join(f"{n} has {v}" for n, v in sorted(grown.items())))
    size = next(iter(grown.values()), None)
    return size if size is not None and size > model.tok_embeddings.weight.shape[0] else None


def adapter_vocab_size(directory: str | Path) -> Optional[int]:
    """The vocabulary size (rows) of the embedding / LM-head weights the PEFT folder ``directory`` carries whole
    (``modules_to_save``), or None when it carries neither. Raises :class:`MiniGPTError` for an unreadable
    folder."""
    _, _, whole, _ = _read_tensors(directory)
    rows = [v.shape[0] for n, v in sorted(whole.items()) if n in VOCAB_WEIGHTS and v.dim() == 2]
    return rows[0] if rows else None


def tokenizer_source(base: str | Path, adapter: str | Path | None = None) -> Path:
    """Where the tokenizer and chat template that go with the PEFT folder ``adapter`` over the model ``base`` are:
    the adapter folder when it holds a tokenizer, else its parent when that does (an SFT output's ``adapter/``
    sits next to the tokenizer with the tokens it added), else ``base``; ``adapter`` None gives ``base``. Read it
    with :func:`~minigpt.checkpoint.native.load_tokenizer` / ``load_chat_template``. Raises nothing."""
    if adapter is not None:
        for where in (Path(adapter), Path(adapter).parent):
            if any((where / name).is_file() for name in TOKENIZER_FILES):
                return where
    return Path(base)


def read_adapter(model: nn.Module, directory: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """The LoRA updates of the PEFT folder ``directory`` for ``model`` without touching it: ``{our module name:
    (A [rank, in], B [out, rank], scaling)}``, checked as :func:`load_adapter` checks them. For serving several
    adapters over one base (:mod:`minigpt.infer.adapters`). Raises :class:`MiniGPTError` as :func:`load_adapter`
    does, and for an adapter carrying whole modules (``modules_to_save``), which cannot be shared per row, naming
    the vocabulary it adds when it grows the base's."""
    config, pairs, whole, weights = _read_tensors(directory)
    vocab_size = _adapter_vocab_size(model, whole, weights)
    if vocab_size is not None:
        raise MiniGPTError(f"{directory} grows the vocabulary from {model.config.vocab_size} to {vocab_size} tokens "
                           "(its tokenizer added tokens); adapters served by name share the base's vocabulary and "
                           "tokenizer: serve it alone, merged: --adapter DIR")
    if whole:
        raise MiniGPTError(f"{directory} carries whole {', '.join(sorted(whole))} weights (modules_to_save); "
                           "serve it alone, merged: --adapter DIR")
    out = {}
    for hf_name, ab in sorted(pairs.items()):
        name, _, a, b, alpha = _checked_pair(model, hf_name, ab, config, weights)
        rank = a.shape[0]
        out[name] = (a, b, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank))
    return out


def _read_tensors(directory: str | Path):
    """``(config, {hf module: {"A": tensor, "B": tensor}}, {our name: whole tensor}, weights path)`` of a PEFT
    folder."""
    directory = Path(directory)
    config = read_adapter_config(directory)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise MiniGPTError(f"{directory} has no {WEIGHTS_NAME} (adapter_model.bin pickles are not read)")
    try:
        tensors = load_file(str(weights))
    except SafetensorError as e:
        raise MiniGPTError(f"{weights} is corrupt or truncated ({e})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    whole: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if not key.startswith(PREFIX):
            raise MiniGPTError(f"{weights}: unexpected tensor {key!r} (PEFT keys start with {PREFIX!r})")
        m = _LORA_KEY.match(key[len(PREFIX):])
        if m:
            pairs.setdefault(m.group(1), {})[m.group(2)] = value
            continue
        try:
            whole[from_hf_key(key[len(PREFIX):])] = value
        except KeyError:
            raise MiniGPTError(f"{weights}: tensor {key!r} has no MiniGPT counterpart") from None
    return config, pairs, whole, weights


def _attach(model: nn.Module, hf_name: str, ab: dict[str, torch.Tensor], config: dict[str, Any], weights: Path
            ) -> str:
    name, base, a, b, alpha = _checked_pair(model, hf_name, ab, config, weights)
    layer = LoRALinear(base, a.shape[0], alpha, float(config.get("lora_dropout") or 0.0),
                       bool(config.get("use_rslora")))
    with torch.no_grad():
        layer.lora_A.weight.copy_(a)
        layer.lora_B.weight.copy_(b)
    parent_name, child = name.rsplit(".", 1)
    setattr(model.get_submodule(parent_name), child, layer)
    return name


def _checked_pair(model: nn.Module, hf_name: str, ab: dict[str, torch.Tensor], config: dict[str, Any],
                  weights: Path) -> tuple[str, nn.Module, torch.Tensor, torch.Tensor, float]:
    """``(our name, base layer, A, B, alpha)`` of one adapted module, its shapes checked against the base."""
    if set(ab) != {"A", "B"}:
        raise MiniGPTError(f"{weights}: {hf_name} has lora_{''.join(ab)} but not both lora_A and lora_B")
    name = _our_module(hf_name)
    try:
        base = model.get_submodule(name)
    except AttributeError:
        raise MiniGPTError(f"{weights}: {hf_name} does not exist in the base model") from None
    if not isinstance(base, (nn.Linear, Int8Linear)):
        raise MiniGPTError(f"{weights}: {hf_name} is not a linear layer in the base model")
    a, b = ab["A"], ab["B"]
    rank = a.shape[0]
    expected = {"lora_A": (rank, base.in_features), "lora_B": (base.out_features, rank)}
    for part, t in (("lora_A", a), ("lora_B", b)):
        if tuple(t.shape) != expected[part]:
            raise MiniGPTError(f"{weights}: {hf_name}.{part} has shape {tuple(t.shape)} but the base model needs "
                               f"{expected[part]} (adapter made for a different base model?)")
    alpha = _pattern_value(config.get("alpha_pattern"), hf_name, config.get("lora_alpha", 8))
    return name, base, a, b, alpha


def load_merged(source: str | Path, adapter: str | Path | None = None, device: str | torch.device = "cpu",
                dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The model at ``source`` (anything :func:`~minigpt.checkpoint.native.load_model` reads) with the PEFT adapter
    folder ``adapter`` applied and merged (``W + B A * lora_alpha / r``), in eval mode: what ``generate``, ``chat``,
    ``serve`` and ``lora merge`` run; ``adapter`` None loads the model as it is. Raises :class:`MiniGPTError` for
    an unreadable adapter or one made for another base (shape mismatch)."""
    if adapter is None:
        return load_model(source, device=device, dtype=dtype)
    model = load_model(source, device=device)
    load_adapter(model, adapter)
    merge_lora(model)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(dtype=dtype or torch.float32).eval()
