"""``LoptiPolicyModelActor``: OpenRLHF 0.11.2's Ray ``PolicyModelActor``, training with ``LoptiActorPPOTrainer``."""

import ray

from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

from .trainer import LoptiActorPPOTrainer


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
