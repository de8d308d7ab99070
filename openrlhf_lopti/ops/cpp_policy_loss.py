"""C++ CPU backend of ``fused_policy_loss``: the ``torch.ops.openrlhf_lopti.policy_loss_fwd`` / ``_bwd`` ops
from ``csrc/``, wrapped in an autograd function.

The kernel is found, on first use, in this order: the extension ``setup.py`` built (``openrlhf_lopti._C``),
unless it was built for another torch than the one running (``setup.py`` writes that version beside it); else
a JIT build of the C++ sources with ``torch.utils.cpp_extension`` against the running torch: the sources an
installed package carries (``openrlhf_lopti/csrc/``, copied there by every wheel build) or a checkout's
``csrc/``; cached in ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/openrlhf_lopti``; ``OPENRLHF_LOPTI_NO_JIT=1`` skips
it. Else :func:`cpp_available` is False and one warning says why, with the command that fixes it, and
``backend="auto"`` uses the torch backend.
"""

import importlib
import logging
import os
import shlex
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from ..algo import PolicyLossOutput
from ..install import checkout, pip_install
from .first_order import first_order
from .loss_head_output import LossHeadOutput
from .torch_policy_loss import finish_per_token

logger = logging.getLogger(__name__)

# Keep in sync with native_extensions() in setup.py. No -march: the binary must run on any x86-64 CPU,
# the kernels pick AVX2 / AVX-512 at run time (csrc/softmax_rows.cpp).
_CFLAGS = ["-O3", "-Wno-psabi"] + ([] if sys.platform == "darwin" else ["-fopenmp"])
_LDFLAGS = [] if sys.platform == "darwin" else ["-fopenmp"]
_JIT_NAME = "openrlhf_lopti_cpu_kernels"
_PACKAGE = Path(__file__).resolve().parents[1]
# Written by setup.py beside the extension it builds: the torch version it was compiled against.
_TORCH_STAMP = _PACKAGE / "_C.torch_version"

_lock = threading.Lock()
_error: Optional[str] = None  # why the kernel is unavailable; None while untried or once loaded
_loaded = False
_tried = False


class _CannotBuild(RuntimeError):
    """A JIT build that cannot start here; the message says what is missing and the command that fixes it."""


def _csrc() -> Path:
    """The kernel's C++ sources: inside the installed package (a wheel carries them), else a source checkout's csrc/
    (never a csrc/ that only sits beside an installed package: in site-packages it is another package's)."""
    inside = _PACKAGE / "csrc"
    in_checkout = checkout() == _PACKAGE.parent  # this package is a source checkout's, not an installed copy
    return inside if any(inside.glob("*.cpp")) or not in_checkout else _PACKAGE.parent / "csrc"


def _stale_extension_reason() -> Optional[str]:
    """Why the built ``_C`` must not be loaded (it was built for another torch), or None."""
    try:
        built_for = _TORCH_STAMP.read_text(encoding="utf-8").strip()
    except OSError:  # no stamp (an older build): try it; a mismatch then shows as an ImportError
        return None
    if built_for and built_for != torch.__version__:
        return f"openrlhf_lopti._C was built for torch {built_for}, this is torch {torch.__version__}"
    return None


def _quiet_import_of_the_builder():
    """``torch.utils.cpp_extension``, imported without the "No CUDA runtime is found" line it logs on a machine
    without a GPU when torch is a CUDA build: nothing for a user of the CPU kernel to act on."""
    builder_log = logging.getLogger("torch.utils.cpp_extension")
    level = builder_log.level
    builder_log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        builder_log.setLevel(level)
    return cpp_extension


def _jit_build() -> None:
    csrc = _csrc()
    sources = sorted(str(p) for p in csrc.glob("*.cpp"))
    if not sources:
        where = f"{_PACKAGE / 'csrc'} or {csrc}" if csrc != _PACKAGE / "csrc" else str(csrc)
        raise _CannotBuild(f"no C++ sources in {where} (a wheel built without them): reinstall, "
                           f"{pip_install()} --force-reinstall --no-deps")  # fmt: skip
    compiler = os.environ.get("CXX", "c++")
    # CXX may be a command line, a launcher before the compiler ("ccache g++"): every program of it must be there
    missing = [word for word in shlex.split(compiler) or ["c++"] if not word.startswith("-") and not shutil.which(word)]
    if missing:
        what = repr(missing[0]) if missing[0] == compiler else f"{missing[0]!r} of CXX={compiler!r}"
        raise _CannotBuild(f"no C++ compiler ({what} is not on PATH): install one (Debian/Ubuntu: apt-get install "
                           "g++; conda: conda install gxx) or set CXX")  # fmt: skip
    if shutil.which("ninja") is None:
        try:  # the pip `ninja` package, when the venv's bin/ is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            raise _CannotBuild("torch builds C++ extensions with ninja, not installed: pip install ninja") from None
    cpp_extension = _quiet_import_of_the_builder()
    build_dir = None  # torch's default honours $TORCH_EXTENSIONS_DIR
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.split('+')[0]}"
        build_dir = os.path.join(Path.home(), ".cache", "openrlhf_lopti", "torch_extensions", tag)
        os.makedirs(build_dir, exist_ok=True)
    logger.info("openrlhf_lopti: JIT-building the C++ policy-loss kernel from %s (first use only)", csrc)
    cpp_extension.load(
        name=_JIT_NAME,
        sources=sources,
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        build_directory=build_dir,
        is_python_module=False,  # loads the library: its TORCH_LIBRARY blocks register the ops
        verbose=os.environ.get("OPENRLHF_LOPTI_JIT_VERBOSE") == "1",
    )


