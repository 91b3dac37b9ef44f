"""Vision side of the reference model: a ViT encoder and an MLP projector.

Parameter names follow Hugging Face's SigLIP / LLaVA projector so that checkpoints map
over with a simple prefix change. Every visual unit (image tile or video frame) is encoded
independently, so the encoder batches units and needs no packing.

Pipeline stages: ``VisionStage`` holds a contiguous range of encoder blocks, optionally
with the patch embedding (first stage) and the final norm + projector (last stage). A stage
keeps the full model's parameter names, so its ``state_dict`` is a subset of the full
tower's and a stage built on its own initialises to the same weights for the same seed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflop.models.config import ProjectorConfig, VisionConfig
from dflop.models.decoder import DeviceLike, embedding
from dflop.models.init import init_weights

__all__ = ["Projector", "VisionEncoder", "VisionStage", "VisionTower"]


def _check_layer_range(owner: str, first_layer: int, end_layer: int, layers: int) -> None:
    if not 0 <= first_layer <= end_layer <= layers:
        raise ValueError(
            f"{owner}: layer range [first_layer={first_layer}, end_layer={end_layer}) must "
            f"lie within [0, VisionConfig.layers={layers}]"
        )


class PatchEmbedding(nn.Module):
    """Non-overlapping patch convolution plus learned position embeddings."""

    def __init__(
        self, config: VisionConfig, device: DeviceLike = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.channels,
            config.hidden,
            kernel_size=config.patch_size_px,
            stride=config.patch_size_px,
            device=device,
            dtype=dtype,
        )
        self.position_embedding = embedding(
            config.tokens_per_unit, config.hidden, device=device, dtype=dtype
        )
        self.config = config

    def forward(self, pixel_values: Tensor) -> Tensor:
        """``[U, C, H, W]`` pixels -> ``[U, tokens_per_unit, hidden]``."""
        c = self.config
        expected = (c.channels, c.image_size_px, c.image_size_px)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected "
                f"[units, {c.channels}, {c.image_size_px}, {c.image_size_px}] "
                "(VisionConfig.channels, image_size_px)"
            )
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # [U, D, P, P]
        tokens = patches.flatten(2).transpose(1, 2)  # [U, P*P, D]
        return tokens + self.position_embedding.weight


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention within each unit."""

    def __init__(
        self, config: VisionConfig, device: DeviceLike = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        h = config.hidden
        self.heads = config.heads
        self.q_proj = nn.Linear(h, h, device=device, dtype=dtype)
        self.k_proj = nn.Linear(h, h, device=device, dtype=dtype)
        self.v_proj = nn.Linear(h, h, device=device, dtype=dtype)
        self.out_proj = nn.Linear(h, h, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        units, tokens, hidden = x.shape

        def split_heads(t: Tensor) -> Tensor:  # [U, N, D] -> [U, heads, N, D / heads]
            return t.view(units, tokens, self.heads, -1).transpose(1, 2)

        q, k, v = (split_heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        # -1: the local width when the projections are sharded over tensor parallelism
        return self.out_proj(out.transpose(1, 2).reshape(units, tokens, -1))


class VisionMLP(nn.Module):
    def __init__(
        self, config: VisionConfig, device: DeviceLike = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden, config.mlp_hidden, device=device, dtype=dtype)
        self.fc2 = nn.Linear(config.mlp_hidden, config.hidden, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self, config: VisionConfig, device: DeviceLike = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.layer_norm1 = nn.LayerNorm(config.hidden, eps=config.norm_eps, **kw)
        self.self_attn = VisionAttention(config, **kw)
        self.layer_norm2 = nn.LayerNorm(config.hidden, eps=config.norm_eps, **kw)
        self.mlp = VisionMLP(config, **kw)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """ViT encoder: ``forward(pixel_values[U, C, H, W]) -> [U, tokens_per_unit, hidden]``.

    By default the whole encoder. With a layer range ``[first_layer, end_layer)`` and
    ``has_embed`` / ``has_norm`` it is one pipeline part: without the embedding its input
    is the previous part's ``[U, tokens_per_unit, hidden]`` hidden states; without the
    final norm it returns un-normalised hidden states. Blocks are keyed by their global
    index (``blocks.7.…``), so names match the full encoder's.
    """

    def __init__(
        self,
        config: VisionConfig,
        first_layer: int = 0,
        end_layer: int | None = None,
        *,
        has_embed: bool = True,
        has_norm: bool = True,
        device: DeviceLike = None,
        dtype: torch.dtype | None = None,
        _source: VisionEncoder | None = None,
    ) -> None:
        # _source (internal, see VisionTower.stage): share its modules instead of building.
        super().__init__()
        config.validate()
        end_layer = config.layers if end_layer is None else end_layer
        _check_layer_range("VisionEncoder", first_layer, end_layer, config.layers)
        kw = {"device": device, "dtype": dtype}
        src = _source
        self.config = config
        self.first_layer, self.end_layer = first_layer, end_layer
        self.embeddings: PatchEmbedding | None = None
        self.post_layernorm: nn.LayerNorm | None = None
        if has_embed:
            self.embeddings = src.embeddings if src else PatchEmbedding(config, **kw)
        self.blocks = nn.ModuleDict(
            {
                str(i): src.blocks[str(i)] if src else VisionBlock(config, **kw)
                for i in range(first_layer, end_layer)
            }
        )
        if has_norm:
            self.post_layernorm = (
                src.post_layernorm
                if src
                else nn.LayerNorm(config.hidden, eps=config.norm_eps, **kw)
            )

    def forward(self, x: Tensor) -> Tensor:
        """Pixels ``[U, C, H, W]`` (or hidden states ``[U, N, hidden]`` without the
        embedding) -> ``[U, tokens_per_unit, hidden]``."""
        if self.embeddings is not None:
            x = self.embeddings(x)
        for block in self.blocks.values():
            x = block(x)
        if self.post_layernorm is not None:
            x = self.post_layernorm(x)
        return x


class Projector(nn.Module):
    """Two-layer MLP with GELU: ``forward(x[..., vision_hidden]) -> [..., hidden]``."""

    def __init__(
        self, config: ProjectorConfig, device: DeviceLike = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        config.validate()
        kw = {"device": device, "dtype": dtype}
        self.config = config
        self.linear_1 = nn.Linear(config.vision_hidden, config.intermediate, **kw)
        self.linear_2 = nn.Linear(config.intermediate, config.hidden, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class VisionStage(nn.Module):
    """A contiguous part of a ``VisionTower`` for pipeline parallelism.

    Holds encoder blocks ``[first_layer, end_layer)``; ``has_embed`` adds the patch
    embedding (the stage then takes pixels), ``has_head`` adds the encoder's final norm
    and the projector (the stage then returns ``[U * tokens_per_unit, decoder hidden]``).
    Otherwise input and output are hidden states ``[U, tokens_per_unit, vision hidden]``.
    """

    def __init__(
        self,
        vision_config: VisionConfig,
        projector_config: ProjectorConfig,
        first_layer: int,
        end_layer: int,
        *,
        has_embed: bool,
        has_head: bool,
        device: DeviceLike = None,
        dtype: torch.dtype | None = None,
        _source: VisionStage | None = None,
    ) -> None:
        # _source (internal, see VisionTower.stage): share its modules instead of building.
        super().__init__()
        if projector_config.vision_hidden != vision_config.hidden:
            raise ValueError(
                f"ProjectorConfig.vision_hidden={projector_config.vision_hidden} must equal "
                f"VisionConfig.hidden={vision_config.hidden}"
            )
        self.vision_config = vision_config
        self.projector_config = projector_config
        self.has_embed, self.has_head = has_embed, has_head
        self.encoder = VisionEncoder(
            vision_config,
            first_layer,
            end_layer,
            has_embed=has_embed,
            has_norm=has_head,
            device=device,
            dtype=dtype,
            _source=_source.encoder if _source else None,
        )
        self.projector: Projector | None = None
        if has_head:
            self.projector = (
                _source.projector
                if _source
                else Projector(projector_config, device=device, dtype=dtype)
            )

    @property
    def tokens_per_unit(self) -> int:
        return self.vision_config.tokens_per_unit

    @property
    def hidden_size(self) -> int:
        return self.vision_config.hidden

    @property
    def output_size(self) -> int:
        return self.projector_config.hidden

    def forward(self, x: Tensor) -> Tensor:
        """See the class docstring for the input and output of each kind of stage."""
        x = self.encoder(x)
        if self.projector is None:
            return x
        return self.projector(x).flatten(0, 1)

    def init_weights(self, seed: int) -> None:
        """Deterministic init keyed by ``vision.<name>`` (see ``dflop.models.init``)."""
        init_weights(self, seed, prefix="vision.")

    # Tensor parallelism (dflop.runtime.tensor_parallel), Megatron-style.

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Submodule name -> ``"colwise"`` / ``"rowwise"``: attention q/k/v column- and
        ``out_proj`` row-parallel, ``fc1`` / ``fc2`` the same, the projector's
        ``linear_1`` / ``linear_2`` on the head stage; the rest replicated."""
        plan: dict[str, str] = {}
        for i in self.encoder.blocks:
            base = f"encoder.blocks.{i}"
            for name in ("q_proj", "k_proj", "v_proj"):
                plan[f"{base}.self_attn.{name}"] = "colwise"
            plan[f"{base}.self_attn.out_proj"] = "rowwise"
            plan[f"{base}.mlp.fc1"] = "colwise"
            plan[f"{base}.mlp.fc2"] = "rowwise"
        if self.projector is not None:
            plan["projector.linear_1"] = "colwise"
            plan["projector.linear_2"] = "rowwise"
        return plan

    def tensor_parallel_sizes(self) -> list[tuple[str, int]]:
        """The config fields the tensor-parallel size must divide."""
        v, p = self.vision_config, self.projector_config
        sizes = [("VisionConfig.heads", v.heads), ("VisionConfig.mlp_hidden", v.mlp_hidden)]
        if self.projector is not None:
            sizes.append(("ProjectorConfig.intermediate", p.intermediate))
        return sizes

    def recompute_blocks(self) -> list[nn.Module]:
        """The transformer blocks this stage runs (activation recompute wraps each)."""
        return list(self.encoder.blocks.values())

    def use_local_heads(self, tp_size: int) -> None:
        """Each block's attention over its TP rank's ``heads / tp_size`` heads."""
        for block in self.encoder.blocks.values():
            block.self_attn.heads = self.vision_config.heads // tp_size


class VisionTower(VisionStage):
    """Encoder + projector: ``forward(pixel_values[U, C, H, W]) -> [U * tokens_per_unit,
    hidden]``, the rows in unit order (unit 0's tokens first)."""

    def __init__(
        self,
        vision_config: VisionConfig,
        projector_config: ProjectorConfig,
        *,
        device: DeviceLike = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            vision_config,
            projector_config,
            0,
            vision_config.layers,
            has_embed=True,
            has_head=True,
            device=device,
            dtype=dtype,
        )

    def encode(self, pixel_values: Tensor) -> Tensor:
        """Encoder only: ``[U, C, H, W] -> [U, tokens_per_unit, vision hidden]``."""
        return self.encoder(pixel_values)

    def stage(
        self, first_layer: int, end_layer: int, *, has_embed: bool, has_head: bool
    ) -> VisionStage:
        """A stage holding blocks ``[first_layer, end_layer)`` that SHARES this tower's
        modules (same parameters, so gradients land on the tower's parameters)."""
        return VisionStage(
            self.vision_config,
            self.projector_config,
            first_layer,
            end_layer,
            has_embed=has_embed,
            has_head=has_head,
            _source=self,
        )
