"""Deterministic, name-keyed weight initialisation.

Every parameter draws from its own generator, seeded by ``(seed, qualified name)``. So a
pipeline stage built on its own (holding only layers 8..15, say) gets exactly the weights
that the same layers have in the full model built with the same seed, with no need to build
the full model first. Values are drawn on the CPU and copied, so a stage on a GPU holds the
weights the same stage holds on the CPU.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

__all__ = ["INIT_STD", "init_weights", "param_seed"]

#: Standard deviation of the normal init of every matrix, embedding and convolution.
INIT_STD = 0.02


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from a model seed and a parameter's qualified name."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _is_norm(module: nn.Module) -> bool:
    # Any module with a "weight" used as a scale (LayerNorm, RMSNorm variants).
    norm_types = (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))  # nn.RMSNorm: torch 2.4+
    return isinstance(module, norm_types) or getattr(module, "is_norm", False)


@torch.no_grad()
def init_weights(module: nn.Module, seed: int, prefix: str = "") -> None:
    """Initialise ``module``'s parameters in place, keyed by ``prefix + name``.

    Norm scales are ones, biases zeros, everything else normal(0, ``INIT_STD``).
    Parameters on the meta device are skipped.
    """
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            if param.device.type == "meta":
                continue
            if _is_norm(sub) and param_name == "weight":
                param.fill_(1.0)
            elif param_name == "bias":
                param.zero_()
            else:
                full_name = prefix + (f"{module_name}." if module_name else "") + param_name
                # Drawn on the CPU whatever the device: CUDA's generator is another
                # algorithm, and a GPU stage must hold the weights a CPU stage holds.
                generator = torch.Generator()
                generator.manual_seed(param_seed(seed, full_name))
                values = torch.empty(param.shape, dtype=param.dtype)
                param.copy_(values.normal_(0.0, INIT_STD, generator=generator))
