"""The shared test grid for every ``fused_policy_loss`` backend: inputs, options, and the comparison with the
torch reference (``openrlhf_lopti.algo.policy_loss_from_logits``), forward and backward.

Each backend's test file parametrizes over ``CASES`` (or a subset, for slow interpreter runs) and calls
``check_backend_matches_reference``.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch

from openrlhf_lopti.algo import policy_loss_from_logits
from openrlhf_lopti.ops import fused_policy_loss

from .numerics import Float64Shadow, assert_near_float64, fp32_error_bound


@dataclass(frozen=True)
class Case:
    n: int = 8
    v: int = 96
    dtype: torch.dtype = torch.float32
    temperature: float = 1.0
    alpha: float = 0.0
    kl: Optional[str] = None  # None: no KL; else the estimator, with kl_coef 0.05
    dual_clip: Optional[float] = None
    entropy: bool = False
    eps_high: float = 0.28
    masked_fraction: float = 0.25
    seed: int = 0
    options: dict = field(default_factory=dict)
    # Spread of old/ref log-probs around the current ones, and a constant added to every logit: large
    # values drive ratios past the dual clip and the +-20 clamp, KL past its +-10 clamp, and test stability.
    old_spread: float = 0.3
    ref_spread: float = 0.5
    logit_offset: float = 0.0

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (
            f"n{self.n}-v{self.v}-{dt}-T{self.temperature}-a{self.alpha}-kl{self.kl}"
            f"-dc{self.dual_clip}-ent{int(self.entropy)}-m{self.masked_fraction}"
        )


CASES = [
    Case(),
    Case(v=257),  # V not a multiple of any block size
    Case(dtype=torch.bfloat16, v=130),
    Case(dtype=torch.float16, v=130),
    Case(temperature=0.7),
    Case(alpha=0.3, kl="k3"),
    Case(alpha=1.0, kl="k1", entropy=True),
    Case(kl="k2", dual_clip=3.0),
    Case(dual_clip=3.0, entropy=True, temperature=1.3, dtype=torch.bfloat16),
    Case(n=1, v=33, masked_fraction=0.0),  # one token
    Case(masked_fraction=1.0, entropy=True, kl="k3"),  # all masked: zero loss, zero gradient
    Case(n=37, v=1000, alpha=0.3, kl="k3", entropy=True, seed=3),
]

# Inputs far from the current policy: every clamp and the dual clip bind on some rows (the triton tests
# check that they really do).
EXTREME_CASES = {
    "dual-clip-binds": Case(n=32, old_spread=3.0, dual_clip=3.0, seed=5),
    "log-ratio-clamp": Case(n=32, old_spread=25.0, alpha=0.3, seed=6),
    "k1-clamp": Case(n=32, kl="k1", ref_spread=15.0, seed=7),
    "k2-clamp": Case(n=32, kl="k2", ref_spread=8.0, seed=8),
    "k3-clamp": Case(n=32, kl="k3", ref_spread=15.0, entropy=True, seed=9),
    "logits-offset-300": Case(n=16, logit_offset=300.0, entropy=True, temperature=0.7, seed=10),
}


def make_inputs(case: Case, device: str = "cpu") -> dict:
    """Random inputs for one case: logits with a realistic spread, old log-probs near the current policy
    (so some ratios clip and some do not), mixed-sign advantages, a mask with ``masked_fraction`` zeros."""
    g = torch.Generator().manual_seed(case.seed)
    n, v = case.n, case.v
    logits = (torch.randn(n, v, generator=g) * 3.0 + case.logit_offset).to(case.dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    # Put some labels on the argmax so high-probability tokens appear too.
    top = logits.float().argmax(-1)
    labels = torch.where(torch.rand(n, generator=g) < 0.4, top, labels)
    with torch.no_grad():
        logp = torch.log_softmax(logits.float() / case.temperature, -1).gather(-1, labels[:, None]).squeeze(-1)
    old = (logp + torch.randn(n, generator=g) * case.old_spread).clamp(max=0.0)  # log-probs are <= 0
    ref = logp + torch.randn(n, generator=g) * case.ref_spread
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) >= case.masked_fraction
    if case.masked_fraction == 0.0:
        mask[:] = True
    # Masked rows may hold ids outside [0, V) (padding); the backends must not read them.
    labels = torch.where(mask, labels, torch.full_like(labels, -100))
    return {
        "logits": logits.to(device),
        "labels": labels.to(device),
        "old_log_probs": old.to(device),
        "advantages": adv.to(device),
        "mask": mask.to(device),
        "ref_log_probs": ref.to(device) if case.kl else None,
    }


def options(case: Case) -> dict:
    return dict(
        alpha=case.alpha,
        eps_low=0.2,
        eps_high=case.eps_high,
        dual_clip=case.dual_clip,
        kl_coef=0.05 if case.kl else 0.0,
        kl_estimator=case.kl or "k3",
        temperature=case.temperature,
        return_entropy=case.entropy,
        **case.options,
    )


def _run(fn, inputs: dict, opts: dict, upstream: dict):
    logits = inputs["logits"].detach().clone().requires_grad_(True)
    out = fn(
        logits,
        inputs["labels"],
        inputs["old_log_probs"],
        inputs["advantages"],
        inputs["mask"],
        ref_log_probs=inputs["ref_log_probs"],
        **opts,
    )
    _weighted(out, upstream).backward()
    return out, logits.grad


def allow_float64_logits(monkeypatch) -> None:
    """Test-only widening: the fused loss (``fused_policy_loss`` and ``fused_linear_policy_loss``, torch backend)
    accepts float64 logits / hidden states, so float64 runs of a whole path (tests/numerics.py) can use it."""
    import importlib

    fused_module = importlib.import_module("openrlhf_lopti.ops.fused_policy_loss")
    linear_module = importlib.import_module("openrlhf_lopti.ops.fused_linear_policy_loss")
    for module in (fused_module, linear_module):
        monkeypatch.setattr(module, "LOGITS_DTYPES", (*fused_module.LOGITS_DTYPES, torch.float64))


def reference_truth(inputs: dict, opts: dict, objective):
    """The reference (``policy_loss_from_logits``) on the same inputs, run in float64 (tests/numerics.py,
    ``Float64Shadow``): the truth each fp32 path is measured against. ``objective(outputs)`` gives the scalar to
    differentiate. Returns ``(outputs, logits gradient)``, float64, on the CPU."""
    on_cpu = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    logits = on_cpu.pop("logits").double().requires_grad_(True)
    with Float64Shadow():
        out = policy_loss_from_logits(logits, **on_cpu, **opts)
        objective(out).backward()
    return out, logits.grad


def reference_in_float64(inputs: dict, opts: dict, upstream: dict):
    """:func:`reference_truth` of the grid's objective: the outputs weighted by ``upstream``."""
    up = {k: v.detach().cpu().double() for k, v in upstream.items()}
    return reference_truth(inputs, opts, lambda out: _weighted(out, up))


