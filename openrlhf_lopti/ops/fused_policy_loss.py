"""``fused_policy_loss``: logits -> log-prob -> AR weight -> clipped surrogate -> KL, one call, three backends.

The math is :func:`openrlhf_lopti.algo.policy_loss_from_logits` (the ``"torch"`` backend); ``"triton"`` and
``"cpp"`` compute the same per-token outputs without an fp32 ``[N, V]`` copy of the logits. Shapes, dtypes,
devices and options are checked here, before any backend runs; the values (ids in range, finite log-probs and
advantages, a finite log-sum-exp per logits row) by each backend, as per-row status bits written in the pass it
makes anyway (``ops/value_status.py``), read when the check policy (``check``) says: at once, at the trainer's
optimizer step, or never. No host sync otherwise.
"""

import os
from collections import Counter
from typing import Dict, Optional

import torch

from ..algo.option_checks import check_options, dual_clip_bound
from .loss_head_output import LossHeadOutput
from .loss_options import LossOptions, resolve_options
from .torch_policy_loss import torch_policy_loss

BACKENDS = ("auto", "triton", "cpp", "torch")
LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_inputs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_log_probs: Optional[torch.Tensor],
    settings: LossOptions,
) -> None:
    backend = settings.backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a [N, V] tensor, got shape {getattr(logits, 'shape', type(logits))}")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    n, v = logits.shape
    if v == 0:
        raise ValueError("logits must have a non-empty vocab dimension V")
    # the device only: a package missing stays the backend's ImportError (what `bench` reports as "not installed")
    problem = backend_cannot_run(backend, logits.device.type, installed_here=False)
    if problem:
        raise ValueError(f"backend={backend!r} {problem}; use backend='auto'")
    _check_row_inputs(n, v, logits.device, "logits [N, V]", labels, old_log_probs, advantages, mask, ref_log_probs,
                      settings)  # fmt: skip


def _check_row_inputs(
    n: int,
    v: int,
    device: torch.device,
    rows_from: str,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_log_probs: Optional[torch.Tensor],
    settings: LossOptions,
) -> None:
    """The checks of every per-token input and option (``settings`` but its backend), for ``N`` rows over a vocab of
    ``V`` on ``device``.

    ``rows_from`` names the tensor that fixes ``N`` and the device in the messages (``"logits [N, V]"``,
    or ``"hidden [N, H]"`` for the fused lm_head).
    """
    source = rows_from.split()[0]
    per_token = {"labels": labels, "old_log_probs": old_log_probs, "advantages": advantages, "mask": mask}
    if ref_log_probs is not None:
        per_token["ref_log_probs"] = ref_log_probs
    for name, tensor in per_token.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape [{n}], got {type(tensor).__name__}")
        if tuple(tensor.shape) != (n,):
            raise ValueError(f"{name} must have shape [N]=[{n}] to match {rows_from}, got {tuple(tensor.shape)}")
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but {source} is on {device}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    for name in ("old_log_probs", "advantages", "ref_log_probs"):
        if name in per_token and not per_token[name].dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {per_token[name].dtype}")
    if mask.dtype.is_complex:
        raise ValueError(f"mask must be bool or 0/1, got {mask.dtype}")

    check_options(settings.alpha, settings.eps_low, settings.eps_high, settings.dual_clip, settings.kl_coef,
                  settings.kl_estimator, settings.temperature)  # fmt: skip
    if float(settings.kl_coef) != 0 and ref_log_probs is None:
        raise ValueError("ref_log_probs is required when kl_coef != 0")

    # The values (ids in range, finite floats, finite log-sum-exp per row) are checked by each backend as status
    # bits in the pass it makes anyway (ops/value_status.py), and read when the check policy says.


def resolve_backend(backend: str, logits: torch.Tensor) -> str:
    """The backend ``backend`` runs on for ``logits``' device: ``"auto"`` is triton on CUDA once its self-check has
    passed on that device (``triton.self_check.triton_verified``; torch without triton or after a failed check),
    cpp on CPU (torch without the built extension); any other name is itself."""
    if backend != "auto":
        return backend
    if logits.is_cuda:
        from .triton import triton_available
        from .triton.self_check import triton_verified

        return "triton" if triton_available() and triton_verified(logits.device) else "torch"
    from .cpp_policy_loss import cpp_available

    return "cpp" if cpp_available() else "torch"


