// CPU implementation of the per-step conversion: plain loops over the rows of convert.h.
#include "convert.h"

#include <ATen/Parallel.h>

#include <string>

namespace mtraining {
namespace {

// global block -> local block, -1 where the chunk does not hold it. On the CPU the ids are
// cheap to check, so bad ones fail loudly instead of being silently dropped.
std::vector<int32_t> inverse_map(const at::Tensor& ids, int64_t num_blocks, const char* name) {
  std::vector<int32_t> inv(num_blocks, -1);
  const int32_t* p = ids.data_ptr<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < num_blocks, "convert_step: ", name, "[", std::to_string(i), "] = ",
                std::to_string(p[i]), " is out of range [0, ", std::to_string(num_blocks), ")");
    TORCH_CHECK(inv[p[i]] < 0, "convert_step: ", name, " holds block ", std::to_string(p[i]), " twice");
    inv[p[i]] = static_cast<int32_t>(i);
  }
  return inv;
}

}  // namespace

std::vector<at::Tensor> convert_step_cpu(const at::Tensor& slash, const at::Tensor& n_slash,
                                         const at::Tensor& vertical, const at::Tensor& n_vertical,
                                         const at::Tensor& q_block_ids, const at::Tensor& k_block_ids,
                                         int64_t num_blocks, int64_t block_size,
                                         const std::optional<at::Tensor>& key_block_floor) {
  const int64_t b = slash.size(0), h = slash.size(1), max_s = slash.size(2), max_v = vertical.size(2);
  const int64_t nqb = q_block_ids.numel(), nkb = k_block_ids.numel();
  const auto inv_q = inverse_map(q_block_ids, num_blocks, "q_block_ids");
  const auto inv_k = inverse_map(k_block_ids, num_blocks, "k_block_ids");

  const auto opts = slash.options();
  auto kv_count = at::zeros({b, h, nqb}, opts), kv_blocks = at::zeros({b, h, nqb, max_s}, opts);
  auto q_count = at::zeros({b, h, nkb}, opts), q_blocks = at::zeros({b, h, nkb, max_s}, opts);
  auto col_count = at::zeros({b, h}, opts), cols = at::zeros({b, h, max_v}, opts);

  const int32_t *s = slash.data_ptr<int32_t>(), *ns = n_slash.data_ptr<int32_t>();
  const int32_t *v = vertical.data_ptr<int32_t>(), *nv = n_vertical.data_ptr<int32_t>();
  const int32_t *qid = q_block_ids.data_ptr<int32_t>(), *kid = k_block_ids.data_ptr<int32_t>();
  int32_t *kvc = kv_count.data_ptr<int32_t>(), *kvb = kv_blocks.data_ptr<int32_t>();
  int32_t *qc = q_count.data_ptr<int32_t>(), *qbl = q_blocks.data_ptr<int32_t>();
  int32_t *cc = col_count.data_ptr<int32_t>(), *cl = cols.data_ptr<int32_t>();
  const int32_t* floor = key_block_floor ? key_block_floor->data_ptr<int32_t>() : nullptr;

  // Each (batch, head) writes only its own output rows, so heads run in parallel.
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int32_t* srow = s + bh * max_s;
      const int64_t n_s = clamp_count(ns[bh], max_s);
      for (int64_t i = 0; i < nqb; ++i) {
        const int64_t row = bh * nqb + i;
        kvc[row] = kv_row(srow, n_s, qid[i], inv_k.data(), num_blocks, floor, kvb + row * max_s);
      }
      for (int64_t j = 0; j < nkb; ++j) {
        const int64_t row = bh * nkb + j;
        qc[row] = q_row(srow, n_s, kid[j], inv_q.data(), num_blocks, floor, qbl + row * max_s);
      }
      cc[bh] = col_row(v + bh * max_v, clamp_count(nv[bh], max_v), inv_k.data(), num_blocks,
                       block_size, cl + bh * max_v);
    }
  });
  return {kv_count, kv_blocks, q_count, q_blocks, col_count, cols};
}

}  // namespace mtraining
