"""The value checks as status bits (ops/value_status.py): every backend sets the reference's bits on planted bad
inputs, bit for bit; a call under ``check="step"`` makes no host sync and few launches (counted with a
TorchDispatchMode over the ops that read a device value on the host); ``"eager"`` makes one 4-byte read; the
``StepChecks`` ledger raises once, before the step, naming the call, also for a bad row found on another
process."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from openrlhf_lopti.ops import fused_linear_policy_loss, fused_policy_loss
from openrlhf_lopti.ops.value_status import (
    BAD_ADVANTAGE,
    BAD_LABEL,
    BAD_LOGITS,
    BAD_OLD,
    BAD_REF,
    StepChecks,
    input_status,
)

from openrlhf_lopti.cli.bench_loss_head import HOST_READS
from openrlhf_lopti.ops.triton import policy_loss as kernels  # conftest has set TRITON_INTERPRET by now

NAN, INF = float("nan"), float("inf")
# The ops that copy a device value to the host (a sync on a GPU): the benchmark's syncs_free counts the same ones
SYNCING = HOST_READS
# Ops that launch nothing: allocations, views, metadata.
SILENT = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "view",
          "t", "transpose", "select", "slice", "unsqueeze", "squeeze", "expand", "as_strided", "set_", "lift_fresh",
          "_unsafe_view", "reshape", "permute", "unbind"}  # fmt: skip


class _Ops(TorchDispatchMode):
    """Counts the ATen ops dispatched: ``syncs`` (host reads of device values) and ``launches`` (ops that are a
    kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.syncs, self.launches = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING:
            self.syncs.append(name)
        elif name not in SILENT:
            self.launches.append(name)
        return func(*args, **(kwargs or {}))


def _planted(n=12, v=20, seed=0):
    """Inputs with one bad value of each kind on its own row, two kinds on one row, and garbage on masked rows."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    old, adv, ref = -torch.rand(n, generator=g), torch.randn(n, generator=g), -torch.rand(n, generator=g)
    mask = torch.ones(n, dtype=torch.bool)
    labels[1] = v  # BAD_LABEL
    labels[2] = -3
    old[3] = NAN  # BAD_OLD
    adv[4] = INF  # BAD_ADVANTAGE
    ref[5] = -INF  # BAD_REF
    logits[6, 7] = NAN  # BAD_LOGITS
    logits[7, :] = -INF  # all -inf: no finite log-sum-exp
    logits[8, 0] = INF
    old[9], adv[9] = INF, NAN  # two bits on one row
    mask[10] = False  # garbage on a masked row: never flagged
    labels[10], old[10], logits[10, 3] = -100, NAN, NAN
    want = torch.zeros(n, dtype=torch.int32)
    want[1] = want[2] = BAD_LABEL
    want[3], want[4], want[5] = BAD_OLD, BAD_ADVANTAGE, BAD_REF
    want[6] = want[7] = want[8] = BAD_LOGITS
    want[9] = BAD_OLD | BAD_ADVANTAGE
    return dict(logits=logits, labels=labels, old_log_probs=old, advantages=adv, mask=mask, ref_log_probs=ref), want


@pytest.mark.parametrize("backend", ["triton", "cpp", "torch"])
def test_every_backend_sets_the_references_bits(backend):
    inputs, want = _planted()
    v = inputs["logits"].shape[1]
    reference = input_status(inputs["labels"], inputs["old_log_probs"], inputs["advantages"], inputs["mask"],
                             inputs["ref_log_probs"], v)  # fmt: skip
    assert torch.equal(reference, torch.where(want == BAD_LOGITS, 0, want))  # the reference on the input bits
    logits = inputs.pop("logits").requires_grad_(True)
    out = fused_policy_loss(logits, **inputs, kl_coef=0.1, return_entropy=True, backend=backend, check="step")
    assert torch.equal(out.status.rows, want), out.status.rows
    assert int(out.status.word) == int(torch.tensor(0, dtype=torch.int32).bitwise_or(want).max()) | BAD_LABEL | (
        BAD_OLD | BAD_ADVANTAGE | BAD_REF | BAD_LOGITS)  # every kind was planted: the OR is every bit
    flagged = want != 0
    assert torch.isnan(out.loss[flagged]).all() and torch.isnan(out.logp[flagged]).all()
    # the KL too (a logged metric): the kernel's clamp would turn a NaN log-prob into a finite bound
    assert torch.isnan(out.kl[flagged]).all() and torch.isfinite(out.kl[~flagged]).all()
    assert torch.isfinite(out.loss[~flagged]).all() and out.loss[10] == 0
    (out.loss.nan_to_num().sum() + out.logp.nan_to_num().sum()).backward()
    assert torch.isfinite(logits.grad[~flagged]).all() and torch.all(logits.grad[10] == 0)


@pytest.mark.parametrize("head", ["triton", "cpp", "torch", "lm_head-torch", "lm_head-triton"])
def test_a_flagged_rows_gradient_is_nan_even_where_its_loss_clamps(head):
    """Row 1's label is out of range and its ratio far above 1 + eps (a positive advantage: the clip binds), row 2's
    old log-prob is NaN. Their gradients must be NaN on every backend (KERNELS.md: "their gradient too"). Before, the
    torch backend and both fused lm_head backends sent 0 there: autograd's backward of a clamp or a min that binds
    sends 0, and the loss's NaN factor came after it."""
    n, v, h = 3, 5, 4
    g = torch.Generator().manual_seed(0)
    labels, adv = torch.tensor([0, 7, 2]), torch.ones(n)
    mask = torch.ones(n, dtype=torch.bool)
    if head.startswith("lm_head"):
        hidden = torch.randn(n, h, generator=g).requires_grad_(True)
        weight = torch.randn(v, h, generator=g)
        logp = torch.log_softmax(hidden.detach() @ weight.t(), -1)[torch.arange(n), labels.clamp(max=v - 1)]
        old = torch.stack([logp[0], logp[1] - 4, torch.tensor(NAN)])
        out = fused_linear_policy_loss(hidden, weight, labels, old, adv, mask, backend=head.split("-")[1], check="off")
        leaf = hidden
    else:
        leaf = torch.zeros(n, v, requires_grad=True)  # uniform: logp = -log 5 on every row
        old = torch.tensor([-1.609, -5.0, NAN])  # row 1: ratio e^3.4
        out = fused_policy_loss(leaf, labels, old, adv, mask, backend=head, check="off")
    assert torch.isnan(out.loss[1:]).all() and torch.isfinite(out.loss[0])
    out.loss.sum().backward()
    assert torch.isnan(leaf.grad[1:]).all(), leaf.grad
    assert torch.isfinite(leaf.grad[0]).all() or head.startswith("lm_head")  # the lm_head's rows share the weight


@pytest.mark.parametrize("backend", ["triton", "cpp", "torch"])
def test_a_step_policy_call_makes_no_host_sync_forward_and_backward(backend):
    inputs, _ = _planted()
    inputs["labels"][1], inputs["labels"][2] = 0, 0  # all good but row 7..: the flags are set, nothing is read
    logits = inputs.pop("logits").requires_grad_(True)
    checks = StepChecks()
    with _Ops() as ops:
        out = fused_policy_loss(logits, **inputs, kl_coef=0.1, return_entropy=True, backend=backend, check="step")
        checks.add(out.status, "micro-batch 1")
        (out.loss.sum() + out.entropy.sum()).backward()
    assert ops.syncs == [], ops.syncs
    with _Ops() as ops, pytest.raises(ValueError, match=r"old_log_probs must be finite .*\(row 3 at micro-batch 1\)"):
        checks.raise_if_bad()
    assert ops.syncs[0] == "_local_scalar_dense"  # the step's one read, then the error's own reads


def test_eager_reads_one_word_when_every_row_is_good():
    inputs, _ = _planted()
    good = dict(logits=torch.randn(12, 20), labels=torch.randint(0, 20, (12,)), old_log_probs=-torch.rand(12),
                advantages=torch.randn(12), mask=inputs["mask"], ref_log_probs=-torch.rand(12))  # fmt: skip
    for backend in ("triton", "cpp", "torch"):
        with _Ops() as ops:
            fused_policy_loss(**good, kl_coef=0.1, backend=backend)
        assert ops.syncs == ["_local_scalar_dense"], (backend, ops.syncs)


class _LaunchCounter:
    """Stands in for a Triton kernel: records the launch, runs nothing (its outputs stay as allocated)."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(self.name)


def test_the_triton_call_is_two_launches_forward_and_one_backward(monkeypatch):
    """Forward: the status word's zeroing and the kernel; backward: the kernel (the chain rule through logp is
    inside it). Nothing else is launched: no casts (the [N] vectors are read in their dtype), no zero-fill of
    masked rows (the kernel writes them), no value checks, no read of the flags."""
    launches = []
    for name in ("_policy_loss_fwd_kernel", "_policy_loss_bwd_kernel"):
        monkeypatch.setattr(kernels, name, _LaunchCounter(name, launches))
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 20, generator=g, dtype=torch.bfloat16).requires_grad_(True)
    vectors = dict(labels=torch.randint(0, 20, (12,), generator=g), old_log_probs=-torch.rand(12, generator=g),
                   advantages=torch.randn(12, generator=g), mask=torch.rand(12, generator=g) > 0.3,
                   ref_log_probs=-torch.rand(12, generator=g))  # fmt: skip
    with _Ops() as ops:
        out = fused_policy_loss(logits, **vectors, kl_coef=0.1, return_entropy=True, backend="triton", check="step")
    assert (ops.launches, launches, ops.syncs) == (["zeros"], ["_policy_loss_fwd_kernel"], [])
    objective = out.loss.sum() + out.entropy.sum()
    with _Ops() as ops:
        objective.backward()
    assert launches == ["_policy_loss_fwd_kernel", "_policy_loss_bwd_kernel"] and ops.syncs == []
    assert ops.launches == ["ones_like"], ops.launches  # autograd's seed of the backward: nothing of ours


def test_the_fused_lm_head_syncs_once_whatever_the_number_of_blocks():
    """One host sync per call (the kept rows' count, to size the blocks), none per block, under "step"."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(30, 8, generator=g).requires_grad_(True), torch.randn(50, 8, generator=g)
    vectors = dict(labels=torch.randint(0, 50, (30,), generator=g), old_log_probs=-torch.rand(30, generator=g),
                   advantages=torch.randn(30, generator=g), mask=torch.rand(30, generator=g) > 0.3)  # fmt: skip
    counts = []
    for chunk, block in ((None, None), (4, 7)):  # 1 block, then 8 row chunks x 8 vocab blocks
        with _Ops() as ops:
            out = fused_linear_policy_loss(hidden, weight, **vectors, chunk_size=chunk, vocab_block=block,
                                           return_entropy=True, check="step")  # fmt: skip
            (out.loss.sum() + out.entropy.sum()).backward()
        counts.append(ops.syncs)
    assert counts == [["nonzero"], ["nonzero"]], counts


def test_the_ledger_raises_the_first_bad_call_and_every_process_raises_together():
    checks = StepChecks()
    good = fused_policy_loss(torch.randn(3, 5), torch.tensor([0, 1, 2]), torch.zeros(3), torch.zeros(3),
                             torch.ones(3, dtype=torch.bool), check="step")  # fmt: skip
    checks.add(good.status, "micro-batch 1")
    checks.raise_if_bad()  # nothing bad: silent, and emptied
    assert len(checks) == 0
    # another process found a bad row: this one's word is 0, the collective's is not -> raise here too
    checks.add(good.status, "micro-batch 2")
    with pytest.raises(ValueError, match="a loss-head call on another process found a bad input"):
        checks.raise_if_bad(any_rank=lambda word: word | BAD_OLD)
    assert len(checks) == 0
