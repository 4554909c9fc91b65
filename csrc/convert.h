// Per-step VSIndex conversion (megatron_mtraining/kernels/step_plan.py, convert_step_reference).
//
// The row functions below are shared by the CPU loops and the CUDA kernels, so both
// implementations run the very same logic and the CPU tests cover the GPU arithmetic too.
// Output rows must be zero-initialised by the caller: a row function writes only its entries.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#ifdef __CUDACC__
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif

namespace mtraining {

// A count read from an input, clamped to [0, cap] like the reference's `arange(cap) < n` mask.
MT_HOST_DEVICE inline int64_t clamp_count(int32_t n, int64_t cap) {
  return n < 0 ? 0 : (n > cap ? cap : n);
}

// Packed documents: `floor[qb]` (global query block -> first global key block sharing a document
// with one of its queries; nullptr without documents). Pairs below it are in earlier documents.
MT_HOST_DEVICE inline bool before_floor(const int32_t* floor, int64_t qb, int64_t kb) {
  return floor != nullptr && kb < floor[qb];
}

// Local key blocks read by the query block with global id `q_block`: q_block - delta for each
// slash offset, largest delta first (ascending key order, the diagonal last).
MT_HOST_DEVICE inline int32_t kv_row(const int32_t* slash, int64_t n, int32_t q_block,
                                     const int32_t* inv_k, int64_t num_blocks, const int32_t* floor,
                                     int32_t* out) {
  int32_t count = 0;
  for (int64_t t = n - 1; t >= 0; --t) {
    if (slash[t] < 0) continue;  // a key block after the query block: never attended (plan.py)
    const int64_t kb = static_cast<int64_t>(q_block) - slash[t];  // int64: no overflow on odd offsets
    if (kb >= 0 && kb < num_blocks && inv_k[kb] >= 0 && !before_floor(floor, q_block, kb)) out[count++] = inv_k[kb];
  }
  return count;
}

// Local query blocks reading the key block with global id `k_block`: k_block + delta, smallest first.
MT_HOST_DEVICE inline int32_t q_row(const int32_t* slash, int64_t n, int32_t k_block,
                                    const int32_t* inv_q, int64_t num_blocks, const int32_t* floor,
                                    int32_t* out) {
  int32_t count = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (slash[t] < 0) continue;
    const int64_t qb = static_cast<int64_t>(k_block) + slash[t];
    if (qb >= 0 && qb < num_blocks && inv_q[qb] >= 0 && !before_floor(floor, qb, k_block)) out[count++] = inv_q[qb];
  }
  return count;
}

// Local key-token index of global column `c` in the key chunk, -1 where the chunk does not hold it.
MT_HOST_DEVICE inline int32_t col_local(int32_t c, const int32_t* inv_k, int64_t num_blocks,
                                        int64_t block_size) {
  if (c < 0 || c >= num_blocks * block_size) return -1;
  const int64_t local = inv_k[c / block_size];
  return local < 0 ? -1 : static_cast<int32_t>(local * block_size + c % block_size);
}

// Vertical columns held by the key chunk, as local key-token indices, in input order.
MT_HOST_DEVICE inline int32_t col_row(const int32_t* vertical, int64_t n, const int32_t* inv_k,
                                      int64_t num_blocks, int64_t block_size, int32_t* out) {
  int32_t count = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int32_t local = col_local(vertical[t], inv_k, num_blocks, block_size);
    if (local >= 0) out[count++] = local;
  }
  return count;
}

// Both return {kv_count, kv_blocks, q_count, q_blocks, col_count, cols}; inputs are checked
// by the dispatcher in bindings.cpp. `key_block_floor`: int32 [num_blocks] for packed documents.
std::vector<at::Tensor> convert_step_cpu(const at::Tensor& slash, const at::Tensor& n_slash,
                                         const at::Tensor& vertical, const at::Tensor& n_vertical,
                                         const at::Tensor& q_block_ids, const at::Tensor& k_block_ids,
                                         int64_t num_blocks, int64_t block_size,
                                         const std::optional<at::Tensor>& key_block_floor);

#ifdef WITH_CUDA
std::vector<at::Tensor> convert_step_cuda(const at::Tensor& slash, const at::Tensor& n_slash,
                                          const at::Tensor& vertical, const at::Tensor& n_vertical,
                                          const at::Tensor& q_block_ids, const at::Tensor& k_block_ids,
                                          int64_t num_blocks, int64_t block_size,
                                          const std::optional<at::Tensor>& key_block_floor);
#endif

}  // namespace mtraining
