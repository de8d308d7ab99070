"""The Triton backend against the torch reference: the shared grid, the kernel's own edges (block and grid
boundaries, masked rows never read, extreme ratios and KL values), and what it saves for backward.

Without CUDA the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); small blocks make V span several.
"""

import json
import math
import os
import re
import subprocess
import sys
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_lopti.algo import policy_loss_from_logits
from openrlhf_lopti.ops import fused_linear_policy_loss, fused_policy_loss
from openrlhf_lopti.ops import triton as triton_ops

from .kernel_cases import (
    CASES,
    EXTREME_CASES,
    Case,
    assert_near_truth,
    check_backend_matches_reference,
    make_inputs,
    options,
    reference_truth,
    textbook_policy_loss,
)

from openrlhf_lopti.ops.triton import policy_loss as kernels  # conftest has set TRITON_INTERPRET by now

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _launch_env(block_v=None, grid_cap=None) -> dict:
    env = {}
    if block_v is not None:
        env[kernels.ENV_BLOCK_V] = str(block_v)
    if grid_cap is not None:
        env[kernels.ENV_GRID_CAP] = str(grid_cap)
    return env


@pytest.mark.parametrize("block_v,grid_cap", [(64, None), (32, 3)], ids=["block64", "block32-grid3"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_shared_grid_matches_reference(case, block_v, grid_cap):
    # grid3: 3 programs stride over all rows, the path N > 65535 takes on a GPU.
    with mock.patch.dict(os.environ, _launch_env(block_v, grid_cap)):
        check_backend_matches_reference(case, backend="triton", device=DEVICE)


# Kernel edges: V exactly one/several blocks, one over, smaller than a block; the default block size
# (no override) with V spanning two 4096-wide blocks; more rows than programs.
EDGE_CASES = [
    (Case(v=64, entropy=True), 64, None),
    (Case(v=65, kl="k3"), 64, None),
    (Case(v=192, alpha=0.3, temperature=0.5), 64, None),
    (Case(v=5, entropy=True, masked_fraction=0.0), 64, None),
    (Case(n=4, v=5000, entropy=True, kl="k2", dtype=torch.bfloat16), None, None),
    (Case(n=40, v=50, alpha=1.0, dual_clip=2.0, entropy=True), 16, 1),
    (Case(n=40, v=50, masked_fraction=0.9), 16, 7),
    (Case(n=3, v=5, entropy=True, masked_fraction=0.0), 1, None),  # a block of 2**0 = 1 column
]


@pytest.mark.parametrize("case,block_v,grid_cap", EDGE_CASES, ids=lambda x: str(x) if isinstance(x, Case) else None)
def test_block_and_grid_edges(case, block_v, grid_cap):
    with mock.patch.dict(os.environ, _launch_env(block_v, grid_cap)):
        check_backend_matches_reference(case, backend="triton", device=DEVICE)




@pytest.mark.parametrize("name", EXTREME_CASES)
def test_extreme_inputs_match_reference(name):
    with mock.patch.dict(os.environ, _launch_env(block_v=32)):
        check_backend_matches_reference(EXTREME_CASES[name], backend="triton", device=DEVICE)


def test_extreme_cases_reach_every_branch():
    """Guards the test above: each extreme case really crosses the boundary it is named after."""

    def quantities(case):
        inputs = make_inputs(case)
        keep = inputs["mask"]
        logp = torch.log_softmax(inputs["logits"].float() / case.temperature, -1)
        logp = logp.gather(-1, inputs["labels"].clamp(min=0)[:, None]).squeeze(-1)
        return inputs, keep, logp

    inputs, keep, logp = quantities(EXTREME_CASES["dual-clip-binds"])
    ratio = (logp - inputs["old_log_probs"]).exp()
    adv = inputs["advantages"]
    assert (keep & (adv < 0) & (ratio > 3.0)).any()
    inputs, keep, logp = quantities(EXTREME_CASES["log-ratio-clamp"])
    assert (keep & ((logp - inputs["old_log_probs"]).abs() > 20)).any()
    for name, bound in (("k1-clamp", 10.0), ("k2-clamp", math.sqrt(20.0)), ("k3-clamp", 10.0)):
        inputs, keep, logp = quantities(EXTREME_CASES[name])
        x = logp - inputs["ref_log_probs"]
        assert (keep & (x.abs() > bound)).any(), name
        assert (keep & (x.abs() < bound / 2)).any(), name


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 24),
    v=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    temperature=st.sampled_from([0.6, 1.0, 1.7]),
    alpha=st.sampled_from([0.0, 0.3, 1.0]),
    kl=st.sampled_from([None, "k1", "k2", "k3"]),
    dual_clip=st.sampled_from([None, 3.0]),
    entropy=st.booleans(),
    masked_fraction=st.sampled_from([0.0, 0.25, 0.6, 1.0]),
    seed=st.integers(0, 2**16),
    block_v=st.sampled_from([16, 64, 256]),
    grid_cap=st.sampled_from([1, 5, 65535]),
)
def test_random_configurations_match_reference(
    n, v, dtype, temperature, alpha, kl, dual_clip, entropy, masked_fraction, seed, block_v, grid_cap
):
    case = Case(
        n=n, v=v, dtype=dtype, temperature=temperature, alpha=alpha, kl=kl, dual_clip=dual_clip,
        entropy=entropy, masked_fraction=masked_fraction, seed=seed,
    )  # fmt: skip
    with mock.patch.dict(os.environ, _launch_env(block_v, grid_cap)):
        check_backend_matches_reference(case, backend="triton", device=DEVICE)


