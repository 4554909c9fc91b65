"""megatron-core's optimizer and torch_dist checkpointing on the CPU, for tests' worker processes.

Both assume CUDA beyond what ``megatron_mtraining.testing.cpu_shims`` covers: ``device='cuda'``
tensors, ``param.type() == 'torch.cuda.BFloat16Tensor'``, CUDA streams and synchronisation, the
CUDA RNG state in a checkpoint, a Manager process for the writer's results.
``apply_checkpoint_cpu_shims`` answers them on the CPU, process-wide and never undone: call it in
a worker process that ends with the test. ``extra_modules``: more modules whose ``torch`` global
is replaced (Megatron-LM's ``megatron.training.checkpointing`` for its loader and saver).
"""

from __future__ import annotations

import importlib
import io
import multiprocessing
import queue
import types

import torch


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like")
# Modules whose ``torch`` global is replaced by a proxy that builds 'cuda' tensors on the CPU.
_CUDA_MODULES = ("megatron.core.utils", "megatron.core.optimizer.optimizer",
                 "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.clip_grads",
                 "megatron.core.optimizer.grad_scaler", "megatron.core.distributed.param_and_grad_buffer",
                 "megatron.core.distributed.distributed_data_parallel",
                 "megatron.core.dist_checkpointing.strategies.torch",
                 "megatron.core.dist_checkpointing.strategies.filesystem_async",
                 "megatron.core.dist_checkpointing.strategies.state_dict_saver",
                 "megatron.core.dist_checkpointing.strategies.async_utils")


class _Stream:
    def wait_event(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass


class _CudaOnCpu(types.ModuleType):
    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    def current_stream(self, *args, **kwargs):
        return _Stream()

    def current_device(self):
        return "cpu"

    def empty_cache(self):
        pass

    def synchronize(self, *args, **kwargs):
        pass

    def get_rng_state(self, *args, **kwargs):  # a checkpoint's "cuda_rng_state": the CPU generator's
        return torch.get_rng_state()


def _on_cpu(factory):
    def build(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or str(device).startswith("cuda")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return build


class _TorchOnCpu(types.ModuleType):
    cuda = _CudaOnCpu("torch.cuda")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        return _on_cpu(attr) if name in _FACTORIES else attr


def apply_checkpoint_cpu_shims(extra_modules=()) -> None:
    """Worker processes only: process-wide and never undone (the process ends with the test)."""
    tensor_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):  # 'torch.BFloat16Tensor' -> 'torch.cuda.BFloat16Tensor'
        out = tensor_type(self, *args, **kwargs)
        if not args and not kwargs and self.device.type == "cpu":
            return out.replace("torch.", "torch.cuda.", 1)
        return out

    torch.Tensor.type = cuda_type
    for name in (*_CUDA_MODULES, *extra_modules):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.torch = _TorchOnCpu("torch")
    # The torch_dist writer: a synchronous save puts its results in a queue and reads them back in
    # this same process (a plain queue, not a Manager server process); megatron-core 0.16 writes from
    # forked children, which a daemonic process (run_distributed's workers) may not have.
    filesystem_async = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")
    for name in ("get_write_results_queue", "_get_write_results_queue"):
        if hasattr(filesystem_async, name):
            setattr(filesystem_async, name, lambda *args, **kwargs: queue.Queue())
    multiprocessing.current_process()._config["daemon"] = False
    if not getattr(filesystem_async, "HAVE_PSUTIL", True):  # only logs the writer's memory use
        filesystem_async._process_memory = lambda: 0


def read_objects_in_place() -> None:
    """PyTorch 2.13's DCP fills a checkpoint's byte objects into the BytesIO it was given instead of
    returning them unpickled, which megatron-core 0.19's torch_dist loader expects (its own
    ``load_common_state_dict`` handles both); unpickle such a value where the loader unwraps it."""
    strategy = importlib.import_module("megatron.core.dist_checkpointing.strategies.torch")
    unwrap = strategy._unwrap_pyt_sharded_tensor

    def unwrap_bytes(value):
        if isinstance(value, io.BytesIO):
            value.seek(0)
            return torch.load(value, weights_only=False)
        return unwrap(value)

    strategy._unwrap_pyt_sharded_tensor = unwrap_bytes
