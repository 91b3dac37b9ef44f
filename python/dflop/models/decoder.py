"""Decoder-only LLM of the reference model, over packed variable-length sequences.

A microbatch is packed: the samples' tokens are concatenated into one ``[T, hidden]`` tensor
and ``cu_seqlens`` (``[num_seqs + 1]``, cumulative lengths starting at 0 and ending at T)
marks the boundaries. Attention is causal within each sample and never crosses samples;
rotary positions restart at 0 for each sample; the loss shifts within each sample. So a
packed microbatch computes exactly what running its samples one by one would.

Parameter names follow Hugging Face's Llama/Qwen2 (``layers.N.self_attn.q_proj`` …).
Pipeline stages: ``DecoderStage`` holds a contiguous range of blocks, optionally with the
token embedding (first stage) and the final norm + output head (last stage); blocks are
keyed by their global index so a stage's names match the full decoder's.
"""

from __future__ import annotations

from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflop.batch.text import IGNORE_INDEX
from dflop.models.config import DecoderConfig
from dflop.models.init import init_weights
from dflop.models.loss import DEFAULT_LOSS_CHUNK_TOKENS, chunked_lm_loss

__all__ = [
    "IGNORE_INDEX",
    "Decoder",
    "DecoderStage",
    "RMSNorm",
    "merge_visual_features",
    "next_token_targets",
    "packed_positions",
]

DeviceLike = Union[torch.device, str, None]


def embedding(
    num: int, dim: int, device: DeviceLike = None, dtype: torch.dtype | None = None
) -> nn.Embedding:
    """``nn.Embedding`` that skips its default init on the meta device (torch's ``normal_``
    on meta tensors imports torch._dynamo: seconds); elsewhere it behaves as usual."""
    weight = torch.empty(num, dim, device=device, dtype=dtype)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(num, dim, _weight=weight)


def _seq_lens(cu_seqlens: Tensor, total_tokens: int, max_seq_len: int) -> list[int]:
    """Validate ``cu_seqlens`` against ``total_tokens`` and return the sample lengths.

    This is the one host synchronisation of a forward pass; every layer reuses the list.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [num_seqs + 1] with num_seqs >= 1, got "
            f"dtype={cu_seqlens.dtype} shape={tuple(cu_seqlens.shape)}"
        )
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total_tokens:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the number of tokens {total_tokens}, "
            f"got {bounds[0]} .. {bounds[-1]}"
        )
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing; it decreases at index {i + 1}")
        if n > max_seq_len:
            raise ValueError(
                f"sample {i} has {n} tokens, more than DecoderConfig.max_seq_len={max_seq_len}"
            )
    return lens


def packed_positions(cu_seqlens: Tensor, total_tokens: int) -> Tensor:
    """Position of every packed token within its own sample: ``[T]``, restarting at 0."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lens, output_size=total_tokens)
    return torch.arange(total_tokens, device=cu_seqlens.device) - starts


