"""examples/verl/train_kk_grpo_ar_lopti.sh: its main_ppo overrides (``DRY_RUN=1``) compose into verl's config
(hydra, ``ppo_trainer``), pass main_ppo's own ``validate_config``, and build the actor config our worker reads:
the paper's K&K settings for each METHOD. (The run itself: test_main_ppo.py, on the CPU.) And every ``python -m
verl.trainer.main_ppo`` command of the README and docs/*.md builds verl's config the same way."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ..doc_blocks import fenced_lines
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
    assert cfg.reward.custom_reward_function.path == "pkg://openrlhf_lopti.verl.reward"  # test_data.py loads it


ROOT = SCRIPT.parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `$(... bash examples/verl/train_kk_grpo_ar_lopti.sh)`: the script's overrides, as a shell would expand them
SCRIPT_OUTPUT = re.compile(r"\$\(([^()]*bash examples/verl/train_kk_grpo_ar_lopti\.sh)\)")


def main_ppo_commands() -> list:
    """``(where, overrides)`` of each ``python -m verl.trainer.main_ppo ...`` in a fenced block of the README and
    docs/*.md: continuations joined, ``VAR=value`` prefixes and the ``...`` placeholder dropped, a ``$(...)`` of the
    launch script replaced by its ``DRY_RUN=1`` output."""
    found = []
    for doc in DOCS:
        for start, logical in fenced_lines(doc.read_text(encoding="utf-8")):
            if "verl.trainer.main_ppo" not in logical:
                continue
            for inner in SCRIPT_OUTPUT.findall(logical):
                printed = subprocess.run(["bash", "-c", inner], env=dict(os.environ, PYTHON=sys.executable),
                                         cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
                logical = logical.replace(f"$({inner})", " ".join(shlex.quote(x) for x in printed.stdout.splitlines()))
            words = shlex.split(logical, comments=True)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words = words[1:]
            assert words[1:3] == ["-m", "verl.trainer.main_ppo"], words[:3]
            found.append((f"{doc.relative_to(ROOT)}:{start}", words[3:]))
    return found


COMMANDS = main_ppo_commands()


def test_the_docs_show_main_ppo():
    assert {where.split(":")[0] for where, _ in COMMANDS} >= {"README.md", "docs/VERL.md"}


@pytest.mark.parametrize("where, overrides", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_each_main_ppo_command_of_the_docs_builds_verls_config(where, overrides):
    """Composed by hydra as main_ppo composes it; the policy-loss config with our keys (a whole command: the actor
    config, through main_ppo's validate_config) and the reward, built by verl."""
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from openrlhf_lopti.verl.config import round_settings

    cfg = harness.compose([w for w in overrides if w != "..."])
    if "..." in overrides:  # the user's own settings left out: verl's defaults do not make a valid actor by themselves
        actor = {"policy_loss": omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.policy_loss)}
    else:
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    lopti, alpha = round_settings(actor)
    assert alpha > 0 or lopti is not None, f"{where}: neither AR nor Lopti"
    if cfg.reward.custom_reward_function.path:
        assert callable(get_custom_reward_fn(cfg)), where


def test_the_launch_script_needs_no_plugin_variable():
    """verl loads our plugin by itself (test_plugin.py); the script's runs (test_main_ppo.py) run without these."""
    text = SCRIPT.read_text()
    assert "VERL_USE_EXTERNAL_MODULES" not in text and "VERL_USE_EXTERNAL_PLUGINS" not in text
