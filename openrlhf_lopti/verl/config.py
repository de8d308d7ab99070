"""Our keys in verl's config: ``actor_rollout_ref.actor.policy_loss`` as :class:`LoptiPolicyLossConfig`.

verl builds the policy-loss config from ``actor_rollout_ref.actor.policy_loss._target_`` (a dataclass, by default
``verl.workers.config.PolicyLossConfig``, which refuses unknown keys). Pointing ``_target_`` at our subclass adds
four keys, checked when the config is built, each error one line naming its key:

======================  =========  ================================================================================
key                     default    meaning
======================  =========  ================================================================================
``ar_alpha``            0.0        AR's alpha in [0, 1]; needs ``loss_mode=ar`` (the ``ar`` loss reads it)
``lopti_eta``           null       Lopti's threshold in (0, 1]; null: Lopti off (unless ``lopti_quantile``)
``lopti_order``         low_first  ``low_first`` (the paper's) or ``high_first`` (the ablation that collapses)
``lopti_quantile``      null       in (0, 1): the threshold is this quantile of p over every data-parallel rank's
                                   response tokens (turns Lopti on by itself; not with ``lopti_eta``)
======================  =========  ================================================================================

The rule of when Lopti runs and with which settings is ``openrlhf_lopti.algo.lopti_settings``, the same in every
front end. What verl must be set to for Lopti (:func:`check_lopti_actor`) is checked by the worker when it receives
its loss function, before any training.
"""

import sys
from dataclasses import dataclass
from typing import Optional, Tuple

from verl.workers.config import PolicyLossConfig

from openrlhf_lopti.algo import LoptiSettings, check_alpha, check_lopti_args, lopti_settings

KEY = "actor_rollout_ref.actor"  # where verl's actor config lives in main_ppo's config
POLICY_LOSS_KEY = f"{KEY}.policy_loss"
# loss_agg_mode values under which a pass over one phase's tokens plus a pass over the other's is one pass over
# all: a sum over the trained tokens divided by a count that does not depend on which tokens are trained (the
# response tokens of the mini-batch, its sequences, or 1). seq-mean-token-mean divides each sequence by its own
# count of trained tokens, which differs per phase.
LOPTI_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# policy losses whose per-token terms only see the token's own values: masking a phase changes nothing else.
# Others (gspo's sequence ratio, clip_cov / kl_cov's batch covariance, geo_mean, ...) would change meaning.
LOPTI_LOSS_MODES = ("vanilla", "ar")


class ConfigError(ValueError):
    """A bad value of one of our keys or of a verl key Lopti cannot honour; the message is one line naming it."""


@dataclass
class LoptiPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus AR's and Lopti's keys (module docstring)."""

    ar_alpha: float = 0.0
    lopti_eta: Optional[float] = None
    lopti_order: str = "low_first"
    lopti_quantile: Optional[float] = None

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        try:
            check_alpha(self.ar_alpha)
        except ValueError as exc:
            raise ConfigError(f"{POLICY_LOSS_KEY}.ar_alpha: {exc}") from None
        checks = (
            ("lopti_eta", lambda: self.lopti_eta is None or check_lopti_args(self.lopti_eta, "low_first", None)),
            ("lopti_order", lambda: check_lopti_args(0.5, self.lopti_order, None)),
            ("lopti_quantile", lambda: check_lopti_args(0.5, "low_first", self.lopti_quantile)),
        )
        for name, check in checks:
            try:
                check()
            except ValueError as exc:
                raise ConfigError(f"{POLICY_LOSS_KEY}.{name}: {exc}") from None
        try:  # algo's rule: the two thresholds together are refused
            self.lopti  # noqa: B018
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.ar_alpha > 0 and self.loss_mode != "ar":
            raise ConfigError(
                f"{POLICY_LOSS_KEY}.ar_alpha is {self.ar_alpha} but {POLICY_LOSS_KEY}.loss_mode is "
                f"{self.loss_mode!r}: AR is the 'ar' loss, set loss_mode=ar"
            )
        if self.loss_mode == "ar":
            check_plugin(f"{POLICY_LOSS_KEY}.loss_mode=ar", "ar")
        if self.lopti is not None:
            check_loss_mode(self.loss_mode)  # here, the driver's config check: else in a worker, after Ray and vLLM
            check_plugin(f"Lopti ({POLICY_LOSS_KEY}.lopti_eta / lopti_quantile)", "lopti")
            check_lopti_worker()

    @property
    def lopti(self) -> Optional[LoptiSettings]:
        """Lopti's settings (``algo.lopti_settings``), or None when Lopti is off."""
        keys = tuple(f"{POLICY_LOSS_KEY}.lopti_{name}" for name in ("eta", "quantile", "order"))
        return lopti_settings(self.lopti_eta is not None, self.lopti_eta, self.lopti_order, self.lopti_quantile, keys)