def next_token_targets(labels: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Targets for next-token prediction, shifted WITHIN each sample.

    ``labels[t]`` is the label of the token at position t (``IGNORE_INDEX`` = no loss);
    position t is trained to predict ``labels[t + 1]`` when t + 1 is in the same sample.
    The last position of every sample predicts nothing, and a sample's first label is
    never a target.
    """
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:-1] = labels[1:]
    last = cu_seqlens[1:] - 1
    targets[last[last >= 0]] = IGNORE_INDEX
    return targets


def merge_visual_features(
    text_embeds: Tensor, image_token_mask: Tensor, visual_features: Tensor
) -> Tensor:
    """Put ``visual_features`` rows, in order, at the ``True`` positions of
    ``image_token_mask``: ``[T, hidden]`` with ``[T]`` bool and ``[V, hidden]`` -> ``[T, hidden]``.

    Out of place and differentiable in both inputs. ``V`` must equal the mask's count (see
    ``check_visual_layout``, which also checks each sample's share).
    """
    if visual_features.shape[0] == 0:
        return text_embeds
    mask = image_token_mask.to(text_embeds.device).unsqueeze(-1)
    return text_embeds.masked_scatter(mask, visual_features.to(text_embeds.dtype))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32, with a learned scale."""

    is_norm = True

    def __init__(
        self, dim: int, eps: float, device: DeviceLike = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Rotary tables for ``positions`` ``[T]``: ``(cos, sin)``, each ``[T, head_dim / 2]``
    float32. Computed per call (cheap next to attention), so there is no cache to size,
    move between devices, or initialise on the meta device."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` (half-split layout, as in Llama/Qwen2)."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class DecoderAttention(nn.Module):
    """Grouped-query causal self-attention over packed samples."""

    def __init__(
        self, config: DecoderConfig, device: DeviceLike = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        h, d = config.hidden, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, d
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, config.heads * d, bias=bias, **kw)
        self.k_proj = nn.Linear(h, config.kv_heads * d, bias=bias, **kw)
        self.v_proj = nn.Linear(h, config.kv_heads * d, bias=bias, **kw)
        self.o_proj = nn.Linear(config.heads * d, h, bias=False, **kw)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, seq_lens: list[int]) -> Tensor:
        tokens = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(tokens, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(tokens, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(tokens, self.kv_heads, self.head_dim)
        # [1, heads, T, head_dim]: SDPA's CPU kernels are several times faster on 4-D
        # inputs than on 3-D ones.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        gqa = self.kv_heads != self.heads
        # Packed causal attention: one SDPA call per sample, on views of the packed q/k/v.
        # Not one call with a block-diagonal [T, T] mask: a mask costs O(T^2) memory and
        # compute where the loop costs O(sum of seq^2) -- exactly the attention term
        # dflop's cost model fits -- and is_causal=True keeps SDPA's fused kernels
        # (flash / memory-efficient), which an arbitrary mask disables. The loop's
        # overhead is about 0.15 ms per sample and layer (forward + backward, CPU); on a
        # 1-thread CPU, fwd+bwd attention over 512 packed tokens (4 heads of 64) takes
        # 5 ms as 8 x 64 or 32 x 16 samples with the loop vs 22-24 ms with a mask, and
        # breaks even only at 128 x 4. (On CUDA, torch.nn.attention.varlen could replace
        # the loop with one kernel.)
        if len(seq_lens) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            parts = [
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
                for qs, ks, vs in zip(
                    q.split(seq_lens, dim=2), k.split(seq_lens, dim=2), v.split(seq_lens, dim=2)
                )
                if qs.shape[2] > 0
            ]
            out = torch.cat(parts, dim=2)
        out = out.squeeze(0).transpose(0, 1)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(tokens, self.heads * self.head_dim))


class DecoderMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(
        self, config: DecoderConfig, device: DeviceLike = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": False}
        self.gate_proj = nn.Linear(config.hidden, config.mlp_hidden, **kw)
        self.up_proj = nn.Linear(config.hidden, config.mlp_hidden, **kw)
        self.down_proj = nn.Linear(config.mlp_hidden, config.hidden, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self, config: DecoderConfig, device: DeviceLike = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(config.hidden, config.norm_eps, **kw)
        self.self_attn = DecoderAttention(config, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.norm_eps, **kw)
        self.mlp = DecoderMLP(config, **kw)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, seq_lens: list[int]) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, seq_lens)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStage(nn.Module):
    """Blocks ``[first_layer, end_layer)`` of the decoder, for pipeline parallelism.

    ``has_embed``: the stage owns the token embedding (``embed``) and, with
    ``DecoderConfig.image_newline``, the ``image_newline`` row
    (``append_visual_newlines``); callers embed tokens (and merge visual features) before
    ``forward``. ``has_head``: the stage owns the final
    norm and output head; ``forward`` returns logits and ``loss`` is available. Otherwise
    ``forward`` maps hidden states ``[T, hidden]`` to hidden states ``[T, hidden]``.
    """

    def __init__(
        self,
        config: DecoderConfig,
        first_layer: int = 0,
        end_layer: int | None = None,
        *,
        has_embed: bool = True,
        has_head: bool = True,
        device: DeviceLike = None,
        dtype: torch.dtype | None = None,
        _source: DecoderStage | None = None,
    ) -> None:
        # _source (internal, see Decoder.stage): share its modules instead of building.
        super().__init__()
        config.validate()
        end_layer = config.layers if end_layer is None else end_layer
        if not 0 <= first_layer <= end_layer <= config.layers:
            raise ValueError(
                f"DecoderStage: layer range [first_layer={first_layer}, end_layer={end_layer}) "
                f"must lie within [0, DecoderConfig.layers={config.layers}]"
            )
        kw = {"device": device, "dtype": dtype}
        src = _source
        self.config = config
        self.first_layer, self.end_layer = first_layer, end_layer
        self.has_embed, self.has_head = has_embed, has_head
        self.embed_tokens: nn.Embedding | None = None
        self.image_newline: nn.Parameter | None = None
        self.norm: RMSNorm | None = None
        self.lm_head: nn.Linear | None = None
        if has_embed:
            self.embed_tokens = (
                src.embed_tokens if src else embedding(config.vocab_size, config.hidden, **kw)
            )
            if config.image_newline:
                self.image_newline = (
                    src.image_newline if src else nn.Parameter(torch.zeros(config.hidden, **kw))
                )
        self.layers = nn.ModuleDict(
            {
                str(i): src.layers[str(i)] if src else DecoderBlock(config, **kw)
                for i in range(first_layer, end_layer)
            }
        )
        if has_head:
            self.norm = src.norm if src else RMSNorm(config.hidden, config.norm_eps, **kw)
            self.lm_head = (
                src.lm_head
                if src
                else nn.Linear(config.hidden, config.vocab_size, bias=False, **kw)
            )

    def embed(self, token_ids: Tensor) -> Tensor:
        """Token embeddings: ``LongTensor[T] -> [T, hidden]`` (needs ``has_embed``)."""
        if self.embed_tokens is None:
            raise ValueError("this DecoderStage has no token embedding (has_embed=False)")
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D [T], got shape {tuple(token_ids.shape)}")
        return self.embed_tokens(token_ids)

    def append_visual_newlines(self, features: Tensor, rows_per_sample: list[int]) -> Tensor:
        """``features`` ``[sum(rows_per_sample), hidden]``, the visual features of
        consecutive samples, with the ``image_newline`` row appended after each sample
        that has rows (needs ``DecoderConfig.image_newline`` and ``has_embed``).
        Differentiable in both; the result has one row more per such sample."""
        if self.image_newline is None:
            raise ValueError(
                "this DecoderStage has no image_newline (DecoderConfig.image_newline=False "
                "or has_embed=False)"
            )
        if sum(rows_per_sample) != features.shape[0]:
            raise ValueError(
                f"rows_per_sample sums to {sum(rows_per_sample)} but features has "
                f"{features.shape[0]} rows"
            )
        newline = self.image_newline.to(features.dtype)[None]
        parts = []
        for rows in features.split(list(rows_per_sample)):
            if rows.shape[0]:
                parts += [rows, newline]
        return torch.cat(parts) if parts else features

    @property
    def hidden_size(self) -> int:
        return self.config.hidden

    @property
    def visual_newline(self) -> bool:
        return self.config.image_newline

    def merge_visual(
        self,
        input_embeds: Tensor,
        features: Tensor,
        text: Any,
        rows_per_sample: list[int],
    ) -> Tensor:
        """Token embeddings with the visual ``features`` (``rows_per_sample`` rows of each
        sample, in order) at ``text.image_token_mask``, after appending the image_newline
        row to each sample's rows when the model has one."""
        if self.image_newline is not None:
            features = self.append_visual_newlines(features, rows_per_sample)
        return merge_visual_features(input_embeds, text.image_token_mask, features)

    def hidden_states(self, input_embeds: Tensor, cu_seqlens: Tensor) -> Tensor:
        """Run this stage's blocks: ``[T, hidden] -> [T, hidden]`` (no final norm)."""
        if input_embeds.dim() != 2 or input_embeds.shape[1] != self.config.hidden:
            raise ValueError(
                f"input_embeds has shape {tuple(input_embeds.shape)}, expected "
                f"[T, {self.config.hidden}] (DecoderConfig.hidden)"
            )
        tokens = input_embeds.shape[0]
        seq_lens = _seq_lens(cu_seqlens, tokens, self.config.max_seq_len)
        positions = packed_positions(cu_seqlens.to(input_embeds.device), tokens)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = input_embeds
        for block in self.layers.values():
            x = block(x, cos, sin, seq_lens)
        return x

    def forward(self, input_embeds: Tensor, cu_seqlens: Tensor) -> Tensor:
        """``[T, hidden]`` -> logits ``[T, vocab_size]`` with the head, else ``[T, hidden]``."""
        x = self.hidden_states(input_embeds, cu_seqlens)
        if self.lm_head is None:
            return x
        return self.lm_head(self.norm(x))

    def loss(
        self,
        input_embeds: Tensor,
        cu_seqlens: Tensor,
        labels: Tensor,
        *,
        chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    ) -> tuple[Tensor, Tensor]:
        """Next-token cross-entropy, SUMMED over target tokens (needs ``has_head``).

        ``labels``: ``LongTensor[T]`` aligned with the input positions, ``IGNORE_INDEX``
        (-100) where there is no loss; shifted within each sample (``next_token_targets``).
        Returns ``(sum_loss, num_target_tokens)`` as 0-dim tensors (float32, int64), so a
        caller divides the sum over all microbatches and ranks by the global target count.
        The head runs only on positions that have a target, ``chunk_tokens`` of them at a
        time (:func:`~dflop.models.loss.chunked_lm_loss`: no full logits tensor).
        """
        if self.lm_head is None:
            raise ValueError("this DecoderStage has no output head (has_head=False)")
        if labels.shape != input_embeds.shape[:1]:
            raise ValueError(
                f"labels has shape {tuple(labels.shape)}, expected [T={input_embeds.shape[0]}]"
            )
        x = self.hidden_states(input_embeds, cu_seqlens)
        targets = next_token_targets(labels.to(x.device), cu_seqlens.to(x.device))
        keep = targets != IGNORE_INDEX
        sum_loss = chunked_lm_loss(self.norm(x[keep]), self.lm_head, targets[keep], chunk_tokens)
        return sum_loss, keep.sum()

    def init_weights(self, seed: int) -> None:
        """Deterministic init keyed by ``decoder.<name>`` (see ``dflop.models.init``)."""
        init_weights(self, seed, prefix="decoder.")

    # Tensor parallelism (dflop.runtime.tensor_parallel), Megatron-style.

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Submodule name -> ``"colwise"`` / ``"rowwise"`` / ``"vocab"``: attention q/k/v
        column- and ``o_proj`` row-parallel, ``gate_proj`` / ``up_proj`` column- and
        ``down_proj`` row-parallel, the head vocabulary-parallel; embeddings and norms
        replicated."""
        plan: dict[str, str] = {}
        for i in self.layers:
            base = f"layers.{i}"
            for name in ("q_proj", "k_proj", "v_proj"):
                plan[f"{base}.self_attn.{name}"] = "colwise"
            plan[f"{base}.self_attn.o_proj"] = "rowwise"
            for name in ("gate_proj", "up_proj"):
                plan[f"{base}.mlp.{name}"] = "colwise"
            plan[f"{base}.mlp.down_proj"] = "rowwise"
        if self.lm_head is not None:
            plan["lm_head"] = "vocab"
        return plan

    def tensor_parallel_sizes(self) -> list[tuple[str, int]]:
        """The config fields the tensor-parallel size must divide."""
        c = self.config
        return [
            ("DecoderConfig.heads", c.heads),
            ("DecoderConfig.kv_heads", c.kv_heads),
            ("DecoderConfig.mlp_hidden", c.mlp_hidden),
        ]

    def recompute_blocks(self) -> list[nn.Module]:
        """The transformer blocks this stage runs (activation recompute wraps each)."""
        return list(self.layers.values())

    def use_local_heads(self, tp_size: int) -> None:
        """Each block's attention over its TP rank's heads (a contiguous run of query heads
        and their key/value heads, so grouped-query pairs stay on one rank)."""
        for block in self.layers.values():
            block.self_attn.heads = self.config.heads // tp_size
            block.self_attn.kv_heads = self.config.kv_heads // tp_size


class Decoder(DecoderStage):
    """The whole decoder: ``embed(token_ids[T]) -> [T, hidden]``,
    ``forward(input_embeds[T, hidden], cu_seqlens[num_seqs + 1]) -> logits [T, vocab]``,
    ``loss(input_embeds, cu_seqlens, labels) -> (sum_loss, num_target_tokens)``."""

    def __init__(
        self,
        config: DecoderConfig,
        *,
        device: DeviceLike = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            config, 0, config.layers, has_embed=True, has_head=True, device=device, dtype=dtype
        )

    def stage(
        self, first_layer: int, end_layer: int, *, has_embed: bool, has_head: bool
    ) -> DecoderStage:
        """A stage holding blocks ``[first_layer, end_layer)`` that SHARES this decoder's
        modules (same parameters, so gradients land on the decoder's parameters)."""
        return DecoderStage(
            self.config,
            first_layer,
            end_layer,
            has_embed=has_embed,
            has_head=has_head,
            _source=self,
        )
