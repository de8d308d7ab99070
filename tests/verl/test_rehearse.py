"""``python -m openrlhf_lopti.verl.rehearse --cpu``: two RL steps of the actor side of main_ppo with AR+Lopti on a
tiny model and K&K prompts (verl's worker, engine, advantage estimator and data conversion; transformers samples)."""

import math

import pytest

from openrlhf_lopti.__main__ import main as cli
from openrlhf_lopti.verl.rehearse import main

ACTOR = "actor_rollout_ref.actor"
AR_LOPTI = [
    f"{ACTOR}.policy_loss._target_=openrlhf_lopti.verl.LoptiPolicyLossConfig",
    f"{ACTOR}.policy_loss.loss_mode=ar",
    f"+{ACTOR}.policy_loss.ar_alpha=0.3",
    f"+{ACTOR}.policy_loss.lopti_eta=0.5",
    f"{ACTOR}.use_kl_loss=true",
    f"{ACTOR}.kl_loss_type=low_var_kl",
    "actor_rollout_ref.rollout.temperature=0.7",
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rehearse")
    assert cli(["tiny-model", "--out", str(root / "tiny")]) == 0
    assert cli(["data", "kk", "--out", str(root / "kk"), "--people", "3", "--train-per-n", "4", "--test-per-n", "1"]) == 0
    from openrlhf_lopti.verl.data import main as convert

    assert convert([str(root / "kk")]) == 0
    return root


def test_two_steps_of_ar_and_lopti(inputs, capsys):
    code = main(["--cpu", "--model", str(inputs / "tiny"), "--data", str(inputs / "kk" / "train.parquet"),
                 "--steps", "2", "--prompts", "2", "--n", "4", "--max-new-tokens", "16", *AR_LOPTI])  # fmt: skip
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert code == 0 and len(lines) == 2, out
    for line in lines:
        fields = dict(part.rsplit(" ", 1) for part in line.split(" | ")[1:])
        assert fields["actor/lopti/threshold"] == "0.5"
        assert 0 <= float(fields["actor/lopti/low_token_frac"]) <= 1
        assert 0.7 <= float(fields["actor/ar/mean_weight"]) <= 1  # 1 - alpha <= weight <= 1
        assert math.isfinite(float(fields["actor/grad_norm"])) and "actor/kl_loss" in fields


def test_the_rehearsal_needs_cpu(inputs, capsys):
    assert main(["--model", str(inputs / "tiny"), "--data", str(inputs / "kk" / "train.parquet")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--cpu is required" in err
