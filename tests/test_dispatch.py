"""kernels/dispatch.py's decision table, row by row, on the CPU: the device's capabilities (CUDA,
compute capability, Gluon, the interpreter, cuDNN, the compiled extension) are monkeypatched,
and the step functions are checked to run what dispatch picks."""

import logging
import types

import pytest
import torch

from megatron_mtraining import VSIndex
from megatron_mtraining.config import Settings
from megatron_mtraining.kernels import common, dispatch, single_device_plan, step
from megatron_mtraining.kernels.dispatch import BackwardParts

CUDA = torch.device("cuda")  # only a name here: nothing is allocated on it
CPU = torch.device("cpu")


@pytest.fixture
def fresh(monkeypatch):
    """Nothing announced, the device answer recomputed."""
    monkeypatch.setattr(dispatch, "_ANNOUNCED", set())
    cached = dispatch.hopper_device_reason  # the sm90 fixture replaces it until after this teardown
    cached.cache_clear()
    yield monkeypatch
    cached.cache_clear()


@pytest.fixture
def sm90(fresh):
    """Every device is an sm_90 GPU with Gluon (the coverage of the call still decides)."""
    fresh.setattr(dispatch, "hopper_device_reason", lambda device: "")
    return fresh


def _plan(block_size):
    return types.SimpleNamespace(block_size=block_size)


def _qkv(dtype=torch.bfloat16, d=128):
    x = torch.zeros(1, 2, 256, d, dtype=dtype)
    return x, x, x


# ------------------------------------------------------------------------------------------ backend


# The approximator's statistics kernels (approx_kernel) are resolved as the attention's backend.
CHOOSERS = [dispatch.resolve_backend, dispatch.approx_kernel]


