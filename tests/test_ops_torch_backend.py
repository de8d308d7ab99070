"""The torch backend through ``fused_policy_loss`` against the loss written out from its definition in the test
(``kernel_cases.textbook_policy_loss``: float64, literal clamp bounds), forward and backward, on the shared grid.

The torch backend is the reference the other backends are compared with, so it is checked here against an
implementation that shares no code with it.
"""

import pytest
import torch

from openrlhf_lopti.ops import fused_policy_loss

from .kernel_cases import CASES, EXTREME_CASES, assert_near_truth, make_inputs, max_weight, options, textbook_policy_loss


def _outputs_and_grad(fn, inputs, upstream):
    logits = inputs["logits"].detach().clone().requires_grad_(True)
    out = fn(logits)
    total = sum((out[name] * upstream[name]).sum() for name in ("loss", "logp", "entropy"))
    total.backward()
    return out, logits.grad


@pytest.mark.parametrize("case", CASES + list(EXTREME_CASES.values()), ids=str)
def test_torch_backend_matches_the_textbook_loss(case):
    inputs, opts = make_inputs(case), options(case)
    opts["return_entropy"] = True
    g = torch.Generator().manual_seed(case.seed + 1)
    upstream = {k: torch.randn(case.n, generator=g) for k in ("loss", "logp", "entropy")}

    def ours(logits):
        args = [inputs[k] for k in ("labels", "old_log_probs", "advantages", "mask")]
        out = fused_policy_loss(logits, *args, ref_log_probs=inputs["ref_log_probs"], backend="torch", **opts)
        return {name: getattr(out, name) for name in ("loss", "logp", "kl", "clipped", "entropy")}

    got, got_grad = _outputs_and_grad(ours, inputs, upstream)
    want, want_grad = _outputs_and_grad(lambda z: textbook_policy_loss(inputs, opts, z), inputs, upstream)
    # fp32 against float64: bf16/fp16 logits are the same values in both; the bound is derived from the
    # computation (kernel_cases.assert_near_truth), the gradient's with one ulp of the logits' dtype
    assert_near_truth("torch", got, got_grad, want, want_grad, inputs["logits"], case.temperature, max_weight(upstream))
    assert torch.equal(got["clipped"], want["clipped"])
    assert torch.all(got_grad[~inputs["mask"]] == 0)


def test_old_ref_log_probs_and_advantages_are_constants_as_on_the_kernels():
    # an old_log_probs still attached to the logits' graph (a missed .detach()) must not cancel the ratio's
    # gradient: the cpp and triton backends read it as a constant, and so must the torch backend
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, generator=g).requires_grad_(True)
    labels = torch.randint(0, 7, (4,), generator=g)
    advantages = torch.randn(4, generator=g).requires_grad_(True)
    mask = torch.ones(4, dtype=torch.bool)
    grads = []
    for attached in (True, False):
        logits.grad = None
        logp = torch.log_softmax(logits, -1).gather(1, labels[:, None]).squeeze(1)
        old = logp - 0.05 if attached else (logp - 0.05).detach()
        ref = old - 0.1
        out = fused_policy_loss(logits, labels, old, advantages if attached else advantages.detach(), mask,
                                ref_log_probs=ref, kl_coef=0.1, backend="torch")  # fmt: skip
        out.loss.sum().backward()
        grads.append(logits.grad.clone())
    assert grads[1].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1])
    assert advantages.grad is None
