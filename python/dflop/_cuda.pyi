# Stub of the optional CUDA extension (built when the install found nvcc); private: use
# dflop.runtime.rows, which checks tensors and indices before calling these.

def gather_rows(
    src: int, index: int, count: int, dst: int, row_bytes: int, stream: int
) -> None: ...
def scatter_rows(
    src: int, index: int, count: int, dst: int, row_bytes: int, stream: int
) -> None: ...
def device_count() -> int: ...