def _weighted(out, upstream: dict) -> torch.Tensor:
    total = (out.loss * upstream["loss"]).sum() + (out.logp * upstream["logp"]).sum()
    if out.entropy is not None:
        total = total + (out.entropy * upstream["entropy"]).sum()
    return total


def _field(outputs, name: str):
    return outputs.get(name) if isinstance(outputs, dict) else getattr(outputs, name)


def assert_near_truth(path: str, out, grad, truth, truth_grad, logits: torch.Tensor, temperature: float,
                      weight: float = 1.0, fields=("loss", "logp", "kl", "entropy")) -> None:  # fmt: skip
    """Each fp32 output of one path (``out``: a ``PolicyLossOutput`` or a dict) and its gradient are within
    :func:`tests.numerics.fp32_error_bound` of the float64 truth: magnitude max|z/T| over the finite logits,
    reduction length V, scale max(1, max|output|) for the forward fields (logp's error is absolute; the others
    carry it times about their own size) and, for the gradient, max|gradient| or ``weight`` / T (the largest
    upstream weight of the objective differentiated),
    whichever is larger (a rounding of logp reaches the gradient times a weight and 1/T even where the true
    gradient is 0, e.g. V = 1), plus one ulp of the logits' dtype. ``None`` in the truth (no entropy asked) must
    be ``None`` in ``out`` too."""
    finite = logits.detach().float()
    finite = finite[torch.isfinite(finite)]
    magnitude = (finite.abs().max().item() if finite.numel() else 0.0) / temperature
    length = logits.shape[-1]
    for name in fields:
        want = _field(truth, name)
        got = _field(out, name)
        if want is None:
            assert got is None, f"{path}: {name} should be None"
            continue
        assert got.dtype == torch.float32, f"{path}: {name} dtype {got.dtype}"
        want = want.detach().double()
        values = want[torch.isfinite(want)]
        scale = max(1.0, values.abs().max().item() if values.numel() else 0.0)
        assert_near_float64(name, got, want, fp32_error_bound(magnitude, length, scale), path)
    if grad is not None:
        want = truth_grad.detach().double()
        scale = max(want.abs().max().item() if want.numel() else 0.0, weight / temperature)
        assert_near_float64("grad", grad, want, fp32_error_bound(magnitude, length, scale, dtype=grad.dtype), path)