def _call(inputs, **opts):
    return fused_policy_loss(
        inputs["logits"], inputs["labels"], inputs["old_log_probs"], inputs["advantages"], inputs["mask"],
        ref_log_probs=inputs["ref_log_probs"], **opts,
    )  # fmt: skip


def _leaf(inputs):
    return dict(inputs, logits=inputs["logits"].detach().clone().requires_grad_(True))


@pytest.mark.parametrize("used", ["loss", "logp", "entropy"])
def test_gradient_from_each_output_alone(used):
    """Unused outputs reach backward as None (grads are not materialised); each path alone is right."""
    case = Case(n=12, v=70, kl="k3", alpha=0.3, entropy=True, temperature=0.8, seed=11)
    inputs = make_inputs(case, DEVICE)
    truth, truth_grad = reference_truth(inputs, options(case), lambda out: getattr(out, used).sum())
    for backend in ("torch", "triton"):
        leaf = _leaf(inputs)
        with mock.patch.dict(os.environ, _launch_env(block_v=32)):
            out = _call(leaf, backend=backend, **options(case))
        getattr(out, used).sum().backward()
        grad = leaf["logits"].grad
        assert_near_truth(backend, out, grad, truth, truth_grad, inputs["logits"], case.temperature, fields=())
    assert grad.abs().sum() > 0


def test_masked_rows_are_never_read():
    """NaN logits, ids and log-probs on masked rows change nothing: those rows are skipped, not computed."""
    case = Case(n=16, v=80, kl="k3", entropy=True, dual_clip=3.0, masked_fraction=0.5, seed=12)
    clean = make_inputs(case, DEVICE)
    poisoned = dict(clean)
    masked = ~clean["mask"]
    assert masked.any() and clean["mask"].any()
    poisoned["logits"] = clean["logits"].masked_fill(masked[:, None], float("nan"))
    poisoned["old_log_probs"] = clean["old_log_probs"].masked_fill(masked, float("nan"))
    poisoned["advantages"] = clean["advantages"].masked_fill(masked, float("inf"))
    poisoned["ref_log_probs"] = clean["ref_log_probs"].masked_fill(masked, float("nan"))
    poisoned["labels"] = clean["labels"].masked_fill(masked, 10**9)
    results = []
    for inputs in (clean, poisoned):
        leaf = _leaf(inputs)
        out = _call(leaf, backend="triton", **options(case))
        (out.loss.sum() + out.logp.sum() + out.entropy.sum()).backward()
        results.append((out, leaf["logits"].grad))
    (out_a, grad_a), (out_b, grad_b) = results
    for name in ("loss", "logp", "kl", "clipped", "entropy"):
        assert torch.equal(getattr(out_a, name), getattr(out_b, name)), name
    assert torch.equal(grad_a, grad_b)
    assert torch.all(grad_b[masked] == 0)