def _register_fakes() -> None:
    # Shape-only versions of the ops, so torch.compile / FakeTensor tracing can see through them.
    @torch.library.register_fake("openrlhf_lopti::policy_loss_fwd")
    def _fwd_fake(logits, labels, old_log_probs, advantages, mask, ref_log_probs, alpha, eps_low, eps_high,
                  dual_clip, kl_coef, kl_estimator, temperature, return_entropy):  # fmt: skip
        n = logits.shape[0]
        new = old_log_probs.new_empty
        clipped = torch.empty(n, dtype=torch.bool, device=logits.device)
        bad_rows = torch.empty(n, dtype=torch.bool, device=logits.device)
        return new(n), new(n), new(n), clipped, new(n if return_entropy else 0), new((n, 4)), bad_rows

    @torch.library.register_fake("openrlhf_lopti::policy_loss_bwd")
    def _bwd_fake(logits, labels, mask, stats, grad_loss, grad_logp, grad_entropy, temperature):
        return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)

    if hasattr(torch.ops.openrlhf_lopti, "policy_loss_bwd_"):  # absent from an extension built before it

        @torch.library.register_fake("openrlhf_lopti::policy_loss_bwd_")
        def _bwd_in_place_fake(logits, labels, mask, stats, grad_loss, grad_logp, grad_entropy, temperature):
            return logits


def _load() -> bool:
    global _error, _loaded, _tried
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        reasons = []
        stale = _stale_extension_reason()
        if stale:
            reasons.append(stale)
        else:
            try:
                importlib.import_module("openrlhf_lopti._C")
                _loaded = True
            except ImportError as exc:
                reasons.append(f"openrlhf_lopti._C: {exc}")
        if not _loaded and os.environ.get("OPENRLHF_LOPTI_NO_JIT") == "1":
            reasons.append("JIT build skipped (OPENRLHF_LOPTI_NO_JIT=1; unset it to build the kernel at first use)")
        elif not _loaded:
            try:
                _jit_build()
                _loaded = True
            except _CannotBuild as exc:
                reasons.append(f"JIT build impossible: {exc}")
            except Exception as exc:  # noqa: BLE001  (a compile error: the torch backend still runs)
                lines = str(exc).strip().splitlines()
                reasons.append(f"JIT build failed: {lines[-1] if lines else repr(exc)} (OPENRLHF_LOPTI_JIT_VERBOSE=1 "
                               "prints the compiler's log)")  # fmt: skip
        if _loaded and not hasattr(torch.ops.openrlhf_lopti, "policy_loss_fwd"):
            _loaded = False
            reasons.append("the library loaded but registered no openrlhf_lopti::policy_loss_fwd op")
        if _loaded:
            _register_fakes()
        else:
            _error = " ".join("; ".join(reasons).split())  # one line
            warnings.warn(
                f"openrlhf_lopti: C++ policy-loss kernel unavailable, using the torch backend ({_error})",
                RuntimeWarning,
                stacklevel=3,
            )
        return _loaded


def cpp_available() -> bool:
    """Whether the C++ kernel is loaded (building it by JIT on first call if needed; warns once if not)."""
    return _load()


def cpp_isa() -> str:
    """The instruction set the C++ kernel runs with here: ``"avx512"``, ``"avx2"`` or ``"generic"``.

    ``OPENRLHF_LOPTI_CPU_ISA=generic|avx2|avx512`` (read once, at the first kernel call) caps it; any other
    non-empty value makes that call (and every kernel call) raise a ``ValueError`` naming the variable.
    """
    _require()
    return torch.ops.openrlhf_lopti.cpu_isa()


def _require() -> None:
    if not _load():
        raise RuntimeError(f"the cpp backend of fused_policy_loss is unavailable: {_error}")


