"""``openrlhf_lopti.openrlhf.launch.train``: our classes at upstream's seams for the call only."""

import pytest

from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs

install_cpu_stubs()  # before openrlhf's trainer modules: they import flash_attn / vllm at the top

import openrlhf.cli.train_ppo_ray as upstream  # noqa: E402
import openrlhf.trainer.ppo_trainer as controller  # noqa: E402

from openrlhf_lopti.openrlhf.actor import LoptiPolicyModelActor, LoptiReferenceModelActor  # noqa: E402
from openrlhf_lopti.openrlhf.evaluation import LoptiPPOTrainer  # noqa: E402
from openrlhf_lopti.openrlhf.launch import train  # noqa: E402


def seams():
    return upstream.PolicyModelActor, upstream.ReferenceModelActor, controller.PPOTrainer


@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_upstream_classes_are_back_after_train(ends, monkeypatch):
    originals = seams()
    seen = []

    def upstream_train(args):
        seen.append(seams())
        if ends == "raises":
            raise RuntimeError("a failed run")

    monkeypatch.setattr(upstream, "train", upstream_train)
    if ends == "raises":
        with pytest.raises(RuntimeError, match="a failed run"):
            train(object())
    else:
        train(object())
    assert seen == [(LoptiPolicyModelActor, LoptiReferenceModelActor, LoptiPPOTrainer)]  # ours during the call
    assert seams() == originals  # upstream's after it: a later upstream train() runs upstream's classes
    assert LoptiPPOTrainer not in originals