class _LaunchSpy:
    """Stands in for a kernel: records each launch's ``(args, kwargs)`` in ``launches``, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append((args, kwargs))
            return launch(*args, **kwargs)

        return run


def _spy_on_kernels(monkeypatch) -> dict:
    names = ("_policy_loss_fwd_kernel", "_policy_loss_bwd_kernel")
    spies = {name: _LaunchSpy(getattr(kernels, name)) for name in names}
    for name, spy in spies.items():
        monkeypatch.setattr(kernels, name, spy)
    return spies


def test_strided_rows_are_read_in_place(monkeypatch):
    """A row stride larger than V (a slice of a wider buffer) is handed to both kernels as is (same memory, its
    own stride: no copy); a transposed view is copied once and still gives the right values."""
    case = Case(n=10, v=50, entropy=True, kl="k1", seed=13)
    inputs = make_inputs(case, DEVICE)
    wide = torch.zeros(case.n, case.v + 13, dtype=case.dtype, device=DEVICE)
    wide[:, : case.v] = inputs["logits"]
    sliced = wide[:, : case.v].requires_grad_(True)
    transposed = inputs["logits"].t().contiguous().t().requires_grad_(True)
    assert sliced.stride(0) == case.v + 13 and transposed.stride(-1) != 1
    objective = lambda out: out.loss.sum() + out.entropy.sum()  # noqa: E731
    truth, truth_grad = reference_truth(inputs, options(case), objective)
    for logits in (sliced, transposed):
        spies = _spy_on_kernels(monkeypatch)
        got = _call(dict(inputs, logits=logits), backend="triton", **options(case))
        objective(got).backward()
        path = "triton (sliced)" if logits is sliced else "triton (transposed)"
        assert_near_truth(path, got, logits.grad, truth, truth_grad, inputs["logits"], case.temperature)
        # the logits pointer and row stride each launch received
        launched = [[(args[0].data_ptr(), args[1]) for args, _ in spy.launches] for spy in spies.values()]
        if logits is sliced:
            assert launched == [[(sliced.data_ptr(), case.v + 13)]] * 2, launched
        else:  # a copy with contiguous rows, made once and read by both kernels
            (fwd,), (bwd,) = launched
            assert fwd == bwd and fwd[0] != transposed.data_ptr() and fwd[1] == case.v


@pytest.mark.parametrize("name", ["log-ratio-clamp", "k1-clamp", "k2-clamp", "k3-clamp", "dual-clip-binds"])
def test_clamps_are_the_literal_bounds(name):
    """The kernel clamps the log ratio at +-20 and the KL at +-10: checked against the loss written out in the test
    with its own literal bounds (the kernel takes its constants from the reference module, so comparing with the
    reference alone would not see a changed constant)."""
    case = EXTREME_CASES[name]
    inputs, opts = make_inputs(case, DEVICE), options(case)
    leaf = _leaf(inputs)
    with mock.patch.dict(os.environ, _launch_env(block_v=32)):
        got = _call(leaf, backend="triton", **opts)
    got.loss.sum().backward()
    want, want_grad = _textbook(inputs, opts)
    grad = leaf["logits"].grad
    assert_near_truth("triton", got, grad, want, want_grad, inputs["logits"], case.temperature, fields=("loss", "kl"))


def _textbook(inputs: dict, opts: dict):
    """``textbook_policy_loss`` on a CPU copy of ``inputs`` with its summed loss backpropagated: (values, logits grad)."""
    cpu = {k: None if v is None else v.cpu() for k, v in inputs.items()}
    logits = cpu["logits"].clone().requires_grad_(True)
    want = textbook_policy_loss(cpu, opts, logits)
    want["loss"].sum().backward()
    return want, logits.grad


def test_only_per_row_vectors_are_saved_for_backward():
    """Nothing [N, V] is saved besides the caller's logits (no fp32 copy, no softmax)."""
    case = Case(n=12, v=90, kl="k3", entropy=True, dtype=torch.bfloat16, seed=14)
    inputs = _leaf(make_inputs(case, DEVICE))
    out = _call(inputs, backend="triton", **options(case))
    saved = out.loss.grad_fn.saved_tensors
    assert any(t.data_ptr() == inputs["logits"].data_ptr() and t.dtype == torch.bfloat16 for t in saved)
    for tensor in saved:
        if tensor.data_ptr() != inputs["logits"].data_ptr():
            assert tuple(tensor.shape) == (case.n,), tuple(tensor.shape)
    assert not out.kl.requires_grad and not out.clipped.requires_grad
    assert out.clipped.dtype == torch.bool


