"""Our Ray model actors: OpenRLHF 0.11.2's ``PolicyModelActor`` training with ``LoptiActorPPOTrainer``, and both it and
``ReferenceModelActor`` computing their forward-only log-probs with our kernels when the fused loss is on."""

import ray

from openrlhf.trainer.ray.launcher import ReferenceModelActor
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

from .flags import fused_backend, lopti_config
from .fused import fused_log_probs
from .trainer import LoptiActorPPOTrainer


def forward_with_kernels(strategy, actor, upstream_forward, *args, **kwargs):
    """``upstream_forward(*args, **kwargs)`` (an actor's forward-only pass over ``actor``) with our kernels when
    ``--actor.fused_loss`` is on (:func:`~.fused.fused_log_probs`), upstream's own path otherwise."""
    backend = fused_backend(strategy.args)
    if backend is None:
        return upstream_forward(*args, **kwargs)
    with fused_log_probs(actor, backend, lopti_config(strategy.args).fused_lm_head):
        return upstream_forward(*args, **kwargs)


# @ray.remote classes cannot be subclassed; Ray keeps the plain class as `__ray_actor_class__` and asks to
# subclass that and decorate the subclass (the error Ray raises on `class X(ActorClass)` says so).
@ray.remote(num_gpus=1)
class LoptiPolicyModelActor(PolicyModelActor.__ray_actor_class__):
    """Upstream's policy actor (model, DeepSpeed, vLLM weight sync, checkpoints) with our trainer."""

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        """Upstream's method, building a :class:`LoptiActorPPOTrainer` where it builds ``ActorPPOTrainer``."""
        # Upstream ends this method with `self.trainer = ActorPPOTrainer(...)`, a global name looked up when
        # that line runs. Binding the name to our subclass for this call makes upstream's own code build our
        # trainer with its exact arguments, without copying the method. The name is rebound in the globals
        # the method really uses (`__globals__`): in a Ray actor process that is not the module's dict,
        # because Ray ships actor classes cloudpickled by value, with copies of their functions' globals.
        # A Ray actor runs one method at a time, so nothing else sees the change; it is undone right after.
        upstream = super().init_model_from_pretrained
        names = upstream.__func__.__globals__
        upstream_trainer = names["ActorPPOTrainer"]
        names["ActorPPOTrainer"] = LoptiActorPPOTrainer
        try:
            upstream(strategy, pretrain, max_steps, vllm_engines)
        finally:
            names["ActorPPOTrainer"] = upstream_trainer
        # A resumed run continues the RL step count of the checkpoint (the trainer names steps in its errors).
        self.trainer.rl_step = int(self.checkpoint_states.get("global_step", 0))

    def forward(self, *args, **kwargs):
        """Upstream's old-policy log-prob pass (``[B, A]``, nats), through our kernels with the fused loss on."""
        return forward_with_kernels(self.strategy, self.actor, super().forward, *args, **kwargs)


@ray.remote(num_gpus=1)
class LoptiReferenceModelActor(ReferenceModelActor.__ray_actor_class__):
    """Upstream's reference-model actor; its log-prob pass goes through our kernels with the fused loss on."""

    def forward(self, *args, **kwargs):
        """Upstream's reference log-prob pass (``[B, A]``, nats), through our kernels with the fused loss on."""
        return forward_with_kernels(self.strategy, self.model, super().forward, *args, **kwargs)

