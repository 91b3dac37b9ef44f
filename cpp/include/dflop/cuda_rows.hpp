// Stream-ordered row packing on a CUDA device (dflop._cuda, built when CMake finds a CUDA
// compiler): the bridge's pack (gather the rows bound for a peer into one contiguous send
// buffer) and unpack (scatter received rows into place). Rows are opaque bytes, so every
// dtype (bf16, fp16, fp32) and any row width works; copies use the widest vector width
// that the pointers and the row width allow. No torch, no CUDA headers here: pointers are
// device addresses and `stream` is a cudaStream_t (torch.cuda.current_stream().cuda_stream).
#pragma once

#include <cstdint>
#include <string>

namespace dflop::cuda {

// dst[r] = src[index[r]] for r < count. `index`: a device int64 array whose values were
// checked on the host (dflop::check_row_index against src's rows). Enqueued on `stream`;
// nothing waits. Returns "" or the CUDA error's description.
std::string gather_rows(const void* src, const int64_t* index, int64_t count, void* dst,
                        int64_t row_bytes, void* stream);

// dst[index[r]] = src[r] for r < count (`index` checked unique and < dst's rows).
std::string scatter_rows(const void* src, const int64_t* index, int64_t count, void* dst,
                         int64_t row_bytes, void* stream);

// The number of visible CUDA devices (0 when there is no driver or no device).
int device_count();

}  // namespace dflop::cuda
