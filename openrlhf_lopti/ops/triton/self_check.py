"""The Triton kernel checked against the torch reference on the device it is about to run on.

``fused_policy_loss(backend="auto")`` sends CUDA tensors to Triton only after :func:`triton_verified` has run the
kernel forward and backward on a few small cases on that device, in this process, and found it within the
derived bounds below; otherwise it warns once, with the worst error, and uses the torch reference. The result is
cached per device. ``openrlhf-lopti check-gpu`` runs the wider :data:`WIDE_CASES` and prints a report.

Bounds (the rule of TESTING.md, "Numerical comparisons"): both paths compute in fp32 from the same logits, so a
forward field may differ by rounding of the size of ``max|z / T|`` (log-sum-exp subtracts numbers of that size)
and of the ``V``-term sums: ``FP32_ULPS * u32 * (max|z/T| + sqrt(V))`` for log-probs and entropies, times the
loss's size for the loss and ``1 + size`` for the k3 KL (the rounding of the log-prob carried through them). Gradients come
back in the logits' dtype, rounded there by both paths, so a bf16/fp16 gradient may also differ by one ulp of that
dtype.
"""

import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from openrlhf_lopti.algo import policy_loss_from_logits

FP32_ULPS = 64.0  # margin over one fp32 rounding of the magnitudes involved (several roundings add up)


@dataclass(frozen=True)
class Case:
    """One input of the check: ``[n, v]`` logits of ``dtype`` at ``temperature``; ``neg_inf`` puts -inf in a column."""

    n: int
    v: int
    dtype: torch.dtype
    temperature: float = 1.0
    neg_inf: bool = False


# V not a multiple of any block size, a -inf column, temperature != 1, fp32 and bf16: the shapes `auto` checks.
QUICK_CASES: Tuple[Case, ...] = (
    Case(16, 1000, torch.float32, temperature=0.7, neg_inf=True),
    Case(16, 1000, torch.bfloat16, temperature=1.0, neg_inf=True),
)
WIDE_CASES: Tuple[Case, ...] = QUICK_CASES + tuple(
    Case(n, v, dtype, temperature)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for n, v in ((1, 1), (64, 4099), (257, 32000), (512, 151936))
    for temperature in (1.0, 0.6)
)


@dataclass
class SelfCheck:
    """What :func:`run_self_check` found. ``worst``: dtype name -> the largest error of any field, in units of its
    bound (<= 1 passes); ``error``: the exception text when the kernel could not compile or run."""

    ok: bool
    seconds: float
    worst: Dict[str, float] = field(default_factory=dict)
    worst_case: Dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None

    def summary(self) -> str:
        """One line: pass / fail, the worst error per dtype (in units of its bound), the time taken."""
        if self.error is not None:
            return f"could not run ({self.error}) after {self.seconds:.1f} s"
        errors = ", ".join(f"{dtype} {value:.2g} ({self.worst_case[dtype]})" for dtype, value in self.worst.items())
        verdict = "passed" if self.ok else "FAILED"
        return f"{verdict} in {self.seconds:.1f} s; worst error / bound per dtype: {errors}"


