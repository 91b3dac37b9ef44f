"""The types a batch is made of, shared by the models and the runtime.

A model reads these (an LLM stage's ``merge_visual`` gets :class:`TextInputs` with each
sample's :class:`VisualItem` s; a Hugging Face record converter makes
:class:`ProcessedSample` s) and the runtime's batch sources produce them
(:mod:`dflop.runtime.synthetic_batch`, :mod:`dflop.runtime.processed_batch`,
:mod:`dflop.runtime.dataset_batch`), so they sit in a layer of their own between
:mod:`dflop.data` and :mod:`dflop.models`: the models never import the runtime.

- :mod:`dflop.batch.visual`: :class:`VisualItem`, one visual input of a sample.
- :mod:`dflop.batch.text`: :class:`TextInputs`, the LLM side of a packed microbatch.
- :mod:`dflop.batch.sample`: :class:`ProcessedSample`, one sample as model inputs, and
  :func:`truncate_sample` (the length policy on one).

Needs torch (the tensors). The old homes keep working: ``dflop.models.VisualItem``,
``dflop.models.spec.VisualItem``, ``dflop.runtime.synthetic_batch.TextInputs``,
``dflop.runtime.processed_batch.ProcessedSample`` / ``truncate_sample``.
"""

from dflop.batch.sample import ProcessedSample, truncate_sample
from dflop.batch.text import TextInputs
from dflop.batch.visual import VisualItem

__all__ = ["ProcessedSample", "TextInputs", "VisualItem", "truncate_sample"]
