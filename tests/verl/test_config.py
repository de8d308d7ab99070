"""Bad settings fail before training, each in one line naming its key: our keys when verl builds the actor config
(hydra's instantiate, as main_ppo's workers do), a verl setting Lopti cannot honour when the actor worker gets its
loss function (``ActorRolloutRefWorker.init_model``). And the reason for the ``loss_agg_mode`` rule: Lopti's phases
add up to one pass exactly for the modes it accepts, not for ``seq-mean-token-mean``."""

from functools import partial

import pytest
import torch

from ..numerics import Float64Shadow
from . import harness

KEY = "actor_rollout_ref.actor.policy_loss"


def build_actor_config(**overrides):
    from verl.utils.config import omega_conf_to_dataclass

    extra = tuple(overrides.pop("extra", ()))
    cfg = harness.compose(harness.actor_overrides("unused", mini_batch=8, micro_batch=4, lr=0.1, extra=extra,
                                                  **overrides))  # fmt: skip
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def our_line(exc: BaseException) -> str:
    """Our message in the raised error (hydra wraps it as ``ConfigError('<message>')`` between lines of its own)."""
    from openrlhf_lopti.verl import ConfigError

    while exc is not None and not isinstance(exc, ConfigError):
        exc = exc.__cause__ or exc.__context__
    assert exc is not None, "no ConfigError raised"
    message = str(exc)
    assert "\n" not in message, f"not one line: {message!r}"
    return message


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (dict(alpha=1.5), "ar_alpha", "[0, 1], got 1.5"),
        (dict(alpha=-0.1), "ar_alpha", "[0, 1], got -0.1"),
        (dict(eta=0.5, order="sideways"), "lopti_order", "'sideways'"),
        (dict(eta=0.0), "lopti_eta", "(0, 1], got 0.0"),
        (dict(eta=1.5), "lopti_eta", "(0, 1], got 1.5"),
        (dict(quantile=1.0), "lopti_quantile", "(0, 1) or None, got 1.0"),
        (dict(eta=0.5, quantile=0.3), "lopti_eta", f"{KEY}.lopti_quantile=0.3 are two Lopti thresholds: give one"),
        # the ablation's order with no threshold ran plain GRPO without a word (the rule is algo.lopti_settings')
        (dict(order="high_first"), "lopti_order", "=high_first orders Lopti's phases, but Lopti is off"),
        (dict(alpha=0.3, loss_mode="vanilla"), "ar_alpha", "set loss_mode=ar"),
        # with the config (the driver's check): before, in the actor worker's init_model, after Ray, vLLM, the model
        (dict(eta=0.5, loss_mode="gspo"), "loss_mode", "Lopti runs with vanilla or ar (per-token clipped"),
        (dict(alpha=True), "ar_alpha", "got True"),  # not 1.0
        (dict(eta=True), "lopti_eta", "got True"),
    ],
)
def test_our_keys_fail_in_one_line_naming_the_key(overrides, key, words):
    with pytest.raises(Exception) as info:
        build_actor_config(**overrides)
    line = our_line(info.value)
    assert line.startswith(f"{KEY}.{key}") and words in line, line


def test_the_ar_loss_without_our_config_is_refused_when_the_worker_gets_its_loss(tiny):
    """``loss_mode=ar`` with verl's own PolicyLossConfig (no ``ar_alpha``): refused in ``init_model``, before any
    rollout (before: at the first actor update, after the model load, the rollout and the reference pass)."""
    overrides = harness.actor_overrides(tiny["path"], mini_batch=8, micro_batch=4, lr=0.1, alpha=0.3)
    overrides = [o for o in overrides if "policy_loss._target_" not in o and "policy_loss.ar_alpha" not in o
                 and "policy_loss.lopti" not in o]  # fmt: skip
    with pytest.raises(Exception) as info:
        harness.actor_worker(harness.compose(overrides))
    line = our_line(info.value)
    assert f"{KEY}.ar_alpha" in line and f"{KEY}._target_=openrlhf_lopti.verl.LoptiPolicyLossConfig" in line


def test_lopti_is_refused_when_the_actor_trains_in_another_worker(monkeypatch):
    """Another plugin or recipe set ``actor_worker_cls`` after ours: Lopti would run as one plain pass."""
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    build_actor_config(eta=0.5)  # our worker: accepted
    monkeypatch.setattr(ActorRolloutRefWorker, "actor_worker_cls", TrainingWorker)
    with pytest.raises(Exception) as info:
        build_actor_config(eta=0.5)
    line = our_line(info.value)
    assert "actor_worker_cls is verl.workers.engine_workers.TrainingWorker" in line, line
    build_actor_config(alpha=0.3)  # AR alone is the loss: it runs in any worker


def test_the_plugin_keeps_a_training_worker_another_plugin_chose(monkeypatch):
    """Loaded after a plugin that set its own ``actor_worker_cls``, ours leaves it (runs without our keys are that
    plugin's) and our keys asking for Lopti are refused in one line naming it."""
    from verl.workers import engine_workers
    from verl.workers.engine_workers_tinker import TinkerTrainingWorker

    from openrlhf_lopti.verl import plugin

    monkeypatch.setattr(plugin, "FAILED", {})
    monkeypatch.setattr(engine_workers.ActorRolloutRefWorker, "actor_worker_cls", TinkerTrainingWorker)
    plugin._set_lopti_worker(engine_workers)
    assert engine_workers.ActorRolloutRefWorker.actor_worker_cls is TinkerTrainingWorker
    with pytest.raises(Exception) as info:
        build_actor_config(eta=0.5)
    line = our_line(info.value)
    assert "the Lopti worker: ActorRolloutRefWorker.actor_worker_cls is " in line, line
    assert "engine_workers_tinker.TinkerTrainingWorker already (set by another plugin or recipe)" in line, line
    build_actor_config(alpha=0.3)  # AR alone is a loss, registered all the same: it runs in that worker


