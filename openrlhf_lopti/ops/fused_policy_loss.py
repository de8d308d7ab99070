"""``fused_policy_loss``: logits -> log-prob -> AR weight -> clipped surrogate -> KL, one call, three backends.

The math is :func:`openrlhf_lopti.algo.policy_loss_from_logits` (the ``"torch"`` backend); ``"triton"`` and
``"cpp"`` compute the same per-token outputs without an fp32 ``[N, V]`` copy of the logits. Every input
is checked here, once, before any backend runs, so a kernel never sees a bad index or a NaN it did not make;
the logits' values excepted: reading ``[N, V]`` twice would cost as much as the loss, so each backend flags
rows holding NaN / +inf in the pass it makes anyway, and the ``ValueError`` comes right after the forward.
"""

import math
from dataclasses import astuple
from typing import Optional

import torch

from ..algo import KL_ESTIMATORS, PolicyLossOutput, check_alpha, policy_loss_from_logits
from ..algo.policy_loss import check_logit_rows
from .loss_options import LossOptions, resolve_options

BACKENDS = ("auto", "triton", "cpp", "torch")
LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_inputs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_log_probs: Optional[torch.Tensor],
    alpha: float,
    eps_low: float,
    eps_high: float,
    dual_clip: Optional[float],
    kl_coef: float,
    kl_estimator: str,
    temperature: float,
    backend: str,
) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a [N, V] tensor, got shape {getattr(logits, 'shape', type(logits))}")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    n, v = logits.shape
    if v == 0:
        raise ValueError("logits must have a non-empty vocab dimension V")
    _check_row_inputs(
        n, v, logits.device, "logits [N, V]", labels, old_log_probs, advantages, mask, ref_log_probs,
        alpha, eps_low, eps_high, dual_clip, kl_coef, kl_estimator, temperature,
    )  # fmt: skip


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
    alpha: float,
    eps_low: float,
    eps_high: float,
    dual_clip: Optional[float],
    kl_coef: float,
    kl_estimator: str,
    temperature: float,
) -> None:
    """The checks of every per-token input and option, for ``N`` rows over a vocab of ``V`` on ``device``.

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

    check_alpha(alpha)
    if not (0.0 <= eps_low < 1.0):
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low!r}")
    if not (eps_high >= 0.0 and math.isfinite(eps_high)):
        raise ValueError(f"eps_high must be a finite number >= 0, got {eps_high!r}")
    if dual_clip is not None and not (dual_clip > 1.0 and math.isfinite(dual_clip)):
        raise ValueError(f"dual_clip must be None or a finite number > 1, got {dual_clip!r}")
    if not math.isfinite(kl_coef):
        raise ValueError(f"kl_coef must be finite, got {kl_coef!r}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if kl_coef != 0 and ref_log_probs is None:
        raise ValueError("ref_log_probs is required when kl_coef != 0")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")

    # Value checks on the rows that will be computed; one host sync for all of them. Float vectors of any
    # dtype are accepted and every backend rounds them to float32 first, so finiteness is checked there
    # (a float64 1e300 is finite, its float32 is not).
    keep = mask.bool()
    bad = torch.stack(
        [
            (keep & ((labels < 0) | (labels >= v))).any(),
            (keep & ~torch.isfinite(old_log_probs.float())).any(),
            (keep & ~torch.isfinite(advantages.float())).any(),
            (keep & ~torch.isfinite(ref_log_probs.float())).any() if ref_log_probs is not None else keep.new_zeros(()),
        ]
    ).tolist()
    in_fp32 = "on unmasked rows (as float32, the precision of the loss)"
    messages = [
        f"labels must be token ids in [0, V) = [0, {v}) on unmasked rows",
        f"old_log_probs must be finite {in_fp32}",
        f"advantages must be finite {in_fp32}",
        f"ref_log_probs must be finite {in_fp32}",
    ]
    for is_bad, message in zip(bad, messages):
        if is_bad:
            raise ValueError(message)


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
    options: Optional[LossOptions] = None,
) -> PolicyLossOutput:
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
        dual_clip: dual-clip bound (> 1) for negative advantages, or None.
        kl_coef: weight of the KL estimate folded into ``loss``.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (OpenRLHF's estimators, clamped to [-10, 10]).
        temperature: logits are divided by it (the rollout's sampling temperature).
        return_entropy: also return the per-row entropy of ``softmax(logits / temperature)`` (differentiable).
        backend: ``"auto"`` (triton on CUDA, cpp on CPU when built, else torch), ``"triton"``, ``"cpp"``,
            ``"torch"``.
        options: a :class:`~openrlhf_lopti.ops.LossOptions` holding ``alpha`` .. ``backend`` (what the front
            ends pass), instead of those keywords.

    Returns:
        :class:`~openrlhf_lopti.algo.PolicyLossOutput`: fp32 ``loss``, ``logp``, ``kl``, bool ``clipped``,
        and ``entropy`` or None, each ``[N]``. Gradients reach ``logits`` through ``loss``, ``logp`` and
        ``entropy``.

    Raises:
        ValueError: naming the argument, for any bad shape, device, dtype, id or non-finite value,
            before anything is launched. And after the forward, before anything is returned: naming the
            first unmasked ``logits`` row that holds a NaN or +inf, or only -inf (-inf alone is legal and
            exact: probability 0, zero gradient). Each backend flags such rows in the pass it already makes
            over every row; reading the flags costs one device-to-host sync, on top of the one the input
            checks pay.
    """
    alpha, eps_low, eps_high, dual_clip, kl_coef, kl_estimator, temperature, backend = astuple(resolve_options(
        options, alpha=alpha, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, kl_coef=kl_coef,
        kl_estimator=kl_estimator, temperature=temperature, backend=backend,
    ))  # fmt: skip
    _check_inputs(
        logits, labels, old_log_probs, advantages, mask, ref_log_probs,
        alpha, eps_low, eps_high, dual_clip, kl_coef, kl_estimator, temperature, backend,
    )  # fmt: skip
    options = dict(
        ref_log_probs=ref_log_probs,
        alpha=float(alpha),
        eps_low=float(eps_low),
        eps_high=float(eps_high),
        dual_clip=None if dual_clip is None else float(dual_clip),
        kl_coef=float(kl_coef),
        kl_estimator=kl_estimator,
        temperature=float(temperature),
        return_entropy=return_entropy,
    )
    chosen = resolve_backend(backend, logits)
    if chosen == "torch":  # the reference checks its rows itself (same check, same message)
        return policy_loss_from_logits(logits, labels, old_log_probs, advantages, mask, **options)
    if chosen == "triton":
        from .triton import triton_policy_loss as run
    else:
        from .cpp_policy_loss import cpp_policy_loss as run
    out, bad_rows = run(logits, labels, old_log_probs, advantages, mask, **options)
    check_logit_rows(bad_rows, logits, options["temperature"])  # the host sync after the forward
    return out