def max_weight(upstream: dict) -> float:
    """The largest |weight| of an objective's upstream weights (for :func:`assert_near_truth`)."""
    return max((w.abs().max().item() for w in upstream.values() if w.numel()), default=0.0)


def check_backend_matches_reference(case: Case, backend: str, device: str = "cpu") -> None:
    """Forward fields and ``d(sum of weighted outputs)/d logits`` of ``backend`` equal the reference's: both the
    backend and the fp32 reference are measured against the float64 run of the reference on the same inputs
    (:func:`assert_near_truth`, a bound derived from the computation; a failure names the path that is off)."""
    inputs = make_inputs(case, device)
    g = torch.Generator().manual_seed(case.seed + 1)
    upstream = {k: torch.randn(case.n, generator=g).to(device) for k in ("loss", "logp", "entropy")}
    opts = options(case)
    ref_out, ref_grad = _run(policy_loss_from_logits, inputs, opts, upstream)
    out, grad = _run(lambda *a, **k: fused_policy_loss(*a, backend=backend, **k), inputs, opts, upstream)
    truth, truth_grad = reference_in_float64(inputs, opts, upstream)

    assert grad is not None and grad.dtype == case.dtype and grad.shape == inputs["logits"].shape
    for path, o, gr in (("reference", ref_out, ref_grad), (backend, out, grad)):
        assert_near_truth(path, o, gr, truth, truth_grad, inputs["logits"], case.temperature, max_weight(upstream))
    assert torch.equal(out.clipped.cpu(), ref_out.clipped.cpu()), "clipped flags differ"
    masked_rows = ~inputs["mask"]
    assert torch.all(grad[masked_rows] == 0), "masked rows must get exactly zero gradient"
    assert torch.all(torch.isfinite(grad.float()))


# The tests' own copies of the clamp bounds (not imported from the code under test, so a changed constant there
# fails here): OpenRLHF clamps the log ratio to +-20 before exp, and each KL estimate to +-10.
LOG_RATIO_BOUND = 20.0
KL_BOUND = 10.0


def textbook_policy_loss(inputs: dict, opts: dict, logits: torch.Tensor) -> dict:
    """The per-token loss written out from its definition (PAPER_NOTES / OpenRLHF), in float64, with the
    literal bounds above: an independent reference for the backends and for the reference itself.

    ``logits`` ``[N, V]`` (differentiable); other inputs as :func:`make_inputs`, options as :func:`options`.
    Returns ``loss``, ``logp``, ``kl``, ``clipped``, ``entropy`` ``[N]`` (0 on masked rows).
    """
    keep = inputs["mask"].bool()
    z = torch.where(keep[:, None], logits.double(), 0.0) / opts["temperature"]
    log_p = z - z.logsumexp(-1, keepdim=True)
    labels = inputs["labels"].clamp(0, logits.shape[1] - 1)
    logp = log_p.gather(-1, labels[:, None]).squeeze(-1)
    p = log_p.exp()
    entropy = -(p * log_p).sum(-1)
    old = torch.where(keep, inputs["old_log_probs"].double(), 0.0)
    adv = torch.where(keep, inputs["advantages"].double(), 0.0)
    alpha = opts["alpha"]
    adv = adv * (alpha * old.exp() + 1.0 - alpha)  # AR, paper Eq. 4
    ratio = (logp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - opts["eps_low"], 1.0 + opts["eps_high"]) * adv
    pg = -torch.min(surr1, surr2)
    if opts["dual_clip"] is not None:
        pg = torch.where(adv < 0, torch.min(pg, -opts["dual_clip"] * adv), pg)
    kl = torch.zeros_like(logp)
    if inputs["ref_log_probs"] is not None:
        x = logp - torch.where(keep, inputs["ref_log_probs"].double(), 0.0)
        if opts["kl_estimator"] == "k1":
            kl = x
        elif opts["kl_estimator"] == "k2":
            kl = x**2 / 2
        else:
            x = x.clamp(min=-KL_BOUND)  # OpenRLHF clamps x first for k3 (exp(-x) stays finite)
            kl = (-x).exp() - 1 + x
        kl = kl.clamp(-KL_BOUND, KL_BOUND)
    loss = pg + opts["kl_coef"] * kl
    zero = torch.zeros_like(loss)
    return {
        "loss": torch.where(keep, loss, zero),
        "logp": torch.where(keep, logp, zero),
        "kl": torch.where(keep, kl, zero),
        "clipped": keep & (surr2 < surr1),
        "entropy": torch.where(keep, entropy, zero),
    }