def test_the_ar_loss_without_our_config_says_which_target_to_set():
    """``loss_mode=ar`` with verl's own PolicyLossConfig (no ``ar_alpha``), called directly: the loss refuses too."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    import openrlhf_lopti.verl  # noqa: F401

    cfg = harness.compose([f"{harness.ACTOR}.policy_loss.loss_mode=ar", f"{harness.ACTOR}.ppo_micro_batch_size_per_gpu=4"])
    config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError) as info:
        get_policy_loss_fn("ar")(x, x, x, torch.ones(2, 3, dtype=torch.bool), config=config)
    line = our_line(info.value)
    assert f"{KEY}.ar_alpha" in line and f"{KEY}._target_=openrlhf_lopti.verl.LoptiPolicyLossConfig" in line


@pytest.mark.parametrize(
    "extra, key, words",
    [
        (("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",), "actor_rollout_ref.actor.loss_agg_mode",
         "got 'seq-mean-token-mean'"),
        ((f"{KEY}.loss_mode=gspo",), f"{KEY}.loss_mode", "got 'gspo'"),
    ],
)  # fmt: skip
def test_lopti_refuses_a_verl_setting_it_cannot_honour_before_training(tiny, extra, key, words):
    cfg = harness.compose(harness.actor_overrides(tiny["path"], mini_batch=8, micro_batch=4, lr=0.1, eta=0.5,
                                                  extra=extra))  # fmt: skip
    with pytest.raises(Exception) as info:
        harness.actor_worker(cfg)
    line = our_line(info.value)
    assert line.startswith(key) and words in line, line


def test_lopti_refuses_the_distillation_loss():
    from verl.trainer.distillation import distillation_ppo_loss

    from openrlhf_lopti.verl.config import check_lopti_actor
    from openrlhf_lopti.verl.worker import loss_config

    config = build_actor_config(eta=0.5)
    loss_fn = partial(distillation_ppo_loss, config=config, distillation_config=None)
    assert loss_config(loss_fn) is config
    with pytest.raises(ValueError) as info:
        check_lopti_actor(config, loss_is_ppo=False)
    assert our_line(info.value).startswith("distillation.enabled")


def test_lopti_off_leaves_every_verl_setting_alone():
    """Without Lopti the worker checks nothing: seq-mean-token-mean and gspo stay verl's business."""
    from openrlhf_lopti.verl.config import round_settings

    config = build_actor_config(extra=("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",))
    assert round_settings(config) == (None, 0.0)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                  "seq-mean-token-mean"])  # fmt: skip
def test_phases_add_up_to_one_pass_exactly_for_the_modes_lopti_accepts(mode):
    """verl's vanilla loss aggregated as ppo_loss does (denominators of the whole mini-batch: its response tokens
    and sequences, from ``loss_mask``), once on every token and once per phase, in float64: the two phases sum to
    the one pass to float64 rounding for every accepted mode; seq-mean-token-mean (refused) differs."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    from openrlhf_lopti.verl.config import LOPTI_AGG_MODES

    config = build_actor_config(extra=(f"actor_rollout_ref.actor.loss_agg_mode={mode}",))
    g = torch.Generator().manual_seed(0)
    with Float64Shadow():
        old = -torch.rand(6, 8, generator=g) * 3
        log_prob = old + 0.1 * torch.randn(6, 8, generator=g)
        advantages = torch.randn(6, 1, generator=g).expand(6, 8).clone()
        mask = torch.rand(6, 8, generator=g) < 0.8
        low = mask & (old.exp() < 0.4)
        config.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=6,
                                        loss_scale_factor=None)  # fmt: skip

        def loss(phase):
            value, _ = compute_policy_loss_vanilla(old, log_prob, torch.where(phase, advantages, 0.0), phase,
                                                   loss_agg_mode=mode, config=config)  # fmt: skip
            return float(value)

        whole, parts = loss(mask), loss(low) + loss(mask & ~low)
    bound = 64 * 48 * torch.finfo(torch.float64).eps * max(abs(whole), 1.0)  # 48 terms summed, float64
    if mode in LOPTI_AGG_MODES:
        assert abs(parts - whole) <= bound, (mode, parts, whole)
    else:
        assert abs(parts - whole) > 1e3 * bound, (mode, parts, whole)


@pytest.mark.parametrize("eta, order, quantile", [(0.3, "low_first", None), (0.8, "high_first", None),
                                                  (None, "low_first", 0.4)])  # fmt: skip
def test_the_users_lopti_settings_reach_the_round_unchanged(eta, order, quantile):
    """main_ppo's overrides -> verl's actor config -> the settings the worker's round runs with: a user's eta,
    order and quantile arrive as given (every other test uses the paper's 0.5; issue 37: an eta silently replaced
    by 0.5 in the policy-loss config went unnoticed)."""
    from openrlhf_lopti.algo import LoptiSettings
    from openrlhf_lopti.verl.config import round_settings

    config = build_actor_config(eta=eta, order=order, quantile=quantile, alpha=0.2)
    assert (config.policy_loss.lopti_eta, config.policy_loss.lopti_order) == (eta, order)
    assert round_settings(config) == (LoptiSettings(eta or 0.5, order, quantile), 0.2)  # eta unset: the paper's
