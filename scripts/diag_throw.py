# Diagnosis: does an exception thrown by a torch C++ extension crash on this machine?
import torch, subprocess, sys
from torch.utils.cpp_extension import load_inline
print(subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0])
print("torch", torch.__version__, "cxx11abi", torch._C._GLIBCXX_USE_CXX11_ABI)
cpp = r'''
#include <torch/extension.h>
void boom(const at::Tensor& t) { TORCH_CHECK(t.scalar_type() == at::kInt, "must be int32, got ", t.scalar_type()); }
void boom_std() { throw std::runtime_error("plain std error"); }
'''
mod = load_inline("diag_throw", cpp, functions=["boom", "boom_std"], verbose=False)
for f, a in ((mod.boom_std, ()), (mod.boom, (torch.zeros(1),))):
    try:
        f(*a)
    except Exception as e:
        print("caught", type(e).__name__, str(e).splitlines()[0])
sys.stdout.flush()
import megatron_mtraining._C as C
try:
    C.convert_step(torch.zeros(1, 1, 1), *(torch.zeros(1, 1, dtype=torch.int32),) * 0, torch.zeros(1,1,dtype=torch.int32), torch.zeros(1,1,1,dtype=torch.int32), torch.zeros(1,1,dtype=torch.int32), torch.zeros(1,dtype=torch.int32), torch.zeros(1,dtype=torch.int32), 1, 64)
except Exception as e:
    print("ext caught", type(e).__name__, str(e).splitlines()[0])
