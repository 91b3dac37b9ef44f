"""Sample shapes, model-family shape rules, the embedded synthetic workload and costs.

- :mod:`dflop.data.shapes`: :class:`SampleShapes` (columnar per-sample shapes),
  :class:`Modality` codes.
- :mod:`dflop.data.families`: the shape rules of each model family as data
  (:class:`FamilySpec`, :func:`get_family`) and the functions applying them.
- :mod:`dflop.data.synthetic`: :func:`synthetic_shapes`, a seeded generator mirroring the
  LLaVA-OneVision data mix (:class:`MixSpec`).
- :mod:`dflop.data.costs`: :class:`AnalyticCostModel`, FLOP-based per-sample costs with
  encoder/LLM presets, and :func:`synthetic_costs`.
"""

from dflop.data.costs import (
    ENCODER_PRESETS,
    LLM_PRESETS,
    AnalyticCostModel,
    EncoderConfig,
    LLMConfig,
    synthetic_costs,
)
from dflop.data.families import FamilySpec, get_family, shapes_from_descriptors
from dflop.data.shapes import Modality, SampleShapes
from dflop.data.synthetic import MixSpec, synthetic_shapes

__all__ = [
    "ENCODER_PRESETS",
    "LLM_PRESETS",
    "AnalyticCostModel",
    "EncoderConfig",
    "FamilySpec",
    "LLMConfig",
    "MixSpec",
    "Modality",
    "SampleShapes",
    "get_family",
    "shapes_from_descriptors",
    "synthetic_costs",
    "synthetic_shapes",
]
