"""What every Hugging Face family's spec and stages share: building a rank's stage from a
seeded init or a checkpoint folder, writing checkpoints in the Hugging Face layout, the
architecture description of a decoder, and the packed LLM computations (layers over
samples packed into one sequence, the summed next-token loss).

A family subclasses :class:`HFSpec` (``stage_paths``, the stage classes, its
architecture) and :class:`HFStage` for its stages.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor, nn

from dflop.models.decoder import IGNORE_INDEX, merge_visual_features, next_token_targets
from dflop.models.hf.common import (
    StageTree,
    carve,
    checkpoint_keys,
    has_weights,
    load_stage_weights,
    materialize,
    packed_decoder_inputs,
    tied_names,
    write_index,
    write_shard,
)
from dflop.models.loss import DEFAULT_LOSS_CHUNK_TOKENS, chunked_lm_loss
from dflop.models.spec import ModelSpec, StageInfo

_SEEDED_BUILD = threading.Lock()

__all__ = ["HFSpec", "HFStage", "decoder_architecture"]


def decoder_architecture(name: str, text: Any, num_layers: int) -> Any:
    """The :class:`~dflop.data.costs.LLMConfig` of a transformers decoder config."""
    from dflop.data.costs import LLMConfig

    head_dim = getattr(text, "head_dim", None)
    default = text.hidden_size // text.num_attention_heads
    return LLMConfig(
        name=name,
        hidden_size=text.hidden_size,
        num_layers=num_layers,
        intermediate_size=text.intermediate_size,
        num_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads,
        vocab_size=text.vocab_size,
        head_dim=None if head_dim in (None, default) else int(head_dim),
    )


class HFSpec(ModelSpec):
    """A transformers model class + config (random init for a seed) or a local checkpoint
    folder (``checkpoint_dir``, safetensors in the Hugging Face layout). Subclasses set
    ``model_class``, ``config``, the :class:`~dflop.models.spec.ModelSpec` attributes,
    ``encoder_stage`` / ``llm_stage`` (their :class:`HFStage` classes) and implement
    :meth:`stage_paths`."""

    model_class: Any
    config: Any
    checkpoint_dir: str | None = None
    encoder_stage: type[HFStage]
    llm_stage: type[HFStage]

    def stage_paths(
        self, module: str, first: int, end: int, first_stage: bool, last: bool
    ) -> list[str]:
        """The full model's paths (modules or parameters) a stage holds."""
        raise NotImplementedError

    def text_encoding(self, reserved: tuple[int, ...]) -> tuple[Any, Any]:
        """``(encode, chat template)`` of the records' text: the checkpoint folder's
        tokenizer (with its ChatML template when it has the tokens), else
        :func:`~dflop.models.hf.records.byte_encoder` over the vocabulary minus
        ``reserved`` (the visual token ids) and no template."""
        from dflop.models.hf.common import local_tokenizer
        from dflop.models.hf.records import ChatTemplate, byte_encoder

        tokenizer = local_tokenizer(self.checkpoint_dir)
        if tokenizer is None:
            vocab = self.config.text_config.vocab_size
            return byte_encoder(vocab, tuple(int(r) for r in reserved)), None

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        return encode, ChatTemplate.for_tokenizer(tokenizer)

    def _full_model(self, seed: int, meta: bool) -> nn.Module:
        if meta:
            with torch.device("meta"):
                return self.model_class(self.config)
        # The seeded RNG is the process's: ranks that are threads of one process
        # (--launch threads) build one at a time, each from the seed, leaving it as found.
        with _SEEDED_BUILD, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.model_class(self.config)

    def _from_checkpoint(self) -> bool:
        return self.checkpoint_dir is not None and has_weights(self.checkpoint_dir)

    def build_stage(
        self,
        info: StageInfo,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """This rank's stage: from ``checkpoint_dir`` when it holds weights (only this
        stage's tensors are read), else the weights of the full model built for ``seed``
        (``torch.manual_seed(seed)`` then the transformers constructor: identical on every
        rank, so every TP rank keeps its slice when the runtime shards the stage)."""
        first, end = info.layer_range
        from_checkpoint = self._from_checkpoint()
        full = self._full_model(seed, meta=from_checkpoint)
        paths = self.stage_paths(info.module, first, end, info.is_first_stage, info.is_last_stage)
        tree = carve(full, paths)
        if from_checkpoint:
            materialize(full, tree)
            load_stage_weights(tree, self.checkpoint_dir, checkpoint_keys(full))
        del full
        cls = self.encoder_stage if info.module == "encoder" else self.llm_stage
        stage = cls(self.config, tree, first, end, info.is_first_stage, info.is_last_stage)
        return stage.to(device=device, dtype=dtype)

    def save_shard(
        self, folder: str, filename: str, state_dict: dict[str, Tensor]
    ) -> dict[str, str]:
        """Write a part of the model's ``state_dict`` (e.g. one stage's) to
        ``folder/filename`` under the checkpoint's keys; returns its ``weight_map``."""
        with torch.device("meta"):
            model = self.model_class(self.config)
        keys = checkpoint_keys(model)
        unknown = sorted(set(state_dict) - set(keys))
        if unknown:
            raise ValueError(f"cannot save {unknown[0]!r}: the model has no such tensor")
        tied = set(tied_names(model))  # saved once, under the embedding's key
        tensors = {keys[n]: t for n, t in state_dict.items() if n not in tied}
        return write_shard(folder, filename, tensors)

    def finish_checkpoint(self, folder: str, weight_map: dict[str, str], seed: int = 0) -> None:
        """Complete a checkpoint whose trained tensors :meth:`save_shard` wrote: the
        tensors no stage holds (e.g. a vision tower's layers past its feature layer, which
        never reach the loss) as they started (from ``checkpoint_dir``, else the init for
        ``seed``) in ``model-outside-the-loss.safetensors``, the index, ``config.json``, and
        the input folder's other files (image processor, tokenizer, chat template,
        generation config), so that ``from_pretrained`` and ``AutoProcessor`` both load
        the folder."""
        with torch.device("meta"):
            keys = checkpoint_keys(self.model_class(self.config))
        missing = sorted(name for name, key in keys.items() if key not in weight_map)
        if missing:
            from_checkpoint = self._from_checkpoint()
            full = self._full_model(seed, meta=from_checkpoint)
            tree = carve(full, missing)
            if from_checkpoint:
                materialize(full, tree)
                load_stage_weights(tree, self.checkpoint_dir, keys)
            start = tree.state_dict()
            weight_map = {
                **weight_map,
                **self.save_shard(folder, "model-outside-the-loss.safetensors", start),
            }
        write_index(folder, weight_map)
        self.config.save_pretrained(folder)
        if self.checkpoint_dir is not None:
            copy_processor_files(self.checkpoint_dir, folder)

    def save_checkpoint(self, folder: str, state_dict: dict[str, Tensor], seed: int = 0) -> None:
        """Write the full model's ``state_dict`` (all stages' together) as a Hugging Face
        checkpoint folder (loadable with ``from_pretrained``); see
        :meth:`finish_checkpoint` for the tensors it lacks."""
        self.finish_checkpoint(
            folder, self.save_shard(folder, "model-00000.safetensors", state_dict), seed
        )


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WRITTEN = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def copy_processor_files(source: str, folder: str) -> list[str]:
    """Copy ``source``'s files other than weights and what a checkpoint writes itself
    (processor, tokenizer, chat template, generation config ...) into ``folder``, where
    it has none of that name; returns their names."""
    import os
    import shutil

    copied = []
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if (
            not os.path.isfile(path)
            or name.endswith(_WEIGHT_SUFFIXES)
            or name in _WRITTEN
            or os.path.exists(os.path.join(folder, name))
        ):
            continue
        shutil.copy2(path, os.path.join(folder, name))
        copied.append(name)
    return copied


class HFStage(nn.Module):
    """A pipeline stage holding a :class:`~dflop.models.hf.common.StageTree` (the full
    model's paths, so ``state_dict()`` keys are the full model's), layers
    ``[first, end)``."""

    def __init__(
        self, config: Any, tree: StageTree, first: int, end: int, first_stage: bool, last: bool
    ) -> None:
        super().__init__()
        self.config = config
        self.first_layer, self.end_layer = first, end
        self.has_embed, self.has_head = first_stage, last
        for name, child in tree.named_children():
            self.add_module(name, child)

    def _layers(self, root: str) -> list[nn.Module]:
        layers = self.get_submodule(f"{root}.layers") if self.end_layer > self.first_layer else None
        return [getattr(layers, str(i)) for i in range(self.first_layer, self.end_layer)]

    def recompute_blocks(self) -> list[nn.Module]:
        """The transformer blocks this stage runs (activation recompute wraps each): an
        LLM stage's decoder layers; encoder stages name their tower's."""
        return self._layers(self.text_root)

    def tied_parameter(self) -> nn.Parameter | None:
        """With ``tie_word_embeddings`` and the LLM over >= 2 stages: this stage's copy of
        the tied weight (the token embedding on the first stage, the head on the last),
        whose gradient the engine sums with the other copy's; else None."""
        if not getattr(self.config, "tie_word_embeddings", False):
            return None
        if self.has_embed and not self.has_head:
            return self.get_parameter(f"{self.text_root}.embed_tokens.weight")
        if self.has_head and not self.has_embed:
            return self.get_parameter("lm_head.weight")
        return None

    # ---------------------------------------------------------- tensor parallelism

    def _linear_plan(self, prefix: str, colwise: tuple[str, ...], rowwise: tuple[str, ...]):
        plan = {f"{prefix}.{name}": "colwise" for name in colwise}
        plan.update({f"{prefix}.{name}": "rowwise" for name in rowwise})
        return plan

    # ------------------------------------------------------------- packed decoder stages

    text_root: str = "model.language_model"

    def tensor_parallel_plan(self) -> dict[str, str]:
        """A Qwen2 decoder's layers (the LLM stages of every family here): q/k/v and
        gate/up column-, o_proj and down_proj row-parallel (the attention infers its
        local heads from the shard widths); the LM head vocabulary-parallel unless tied to
        the (replicated) token embedding."""
        plan: dict[str, str] = {}
        for i in range(self.first_layer, self.end_layer):
            base = f"{self.text_root}.layers.{i}"
            plan.update(
                self._linear_plan(f"{base}.self_attn", ("q_proj", "k_proj", "v_proj"), ("o_proj",))
            )
            plan.update(self._linear_plan(f"{base}.mlp", ("gate_proj", "up_proj"), ("down_proj",)))
        if self.has_head and not getattr(self.config, "tie_word_embeddings", False):
            plan["lm_head"] = "vocab"
        return plan

    def tensor_parallel_sizes(self) -> list[tuple[str, int]]:
        text = self.config.text_config
        return [
            ("text_config.num_attention_heads", text.num_attention_heads),
            ("text_config.num_key_value_heads", text.num_key_value_heads),
            ("text_config.intermediate_size", text.intermediate_size),
        ]

    @property
    def hidden_size(self) -> int:
        return self.config.text_config.hidden_size

    def embed(self, token_ids: Tensor) -> Tensor:
        if not self.has_embed:
            raise ValueError("this LLM stage has no token embedding (not the first stage)")
        return self.get_submodule(f"{self.text_root}.embed_tokens")(token_ids)

    def visual_rows(self, features: Tensor, items: tuple[Any, ...]) -> Tensor:
        """One sample's LLM visual rows from its units' features (default: as they are;
        a model with per-sample visual operations overrides it)."""
        return features

    def merge_visual(
        self, input_embeds: Tensor, features: Tensor, text: Any, rows_per_sample: list[int]
    ) -> Tensor:
        """Each packed sample's visual rows (:meth:`visual_rows` of its features) into its
        placeholder positions, checking that the sample has as many placeholders."""
        if text.visual_items is None:
            raise ValueError(
                f"{type(self).__name__} needs each sample's visual items "
                "(TextInputs.visual_items) for its per-sample operations"
            )
        mask = text.image_token_mask
        cu = text.cu_seqlens.tolist()
        counts = torch.cat((mask.new_zeros(1, dtype=torch.long), mask.long().cumsum(0)))
        parts = []
        for k, (rows, sample) in enumerate(zip(features.split(rows_per_sample), zip(cu, cu[1:]))):
            if rows.shape[0] == 0:
                continue
            visual = self.visual_rows(rows, text.visual_items[k])
            placeholders = int(counts[sample[1]] - counts[sample[0]])
            if placeholders != visual.shape[0]:
                raise ValueError(
                    f"packed sample {k} has {placeholders} visual placeholder tokens but "
                    f"the model makes {visual.shape[0]} visual rows from its items "
                    f"{text.visual_items[k]}: the placeholders must follow the model's rule"
                )
            parts.append(visual)
        if not parts:
            return input_embeds
        return merge_visual_features(input_embeds, mask, torch.cat(parts))

    def _rotary_positions(self, packed: Tensor, position_ids: Tensor | None) -> Tensor:
        """The positions the rotary embedding takes (default: the packed 1-D ones)."""
        return packed

    def hidden_states(
        self, input_embeds: Tensor, cu_seqlens: Tensor, position_ids: Tensor | None = None
    ) -> Tensor:
        """The decoder layers over samples packed into one sequence: positions restart
        per sample (or the model's ``position_ids``), no attention across samples. Flash
        attention runs the packed sequence with its varlen boundaries; other
        implementations run each layer's attention per sample (causal within it), so
        attention costs ``sum(seq^2)`` as the cost model prices it, not ``(sum seq)^2``."""
        tokens = input_embeds.shape[0]
        packed, flash = packed_decoder_inputs(
            self.config.text_config, cu_seqlens, tokens, input_embeds.device
        )
        h = input_embeds[None]
        rotary = self.get_submodule(f"{self.text_root}.rotary_emb")
        cos, sin = rotary(h, self._rotary_positions(packed, position_ids))
        layers = self._layers(self.text_root)
        if flash is not None:  # one varlen call over the packed samples
            for layer in layers:
                h = _out(layer(h, position_ids=packed, position_embeddings=(cos, sin), **flash))
            return h[0]
        impl = str(getattr(self.config.text_config, "_attn_implementation", None) or "sdpa")
        bounds = list(zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:]))
        for layer in layers:
            parts = []
            for start, end in bounds:
                length = end - start
                causal = None  # SDPA: is_causal within the sample
                if impl != "sdpa":
                    causal = torch.ones(length, length, dtype=torch.bool, device=h.device)
                    causal = causal.tril()[None, None]
                parts.append(
                    _out(
                        layer(
                            h[:, start:end],
                            attention_mask=causal,
                            position_ids=packed[:, start:end],
                            position_embeddings=(cos[..., start:end, :], sin[..., start:end, :]),
                        )
                    )
                )
            h = torch.cat(parts, dim=1) if parts else h
        return h[0]

    def loss(
        self,
        input_embeds: Tensor,
        cu_seqlens: Tensor,
        labels: Tensor,
        position_ids: Tensor | None = None,
        *,
        chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ) -> tuple[Tensor, Tensor]:
        """Next-token cross-entropy within each packed sample, summed (float32 logits, as
        transformers' loss), and the number of targets; the head runs on the targets only,
        ``chunk_tokens`` at a time (:func:`~dflop.models.loss.chunked_lm_loss`)."""
        if not self.has_head:
            raise ValueError("this LLM stage has no head (not the last stage)")
        x = self.hidden_states(input_embeds, cu_seqlens, position_ids)
        targets = next_token_targets(labels.to(x.device), cu_seqlens.to(x.device))
        keep = targets != IGNORE_INDEX
        hidden = self.get_submodule(f"{self.text_root}.norm")(x[keep])
        head = self.get_submodule("lm_head")
        return chunked_lm_loss(hidden, head, targets[keep], chunk_tokens), keep.sum()


def _out(result: Any) -> Tensor:
    """A decoder layer's hidden states (some versions return a tuple)."""
    return result[0] if isinstance(result, tuple) else result
