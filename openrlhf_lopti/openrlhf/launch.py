"""``train(args)``: OpenRLHF 0.11.2's own ``train(args)`` with our classes at its two seams."""

from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any, Iterator


@contextmanager
def module_globals_set(module: ModuleType, **values: Any) -> Iterator[None]:
    """Set ``module.<name> = value`` for each keyword, and put the old values back on exit, also on an error, so
    that a later upstream ``train()`` in the same process (a sweep, a notebook comparing with the baseline) runs
    upstream's own classes."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def train(args: Any) -> None:
    """Upstream's ``openrlhf.cli.train_ppo_ray.train(args)`` with :class:`~.actor.LoptiPolicyModelActor` and
    :class:`~.actor.LoptiReferenceModelActor` as the policy and reference actors and
    :class:`~.evaluation.LoptiPPOTrainer` as the controller (``--train.async_enable`` keeps upstream's async one),
    for the duration of the call only. Everything else (placement, models, rollouts, rewards, checkpoints) is
    upstream's code; ``--cpu`` changes the rest through ``cpu.runtime.launch_on_cpu``."""
    import openrlhf.cli.train_ppo_ray as upstream
    import openrlhf.trainer.ppo_trainer as controller

    from .actor import LoptiPolicyModelActor, LoptiReferenceModelActor
    from .evaluation import LoptiPPOTrainer

    with ExitStack() as patches:
        # train() hands these module globals to RayActorGroup, and imports PPOTrainer from there when it runs
        patches.enter_context(
            module_globals_set(
                upstream, PolicyModelActor=LoptiPolicyModelActor, ReferenceModelActor=LoptiReferenceModelActor
            )
        )
        patches.enter_context(module_globals_set(controller, PPOTrainer=LoptiPPOTrainer))
        upstream.train(args)
