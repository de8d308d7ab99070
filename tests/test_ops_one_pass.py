"""The one-pass loss head (``loss_weights``): the Triton forward writes the gradient w.r.t. the logits while it reads
them and the backward only scales it; every backend returns the same ``reduced`` scalar and gradient as the
reference ``sum(w * loss) + sum(w_ent * entropy)``. Cases: the shared grid's shapes and dtypes, -inf columns,
T != 1, tiny blocks, more rows than programs, an upstream scalar other than 1, the gradient written into the
logits' own buffer, and no_grad (nothing ``[N, V]`` written). Triton runs in interpreter mode without CUDA."""

import os
from unittest import mock

import pytest
import torch

from openrlhf_lopti.algo import policy_loss_from_logits
from openrlhf_lopti.ops import fused_policy_loss
from openrlhf_lopti.ops.cpp_policy_loss import cpp_available

from .allocations import NewTensors
from .kernel_cases import Case, assert_near_truth, make_inputs, options, reference_truth

from openrlhf_lopti.ops.triton import policy_loss as kernels  # conftest has set TRITON_INTERPRET by now

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the backends that write the gradient over the logits (grad_in_logits); C++ only where it is built, on CPU
IN_PLACE_BACKENDS = ["triton"] + (["cpp"] if DEVICE == "cpu" and cpp_available() else [])
ONE_PASS_CASES = [
    Case(),
    Case(v=257, temperature=0.7, alpha=0.3, kl="k3", entropy=True),
    Case(dtype=torch.bfloat16, v=130, kl="k1", dual_clip=3.0, entropy=True),
    Case(dtype=torch.float16, v=130, masked_fraction=0.5),
    Case(n=1, v=33, masked_fraction=0.0),
    Case(masked_fraction=1.0, entropy=True, kl="k3"),
]


def _weights(case: Case, inputs: dict, entropy: bool):
    """A token mean over the kept rows (what the front ends reduce with), and an entropy bonus on the same rows."""
    keep = inputs["mask"].float()
    loss_weights = keep / keep.sum().clamp(min=1)
    return loss_weights, (-0.01 * loss_weights if entropy else None)


def _reduced_truth(case: Case, inputs: dict, loss_weights, entropy_weights, scale: float):
    """The float64 reference of ``scale * (sum(w * loss) + sum(w_ent * entropy))``: (value, logits gradient)."""
    w, we = loss_weights.double().cpu(), None if entropy_weights is None else entropy_weights.double().cpu()
    opts = dict(options(case), return_entropy=we is not None)

    def objective(out):
        total = (w * out.loss).sum() + (0.0 if we is None else (we * out.entropy).sum())
        objective.value = total.detach()
        return scale * total

    truth, grad = reference_truth(inputs, opts, objective)
    return objective.value, grad


def _one_pass(case: Case, inputs: dict, backend: str, scale: float = 1.0, grad_in_logits: bool = False, **env):
    loss_weights, entropy_weights = _weights(case, inputs, case.entropy)
    logits = inputs["logits"].detach().clone().requires_grad_(True)
    with mock.patch.dict(os.environ, {k: str(v) for k, v in env.items()}):
        out = fused_policy_loss(
            logits, inputs["labels"], inputs["old_log_probs"], inputs["advantages"], inputs["mask"],
            ref_log_probs=inputs["ref_log_probs"], loss_weights=loss_weights, entropy_weights=entropy_weights,
            grad_in_logits=grad_in_logits, backend=backend, **options(case),
        )  # fmt: skip
        (scale * out.reduced).backward()
    return out, logits, loss_weights, entropy_weights


def _assert_one_pass_matches(case: Case, backend: str, scale: float = 1.0, **env) -> None:
    inputs = make_inputs(case, DEVICE)
    out, logits, w, we = _one_pass(case, inputs, backend, scale, **env)
    value, truth_grad = _reduced_truth(case, inputs, w, we, scale)
    assert out.reduced.dtype == torch.float32 and out.reduced.shape == ()
    assert not out.loss.requires_grad and not out.logp.requires_grad  # only the reduced scalar carries a gradient
    truth = {"reduced": value.reshape(1)}
    got = {"reduced": out.reduced.detach().reshape(1)}
    assert_near_truth(backend, got, logits.grad, truth, truth_grad, inputs["logits"], case.temperature,
                      weight=abs(scale) * float(w.abs().max()), fields=("reduced",))  # fmt: skip
    assert torch.all(logits.grad[~inputs["mask"]] == 0)


