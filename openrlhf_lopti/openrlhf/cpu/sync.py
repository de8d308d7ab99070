"""The policy -> rollout weight sync of ``--cpu``: upstream's ``broadcast_to_vllm`` over a gloo group.

Upstream's ``stateless_init_process_group`` builds vLLM's ``StatelessProcessGroup`` and a ``PyNcclCommunicator``
on it (NCCL: no CPU path). :class:`StatelessGlooGroup` is the same kind of group on gloo, with the one call the
sync makes, ``broadcast(tensor, src, stream)``. The policy's rank 0 builds it through
:func:`use_gloo_for_weight_sync` (upstream's ``_init_vllm_sync_group`` runs unchanged), each vLLM worker through
:class:`~.worker.CPUWorkerWrap`. (Ray's gloo collective, upstream's ``--vllm.sync_with_ray``, cannot serve here: it
builds its group with ``dist.new_group`` over the caller's default group, which on the policy's rank 0 is
DeepSpeed's and holds no rollout engine.)

A sync never waits long for a peer that is gone: the group's rendezvous and every broadcast give up after
:func:`sync_timeout` seconds (``OPENRLHF_LOPTI_CPU_SYNC_TIMEOUT``, default 60) with an error naming the setting, so
an engine or a policy rank that fails mid-sync ends the run instead of leaving the others blocked (docs/CPU.md).
"""

import os
from datetime import timedelta
from typing import Optional

import torch

SYNC_TIMEOUT_ENV = "OPENRLHF_LOPTI_CPU_SYNC_TIMEOUT"
DEFAULT_SYNC_TIMEOUT_S = 60.0


def sync_timeout() -> timedelta:
    """How long the weight-sync group waits for a peer (its rendezvous, each broadcast): ``OPENRLHF_LOPTI_CPU_SYNC_TIMEOUT``
    seconds, default 60. The peers enter each broadcast a Ray call apart, so a minute is far more than a sync needs."""
    text = os.environ.get(SYNC_TIMEOUT_ENV, "").strip()
    if not text:
        return timedelta(seconds=DEFAULT_SYNC_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{SYNC_TIMEOUT_ENV}={text!r}: must be a number of seconds > 0")
    return timedelta(seconds=seconds)


class StatelessGlooGroup:
    """A gloo process group of its own (TCP rendezvous at ``host:port``, rank 0 hosts the store), outside
    ``torch.distributed``'s default group; ``timeout`` (default :func:`sync_timeout`) bounds every wait."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: Optional[timedelta] = None):
        self.timeout = sync_timeout() if timeout is None else timeout
        self.rank, self.world_size = int(rank), int(world_size)
        try:
            store = torch.distributed.TCPStore(
                host, int(port), self.world_size, is_master=self.rank == 0, timeout=self.timeout
            )
            self._group = torch.distributed.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)
        except RuntimeError as exc:  # e.g. an engine that never joined
            raise RuntimeError(
                f"--cpu weight sync: rank {self.rank} of {self.world_size} could not form the gloo group at "
                f"{host}:{port} within {self._seconds()}: {first_line(exc)}"
            ) from exc

    def _seconds(self) -> str:
        return f"{self.timeout.total_seconds():g} s, {SYNC_TIMEOUT_ENV}"

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        """Broadcast CPU ``tensor`` (any shape/dtype) in place from rank ``src``; ``stream`` is ignored."""
        try:
            self._group.broadcast(tensor, src).wait()
        except RuntimeError as exc:  # a peer that failed, left, or never entered this broadcast
            raise RuntimeError(
                f"--cpu weight sync: rank {self.rank}'s broadcast of a {tuple(tensor.shape)} {tensor.dtype} tensor "
                f"from rank {src} did not complete (a peer failed, left, or did not come within {self._seconds()}): "
                f"{first_line(exc)}"
            ) from exc


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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
