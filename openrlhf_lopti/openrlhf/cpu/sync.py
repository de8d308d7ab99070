"""The policy -> rollout weight sync of ``--cpu``: upstream's ``broadcast_to_vllm`` over a gloo group.

Upstream's ``stateless_init_process_group`` builds vLLM's ``StatelessProcessGroup`` and a ``PyNcclCommunicator``
on it (NCCL: no CPU path). :class:`StatelessGlooGroup` is the same kind of group on gloo, with the one call the
sync makes, ``broadcast(tensor, src, stream)``. The policy's rank 0 builds it through
:func:`use_gloo_for_weight_sync` (upstream's ``_init_vllm_sync_group`` runs unchanged), each vLLM worker through
:class:`~.worker.CPUWorkerWrap`. (Ray's gloo collective, upstream's ``--vllm.sync_with_ray``, cannot serve here: it
builds its group with ``dist.new_group`` over the caller's default group, which on the policy's rank 0 is
DeepSpeed's and holds no rollout engine.)
"""

from datetime import timedelta

import torch


class StatelessGlooGroup:
    """A gloo process group of its own (TCP rendezvous at ``host:port``, rank 0 hosts the store), outside
    ``torch.distributed``'s default group."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: timedelta = timedelta(minutes=30)):
        store = torch.distributed.TCPStore(host, int(port), int(world_size), is_master=int(rank) == 0, timeout=timeout)
        self.rank, self.world_size = int(rank), int(world_size)
        self._group = torch.distributed.ProcessGroupGloo(store, self.rank, self.world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        """Broadcast CPU ``tensor`` (any shape/dtype) in place from rank ``src``; ``stream`` is ignored."""
        self._group.broadcast(tensor, src).wait()


def gloo_init_process_group(master_address, master_port, rank, world_size, device=None) -> StatelessGlooGroup:
    """Upstream's ``stateless_init_process_group(master_address, master_port, rank, world_size, device)`` on gloo."""
    return StatelessGlooGroup(master_address, master_port, rank, world_size)


def use_gloo_for_weight_sync() -> None:
    """Make upstream's policy actor build its weight-sync group with :func:`gloo_init_process_group`, where its
    module (``openrlhf.trainer.ray.ppo_actor``, which defines the policy actor's class) is loaded in this process."""
    import sys

    ppo_actor = sys.modules.get("openrlhf.trainer.ray.ppo_actor")
    if ppo_actor is not None:
        ppo_actor.stateless_init_process_group = gloo_init_process_group