def test_empty_batch():
    inputs = make_inputs(Case(n=1, v=7, masked_fraction=0.0), DEVICE)
    empty = {k: (v[:0] if v is not None else None) for k, v in inputs.items()}
    empty["logits"] = empty["logits"].detach().requires_grad_(True)
    out = _call(empty, backend="triton", return_entropy=True)
    assert out.loss.shape == (0,) and out.entropy.shape == (0,)
    (out.loss.sum() + out.entropy.sum()).backward()
    assert empty["logits"].grad.shape == (0, 7)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    inputs = make_inputs(Case(n=2, v=8))  # CPU tensors, on any machine
    message = (
        "the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before "
        "openrlhf_lopti.ops.triton.policy_loss is first imported to run on CPU"
    )
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        _call(inputs, backend="triton")


def test_fused_policy_loss_refuses_triton_on_cpu_without_the_interpreter_before_it_runs(monkeypatch):
    """It raised the backend's RuntimeError from inside the call; the documented promise is a ValueError naming the
    argument before anything runs (what the front ends check at parse time, ``backend_cannot_run``)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    inputs = make_inputs(Case(n=2, v=8))
    message = "backend='triton' needs a CUDA device, or TRITON_INTERPRET=1 in the environment to run on cpu (slow)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}; use backend='auto'$"):
        _call(inputs, backend="triton")
    hidden, weight = torch.randn(2, 4), torch.randn(8, 4)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}; use backend='auto'$"):
        fused_linear_policy_loss(hidden, weight, *(inputs[k] for k in ("labels", "old_log_probs", "advantages",
                                 "mask")), backend="triton")  # fmt: skip


def _direct(inputs, **opts):
    """``triton_policy_loss`` itself (``fused_policy_loss`` always passes every option)."""
    return kernels.triton_policy_loss(
        inputs["logits"], inputs["labels"], inputs["old_log_probs"], inputs["advantages"], inputs["mask"], **opts
    )


def test_defaults_are_the_textbook_loss():
    """No options: alpha 0, eps 0.2 / 0.2, no dual clip, the KL reported (k3) but not in the loss, T 1, no entropy."""
    case = Case(n=24, v=40, kl="k3", old_spread=0.6, seed=16)
    inputs = make_inputs(case, DEVICE)
    leaf = _leaf(inputs)
    with mock.patch.dict(os.environ, _launch_env(block_v=16)):
        out = _direct(leaf, ref_log_probs=leaf["ref_log_probs"])
    out.loss.sum().backward()
    defaults = dict(
        alpha=0.0, eps_low=0.2, eps_high=0.2, dual_clip=None, kl_coef=0.0, kl_estimator="k3", temperature=1.0
    )
    want, want_grad = _textbook(inputs, defaults)
    ratio = (want["logp"] - inputs["old_log_probs"].cpu().double()).exp()[inputs["mask"].cpu()]
    assert (ratio < 0.8).any() and (ratio > 1.2).any()  # both clip bounds are crossed
    assert out.entropy is None and not out.status.rows.any() and out.backend == "triton"
    grad = leaf["logits"].grad
    assert_near_truth("triton", out, grad, want, want_grad, inputs["logits"], 1.0, fields=("loss", "logp", "kl"))
    assert torch.equal(out.clipped.cpu(), want["clipped"])


def test_what_each_launch_receives(monkeypatch):
    """The [N] vectors reach the kernels as the caller's tensors, in their own dtype (the kernel rounds them to fp32:
    no cast launched), the mask as the caller's bool, each launch with the configuration's warps; the backward
    takes the entropy term only when the entropy's gradient is used (unused outputs reach backward as None, not
    as zeros) and the loss's upstream gradient as the expanded view of a sum (stride 0, no copy)."""
    case = Case(n=10, v=30, kl="k2", alpha=0.3, entropy=True, seed=17)
    inputs = make_inputs(case, DEVICE)
    half = dict(inputs, **{k: inputs[k].to(torch.bfloat16) for k in ("old_log_probs", "advantages", "ref_log_probs")})
    monkeypatch.setenv(kernels.ENV_NUM_WARPS, "2")
    monkeypatch.setenv(kernels.ENV_BLOCK_V, "16")
    opts = options(case)
    want, _ = _textbook(half, opts)
    for entropy_used in (False, True):
        spies = _spy_on_kernels(monkeypatch)
        leaf = _leaf(half)
        out = _direct(leaf, ref_log_probs=leaf["ref_log_probs"], **opts)
        (out.loss.sum() + (out.entropy.sum() if entropy_used else 0)).backward()
        (fwd_args, fwd_kwargs), = spies["_policy_loss_fwd_kernel"].launches
        (bwd_args, bwd_kwargs), = spies["_policy_loss_bwd_kernel"].launches
        old, adv, keep, ref = fwd_args[3], fwd_args[4], fwd_args[5], fwd_args[6]
        for vector, name in ((old, "old_log_probs"), (adv, "advantages"), (ref, "ref_log_probs")):
            assert vector.data_ptr() == leaf[name].data_ptr() and vector.dtype == torch.bfloat16
        assert keep.data_ptr() == leaf["mask"].data_ptr() and keep.dtype == torch.bool
        assert fwd_kwargs["num_warps"] == 2 and bwd_kwargs["num_warps"] == 2
        assert fwd_kwargs["WITH_ENTROPY"] is True and fwd_kwargs["KL_MODE"] == 2
        assert fwd_kwargs["GRAD_IN_FORWARD"] is False
        assert bwd_kwargs["WITH_ENTROPY_GRAD"] is entropy_used and bwd_kwargs["HAS_G_LOSS"] is True
        assert bwd_kwargs["HAS_G_LOGP"] is False and bwd_args[10] == 0  # g_loss's stride: the expanded 1 of a sum
        assert_near_truth("triton", out, None, want, None, inputs["logits"], case.temperature)


