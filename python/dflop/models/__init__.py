"""dflop's reference multimodal model in plain torch (ViT encoder, MLP projector, decoder LLM
over packed variable-length sequences), sized from CPU-tiny to GPU-billions.

Quick start::

    from dflop.models import build_model
    model = build_model("tiny", seed=0)
    sum_loss, num_targets = model(pixel_values, unit_counts, token_ids, image_mask, cu_seqlens, labels)

Pipeline stages: ``VisionTower.stage`` / ``Decoder.stage`` (sharing the full model's
modules) or ``VisionStage`` / ``DecoderStage`` built on their own (same weights for the
same seed, thanks to name-keyed init).

The runtime trains any model through a :class:`ModelSpec` (``model_spec("tiny")``,
``model_spec("hf:PATH")`` for a Hugging Face folder; see :mod:`dflop.models.spec`,
:mod:`dflop.models.registry` and :mod:`dflop.models.hf`). The batch types a model reads
(:class:`VisualItem`, ``TextInputs``, ``ProcessedSample``) live in :mod:`dflop.batch`;
``VisualItem`` is re-exported here.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Where each name lives. Loaded on first use (PEP 562), so that the torch-free parts
# (``dflop.models.config``, ``dflop.models.trainable``: what a command line validates
# its settings with) import without torch and the CLI starts in a fraction of a second.
_EXPORTS = {
    "config": (
        "DECODER_PRESETS",
        "MODEL_PRESETS",
        "VISION_PRESETS",
        "DecoderConfig",
        "ModelConfig",
        "ProjectorConfig",
        "VisionConfig",
        "model_config",
    ),
    "decoder": (
        "IGNORE_INDEX",
        "Decoder",
        "DecoderStage",
        "next_token_targets",
        "packed_positions",
    ),
    "init": ("init_weights",),
    "multimodal": (
        "MultimodalModel",
        "build_model",
        "check_visual_layout",
        "merge_visual_features",
    ),
    "registry": ("model_spec",),
    "spec": ("EncoderStageModule", "LLMStageModule", "ModelSpec", "ReferenceSpec", "VisualItem"),
    "trainable": ("TrainableParts",),
    "vision": ("Projector", "VisionEncoder", "VisionStage", "VisionTower"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'dflop.models' has no attribute {name!r}")
    value = getattr(import_module(f"dflop.models.{module}"), name)
    globals()[name] = value  # found directly next time
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF])


if TYPE_CHECKING:  # what type checkers and IDEs see
    from dflop.models.config import (
        DECODER_PRESETS,
        MODEL_PRESETS,
        VISION_PRESETS,
        DecoderConfig,
        ModelConfig,
        ProjectorConfig,
        VisionConfig,
        model_config,
    )
    from dflop.models.decoder import (
        IGNORE_INDEX,
        Decoder,
        DecoderStage,
        next_token_targets,
        packed_positions,
    )
    from dflop.models.init import init_weights
    from dflop.models.multimodal import (
        MultimodalModel,
        build_model,
        check_visual_layout,
        merge_visual_features,
    )
    from dflop.models.registry import model_spec
    from dflop.models.spec import (
        EncoderStageModule,
        LLMStageModule,
        ModelSpec,
        ReferenceSpec,
        VisualItem,
    )
    from dflop.models.trainable import TrainableParts
    from dflop.models.vision import Projector, VisionEncoder, VisionStage, VisionTower

__all__ = [
    "DECODER_PRESETS",
    "IGNORE_INDEX",
    "MODEL_PRESETS",
    "VISION_PRESETS",
    "Decoder",
    "DecoderConfig",
    "DecoderStage",
    "EncoderStageModule",
    "LLMStageModule",
    "ModelConfig",
    "ModelSpec",
    "MultimodalModel",
    "Projector",
    "ProjectorConfig",
    "ReferenceSpec",
    "TrainableParts",
    "VisionConfig",
    "VisionEncoder",
    "VisionStage",
    "VisionTower",
    "VisualItem",
    "build_model",
    "check_visual_layout",
    "init_weights",
    "merge_visual_features",
    "model_config",
    "model_spec",
    "next_token_targets",
    "packed_positions",
]
