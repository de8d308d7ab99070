"""vLLM's CPU backend with weights that can change: keep the packed layers' weights, and pack them again after a sync.

vLLM's CPU backend repacks every unquantized linear layer's weight for its GEMM kernels (oneDNN or its own packed
layout) once, after loading (``vllm/model_executor/layers/utils.py``, ``dispatch_cpu_unquantized_gemm``), and by default
frees the weight itself. Then a later ``model.load_weights`` of a weight sync has nowhere to write (``'Parameter'
object has no attribute 'weight_loader'``), or, where the weight is kept but not repacked, the engine silently
samples from the old packed copy. Every front end that syncs weights into a vLLM CPU engine (OpenRLHF's ``--cpu``
worker, TRL's colocate mode, verl) does the same two things, written here once:

- :func:`keep_weights_when_packing` before the model is loaded (in the process that loads it), or
  :func:`keep_weights_when_packing_on_import` in a process that has not imported vLLM yet;
- :func:`repack_linear_layers` after the last weight of each sync.

This is the only module below the front ends that imports vLLM (lazily: importing it does not).
"""

import functools

import torch

from openrlhf_lopti.after_import import call_after_import


def keep_weights_when_packing() -> None:
    """Patch vLLM in the calling process so that its CPU linear layers keep their weight when they pack it.

    vLLM's linear layers look ``dispatch_cpu_unquantized_gemm`` up on its module at call time, so replacing the
    module attribute reaches every layer loaded afterwards. Idempotent: a second call changes nothing."""
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "keeps_weight", False):
        return
    dispatch = utils.dispatch_cpu_unquantized_gemm

    @functools.wraps(dispatch)
    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    dispatch_keeping_weight.keeps_weight = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


PACKING_MODULE = "vllm.model_executor.layers.utils"  # where vLLM's CPU linear layers find their packing function


def keep_weights_when_packing_on_import() -> None:
    """:func:`keep_weights_when_packing` now if vLLM's layers are imported, else right after they are: for a process
    that imports us before it imports vLLM (one that may start an engine later). Does not import vLLM itself."""
    call_after_import(PACKING_MODULE, lambda module: keep_weights_when_packing())


def repack_linear_layers(model: torch.nn.Module) -> int:
    """Pack again, from their current weights, the layers vLLM packed for its CPU GEMMs; returns how many.

    ``model`` is vLLM's own model (``model_runner.model`` in its worker). Only 2-D linear weights are repacked (a
    MoE layer's experts use another layout: docs/CPU.md)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_linear") or getattr(module, "_cpu_skip_gemm_dispatch", False):
            continue
        if isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            count += 1
    return count