def test_outputs_are_fp32_whatever_the_default_dtype():
    case = Case(n=6, v=20, kl="k3", entropy=True, seed=18)
    inputs = make_inputs(case, DEVICE)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = _direct(inputs, ref_log_probs=inputs["ref_log_probs"], kl_coef=0.1, return_entropy=True)
    finally:
        torch.set_default_dtype(previous)
    for field in ("loss", "logp", "kl", "entropy"):
        assert getattr(out, field).dtype == torch.float32, field
    assert out.clipped.dtype == torch.bool and out.status.rows.dtype == out.status.word.dtype == torch.int32


@pytest.mark.parametrize("name,value", [(kernels.ENV_BLOCK_V, "48"), (kernels.ENV_GRID_CAP, "0")])
def test_bad_launch_overrides_are_rejected(name, value):
    inputs = make_inputs(Case(n=2, v=8), DEVICE)
    with mock.patch.dict(os.environ, {name: value}), pytest.raises(ValueError, match=name):
        _call(inputs, backend="triton")


def test_launch_config_by_hand(monkeypatch):
    """Block size: V rounded up to a power of 2, within [16, 4096]; 8 warps for 4096-wide blocks, else 4; at most
    65535 programs. The environment overrides each (tests and tuning)."""
    for name in (kernels.ENV_BLOCK_V, kernels.ENV_GRID_CAP, kernels.ENV_NUM_WARPS):
        monkeypatch.delenv(name, raising=False)
    assert kernels._launch_config(10, 5) == {"grid": (10,), "BLOCK_V": 16, "num_warps": 4}
    assert kernels._launch_config(3, 300) == {"grid": (3,), "BLOCK_V": 512, "num_warps": 4}
    assert kernels._launch_config(3, 2049) == {"grid": (3,), "BLOCK_V": 4096, "num_warps": 8}
    assert kernels._launch_config(70000, 151936) == {"grid": (65535,), "BLOCK_V": 4096, "num_warps": 8}
    monkeypatch.setenv(kernels.ENV_BLOCK_V, "64")
    monkeypatch.setenv(kernels.ENV_GRID_CAP, "7")
    assert kernels._launch_config(10, 5000) == {"grid": (7,), "BLOCK_V": 64, "num_warps": 4}
    monkeypatch.setenv(kernels.ENV_NUM_WARPS, "2")
    monkeypatch.setenv(kernels.ENV_BLOCK_V, "")  # empty: the default
    assert kernels._launch_config(5, 5000) == {"grid": (5,), "BLOCK_V": 4096, "num_warps": 2}
    monkeypatch.setenv(kernels.ENV_NUM_WARPS, "-1")
    with pytest.raises(ValueError, match=rf"^{kernels.ENV_NUM_WARPS} must be a positive integer, got '-1'$"):
        kernels._launch_config(5, 5)


