# Diagnosis of a SIGSEGV seen when the CUDA build of megatron_mtraining._C raises a second error.
import torch
import megatron_mtraining._C as C
i32 = dict(dtype=torch.int32)
slash, n_slash = torch.zeros(1, 2, 3, **i32), torch.ones(1, 2, **i32)
vertical, n_vertical = torch.zeros(1, 2, 4, **i32), torch.zeros(1, 2, **i32)
ids = torch.arange(4, **i32)
for label, args in (("dtype", (slash.long(), n_slash)), ("dims", (slash, n_slash[0])), ("dims again", (slash, n_slash[0]))):
    try:
        C.convert_step(*args, vertical, n_vertical, ids, ids, 4, 64)
    except RuntimeError as e:
        print(label, "-> caught:", str(e).splitlines()[0], flush=True)