def backend_cannot_run(backend: str, device_type: str, installed_here: bool = True) -> Optional[str]:
    """Why ``backend`` cannot run on a ``device_type`` (``"cpu"`` / ``"cuda"``) device, or None: what a front end
    checks before it loads anything, so that a backend named for the wrong device is not found at the first loss call
    (inside a Ray actor, after a rollout). Triton needs CUDA (or ``TRITON_INTERPRET=1``: its interpreter on CPU), cpp
    runs on CPU only; ``auto`` and ``torch`` run anywhere. With ``installed_here`` (the device is this process's, not
    a GPU node's a launcher only schedules) the triton package, CUDA and the built C++ kernel are checked too."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if backend == "triton":
        if device_type != "cuda" and not interpreted:
            return f"needs a CUDA device, or TRITON_INTERPRET=1 in the environment to run on {device_type} (slow)"
        from .triton import triton_available

        if installed_here and not triton_available():
            return "needs triton and a CUDA device here (or TRITON_INTERPRET=1), which this machine lacks"
    elif backend == "cpp":
        if device_type != "cpu":
            return f"runs on CPU only, not {device_type}"
        from .cpp_policy_loss import cpp_available

        if installed_here and not cpp_available():
            return "needs the C++ kernel, which is not built here (see the warning above)"
    return None


def check_weights(n: int, device: torch.device, loss_weights, entropy_weights, grad_in_logits) -> None:
    """The checks of the one-pass head's arguments for ``N`` rows on ``device`` (one-line ``ValueError``s)."""
    for name, weights in (("loss_weights", loss_weights), ("entropy_weights", entropy_weights)):
        if weights is None:
            continue
        if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (n,) or not weights.dtype.is_floating_point:
            got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise ValueError(f"{name} must be None or a float tensor of shape [N]=[{n}], got {got}")
        if weights.device != device:
            raise ValueError(f"{name} is on {weights.device} but the rows are on {device}")
        if weights.requires_grad and torch.is_grad_enabled():  # the Triton one-pass head has no gradient for them
            raise ValueError(f"{name} must not require grad: they are the reduction's constants (pass "
                             f"{name}.detach(), or reduce out.loss yourself with loss_weights=None)")  # fmt: skip
    if entropy_weights is not None and loss_weights is None:
        raise ValueError("entropy_weights needs loss_weights (the one-pass head reduces both), got loss_weights=None")
    if grad_in_logits and loss_weights is None:
        raise ValueError("grad_in_logits=True needs loss_weights (only the one-pass head writes a gradient up front)")


_BACKENDS_RAN: Counter = Counter()


def backends_ran() -> Dict[str, int]:
    """How many loss-head calls each backend ran in this process (``{"triton": 12, ...}``): what a benchmark reads to
    record the backend behind a figure."""
    return dict(_BACKENDS_RAN)


def apply_check_policy(out: LossHeadOutput, check: str) -> LossHeadOutput:
    """``out`` after its check policy: ``"eager"`` raises the first bad row now (one 4-byte read), ``"step"`` leaves
    ``out.status`` for the trainer's :class:`~openrlhf_lopti.ops.value_status.StepChecks`, ``"off"`` drops it."""
    _BACKENDS_RAN[out.backend] += 1
    if check == "eager":
        out.status.raise_if_bad()
        out.status.row_logits = None
    elif check == "off":
        out.status = None
    return out


