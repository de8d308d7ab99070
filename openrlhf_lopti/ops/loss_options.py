"""``LossOptions``: the policy loss's settings as one object, built once by a front end from its own config.

The local trainer, OpenRLHF's actor and TRL's trainer each read AR's alpha, the clip range, the KL term, the
sampling temperature and the kernel backend from their own flags; each builds one :class:`LossOptions` and hands
it to ``fused_policy_loss`` / ``fused_linear_policy_loss`` (``options=``), instead of rebuilding the keyword list.
"""

from dataclasses import dataclass
from typing import Optional

from .value_status import check_policy


@dataclass(frozen=True)
class LossOptions:
    """The settings of ``fused_policy_loss`` other than the per-token tensors (see its docstring for each).

    Attributes:
        alpha: AR strength in [0, 1] (0: plain GRPO).
        eps_low, eps_high: the ratio clip range ``[1 - eps_low, 1 + eps_high]``.
        dual_clip: dual-clip bound (> 1) for negative advantages, or None.
        kl_coef: weight of the KL estimate folded into the loss (0: none).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        temperature: the rollout's sampling temperature (> 0); logits are divided by it.
        backend: ``"auto"``, ``"triton"``, ``"cpp"`` or ``"torch"``.
        check: when the value checks are read: ``"eager"`` (in the call; a standalone call's default), ``"step"``
            (before the trainer's optimizer step, what our trainers set: no host sync in the loss head) or
            ``"off"`` (``ops/value_status.py``).
    """

    alpha: float = 0.0
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: Optional[float] = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    temperature: float = 1.0
    backend: str = "auto"
    check: str = "eager"

    def __post_init__(self) -> None:
        check_policy(self.check)


def resolve_options(options: Optional[LossOptions], **fields) -> LossOptions:
    """The loss's settings: ``options`` when given, else the keyword arguments ``fields``.

    Raises:
        ValueError: ``options`` is not a :class:`LossOptions`, or a field is also passed as a keyword with a value
            other than its default (two sources for one setting).
    """
    if options is None:
        return LossOptions(**fields)
    if not isinstance(options, LossOptions):
        raise ValueError(f"options must be a LossOptions or None, got {type(options).__name__}")
    default = LossOptions()
    for name, value in fields.items():
        if value != getattr(default, name):
            raise ValueError(f"options and {name} both given: set {name} in options")
    return options