def check_plugin(what: str, method: str) -> None:
    """Raise :class:`ConfigError` (one line) when ``what``, a part of ``method`` (``"ar"``: the ``ar`` loss;
    ``"lopti"``: the Lopti worker), would not run in this process: our verl plugin (:mod:`.plugin`) was not loaded
    here, or that part of it failed. Without it verl would run ``vanilla`` with our keys ignored, or fail on an
    unknown loss mode in a worker."""
    plugin = sys.modules.get("openrlhf_lopti.verl.plugin")  # read, not imported: importing it would load it
    if plugin is None:
        raise ConfigError(
            f"{what} needs openrlhf_lopti's verl plugin, not loaded in this process: verl loads it from the installed "
            "package (entry point 'openrlhf_lopti' of the group verl.plugins) unless VERL_USE_EXTERNAL_PLUGINS leaves "
            "it out; with the package in a Ray job's py_modules, set "
            "VERL_USE_EXTERNAL_MODULES=openrlhf_lopti.verl.plugin"
        )
    reason = plugin.unavailable(what, (plugin.AR_LOSS,) if method == "ar" else (plugin.LOPTI_WORKER,))
    if reason:
        raise ConfigError(reason)


def check_lopti_worker() -> None:
    """Raise :class:`ConfigError` (one line) when verl's actor would train in a worker other than ours, which would
    run Lopti's settings as one plain pass: ``ActorRolloutRefWorker.actor_worker_cls`` set to another class after
    our plugin set it. Checked once verl has imported ``engine_workers`` (in the workers, before ``init_model``
    builds the actor); a subclass of ``ActorRolloutRefWorker`` with its own ``actor_worker_cls`` (verl's Tinker
    worker) is not seen here."""
    engine_workers = sys.modules.get("verl.workers.engine_workers")
    if engine_workers is None:
        return
    from .worker import LoptiTrainingWorker

    chosen = engine_workers.ActorRolloutRefWorker.actor_worker_cls
    if not issubclass(chosen, LoptiTrainingWorker):
        raise ConfigError(
            f"Lopti ({POLICY_LOSS_KEY}.lopti_eta / lopti_quantile) runs in openrlhf_lopti's LoptiTrainingWorker, but "
            f"ActorRolloutRefWorker.actor_worker_cls is {chosen.__module__}.{chosen.__qualname__}: it would train one "
            "plain pass"
        )


def ar_alpha_of(config) -> float:
    """AR's alpha from verl's actor config (``config.policy_loss.ar_alpha``) for the ``ar`` loss."""
    policy_loss = None if config is None else config.get("policy_loss", None)
    alpha = None if policy_loss is None else policy_loss.get("ar_alpha", None)
    if alpha is None:
        raise ConfigError(
            f"{POLICY_LOSS_KEY}.loss_mode=ar reads {POLICY_LOSS_KEY}.ar_alpha, which verl's PolicyLossConfig lacks: "
            f"set {POLICY_LOSS_KEY}._target_=openrlhf_lopti.verl.LoptiPolicyLossConfig"
        )
    return check_alpha(alpha)


def round_settings(actor_config) -> Tuple[Optional[LoptiSettings], float]:
    """``(lopti, ar_alpha)`` of a verl actor config: Lopti's settings or None, AR's alpha (0 without AR);
    ``(None, 0.0)`` for verl's own ``PolicyLossConfig``."""
    policy_loss = None if actor_config is None else actor_config.get("policy_loss", None)
    if not isinstance(policy_loss, LoptiPolicyLossConfig):
        return None, 0.0
    alpha = policy_loss.ar_alpha if policy_loss.loss_mode == "ar" else 0.0
    return policy_loss.lopti, float(alpha)


def check_lopti_actor(actor_config, loss_is_ppo: bool = True) -> None:
    """Raise :class:`ConfigError` (one line naming the key) for a verl setting Lopti cannot honour."""
    if not loss_is_ppo:
        raise ConfigError(
            "distillation.enabled: Lopti drives verl's ppo_loss (the policy-gradient loss of PPO / GRPO); "
            "the distillation loss is not split into phases"
        )
    mode = actor_config.get("loss_agg_mode", "token-mean")
    if mode not in LOPTI_AGG_MODES:
        raise ConfigError(
            f"{KEY}.loss_agg_mode: Lopti's two phases add up to one pass only for {', '.join(LOPTI_AGG_MODES)} "
            f"(a sum over tokens divided by a count that does not depend on the phase), got {mode!r}"
        )
    check_loss_mode(actor_config.policy_loss.get("loss_mode", "vanilla"))


def check_loss_mode(loss_mode: str) -> None:
    """Raise :class:`ConfigError` (one line naming the key) for a verl loss mode Lopti cannot split into phases."""
    if loss_mode not in LOPTI_LOSS_MODES:
        raise ConfigError(
            f"{POLICY_LOSS_KEY}.loss_mode: Lopti runs with {' or '.join(LOPTI_LOSS_MODES)} (per-token clipped "
            f"surrogate; a phase's mask changes nothing else of the loss), got {loss_mode!r}"
        )
