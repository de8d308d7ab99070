"""``CPUWorkerWrap``: upstream's vLLM worker extension (``WorkerWrap``) on vLLM's CPU backend.

vLLM loads it by name (``worker_extension_cls``) into its worker process before it builds the model, and
upstream's rollout actor calls its methods through ``collective_rpc``. Two things differ from a GPU worker:

- upstream's ``update_weight`` allocates the received tensor on ``"cuda"`` and broadcasts on a CUDA stream; here
  it is allocated on the worker's device and received over the gloo group of :mod:`.sync`, then loaded with
  vLLM's own ``model.load_weights`` as upstream does;
- vLLM's CPU backend repacks every linear layer's weight for its GEMM kernels (oneDNN / packed) once, after
  loading, and then frees the weight itself, so ``load_weights`` would have nowhere to write and the packed copy
  would never change. Importing this module (vLLM does, in its worker, before loading the model) makes that
  packing keep the weight; after the last parameter of a sync the layers are packed again from the new weights
  (both from :mod:`openrlhf_lopti.vllm_cpu`, shared with the other front ends).
"""

import torch

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from ...vllm_cpu import keep_weights_when_packing, repack_linear_layers
from .sync import StatelessGlooGroup

keep_weights_when_packing()  # vLLM imports this module in its worker before it loads the model


class CPUWorkerWrap(WorkerWrap):
    def init_process_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="gloo", use_ray=False
    ):
        """Join upstream's weight-sync group as rank ``rank_offset`` + this worker's rank (gloo, no Ray collective)."""
        if use_ray:
            raise ValueError("--cpu weight sync runs without --vllm.sync_with_ray (see cpu/sync.py)")
        rank = torch.distributed.get_rank() + rank_offset
        self._model_update_with_ray = False
        self._model_update_group = StatelessGlooGroup(master_address, int(master_port), rank, int(world_size))

    def update_weight(self, name, dtype, shape, empty_cache=False):
        """Receive parameter ``name`` from the policy's rank 0 (upstream's ``broadcast_to_vllm``) and load it;
        after the last one (upstream's ``empty_cache=True``), repack the linear layers.

        The tensor is received as the sender describes it (``name``, ``dtype``, ``shape`` are rank 0's own) before
        anything is checked: a weight this engine refuses (another dtype, a name or shape vLLM does not load) raises
        here after the broadcast has completed on every rank, so the policy's rank 0 gets the error from its
        ``ray.get`` on this call instead of waiting in a broadcast this worker never entered."""
        weight = torch.empty(shape, dtype=dtype, device=self.device)
        self._model_update_group.broadcast(weight, src=0)
        if dtype != self.model_config.dtype:
            raise TypeError(
                f"--cpu weight sync: the policy sent {name} in {dtype}, the engine runs {self.model_config.dtype}"
            )
        self.model_runner.model.load_weights(weights=[(name, weight)])
        if empty_cache:
            repack_linear_layers(self.model_runner.model)

    def update_weight_cuda_ipc(self, *args, **kwargs):
        raise RuntimeError("CUDA IPC weight sync needs GPUs: --cpu uses --vllm.sync_backend gloo")

    def model_weights(self) -> dict:
        """The engine's parameters under vLLM's names (its fused ``qkv_proj`` / ``gate_up_proj``), copied."""
        return {name: param.detach().clone() for name, param in self.model_runner.model.named_parameters()}