@pytest.mark.parametrize("backend", ["triton", "torch", "cpp"])
@pytest.mark.parametrize("case", ONE_PASS_CASES, ids=str)
def test_one_pass_equals_the_reduced_reference(case, backend):
    _assert_one_pass_matches(case, backend)


@pytest.mark.parametrize("block_v,grid_cap", [(16, None), (32, 3)], ids=["block16", "block32-grid3"])
def test_one_pass_over_several_blocks_and_more_rows_than_programs(block_v, grid_cap):
    """V = 257 spans 17 blocks of 16 (the reverse sweep's first block is the partial last one); 3 programs stride
    over 37 rows."""
    env = {kernels.ENV_BLOCK_V: block_v} | ({kernels.ENV_GRID_CAP: grid_cap} if grid_cap else {})
    _assert_one_pass_matches(Case(n=37, v=257, alpha=0.3, kl="k3", entropy=True, temperature=0.7, seed=3), "triton",
                             **env)  # fmt: skip


def test_one_pass_with_neg_inf_columns_is_exact():
    """-inf logits in the one-pass sweep: probability 0, gradient exactly 0 there, as in the two-pass kernel."""
    case = Case(n=12, v=70, entropy=True, kl="k3", temperature=0.7, seed=4)
    inputs = make_inputs(case, DEVICE)
    columns = [3, 40, 69]
    inputs["logits"][:, columns] = float("-inf")
    inputs["labels"] = torch.where(torch.isin(inputs["labels"], torch.tensor(columns)), 5, inputs["labels"])
    with mock.patch.dict(os.environ, {kernels.ENV_BLOCK_V: "16"}):
        out, logits, w, we = _one_pass(case, inputs, "triton")
    assert torch.all(logits.grad[:, columns] == 0)
    _, truth_grad = _reduced_truth(case, inputs, w, we, 1.0)
    assert_near_truth("triton", {}, logits.grad, {}, truth_grad, inputs["logits"], case.temperature,
                      weight=float(w.abs().max()), fields=())  # fmt: skip


@pytest.mark.parametrize("scale", [3.0, -0.25])
def test_an_upstream_scalar_other_than_one_scales_the_gradient_on_the_device(scale):
    _assert_one_pass_matches(Case(v=130, dtype=torch.bfloat16, entropy=True, alpha=0.3, seed=5), "triton", scale)


def test_the_backward_is_one_launch_that_only_scales(monkeypatch):
    """The backward runs no kernel but the scaling one (it reads the scalar on the device: no host sync)."""
    launches = []
    for name in ("_policy_loss_fwd_kernel", "_policy_loss_bwd_kernel", "_scale_rows_kernel"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, _Spy(real, name, launches))
    case = Case(v=130, entropy=True)
    _one_pass(case, make_inputs(case, DEVICE), "triton", scale=2.0)
    assert launches == ["_policy_loss_fwd_kernel", "_scale_rows_kernel"]


class _Spy:
    def __init__(self, real, name, launches):
        self.real, self.name, self.launches = real, name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(self.name)
            return self.real[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("backend", IN_PLACE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "strided rows, -inf columns"])
