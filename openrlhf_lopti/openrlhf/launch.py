"""``train(args)``: OpenRLHF 0.11.2's own ``train(args)`` with our classes at its two seams."""

from typing import Any


def train(args: Any) -> None:
    """Upstream's ``openrlhf.cli.train_ppo_ray.train(args)`` with :class:`~.actor.LoptiPolicyModelActor` and
    :class:`~.actor.LoptiReferenceModelActor` as the policy and reference actors and
    :class:`~.evaluation.LoptiPPOTrainer` as the controller (``--train.async_enable`` keeps upstream's async one).
    Everything else (placement, models, rollouts, rewards, checkpoints) is upstream's code; ``--cpu`` changes the
    rest through ``cpu.runtime.launch_on_cpu``."""
    import openrlhf.cli.train_ppo_ray as upstream
    import openrlhf.trainer.ppo_trainer as controller

    from .actor import LoptiPolicyModelActor, LoptiReferenceModelActor
    from .evaluation import LoptiPPOTrainer

    upstream.PolicyModelActor = LoptiPolicyModelActor  # train() hands these module globals to RayActorGroup
    upstream.ReferenceModelActor = LoptiReferenceModelActor
    controller.PPOTrainer = LoptiPPOTrainer  # train() imports the name from there when it runs
    upstream.train(args)