def _inputs(case: Case, device: torch.device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(case.n, case.v, generator=g) * 4
    labels = torch.randint(0, case.v, (case.n,), generator=g)
    if case.neg_inf and case.v > 1:
        column = int(labels[0] + 1) % case.v  # never the label of row 0
        logits[1:, column] = float("-inf")
        labels[1:] = torch.where(labels[1:] == column, (column + 1) % case.v, labels[1:])
    old = torch.randn(case.n, generator=g) * 0.5 - 1.5
    rows = dict(
        labels=labels,
        old_log_probs=old,
        advantages=torch.randn(case.n, generator=g),
        mask=torch.rand(case.n, generator=g) > 0.2,
        ref_log_probs=old + 0.1 * torch.randn(case.n, generator=g),
        weights=torch.randn(3, case.n, generator=g),  # upstream gradients of loss, logp, entropy
    )
    out = {k: v.to(device) for k, v in rows.items()}
    out["logits"] = logits.to(device=device, dtype=case.dtype)
    return out


def _forward_backward(run, inputs: dict, case: Case) -> Tuple[object, torch.Tensor]:
    logits = inputs["logits"].detach().clone().requires_grad_(True)
    out = run(
        logits, inputs["labels"], inputs["old_log_probs"], inputs["advantages"], inputs["mask"],
        ref_log_probs=inputs["ref_log_probs"], alpha=0.3, eps_low=0.2, eps_high=0.28, dual_clip=3.0,
        kl_coef=0.01, kl_estimator="k3", temperature=case.temperature, return_entropy=True,
    )  # fmt: skip
    out = out[0] if isinstance(out, tuple) else out  # the kernel also returns its bad-row flags
    w = inputs["weights"]
    ((out.loss * w[0]).sum() + (out.logp * w[1]).sum() + (out.entropy * w[2]).sum()).backward()
    return out, logits.grad


def _errors(case: Case, inputs: dict, got, want) -> float:
    """The largest error of any field, in units of its bound (see the module docstring)."""
    (out, grad), (ref, ref_grad) = got, want
    finite = inputs["logits"].float().masked_fill(~torch.isfinite(inputs["logits"].float()), 0)
    magnitude = finite.abs().max().item() / case.temperature + case.v**0.5
    unit = FP32_ULPS * torch.finfo(torch.float32).eps / 2 * magnitude
    worst = 0.0
    for name in ("loss", "logp", "kl", "entropy"):
        a, b = getattr(out, name).float(), getattr(ref, name).detach().float()
        size = b.abs().max().item()
        # logp and entropy carry the log-sum-exp's rounding itself; the loss (A * ratio) and the k3 KL
        # (exp(ref - logp) - ...) carry it times their own size
        factor = {"loss": max(size, 1.0), "kl": size + 1.0}.get(name, 1.0)
        worst = max(worst, (a - b).abs().max().item() / (unit * factor))
    g, rg = grad.float(), ref_grad.float()
    scale = max(rg.abs().max().item(), torch.finfo(torch.float32).tiny)
    # the gradient is rounded to the logits' dtype by both paths: one ulp of that dtype apart at most
    rounding = torch.finfo(case.dtype).eps if case.dtype != torch.float32 else 0.0
    return max(worst, (g - rg).abs().max().item() / ((unit + rounding) * scale))


def run_self_check(device: torch.device, cases: Sequence[Case] = QUICK_CASES) -> SelfCheck:
    """Run the Triton kernel and the torch reference forward and backward on ``cases`` on ``device``.

    Returns a :class:`SelfCheck`; never raises for a kernel that fails to compile or run (that is a failed check).
    """
    from . import triton_policy_loss

    started = time.perf_counter()
    worst: Dict[str, float] = {}
    worst_case: Dict[str, str] = {}
    try:
        for i, case in enumerate(cases):
            inputs = _inputs(case, device, seed=i)
            error = _errors(
                case, inputs, _forward_backward(triton_policy_loss, inputs, case),
                _forward_backward(policy_loss_from_logits, inputs, case),
            )  # fmt: skip
            dtype = str(case.dtype).replace("torch.", "")
            if error >= worst.get(dtype, -1.0):
                worst[dtype] = error
                worst_case[dtype] = f"N={case.n} V={case.v} T={case.temperature}{' -inf' if case.neg_inf else ''}"
    except Exception as exc:  # a kernel that does not compile or crashes on this device: not usable here
        return SelfCheck(False, time.perf_counter() - started, error=f"{type(exc).__name__}: {exc}")
    return SelfCheck(all(e <= 1.0 for e in worst.values()), time.perf_counter() - started, worst, worst_case)


_VERIFIED: Dict[str, SelfCheck] = {}


def triton_verified(device: torch.device) -> bool:
    """Whether ``auto`` may use the Triton kernel on ``device``: the quick self-check, once per device and process.

    Prints one line the first time: its cost when it passes; a warning with the worst error when it fails (the
    torch reference is then used on that device).
    """
    key = str(device)
    if key not in _VERIFIED:
        result = run_self_check(torch.device(device))
        _VERIFIED[key] = result
        if result.ok:
            print(f"[openrlhf-lopti] Triton self-check on {key}: {result.summary()}", file=sys.stderr)
        else:
            print(
                f"[openrlhf-lopti] WARNING: Triton self-check on {key} {result.summary()}; "
                "--actor.fused_loss auto uses the torch reference on this device (`openrlhf-lopti check-gpu` reports more)",
                file=sys.stderr,
            )
    return _VERIFIED[key].ok


def forget_self_checks() -> List[str]:
    """Drop the cached results (tests; a process that changed its Triton install). Returns the devices dropped."""
    dropped = list(_VERIFIED)
    _VERIFIED.clear()
    return dropped