class _CppPolicyLoss(torch.autograd.Function):
    """Forward keeps logits (no copy) and fp32 [N, 4] row statistics; backward recomputes the softmax, into a new
    buffer or (``grad_in_logits``) over the logits themselves.

    Also returns the op's ``bad_rows`` flags (non-differentiable) for the caller to check."""

    @staticmethod
    def forward(ctx, logits, labels, old_log_probs, advantages, mask, ref_log_probs, alpha, eps_low, eps_high,
                dual_clip, kl_coef, kl_estimator, temperature, return_entropy, grad_in_logits):  # fmt: skip
        loss, logp, kl, clipped, entropy, stats, bad_rows = torch.ops.openrlhf_lopti.policy_loss_fwd(
            logits, labels, old_log_probs, advantages, mask, ref_log_probs,
            alpha, eps_low, eps_high, dual_clip, kl_coef, kl_estimator, temperature, return_entropy,
        )  # fmt: skip
        ctx.save_for_backward(logits, labels, mask, stats)
        ctx.temperature = temperature
        # an extension built before the in-place op existed still trains, into a new buffer
        ctx.in_place = grad_in_logits and hasattr(torch.ops.openrlhf_lopti, "policy_loss_bwd_")
        ctx.mark_non_differentiable(kl, clipped, bad_rows)
        ctx.set_materialize_grads(False)  # unused outputs give None, and the kernel skips their terms
        return loss, logp, kl, clipped, entropy, bad_rows

    @staticmethod
    @first_order("fused_policy_loss (backend 'cpp')", "backend='torch' differentiates twice")
    @once_differentiable
    def backward(ctx, grad_loss, grad_logp, _grad_kl, _grad_clipped, grad_entropy, _grad_bad_rows):
        if grad_loss is None and grad_logp is None and grad_entropy is None:
            return (None,) * 15
        logits, labels, mask, stats = ctx.saved_tensors
        upstream = (grad_loss, grad_logp, grad_entropy, ctx.temperature)
        if ctx.in_place:
            grad_logits = torch.ops.openrlhf_lopti.policy_loss_bwd_(logits, labels, mask, stats, *upstream)
            # the logits now hold their gradient: a later backward that saved them raises, never reads it silently
            torch.autograd.graph.increment_version(logits)
        else:
            grad_logits = torch.ops.openrlhf_lopti.policy_loss_bwd(logits, labels, mask, stats, *upstream)
        return (grad_logits,) + (None,) * 14


def cpp_policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_log_probs: Optional[torch.Tensor] = None,
    alpha: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    temperature: float = 1.0,
    return_entropy: bool = False,
    loss_weights: Optional[torch.Tensor] = None,
    entropy_weights: Optional[torch.Tensor] = None,
    grad_in_logits: bool = False,
) -> LossHeadOutput:
    """The ``"cpp"`` backend of :func:`openrlhf_lopti.ops.fused_policy_loss` (shapes and options already checked
    there; values checked here as status bits, :func:`~openrlhf_lopti.ops.torch_policy_loss.finish_per_token`).

    Args:
        logits: ``[N, V]`` fp32 / bf16 / fp16 CPU tensor; read in its dtype, one row at a time (no fp32
            ``[N, V]`` copy). Rows must be contiguous in V (other layouts are copied once).
        labels, old_log_probs, advantages, mask, ref_log_probs: ``[N]``, as ``fused_policy_loss``; a label outside
            ``[0, V)`` on a kept row is flagged and never read.
        alpha, eps_low, eps_high, dual_clip, kl_coef, kl_estimator, temperature, return_entropy, loss_weights,
            entropy_weights, grad_in_logits: as ``fused_policy_loss`` (two passes here: with ``grad_in_logits`` the
            backward writes the gradient over the logits).

    Returns:
        :class:`~openrlhf_lopti.ops.loss_head_output.LossHeadOutput` of fp32 ``[N]`` fields (``clipped`` bool);
        masked rows are 0 everywhere with zero gradient, flagged rows NaN. The gradient to ``logits`` (in its
        dtype) comes from ``loss``, ``logp`` and ``entropy`` (or ``reduced`` alone, with ``loss_weights``).

    Raises:
        ValueError: ``logits`` not on the CPU, or a bad ``OPENRLHF_LOPTI_CPU_ISA``.
        RuntimeError: the kernel could not be loaded or built (see :func:`cpp_available`).
    """
    if logits.device.type != "cpu":
        raise ValueError(f"the cpp backend runs on CPU tensors; logits is on {logits.device} (use backend='triton')")
    _require()
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    loss, logp, kl, clipped, entropy, bad_rows = _CppPolicyLoss.apply(
        logits,
        labels.detach().long().clamp(0, max(logits.shape[1] - 1, 0)).contiguous(),  # a bad id is flagged, not read
        old_log_probs.detach().float().contiguous(),
        advantages.detach().float().contiguous(),
        mask.detach().bool().contiguous(),
        None if ref_log_probs is None else ref_log_probs.detach().float().contiguous(),
        float(alpha),
        float(eps_low),
        float(eps_high),
        None if dual_clip is None else float(dual_clip),
        float(kl_coef),
        kl_estimator,
        float(temperature),
        bool(return_entropy),
        bool(grad_in_logits),
    )
    out = PolicyLossOutput(loss=loss, logp=logp, kl=kl, clipped=clipped, entropy=entropy if return_entropy else None)
    return finish_per_token(
        out, bad_rows, logits.shape[1], labels, old_log_probs, advantages, mask, ref_log_probs, temperature,
        loss_weights, entropy_weights, "cpp", logits.__getitem__,  # overwritten only later, in the backward
        nan_gradient=False,  # the kernel's backward writes a flagged row's NaN gradient itself
    )  # fmt: skip