@pytest.mark.parametrize("choose", CHOOSERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("device, interpreted, asked, want", [
    (CUDA, False, "auto", "triton"),
    (CPU, False, "auto", "torch"),
    (CPU, True, "auto", "torch"),  # the interpreter never makes "auto" Triton
    (CPU, True, "triton", "triton"),
    (CUDA, False, "torch", "torch"),
    (CPU, False, "torch", "torch"),
])
def test_backend(monkeypatch, choose, device, interpreted, asked, want):
    monkeypatch.setattr(common, "INTERPRETING", interpreted)
    assert choose(asked, device) == want


@pytest.mark.parametrize("choose", CHOOSERS, ids=lambda f: f.__name__)
def test_backend_errors(monkeypatch, choose):
    monkeypatch.setattr(common, "INTERPRETING", False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        choose("triton", CPU)
    with pytest.raises(ValueError, match="backend must be one of"):
        choose("cuda", CUDA)


def test_the_approximator_runs_the_kernels_dispatch_picks(monkeypatch):
    """approx.py asks dispatch, and runs the Triton statistics exactly when told "triton"."""
    from megatron_mtraining import MTrainingConfig, approx
    from megatron_mtraining.kernels import triton_approx
    asked = []

    def pick(kernel):
        def approx_kernel(backend, device):
            asked.append((backend, device))
            return kernel
        return approx_kernel

    def launched(*args, **kwargs):
        raise RuntimeError("triton_approx launched")

    monkeypatch.setattr(triton_approx, "row_partials", launched)
    q = torch.randn(1, 2, 256, 16)
    cfg = MTrainingConfig(block_size=64, last_q=64)
    monkeypatch.setattr(approx, "approx_kernel", pick("torch"))
    approx.vs_statistics(q, q, cfg, backend="auto")
    assert asked == [("auto", q.device)]
    monkeypatch.setattr(approx, "approx_kernel", pick("triton"))
    with pytest.raises(RuntimeError, match="triton_approx launched"):
        approx.vs_statistics(q, q, cfg, backend="auto")


# ---------------------------------------------------------------------------- can the Hopper kernels run


@pytest.mark.parametrize("device, interpreted, capability, gluon, want", [
    (CPU, False, (9, 0), True, "not a CUDA device (cpu)"),
    (CUDA, True, (9, 0), True, "not a CUDA device (cuda, TRITON_INTERPRET=1)"),
    (CUDA, False, (8, 0), True, "compute capability 8.0 (sm_90 only)"),
    (CUDA, False, (10, 0), True, "compute capability 10.0 (sm_90 only)"),
    (CUDA, False, (9, 0), False, "this Triton has no Gluon (triton.experimental.gluon)"),
    (CUDA, False, (9, 0), True, ""),
])
def test_hopper_device(fresh, device, interpreted, capability, gluon, want):
    fresh.setattr(common, "INTERPRETING", interpreted)
    fresh.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    fresh.setattr(dispatch, "_has_gluon", lambda: gluon)
    assert dispatch.hopper_device_reason(device) == want


def test_hopper_coverage():
    q, k, v = _qkv()
    assert dispatch.hopper_unsupported_reason(64, dict(q=q, k=k, v=v)) == ""
    assert dispatch.hopper_unsupported_reason(128, dict(q=q.half(), k=k.half(), v=v.half())) == ""
    assert dispatch.hopper_unsupported_reason(256, dict(q=q)) == ""
    assert dispatch.hopper_unsupported_reason(64, dict(q=q.float())) == "dtype torch.float32 (bf16 or fp16 only)"
    assert dispatch.hopper_unsupported_reason(64, dict(q=_qkv(d=64)[0])) == ""
    assert dispatch.hopper_unsupported_reason(64, dict(q=_qkv(d=96)[0])) == "head_dim 96 (64 or 128 only)"
    assert dispatch.hopper_unsupported_reason(32, dict(q=q)) == "block size 32 (a multiple of 64 only)"
    shifted = torch.zeros(1, 2, 256, 132, dtype=torch.bfloat16)[..., :128]  # 264-byte rows
    assert "k's rows are not 16-byte aligned" in dispatch.hopper_unsupported_reason(64, dict(q=q, k=shifted))


# ------------------------------------------------------------------ the sparse kernels on "triton"


@pytest.mark.parametrize("choice, dtype, d, B, want", [
    ("auto", torch.bfloat16, 128, 64, "hopper"),
    ("auto", torch.float16, 64, 128, "hopper"),
    ("triton", torch.bfloat16, 128, 64, "triton"),  # forced
    ("auto", torch.float32, 128, 64, "triton"),  # not covered: Triton's
    ("auto", torch.bfloat16, 96, 64, "triton"),
    ("auto", torch.bfloat16, 128, 16, "triton"),
    ("hopper", torch.bfloat16, 128, 128, "hopper"),
])
def test_kernel_on_sm90(sm90, choice, dtype, d, B, want):
    q, k, v = _qkv(dtype, d)
    assert dispatch.forward_kernel(q, k, v, _plan(B), q, choice) == want
    assert dispatch.backward_kernel(q, k, v, q, _plan(B), choice) == want


def test_kernel_off_sm90_is_triton_and_forcing_hopper_says_why(fresh):
    fresh.setattr(common, "INTERPRETING", False)
    fresh.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    q, k, v = (x.to(torch.bfloat16) for x in _qkv())
    cuda_like = types.SimpleNamespace(device=CUDA, dtype=q.dtype, shape=q.shape)
    tensors = dict(q=cuda_like, k=k, v=v)
    assert dispatch._kernel_choice("forward", "auto", 64, tensors) == "triton"
    with pytest.raises(ValueError, match=r"the backward kernel is set to hopper \(MTRAINING_BACKWARD_KERNEL, "
                                         r"--mtraining-backward-kernel\), but the Hopper kernel cannot run this "
                                         r"call: compute capability 8\.0 \(sm_90 only\)"):
        dispatch._kernel_choice("backward", "hopper", 64, tensors)


def test_forcing_hopper_on_an_uncovered_call_names_the_reason(sm90):
    q, k, v = _qkv(torch.float32)
    with pytest.raises(ValueError, match=r"forward kernel is set to hopper .*dtype torch.float32"):
        dispatch.forward_kernel(q, k, v, _plan(64), q, "hopper")


def test_a_bad_kernel_choice_is_refused(fresh):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"forward kernel must be one of \('auto', 'triton', 'hopper'\)"):
        dispatch.forward_kernel(q, k, v, _plan(64), q, "cudnn")
    with pytest.raises(ValueError, match=r"MTRAINING_FORWARD_KERNEL must be one of \('auto', 'triton', 'hopper'\)"):
        Settings.from_env({"MTRAINING_FORWARD_KERNEL": "cudnn"})


@pytest.mark.parametrize("variable, field", [("MTRAINING_FORWARD_KERNEL", "forward_kernel"),
                                             ("MTRAINING_BACKWARD_KERNEL", "backward_kernel")])
def test_the_kernel_variables_reach_the_step_through_the_settings(monkeypatch, variable, field):
    """MTRAINING_FORWARD_KERNEL / MTRAINING_BACKWARD_KERNEL become ``Settings`` fields at start-up;
    the step functions pass the field to dispatch (never the environment)."""
    settings = Settings.from_env({variable: "triton"})
    assert getattr(settings, field) == "triton" and Settings.from_env({}) == Settings()
    q, k, v, do, lse, delta, plan = _step_inputs(64)
    asked = []
    monkeypatch.setattr(step, "forward_kernel", lambda *a: asked.append(("forward", a[-1])) or "triton")
    monkeypatch.setattr(step, "backward_kernel", lambda *a: asked.append(("backward", a[-1])) or "triton")
    monkeypatch.setattr(step, "_launchers", lambda family, kernel_launch=(): (lambda *a: None,) * 3)
    import megatron_mtraining.kernels.triton_fwd as triton_fwd
    monkeypatch.setattr(triton_fwd, "vs_attention_fwd_triton", lambda *a: None)
    step.step_forward("triton", q, k, v, plan, torch.empty_like(q), lse, 0.125, False, settings=settings)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    step.step_backward("triton", q, k, v, do, lse, delta, plan, dq, dk, dv, 0.125, settings=settings)
    direction = field.split("_")[0]
    assert {choice for d, choice in asked if d == direction} == {"triton"}
    assert {choice for d, choice in asked if d != direction} == {"auto"}


def test_each_choice_is_logged_once(sm90, caplog):
    q, k, v = _qkv()
    with caplog.at_level(logging.INFO, logger="megatron_mtraining.kernels.dispatch"):
        for _ in range(3):
            dispatch.forward_kernel(q, k, v, _plan(64), q)
        dispatch.forward_kernel(q.float(), k, v, _plan(64), q)  # another choice: said once more
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith("MTraining: forward on the Hopper kernel")
    assert said[1] == ("MTraining: forward on the Triton kernel (the Hopper one does not cover this call: dtype "
                       "torch.float32 (bf16 or fp16 only))")


@pytest.mark.parametrize("B, rows", [(64, 64), (128, 128), (256, 64)])
def test_hopper_forward_schedule(B, rows):
    assert dispatch.hopper_forward_rows(B) == rows


@pytest.mark.parametrize("kernel, B, parts", [
    ("triton", 64, ("triton", "triton", "triton")),
    ("triton", 128, ("triton", "triton", "triton")),
    ("hopper", 64, ("triton", "triton", "hopper")),
    ("hopper", 128, ("hopper", "hopper", "hopper")),
    ("hopper", 256, ("triton", "triton", "hopper")),
])
def test_backward_parts(kernel, B, parts):
    assert dispatch.backward_parts(kernel, B) == BackwardParts(*parts)


def test_backward_parts_refuses_an_unknown_kernel():
    with pytest.raises(ValueError, match="kernel must be 'triton' or 'hopper'"):
        dispatch.backward_parts("cudnn", 64)


# --------------------------------------------------------- the step functions run what dispatch picks


def _step_inputs(B):
    n, d = 256, 64
    index = VSIndex.random(1, 2, n, B, max_slash=2, max_vertical=8, generator=torch.Generator().manual_seed(B))
    q, k, v, do = (torch.randn(1, 2, n, d) for _ in range(4))
    lse = delta = torch.zeros(1, 2, n)
    return q, k, v, do, lse, delta, single_device_plan(index, n)


@pytest.mark.parametrize("kernel, B", [("hopper", 64), ("hopper", 128), ("triton", 128)])
def test_step_backward_launches_each_part_where_dispatch_says(monkeypatch, kernel, B):
    q, k, v, do, lse, delta, plan = _step_inputs(B)
    calls = []

    def launchers(family, kernel_launch=()):
        return tuple((lambda *a, _p=part, _f=family: calls.append((_p, _f))) for part in ("query", "blocks", "columns"))

    monkeypatch.setattr(step, "backward_kernel", lambda *a: kernel)
    monkeypatch.setattr(step, "_launchers", launchers)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    step.step_backward("triton", q, k, v, do, lse, delta, plan, dq, dk, dv, 0.125)
    want = dispatch.backward_parts(kernel, B)
    assert calls == [("query", want.query), ("blocks", want.blocks), ("columns", want.columns)]


@pytest.mark.parametrize("B", [64, 128])
def test_step_forward_runs_the_hopper_schedule_dispatch_picks(monkeypatch, B):
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from megatron_mtraining.kernels import hopper_fwd

    q, k, v, _, lse, _, plan = _step_inputs(B)
    calls = []
    monkeypatch.setattr(step, "forward_kernel", lambda *a: "hopper")
    monkeypatch.setattr(hopper_fwd, "vs_attention_fwd_hopper", lambda *a, rows: calls.append(rows))
    step.step_forward("triton", q, k, v, plan, torch.empty_like(q), lse, 0.125, False)
    assert calls == [dispatch.hopper_forward_rows(B)]


# ------------------------------------------------------------------------------ the plan's conversions


def test_column_words_kernel(monkeypatch):
    assert dispatch.column_words_kernel(CUDA) == "triton"
    assert dispatch.column_words_kernel(CPU) == "torch"
    # The plan runs what dispatch picks.
    from megatron_mtraining.kernels import step_plan as plan_module

    index = VSIndex.random(1, 2, 256, 64, max_slash=2, max_vertical=30, generator=torch.Generator().manual_seed(3))
    want = single_device_plan(index, 256).column_words  # the CPU's: PyTorch
    calls = []

    def spy(*args, col_count=None):
        calls.append(args)
        assert col_count is not None  # the plan's counts: the kernel skips the words past them
        return plan_module.column_words_reference(*args)

    monkeypatch.setattr(plan_module, "column_words_triton", spy)
    monkeypatch.setattr(plan_module, "column_words_kernel", lambda device: "triton")
    got = single_device_plan(index, 256).column_words
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("impl, supported, want", [
    ("auto", True, "ext"), ("ext", True, "ext"), ("auto", False, "torch"), ("torch", True, "torch"),
    ("torch", False, "torch"),
])
def test_conversion(monkeypatch, impl, supported, want):
    monkeypatch.setattr(dispatch._ext, "supports", lambda device: supported)
    assert dispatch.conversion_impl(impl, CPU) == want


def test_conversion_errors(monkeypatch):
    monkeypatch.setattr(dispatch._ext, "supports", lambda device: False)
    with pytest.raises(RuntimeError, match="convert_step: the compiled extension is not available for cpu"):
        dispatch.conversion_impl("ext", CPU)
    with pytest.raises(ValueError, match="convert_step: impl must be 'auto', 'ext' or 'torch'"):
        dispatch.conversion_impl("cuda", CPU)


# ------------------------------------------------------------------------------------ dense kernels


@pytest.mark.parametrize("impl, cuda, dtype, cudnn, failed, want", [
    ("auto", True, torch.bfloat16, True, False, "cudnn"),
    ("auto", True, torch.float16, True, True, "flash"),  # cuDNN raised earlier in the call
    ("auto", True, torch.bfloat16, False, False, "flash"),  # no cuDNN
    ("auto", True, torch.float32, True, False, "torch"),
    ("auto", False, torch.bfloat16, True, False, "torch"),
    ("flash", False, torch.float32, True, False, "flash"),  # as asked
    ("cudnn", True, torch.bfloat16, True, True, "cudnn"),
    ("torch", True, torch.bfloat16, True, False, "torch"),
])
def test_dense_impl(monkeypatch, impl, cuda, dtype, cudnn, failed, want):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: cudnn)
    q = types.SimpleNamespace(is_cuda=cuda, dtype=dtype)
    assert dispatch.dense_impl(impl, q, cudnn_failed=failed) == want


