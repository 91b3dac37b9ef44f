"""What every Hugging Face adapter shares: the ``transformers`` import, local configs,
packed samples (restarting positions, flash varlen boundaries), stage trees under the model's own parameter names, and
checkpoints in the Hugging Face layout (safetensors with the original keys).

Stages keep the full model's module paths (``model.language_model.layers.3.mlp...``), so a
stage's ``state_dict()`` is a slice of the full model's; the map between those names and
the keys of a checkpoint file comes from transformers' own conversion rules for the
installed version (:func:`checkpoint_keys`), never from a hand-written table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from dflop.models.decoder import packed_positions

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "StageTree",
    "checkpoint_keys",
    "load_config",
    "materialize",
    "load_stage_weights",
    "packed_decoder_inputs",
    "require_transformers",
    "tiny_decoder",
    "write_index",
    "write_shard",
]

SUPPORTED_TRANSFORMERS = ((5, 0), (6, 0))
"""Tested range of ``transformers`` versions: ``>= 5.0, < 6.0``."""


def require_transformers() -> Any:
    """The ``transformers`` module, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            'Hugging Face models need the optional dependency transformers: pip install "dflop[hf]"'
        ) from err
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= version < high:
        raise ImportError(
            f"transformers {transformers.__version__} is outside dflop's tested range "
            f">= {low[0]}.{low[1]}, < {high[0]}.{high[1]}"
        )
    return transformers


def load_config(path: str) -> Any:
    """The model config in the local folder ``path`` (its ``config.json``); never downloads."""
    transformers = require_transformers()
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"hf:{path}: no config.json in that folder")
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    return config


def tiny_decoder(vocab_size: int, text_layers: int) -> dict[str, Any]:
    """The tiny Qwen2 decoder of every family's tiny test model (hidden 64, 4 heads, 2 KV
    heads), as ``text_config`` entries."""
    return {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": text_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,  # Qwen2's: samples of 18k tokens fit
    }


# --------------------------------------------------------------------------- packing


def packed_decoder_inputs(
    config: Any, cu_seqlens: Tensor, total_tokens: int, device: torch.device
) -> tuple[Tensor, dict[str, Any] | None]:
    """``(position_ids [1, T], flash kwargs)`` for HF decoder layers over samples packed
    into one sequence: positions restart at every sample. Flash attention
    (``_attn_implementation`` starting with ``flash``) gets the varlen boundaries
    (``cu_seq_lens_q/k``, ``max_length_q/k``); other implementations None (the caller
    runs attention per sample)."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    positions = packed_positions(cu, total_tokens)[None]
    impl = str(getattr(config, "_attn_implementation", None) or "sdpa")
    if not impl.startswith("flash"):
        return positions, None
    max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    cu32 = cu.to(torch.int32)
    return positions, {
        "cu_seq_lens_q": cu32,
        "cu_seq_lens_k": cu32,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }


# --------------------------------------------------------------------------- stage trees


class StageTree(nn.Module):
    """A pipeline stage's modules under the full model's paths: ``attach("model.x.layers.3",
    module)`` makes the module's parameters ``model.x.layers.3.*`` in ``state_dict()``."""

    def attach(self, path: str, item: nn.Module | nn.Parameter) -> None:
        *parents, leaf = path.split(".")
        node: nn.Module = self
        for name in parents:
            child = node._modules.get(name)
            if child is None:
                child = nn.Module()
                node.add_module(name, child)
            node = child
        if isinstance(item, nn.Parameter):
            node.register_parameter(leaf, item)
        else:
            node.add_module(leaf, item)

    def find(self, path: str) -> Any:
        """The module or parameter at ``path`` (None when this stage does not hold it)."""
        node: Any = self
        for name in path.split("."):
            node = getattr(node, name, None)
            if node is None:
                return None
        return node


def carve(full: nn.Module, paths: Iterable[str]) -> StageTree:
    """A :class:`StageTree` holding the modules/parameters of ``full`` at ``paths``."""
    tree = StageTree()
    for path in paths:
        tree.attach(
            path, full.get_submodule(path) if _is_module(full, path) else _param(full, path)
        )
    return tree


def materialize(full: nn.Module, tree: StageTree) -> None:
    """Give the meta-device modules of ``tree`` (carved from ``full``, built on the meta
    device) real CPU storage. Parameters and persistent buffers are left to be loaded from
    a checkpoint; non-persistent buffers (position ids, rotary frequencies), which no
    checkpoint holds, are recomputed by the owning model's own ``_init_weights``."""
    from transformers import PreTrainedModel

    owners = [(name, m) for name, m in full.named_modules() if isinstance(m, PreTrainedModel)]
    tree.to_empty(device="cpu")
    for path, module in tree.named_modules():
        if not getattr(module, "_non_persistent_buffers_set", None):
            continue
        # The deepest PreTrainedModel above the module knows how to initialise it.
        owner = max(
            (m for name, m in owners if not name or path.startswith(name + ".")),
            key=lambda m: len(next(n for n, o in owners if o is m)),
        )
        with torch.no_grad():
            owner._init_weights(module)


def _is_module(full: nn.Module, path: str) -> bool:
    try:
        full.get_submodule(path)
    except AttributeError:
        return False
    return True