def test_triton_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_ops.triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_ops.triton_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert triton_ops.triton_available()
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    assert not triton_ops.triton_available()


def test_matches_reference_on_loss_reduction_used_in_training():
    """The token-mean loss a trainer backpropagates gives the reference's gradient (bf16 logits)."""
    case = Case(n=30, v=120, dtype=torch.bfloat16, alpha=0.3, kl="k3", seed=15)
    inputs = make_inputs(case, DEVICE)
    tokens = int(inputs["mask"].sum())
    truth, truth_grad = reference_truth(inputs, options(case), lambda out: out.loss.sum() / tokens)
    paths = {"reference": policy_loss_from_logits, "triton": lambda *a, **k: fused_policy_loss(*a, backend="triton", **k)}
    for path, fn in paths.items():
        leaf = _leaf(inputs)
        out = fn(
            leaf["logits"], leaf["labels"], leaf["old_log_probs"], leaf["advantages"], leaf["mask"],
            ref_log_probs=leaf["ref_log_probs"], **options(case),
        )  # fmt: skip
        (out.loss.sum() / leaf["mask"].sum()).backward()
        grad = leaf["logits"].grad
        assert_near_truth(path, out, grad, truth, truth_grad, inputs["logits"], case.temperature, 1 / tokens, ())


# Compiles (no launch) every kernel variant for an H100 (sm_90) down to a cubin with the ptxas bundled in the
# triton wheel: the GPU code path type-checks and lowers even on CI machines that have no GPU.
_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from openrlhf_lopti.ops.triton import policy_loss as k

assert not k.INTERPRETED
INTS = {"stride_row", "grad_stride_row", "n_rows", "n_cols", "col0", "g_loss_stride", "g_logp_stride",
        "g_entropy_stride"}

def signature(kernel, **pointers):
    sig = {}
    for name in kernel.arg_names:
        if name in pointers:
            sig[name] = pointers[name]
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        else:
            sig[name] = "i32" if name in INTS else ("constexpr" if name.isupper() else "fp32")
    return sig

from openrlhf_lopti.ops.triton import vocab_block as vb

def compile(kernel, consts, warps, **pointers):
    src = ASTSource(fn=kernel, signature=signature(kernel, **pointers), constexprs=consts)
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"]

