// Row indices of the bridge's pack / unpack (dflop::cuda::gather_rows, scatter_rows),
// checked on the host before any device work: a device kernel cannot report a bad index
// except by faulting, which ruins the process's CUDA context.
#pragma once

#include <cstdint>

namespace dflop {

// Checks that each of the `count` entries of `index` is in [0, rows); with `unique`, also
// that no value appears twice (scatter: two source rows would race for one destination
// row). Throws InvalidArgument naming `name`, the first offending position and value.
void check_row_index(const int64_t* index, int64_t count, int64_t rows, bool unique,
                     const char* name);

}  // namespace dflop
