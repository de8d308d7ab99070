"""``CPUDeepspeedStrategy``: OpenRLHF's ``DeepspeedStrategy`` on DeepSpeed's CPU accelerator, over gloo.

It changes only what upstream binds to CUDA, each in one method:

- ``setup_distributed``: upstream's, with ``torch.cuda.set_device`` skipped, the process group on gloo and the
  ``(dp, sp, tp)`` device mesh on ``"cpu"`` instead of ``"cuda"``. Every model actor (policy, reference,
  reward, critic) calls it first, so it also answers, for the rest of that process, the bare ``torch.cuda``
  calls of upstream's trainer (``current_device``, ``synchronize``, ``current_stream``; see
  :func:`answer_cuda_calls_on_cpu`), lets ``--ds.param_dtype fp32`` load models in fp32, and gives the policy's
  weight sync to the vLLM engines a gloo group instead of vLLM's NCCL one (:mod:`.sync`);
- ``get_ds_train_config``: DeepSpeed builds ``torch.optim.AdamW`` (``torch_adam``) instead of its CUDA
  ``FusedAdam``;
- ``get_ds_train_config`` and ``get_ds_eval_config``: ZeRO-3 gathers parameters one collective at a time
  (``stage3_allgather_sequential``; see :func:`_gathers_wait_on_gloo`);
- ``moving_average`` (``--train.enable_ema``): upstream's, on ``"cpu"`` where the trainer asks for ``"cuda"``.

The device DeepSpeed puts tensors on comes from its accelerator: the ``--cpu`` runtime sets
``DS_ACCELERATOR=cpu`` in every process before DeepSpeed is imported (see ``runtime``).
"""

from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Iterator, Optional

import deepspeed
import torch
from torch.distributed.device_mesh import init_device_mesh

import openrlhf.utils.deepspeed.deepspeed as upstream_strategy_module
import openrlhf.utils.utils as upstream_utils
from openrlhf.utils.deepspeed import DeepspeedStrategy

from .sync import use_gloo_for_weight_sync


class _CPUDevice(str):
    """What ``torch.cuda.current_device()`` answers in a ``--cpu`` model actor: the device ``"cpu"`` wherever torch
    takes a device (``.to(d)``, ``device=d``), and ``0`` when formatted: upstream's replay buffer builds an
    unused ``torch.device(f"cuda:{torch.cuda.current_device()}")`` in its constructor."""

    def __format__(self, spec: str) -> str:
        return format(0, spec)


def answer_cuda_calls_on_cpu() -> None:
    """Make this process's ``torch.cuda.current_device / synchronize / current_stream`` answer for the CPU.

    Upstream's trainer calls them unconditionally (``experience.to_device(torch.cuda.current_device())``,
    ``torch_dist_barrier_and_cuda_sync``, the weight-sync broadcast's ``stream=``); ``torch.cuda.empty_cache``
    is already a no-op without CUDA. Also lets upstream's ``convert_to_torch_dtype`` read ``"fp32"``.
    """
    torch.cuda.current_device = lambda: _CPUDevice("cpu")
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: None
    if not getattr(upstream_utils.convert_to_torch_dtype, "accepts_fp32", False):
        to_dtype = upstream_utils.convert_to_torch_dtype

        def convert_to_torch_dtype(param_dtype: str) -> torch.dtype:
            return torch.float32 if param_dtype == "fp32" else to_dtype(param_dtype)

        convert_to_torch_dtype.accepts_fp32 = True
        upstream_utils.convert_to_torch_dtype = convert_to_torch_dtype


@contextmanager
def _cuda_bindings_on_cpu() -> Iterator[None]:
    """For the duration of upstream's ``setup_distributed``: no ``set_device``, gloo, a CPU device mesh."""
    saved = (torch.cuda.set_device, deepspeed.init_distributed, upstream_strategy_module.init_device_mesh)
    torch.cuda.set_device = lambda device: None
    deepspeed.init_distributed = partial(saved[1], dist_backend="gloo")
    upstream_strategy_module.init_device_mesh = lambda device_type, *args, **kwargs: init_device_mesh(
        "cpu", *args, **kwargs
    )
    try:
        yield
    finally:
        torch.cuda.set_device, deepspeed.init_distributed, upstream_strategy_module.init_device_mesh = saved


def _gathers_wait_on_gloo(config: dict) -> dict:
    """``config`` with ZeRO-3's blocking parameter gathers made one collective each (``stage3_allgather_sequential``).

    DeepSpeed 0.19.6 (OpenRLHF 0.11.2's pin) gathers a list of parameters as one async collective per parameter
    and waits for the last only. NCCL runs them in order on one stream; gloo runs them on several threads in any
    order, so a parameter could be read before its values arrived: uninitialized memory in the forward after each
    optimizer step (the persistent parameters' gather), or in a ``GatheredParameters`` read. Fixed upstream in
    0.19.8 (https://github.com/deepspeedai/DeepSpeed/pull/8539); ``tests/test_openrlhf_deepspeed.py`` counts the
    stale reads. Sequential gathers wait for each collective. The setting only matters under ZeRO-3.
    """
    config["zero_optimization"] = {**config["zero_optimization"], "stage3_allgather_sequential": True}
    return config


class CPUDeepspeedStrategy(DeepspeedStrategy):
    """Upstream's strategy for ``--cpu`` runs (see the module docstring for what differs)."""

    def setup_distributed(self, timeout: timedelta = timedelta(minutes=60)) -> None:
        answer_cuda_calls_on_cpu()
        use_gloo_for_weight_sync()  # the policy's rank 0 joins the vLLM engines' weight-sync group over gloo
        with _cuda_bindings_on_cpu():
            super().setup_distributed(timeout)

    def get_ds_train_config(self, optim_dict: Optional[dict] = None, *, max_norm: Optional[float] = None) -> dict:
        config = _gathers_wait_on_gloo(super().get_ds_train_config(optim_dict, max_norm=max_norm))
        optimizer = config.get("optimizer")
        if optimizer is not None and optimizer.get("type") == "AdamW":
            optimizer["params"] = {**optimizer["params"], "torch_adam": True}
        return config

    def get_ds_eval_config(self, offload: bool = False) -> dict:
        return _gathers_wait_on_gloo(super().get_ds_eval_config(offload))

    def moving_average(self, model, model_ema, beta: float = 0.992, device: str = "cpu") -> None:
        super().moving_average(model, model_ema, beta, device="cpu")


def get_cpu_strategy(args) -> CPUDeepspeedStrategy:
    """Upstream's ``openrlhf.utils.get_strategy(args)`` (its settings, unchanged), as a :class:`CPUDeepspeedStrategy`."""
    from openrlhf.utils import get_strategy

    strategy = get_strategy(args)
    strategy.__class__ = CPUDeepspeedStrategy  # a subclass adding no state: only the CUDA-bound methods differ
    return strategy