FWD_OFF = dict(GRAD_IN_FORWARD=False, WITH_ENTROPY_WEIGHT=False)
fwd_variants = [  # (logits, the [N] vectors' dtype, constexprs, warps): two-pass and one-pass, bool / int masks
    ("*bf16", "*fp32", dict(KL_MODE=3, HAS_DUAL_CLIP=True, WITH_ENTROPY=True, BLOCK_V=4096, **FWD_OFF), 8),
    ("*fp32", "*fp64", dict(KL_MODE=0, HAS_DUAL_CLIP=False, WITH_ENTROPY=False, BLOCK_V=1024, **FWD_OFF), 4),
    ("*fp16", "*bf16", dict(KL_MODE=1, HAS_DUAL_CLIP=False, WITH_ENTROPY=True, BLOCK_V=4096, **FWD_OFF), 8),
    ("*bf16", "*fp32", dict(KL_MODE=2, HAS_DUAL_CLIP=True, WITH_ENTROPY=False, BLOCK_V=4096,
                            GRAD_IN_FORWARD=True, WITH_ENTROPY_WEIGHT=False), 8),
    ("*bf16", "*fp32", dict(KL_MODE=3, HAS_DUAL_CLIP=False, WITH_ENTROPY=True, BLOCK_V=4096,
                            GRAD_IN_FORWARD=True, WITH_ENTROPY_WEIGHT=True), 16),
]
for logits, vector, consts, warps in fwd_variants:
    compile(k._policy_loss_fwd_kernel, dict(consts, LOG_RATIO_MAX=20.0, KL_MAX=10.0), warps, logits_ptr=logits,
            grad_ptr=logits, labels_ptr="*i64", keep_ptr="*i1" if vector != "*fp64" else "*i8", old_ptr=vector,
            adv_ptr=vector, ref_ptr=vector, clipped_ptr="*i1", status_ptr="*i32", word_ptr="*i32")
for logits, with_entropy, has_loss, has_logp in (("*bf16", True, True, False), ("*fp16", False, True, True),
                                                 ("*fp32", True, False, True)):
    compile(k._policy_loss_bwd_kernel, dict(WITH_ENTROPY_GRAD=with_entropy, HAS_G_LOSS=has_loss, HAS_G_LOGP=has_logp,
            BLOCK_V=4096), 8, logits_ptr=logits, grad_ptr=logits, labels_ptr="*i32", keep_ptr="*i1")
for grad in ("*bf16", "*fp32"):
    compile(k._scale_rows_kernel, dict(BLOCK_V=4096), 8, grad_ptr=grad)
for z, with_entropy in (("*bf16", True), ("*fp16", False), ("*fp32", True)):
    compile(vb._block_stats_kernel, dict(WITH_ENTROPY=with_entropy, BLOCK_V=4096), 8, z_ptr=z, labels_ptr="*i64")
    compile(vb._block_grad_kernel, dict(WITH_ENTROPY_GRAD=with_entropy, BLOCK_V=4096), 8, z_ptr=z, labels_ptr="*i64")
print("compiled")
"""


def test_gpu_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]


def test_benchmark_runs_on_cpu_and_refuses_to_overwrite(tmp_path, capsys):
    """`openrlhf-lopti bench` at a tiny shape: every available row runs and agrees on the loss."""
    from benchmarks import bench_policy_loss

    path = tmp_path / "bench.json"
    argv = ["--device", DEVICE, "--n", "16", "--v", "96", "--seq-len", "8", "--repeats", "1", "--warmup", "0",
            "--backends", "openrlhf,torch,triton,liger", "--json", str(path)]  # fmt: skip
    assert bench_policy_loss.main(argv) == 0
    report = json.loads(path.read_text())
    rows = {(r["backend"], r["alpha"]): r for r in report["rows"]}
    ran = [b for b in ("openrlhf", "torch", "triton", "liger") if rows[(b, 0.0)]["status"] == "ok"]
    assert ran[:3] == ["openrlhf", "torch", "triton"], report["rows"]
    if "liger" not in ran:
        assert rows[("liger", 0.0)]["status"].startswith(("n/a", "not installed"))
    losses = [rows[(b, 0.0)]["loss"] for b in ran]
    assert max(losses) - min(losses) < 1e-4, losses  # same inputs, same math (alpha = 0)
    assert rows[("triton", 0.3)]["loss"] != rows[("triton", 0.0)]["loss"]  # the +AR row changes the loss
    if DEVICE == "cpu":
        assert all(goal["measured"] is None for goal in report["goals"].values())  # GPU goals only
    with pytest.raises(SystemExit):
        bench_policy_loss.main(argv)  # the JSON exists: refused without --overwrite
    assert "--overwrite" in capsys.readouterr().err