def test_the_dense_choice_keeps_no_process_state(monkeypatch):
    """A cuDNN failure is the failing call's (``dense_kernels.DenseFallback``): "auto" asks cuDNN
    again afterwards, and the module holds no fallback flag."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    q = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    assert dispatch.dense_impl("auto", q) == "cudnn"
    assert dispatch.dense_impl("auto", q, cudnn_failed=True) == "flash"
    assert dispatch.dense_impl("auto", q) == "cudnn"
    assert not hasattr(dispatch, "_cudnn_attention_failed") and not hasattr(dispatch, "note_cudnn_failure")
    with pytest.raises(ValueError, match="impl must be one of"):
        dispatch.dense_impl("sdpa", q)
    assert dispatch.dense_impls_available("cpu") == ["torch"]


@pytest.mark.parametrize("dense_layer, deterministic, ring, layout, cuda, dtype, want", [
    (False, False, False, "zigzag", True, torch.bfloat16, False),  # a sparse layer
    (True, True, False, "zigzag", True, torch.bfloat16, False),  # deterministic keeps the sparse kernels
    (True, False, False, "striped", True, torch.float32, True),  # one device: SDPA takes anything
    (True, False, True, "zigzag", True, torch.bfloat16, True),
    (True, False, True, "zigzag", True, torch.float32, False),  # fp32 steps would materialise the scores
    (True, False, True, "striped", True, torch.bfloat16, False),  # block-causal steps
    (True, False, True, "zigzag", False, torch.float32, True),  # the CPU's PyTorch steps
])
def test_dense_or_sparse_kernels(dense_layer, deterministic, ring, layout, cuda, dtype, want):
    q = types.SimpleNamespace(is_cuda=cuda, dtype=dtype)
    assert dispatch.use_dense_kernels(dense_layer, deterministic, ring, layout, q) is want