def _param(full: nn.Module, path: str) -> nn.Parameter:
    owner, _, name = path.rpartition(".")
    return getattr(full.get_submodule(owner) if owner else full, name)


def local_image_processor(folder: str | None) -> Any:
    """The image processor saved in ``folder`` (``preprocessor_config.json``), or None."""
    if folder is None or not os.path.isfile(os.path.join(folder, "preprocessor_config.json")):
        return None
    transformers = require_transformers()
    return transformers.AutoImageProcessor.from_pretrained(folder, local_files_only=True)


def local_tokenizer(folder: str | None) -> Any:
    """The tokenizer saved in ``folder`` (``tokenizer.json`` or ``tokenizer_config.json``),
    or None."""
    names = ("tokenizer.json", "tokenizer_config.json")
    if folder is None or not any(os.path.isfile(os.path.join(folder, n)) for n in names):
        return None
    transformers = require_transformers()
    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


# --------------------------------------------------------------------------- checkpoints


def checkpoint_keys(model: nn.Module) -> dict[str, str]:
    """``{parameter or buffer name in the model: key in a saved checkpoint}``, from
    transformers' own save-time conversion of ``model`` (build it on the meta device)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    by_id = {id(t): name for name, t in state.items()}
    reverted = revert_weight_conversion(model, dict(state))
    mapping: dict[str, str] = {}
    for key, tensor in reverted.items():
        name = by_id.get(id(tensor))
        if name is None:
            raise ValueError(
                f"checkpoint key {key!r} is not a plain rename of a parameter of "
                f"{type(model).__name__}: this transformers version converts weights in a "
                "way dflop's stage loader does not support"
            )
        mapping[name] = key
    # A tied weight is saved once, under its source's key (the head under the embedding).
    for target, source in tied_pairs(model).items():
        if source in mapping:
            mapping[target] = mapping[source]
    return mapping


def tied_pairs(model: nn.Module) -> dict[str, str]:
    """``{tied parameter: the parameter it is tied to}`` of a model whose config ties
    them (transformers' ``_tied_weights_keys``), else empty."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    pairs = getattr(model, "_tied_weights_keys", None) or {}
    return dict(pairs) if isinstance(pairs, dict) else {}


def tied_names(model: nn.Module) -> list[str]:
    """The parameters saved under another's key (:func:`tied_pairs`' targets)."""
    return list(tied_pairs(model))


def _checkpoint_files(folder: str) -> dict[str, str]:
    """``{checkpoint key: safetensors file}`` of the folder (one file or a sharded index)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {key: os.path.join(folder, name) for key, name in weight_map.items()}
    single = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(
            f"hf:{folder}: no model.safetensors or model.safetensors.index.json (weights)"
        )
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def has_weights(folder: str) -> bool:
    return any(
        os.path.isfile(os.path.join(folder, name))
        for name in ("model.safetensors", "model.safetensors.index.json")
    )


def load_stage_weights(stage: nn.Module, folder: str, keys: dict[str, str]) -> None:
    """Fill every parameter and persistent buffer of ``stage`` from the checkpoint in
    ``folder``, reading only this stage's tensors. ``keys`` maps the stage's names (the
    full model's) to checkpoint keys (:func:`checkpoint_keys`). A missing key or a shape
    that differs raises ``ValueError`` naming it."""
    from safetensors import safe_open

    files = _checkpoint_files(folder)
    wanted: dict[str, list[tuple[str, Tensor]]] = {}
    for name, tensor in stage.state_dict(keep_vars=True).items():
        key = keys.get(name)
        if key is None or key not in files:
            raise ValueError(f"hf:{folder}: the checkpoint has no tensor for {name!r}")
        wanted.setdefault(files[key], []).append((key, tensor))
    with torch.no_grad():
        for path, entries in wanted.items():
            with safe_open(path, "pt") as f:
                for key, tensor in entries:
                    value = f.get_tensor(key)
                    if tuple(value.shape) != tuple(tensor.shape):
                        raise ValueError(
                            f"hf:{folder}: {key!r} has shape {tuple(value.shape)}, the model "
                            f"expects {tuple(tensor.shape)} (does config.json match?)"
                        )
                    tensor.copy_(value.to(tensor.dtype))


def write_shard(folder: str, filename: str, tensors: dict[str, Tensor]) -> dict[str, str]:
    """Write ``tensors`` (checkpoint keys) to ``folder/filename`` as safetensors; returns
    their part of the index's ``weight_map``."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    data = {key: t.detach().to("cpu").contiguous() for key, t in tensors.items()}
    save_file(data, os.path.join(folder, filename), metadata={"format": "pt"})
    return dict.fromkeys(data, filename)


def write_index(folder: str, weight_map: dict[str, str]) -> None:
    """``model.safetensors.index.json`` over the shards ``weight_map`` names."""
    from safetensors import safe_open

    total = 0
    for name in sorted(set(weight_map.values())):
        with safe_open(os.path.join(folder, name), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sl = f.get_slice(key)
                count = 1
                for dim in sl.get_shape():
                    count *= int(dim)
                total += count * _DTYPE_BYTES.get(sl.get_dtype(), 4)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "BOOL": 1}
