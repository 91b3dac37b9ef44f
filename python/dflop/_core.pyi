"""Type stub of the private native core. Use the dflop package instead."""

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

class InfeasibleError(ValueError): ...

def balance(
    costs: np.ndarray,
    num_microbatches: int,
    dp_size: int,
    microbatch_dims: Sequence[int],
    capacity: Optional[Sequence[float]],
    seed: int,
    time_budget_ms: Optional[float],
) -> dict[str, Any]: ...
def default_work_budget(num_items: int, num_bins: int, num_dims: int) -> int: ...
def work_budget_for_ms(time_budget_ms: float) -> int: ...
