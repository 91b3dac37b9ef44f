// Row gather / scatter kernels behind dflop/cuda_rows.hpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "dflop/cuda_rows.hpp"

namespace dflop::cuda {
namespace {

// One row per block (grid-stride over rows), the block's threads over the row's vectors.
// kScatter: the index names the destination row, else the source row.
template <typename Vec, bool kScatter>
__global__ void copy_rows(const char* __restrict__ src, const int64_t* __restrict__ index,
                          int64_t count, char* __restrict__ dst, int64_t row_vecs) {
  const int64_t row_bytes = row_vecs * static_cast<int64_t>(sizeof(Vec));
  for (int64_t r = blockIdx.x; r < count; r += gridDim.x) {
    const int64_t from = kScatter ? r : index[r];
    const int64_t to = kScatter ? index[r] : r;
    const Vec* in = reinterpret_cast<const Vec*>(src + from * row_bytes);
    Vec* out = reinterpret_cast<Vec*>(dst + to * row_bytes);
    for (int64_t v = threadIdx.x; v < row_vecs; v += blockDim.x) out[v] = in[v];
  }
}

template <bool kScatter>
std::string launch(const void* src, const int64_t* index, int64_t count, void* dst,
                   int64_t row_bytes, void* stream) {
  if (count < 0 || row_bytes <= 0) return "count must be >= 0 and row_bytes > 0";
  if (count == 0) return "";
  if (!src || !dst || !index) return "null device pointer";
  // The widest vector that divides the row width and both base addresses.
  const auto alignment = static_cast<uint64_t>(row_bytes) | reinterpret_cast<uintptr_t>(src) |
                         reinterpret_cast<uintptr_t>(dst);
  int width = 16;
  while (width > 1 && (alignment % static_cast<uint64_t>(width)) != 0) width /= 2;
  const int64_t row_vecs = row_bytes / width;
  const int threads = static_cast<int>(std::min<int64_t>(256, ((row_vecs + 31) / 32) * 32));
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(count, 65535));
  auto s = static_cast<cudaStream_t>(stream);
  const auto* in = static_cast<const char*>(src);
  auto* out = static_cast<char*>(dst);
  switch (width) {
    case 16:
      copy_rows<uint4, kScatter><<<blocks, threads, 0, s>>>(in, index, count, out, row_vecs);
      break;
    case 8:
      copy_rows<uint2, kScatter><<<blocks, threads, 0, s>>>(in, index, count, out, row_vecs);
      break;
    case 4:
      copy_rows<uint32_t, kScatter><<<blocks, threads, 0, s>>>(in, index, count, out, row_vecs);
      break;
    case 2:
      copy_rows<uint16_t, kScatter><<<blocks, threads, 0, s>>>(in, index, count, out, row_vecs);
      break;
    default:
      copy_rows<uint8_t, kScatter><<<blocks, threads, 0, s>>>(in, index, count, out, row_vecs);
  }
  const cudaError_t status = cudaGetLastError();
  return status == cudaSuccess ? "" : cudaGetErrorString(status);
}

}  // namespace

std::string gather_rows(const void* src, const int64_t* index, int64_t count, void* dst,
                        int64_t row_bytes, void* stream) {
  return launch<false>(src, index, count, dst, row_bytes, stream);
}

std::string scatter_rows(const void* src, const int64_t* index, int64_t count, void* dst,
                         int64_t row_bytes, void* stream) {
  return launch<true>(src, index, count, dst, row_bytes, stream);
}

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the error: no driver or no device is not a failure here
    return 0;
  }
  return count;
}

}  // namespace dflop::cuda
