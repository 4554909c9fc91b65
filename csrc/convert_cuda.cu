// CUDA implementation of the per-step conversion: one thread per output row, running the row
// functions of convert.h (the column rows, thousands of entries long, take a block each).
// Everything stays on the device (no host synchronisation), on the current stream, so it can
// sit inside a ring step or a CUDA graph.
#include "convert.h"

// c10's stream header rather than ATen/cuda/CUDAContext.h: the same current-stream function
// (at::cuda::getCurrentCUDAStream is c10's), without pulling in the cuBLAS/cuSPARSE headers.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace mtraining {
namespace {

constexpr int kThreads = 256;

int64_t num_launch_blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }

// inv[ids[i]] = i. Ids are unique by contract; out-of-range ones are skipped rather than
// written out of bounds (checking them would need a host synchronisation).
__global__ void inverse_map_kernel(const int32_t* __restrict__ ids, int64_t n, int64_t num_blocks,
                                   int32_t* __restrict__ inv) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int32_t g = ids[i];
  if (g >= 0 && g < num_blocks) inv[g] = static_cast<int32_t>(i);
}

// Row (bh, i) of kv_blocks: thread per local query block.
__global__ void kv_kernel(const int32_t* __restrict__ slash, const int32_t* __restrict__ n_slash,
                          int64_t max_s, const int32_t* __restrict__ q_ids, int64_t nqb,
                          const int32_t* __restrict__ inv_k, int64_t num_blocks,
                          const int32_t* __restrict__ floor, int64_t rows,
                          int32_t* __restrict__ count, int32_t* __restrict__ blocks) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= rows) return;
  const int64_t bh = row / nqb, i = row % nqb;
  count[row] = kv_row(slash + bh * max_s, clamp_count(n_slash[bh], max_s), q_ids[i], inv_k,
                      num_blocks, floor, blocks + row * max_s);
}

// Row (bh, j) of q_blocks: thread per local key block.
__global__ void q_kernel(const int32_t* __restrict__ slash, const int32_t* __restrict__ n_slash,
                         int64_t max_s, const int32_t* __restrict__ k_ids, int64_t nkb,
                         const int32_t* __restrict__ inv_q, int64_t num_blocks,
                         const int32_t* __restrict__ floor, int64_t rows,
                         int32_t* __restrict__ count, int32_t* __restrict__ blocks) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= rows) return;
  const int64_t bh = row / nkb, j = row % nkb;
  count[row] = q_row(slash + bh * max_s, clamp_count(n_slash[bh], max_s), k_ids[j], inv_q,
                     num_blocks, floor, blocks + row * max_s);
}

// Row bh of cols: a block of kThreads per (batch, head). A row holds up to max_vertical columns
// (thousands), so one thread per row spent ~1 ms in dependent loads at 128K. Here each thread
// takes a contiguous run of the row, a block-wide scan of the runs' counts gives each run its
// output offset, and the output keeps the input order, as col_row's does.
__global__ void col_kernel(const int32_t* __restrict__ vertical, const int32_t* __restrict__ n_vertical,
                           int64_t max_v, const int32_t* __restrict__ inv_k, int64_t num_blocks,
                           int64_t block_size, int32_t* __restrict__ count, int32_t* __restrict__ cols) {
  __shared__ int32_t scan[kThreads];
  const int64_t bh = blockIdx.x;
  const int64_t n = clamp_count(n_vertical[bh], max_v);
  const int32_t* row = vertical + bh * max_v;
  const int64_t per_thread = (n + kThreads - 1) / kThreads;
  const int64_t begin = min(n, threadIdx.x * per_thread), end = min(n, begin + per_thread);
  int32_t mine = 0;
  for (int64_t t = begin; t < end; ++t) mine += col_local(row[t], inv_k, num_blocks, block_size) >= 0;
  scan[threadIdx.x] = mine;
  __syncthreads();
  for (int stride = 1; stride < kThreads; stride *= 2) {  // inclusive Hillis-Steele scan
    const int32_t add = threadIdx.x >= stride ? scan[threadIdx.x - stride] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  int32_t* out = cols + bh * max_v + (scan[threadIdx.x] - mine);
  for (int64_t t = begin; t < end; ++t) {
    const int32_t local = col_local(row[t], inv_k, num_blocks, block_size);
    if (local >= 0) *out++ = local;
  }
  if (threadIdx.x == kThreads - 1) count[bh] = scan[kThreads - 1];
}

at::Tensor inverse_map(const at::Tensor& ids, int64_t num_blocks, cudaStream_t stream) {
  auto inv = at::full({num_blocks}, -1, ids.options());  // fill runs on the current stream too
  const int64_t n = ids.numel();
  if (n > 0) {
    inverse_map_kernel<<<num_launch_blocks(n), kThreads, 0, stream>>>(
        ids.data_ptr<int32_t>(), n, num_blocks, inv.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return inv;
}

}  // namespace

std::vector<at::Tensor> convert_step_cuda(const at::Tensor& slash, const at::Tensor& n_slash,
                                          const at::Tensor& vertical, const at::Tensor& n_vertical,
                                          const at::Tensor& q_block_ids, const at::Tensor& k_block_ids,
                                          int64_t num_blocks, int64_t block_size,
                                          const std::optional<at::Tensor>& key_block_floor) {
  const c10::cuda::CUDAGuard guard(slash.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t b = slash.size(0), h = slash.size(1), max_s = slash.size(2), max_v = vertical.size(2);
  const int64_t nqb = q_block_ids.numel(), nkb = k_block_ids.numel(), bh = b * h;

  const auto opts = slash.options();
  auto kv_count = at::zeros({b, h, nqb}, opts), kv_blocks = at::zeros({b, h, nqb, max_s}, opts);
  auto q_count = at::zeros({b, h, nkb}, opts), q_blocks = at::zeros({b, h, nkb, max_s}, opts);
  auto col_count = at::zeros({b, h}, opts), cols = at::zeros({b, h, max_v}, opts);
  const auto inv_q = inverse_map(q_block_ids, num_blocks, stream);
  const auto inv_k = inverse_map(k_block_ids, num_blocks, stream);
  const int32_t* floor = key_block_floor ? key_block_floor->data_ptr<int32_t>() : nullptr;

  // A grid of zero blocks is an invalid launch, so empty outputs skip their kernel.
  if (bh * nqb > 0) {
    kv_kernel<<<num_launch_blocks(bh * nqb), kThreads, 0, stream>>>(
        slash.data_ptr<int32_t>(), n_slash.data_ptr<int32_t>(), max_s, q_block_ids.data_ptr<int32_t>(),
        nqb, inv_k.data_ptr<int32_t>(), num_blocks, floor, bh * nqb, kv_count.data_ptr<int32_t>(),
        kv_blocks.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (bh * nkb > 0) {
    q_kernel<<<num_launch_blocks(bh * nkb), kThreads, 0, stream>>>(
        slash.data_ptr<int32_t>(), n_slash.data_ptr<int32_t>(), max_s, k_block_ids.data_ptr<int32_t>(),
        nkb, inv_q.data_ptr<int32_t>(), num_blocks, floor, bh * nkb, q_count.data_ptr<int32_t>(),
        q_blocks.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (bh > 0) {
    col_kernel<<<bh, kThreads, 0, stream>>>(
        vertical.data_ptr<int32_t>(), n_vertical.data_ptr<int32_t>(), max_v, inv_k.data_ptr<int32_t>(),
        num_blocks, block_size, col_count.data_ptr<int32_t>(), cols.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {kv_count, kv_blocks, q_count, q_blocks, col_count, cols};
}

}  // namespace mtraining
