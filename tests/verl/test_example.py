"""examples/verl/train_kk_grpo_ar_lopti.sh: its main_ppo overrides (``DRY_RUN=1``) compose into verl's config
(hydra, ``ppo_trainer``), pass main_ppo's own ``validate_config``, and build the actor config our worker reads:
the paper's K&K settings for each METHOD. (The run itself: test_main_ppo.py, on the CPU.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import harness

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "verl" / "train_kk_grpo_ar_lopti.sh"


def overrides(method: str) -> list:
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, METHOD=method)
    run = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, check=True)
    return run.stdout.splitlines()


@pytest.mark.parametrize("method, alpha, eta", [("grpo", 0.0, None), ("ar", 0.3, None), ("lopti", 0.0, 0.5),
                                                ("ar+lopti", 0.3, 0.5)])  # fmt: skip
def test_the_launch_script_selects_our_loss_and_worker_settings(method, alpha, eta):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from openrlhf_lopti.verl.config import check_lopti_actor, round_settings

    cfg = harness.compose(overrides(method))
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    lopti, ar_alpha = round_settings(actor)
    assert ar_alpha == alpha and actor.policy_loss.loss_mode == ("ar" if alpha else "vanilla")
    assert (lopti is None) == (eta is None) and (lopti is None or (lopti.eta, lopti.order) == (eta, "low_first"))
    if lopti is not None:
        check_lopti_actor(actor)
    # the paper's K&K settings (PAPER_NOTES.md section 5)
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, cfg.data.max_response_length) == (64, 8, 4096)
    assert cfg.actor_rollout_ref.rollout.temperature == 0.7 and actor.optim.lr == 1e-6
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.kl_loss_coef, actor.kl_loss_type) == (
        0.2, 0.24, 0.001, "low_var_kl")  # fmt: skip
    assert cfg.algorithm.adv_estimator == "grpo" and actor.loss_agg_mode == "token-mean"
    assert Path(cfg.reward.custom_reward_function.path).name == "reward.py"