def fused_policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_log_probs: Optional[torch.Tensor] = None,
    alpha: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    check: str = "eager",
    loss_weights: Optional[torch.Tensor] = None,
    entropy_weights: Optional[torch.Tensor] = None,
    grad_in_logits: bool = False,
    options: Optional[LossOptions] = None,
) -> LossHeadOutput:
    """Per-token PPO/GRPO policy loss with Advantage Reweighting and KL, straight from the logits.

    Args:
        logits: ``[N, V]`` fp32/bf16/fp16, row i predicting ``labels[i]`` (already shifted). Read in its own
            dtype; the triton/cpp backends never make an fp32 ``[N, V]`` copy.
        labels: ``[N]`` integer token ids, in ``[0, V)`` wherever ``mask`` is set.
        old_log_probs: ``[N]`` rollout-policy log-probs of ``labels`` (nats): the PPO anchor and the AR ``p``.
            This and the other float ``[N]`` inputs may have any float dtype (float64 included): every backend
            rounds them to float32 first, the precision the loss is computed in.
        advantages: ``[N]`` per-token advantages (already zeroed outside a Lopti phase if one is active).
        mask: ``[N]`` bool or 0/1; rows with 0 are skipped: every output is 0 there and no gradient flows.
        ref_log_probs: ``[N]`` reference-policy log-probs, needed when ``kl_coef != 0``.
        alpha: AR strength in [0, 1]; 0 is plain GRPO.
        eps_low, eps_high: ratio clip range ``[1 - eps_low, 1 + eps_high]``.
        dual_clip: dual-clip bound (> 1) for negative advantages, or None (inf: None, as the frameworks read it).
        kl_coef: weight of the KL estimate folded into ``loss``.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (OpenRLHF's estimators, clamped to [-10, 10]).
        temperature: logits are divided by it (the rollout's sampling temperature).
        return_entropy: also return the per-row entropy of ``softmax(logits / temperature)`` (differentiable).
        backend: ``"auto"`` (triton on CUDA, cpp on CPU when built, else torch), ``"triton"``, ``"cpp"``,
            ``"torch"``.
        check: when the value checks are read (``ops/value_status.py``): ``"eager"`` (in this call), ``"step"``
            (the caller's :class:`~openrlhf_lopti.ops.value_status.StepChecks`, before its optimizer step) or
            ``"off"``.
        loss_weights: ``[N]`` float per-token weights of the reduced loss, or None. Given, the call returns
            ``reduced = sum(loss_weights * loss) + sum(entropy_weights * entropy)`` and only ``reduced`` carries a
            gradient: the Triton kernel then writes the gradient w.r.t. the logits while it reads them (the
            one-pass head) and the backward only scales it. The reductions the front ends use are such weights
            (a token mean: ``mask / count``; TRL's loss types: ``openrlhf_lopti.trl``'s ``_loss_type_weights``).
        entropy_weights: ``[N]`` float weights of the entropy in ``reduced`` (e.g. ``-coef * loss_weights`` for an
            entropy bonus), or None; needs ``loss_weights``. The entropy is computed for ``reduced``; ``out.entropy``
            (detached) is returned only with ``return_entropy=True``.
        grad_in_logits: with ``loss_weights``, the gradient is written into the logits' own buffer (one ``[N, V]``
            less; Triton in its forward, C++ in its backward, the torch reference not at all; the logits are
            overwritten, so only for a caller that no longer needs them: an op that saved them raises at backward).
        options: a :class:`~openrlhf_lopti.ops.LossOptions` holding ``alpha`` .. ``check`` (what the front
            ends pass), instead of those keywords.

    Returns:
        :class:`~openrlhf_lopti.ops.loss_head_output.LossHeadOutput`: fp32 ``loss``, ``logp``, ``kl``, bool
        ``clipped``, and ``entropy`` or None, each ``[N]``; ``reduced`` (with ``loss_weights``); ``backend``, the
        backend that ran; ``status``, the value checks (unread under ``"step"``). Gradients reach ``logits``
        through ``loss``, ``logp`` and ``entropy``, or through ``reduced`` alone.

    Raises:
        ValueError: naming the argument, for any bad shape, device, dtype or option, before anything is launched.
            Under ``check="eager"``, after the forward, before anything is returned: for the first unmasked row
            with a label outside ``[0, V)``, a non-finite ``old_log_probs`` / ``advantages`` / ``ref_log_probs``,
            or logits holding a NaN or +inf, or only -inf (-inf alone is legal and exact: probability 0, zero
            gradient). Every backend sets those rows' status bits in the pass it already makes; reading them is one
            4-byte device-to-host read. Under ``"step"`` the same error comes from
            :meth:`~openrlhf_lopti.ops.value_status.StepChecks.raise_if_bad`; a flagged row's ``loss``, ``logp``
            and ``kl`` are NaN under every policy. An option that is not a number (a string, None, a bool) or
            that float32 cannot hold, and ``loss_weights`` / ``entropy_weights`` that require grad (they are the
            reduction's constants), are ``ValueError`` s too.
        RuntimeError: at the backward, for a second derivative (``create_graph=True``) on the triton or cpp
            backend (``ops/first_order.py``); the torch backend differentiates twice.
    """
    settings = resolve_options(
        options, alpha=alpha, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, kl_coef=kl_coef,
        kl_estimator=kl_estimator, temperature=temperature, backend=backend, check=check,
    )  # fmt: skip
    _check_inputs(logits, labels, old_log_probs, advantages, mask, ref_log_probs, settings)
    check_weights(logits.shape[0], logits.device, loss_weights, entropy_weights, grad_in_logits)
    chosen = resolve_backend(settings.backend, logits)
    if chosen == "triton":
        from .triton import triton_policy_loss as run
    elif chosen == "cpp":
        from .cpp_policy_loss import cpp_policy_loss as run
    else:
        run = torch_policy_loss
    out = run(
        logits, labels, old_log_probs, advantages, mask, **kernel_options(settings, ref_log_probs, return_entropy
        or entropy_weights is not None), loss_weights=loss_weights, entropy_weights=entropy_weights,
        grad_in_logits=grad_in_logits,
    )  # fmt: skip
    if not return_entropy:
        out.entropy = None
    return apply_check_policy(out, settings.check)


def kernel_options(settings: LossOptions, ref_log_probs: Optional[torch.Tensor], return_entropy: bool) -> dict:
    """The keyword arguments every backend takes, from the call's settings (floats as Python floats)."""
    return dict(
        ref_log_probs=ref_log_probs,
        alpha=float(settings.alpha),
        eps_low=float(settings.eps_low),
        eps_high=float(settings.eps_high),
        dual_clip=dual_clip_bound(settings.dual_clip),
        kl_coef=float(settings.kl_coef),
        kl_estimator=settings.kl_estimator,
        temperature=float(settings.temperature),
        return_entropy=bool(return_entropy),
    )
