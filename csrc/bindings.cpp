// Python module megatron_mtraining._C: input checks and device dispatch for convert_step.
#include <torch/extension.h>

#include <string>

#include "convert.h"

namespace mtraining {
namespace {

// Error messages pass only strings to TORCH_CHECK: in the CUDA build on the GPU machines,
// streaming an integer into the message crashed (SIGSEGV in std::ostream::_M_insert<long>
// resolved inside _C.so), so numbers are formatted with std::to_string.
// "[2, 3, 4]"
std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

void check_tensor(const at::Tensor& t, const char* name, int64_t dim, const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "convert_step: ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "convert_step: ", name, " must have ", std::to_string(dim), " dims, got shape ", shape_str(t));
  TORCH_CHECK(t.device() == device, "convert_step: ", name, " is on ", t.device().str(),
              " but slash is on ", device.str(), "; all inputs must share one device");
  TORCH_CHECK(t.is_contiguous(), "convert_step: ", name, " must be contiguous");
}

std::vector<at::Tensor> convert_step(const at::Tensor& slash, const at::Tensor& n_slash,
                                     const at::Tensor& vertical, const at::Tensor& n_vertical,
                                     const at::Tensor& q_block_ids, const at::Tensor& k_block_ids,
                                     int64_t num_blocks, int64_t block_size,
                                     const std::optional<at::Tensor>& key_block_floor) {
  const auto device = slash.device();
  check_tensor(slash, "slash", 3, device);
  check_tensor(n_slash, "n_slash", 2, device);
  check_tensor(vertical, "vertical", 3, device);
  check_tensor(n_vertical, "n_vertical", 2, device);
  check_tensor(q_block_ids, "q_block_ids", 1, device);
  check_tensor(k_block_ids, "k_block_ids", 1, device);
  const auto bh = slash.sizes().slice(0, 2);
  TORCH_CHECK(n_slash.sizes() == bh && vertical.sizes().slice(0, 2) == bh && n_vertical.sizes() == bh,
              "convert_step: shapes disagree on [batch, heads]: slash ", shape_str(slash), ", n_slash ",
              shape_str(n_slash), ", vertical ", shape_str(vertical), ", n_vertical ", shape_str(n_vertical));
  TORCH_CHECK(num_blocks >= 1, "convert_step: num_blocks must be >= 1, got ", std::to_string(num_blocks));
  TORCH_CHECK(block_size >= 1, "convert_step: block_size must be >= 1, got ", std::to_string(block_size));
  if (key_block_floor) {
    check_tensor(*key_block_floor, "key_block_floor", 1, device);
    TORCH_CHECK(key_block_floor->numel() == num_blocks, "convert_step: key_block_floor must have num_blocks = ",
                std::to_string(num_blocks), " entries, got ", std::to_string(key_block_floor->numel()));
  }

  if (device.is_cpu()) {
    return convert_step_cpu(slash, n_slash, vertical, n_vertical, q_block_ids, k_block_ids, num_blocks,
                            block_size, key_block_floor);
  }
  if (device.is_cuda()) {
#ifdef WITH_CUDA
    return convert_step_cuda(slash, n_slash, vertical, n_vertical, q_block_ids, k_block_ids, num_blocks,
                             block_size, key_block_floor);
#else
    TORCH_CHECK(false, "convert_step: megatron_mtraining._C was built without CUDA, so it cannot take "
                       "CUDA tensors; rebuild with a CUDA toolkit and a CUDA build of torch, or use "
                       "the PyTorch path (impl='torch')");
#endif
  }
  TORCH_CHECK(false, "convert_step: unsupported device ", device.str(), " (only CPU and CUDA)");
}

bool has_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace mtraining

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_mtraining compiled helpers (per-step VSIndex conversion)";
  m.def("convert_step", &mtraining::convert_step, "Per-step VSIndex conversion; see kernels/step_plan.py",
        pybind11::arg("slash"), pybind11::arg("n_slash"), pybind11::arg("vertical"),
        pybind11::arg("n_vertical"), pybind11::arg("q_block_ids"), pybind11::arg("k_block_ids"),
        pybind11::arg("num_blocks"), pybind11::arg("block_size"),
        pybind11::arg("key_block_floor") = pybind11::none());
  m.def("has_cuda", &mtraining::has_cuda, "True iff built with the CUDA kernels");
}