def test_the_gradient_written_into_the_logits_own_buffer(backend, dtype, layout):
    """grad_in_logits=True: the lm_head's logits (not a leaf: the model made them) become their own gradient (Triton:
    in the forward, C++: in the backward), so the call and its backward allocate no [N, V] buffer; the gradients
    that reach the lm_head are the same, masked rows included, also on rows with a stride past V and with -inf
    columns (padded vocab)."""
    case = Case(n=16, v=130, dtype=dtype, entropy=True, kl="k3", seed=6)
    inputs = make_inputs(case, DEVICE)
    g = torch.Generator().manual_seed(6)
    strided = layout != "contiguous"
    hidden = torch.randn(case.n, 8, generator=g).to(case.dtype)
    weight = torch.randn(case.v + (3 if strided else 0), 8, generator=g).to(case.dtype)
    padded = torch.zeros(case.v + 3, dtype=torch.bool)
    padded[case.v - 5 : case.v] = True  # with strided rows, the last 5 columns -inf, none of them a label
    labels = inputs["labels"].clamp(max=case.v - 6) if strided else inputs["labels"]
    inputs = dict(inputs, labels=labels)
    w, we = _weights(case, inputs, True)
    grads, allocated = {}, {}
    for in_place in (False, True):
        h, W = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logits = h @ W.t()
        if strided:  # [N, V] rows 3 elements apart
            logits = logits.masked_fill(padded, float("-inf"))[:, : case.v]
            assert logits.stride(0) == case.v + 3
        with NewTensors() as seen:
            out = fused_policy_loss(logits, inputs["labels"], inputs["old_log_probs"], inputs["advantages"],
                                    inputs["mask"], ref_log_probs=inputs["ref_log_probs"], loss_weights=w,
                                    entropy_weights=we, grad_in_logits=in_place, backend=backend,
                                    **options(case))  # fmt: skip
            out.reduced.backward()
        assert out.backend == backend
        allocated[in_place] = seen.shapes.count((case.n, case.v))
        grads[in_place] = (h.grad, W.grad)
        if in_place:  # the logits now hold their gradient
            assert not torch.equal(logits.detach(), (hidden @ weight.t())[:, : case.v])
    assert allocated == {False: 1, True: 0}
    assert torch.equal(grads[True][0], grads[False][0]) and torch.equal(grads[True][1], grads[False][1])


@pytest.mark.parametrize("backend", IN_PLACE_BACKENDS)
def test_logits_an_earlier_op_saved_are_never_backpropagated_overwritten(backend):
    """grad_in_logits=True overwrites the logits: an op before the head whose backward reads its own output (here
    ``exp``; e.g. a model's final activation) must raise, not differentiate through the gradient's values."""
    case = Case(n=8, v=64, seed=8)
    inputs = make_inputs(case, DEVICE)
    w, _ = _weights(case, inputs, False)
    x = (inputs["logits"].float() / 8).clone().requires_grad_(True)
    logits = torch.exp(x)  # exp's backward reads this very tensor
    out = fused_policy_loss(logits, inputs["labels"], inputs["old_log_probs"], inputs["advantages"], inputs["mask"],
                            loss_weights=w, grad_in_logits=True, backend=backend)  # fmt: skip
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.reduced.backward()


@pytest.mark.parametrize("grad_in_logits", [False, True])
def test_under_no_grad_nothing_n_by_v_is_written(grad_in_logits):
    case = Case(n=16, v=130, entropy=True, seed=7)
    inputs = make_inputs(case, DEVICE)
    logits = inputs["logits"].clone().requires_grad_(True)
    before = logits.detach().clone()
    w, we = _weights(case, inputs, True)
    with torch.no_grad(), NewTensors() as seen:
        out = fused_policy_loss(logits, inputs["labels"], inputs["old_log_probs"], inputs["advantages"],
                                inputs["mask"], loss_weights=w, entropy_weights=we, grad_in_logits=grad_in_logits,
                                backend="triton", **options(case))  # fmt: skip
    assert (case.n, case.v) not in seen.shapes
    assert torch.equal(logits.detach(), before)  # never overwritten
    want = policy_loss_from_logits(inputs["logits"], inputs["labels"], inputs["old_log_probs"], inputs["advantages"],
                                   inputs["mask"], **dict(options(case), return_entropy=True))  # fmt: skip
    expected = (w * want.loss).sum() + (we * want.entropy).sum()
    assert torch.allclose(out.reduced, expected, rtol=1e-5, atol=1e-6)


def test_a_second_backward_is_refused_in_one_line():
    case = Case(n=8, v=40)
    inputs = make_inputs(case, DEVICE)
    logits = inputs["logits"].clone().requires_grad_(True)
    w, _ = _weights(case, inputs, False)
    out = fused_policy_loss(logits, inputs["labels"], inputs["old_log_probs"], inputs["advantages"], inputs["mask"],
                            loss_weights=w, backend="triton")  # fmt: skip
    out.reduced.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already used: it cannot be backpropagated twice"):
        out.reduced.backward()
