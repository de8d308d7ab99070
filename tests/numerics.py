"""Tolerances derived from the computation, not read off one machine (TESTING.md, "Numerical comparisons").

Two fp32 paths that compute the same thing in different orders (another BLAS kernel, another vector width,
chunked vs whole GEMMs) differ by rounding whose size depends on the machine. So a claim "path A computes what
path B computes" is checked in two parts, both machine-independent:

1. **Logic, in float64.** Both paths run again with every float32 request answered in float64
   (:class:`Float64Shadow`: the same code, the same branches, only the precision changes). Their float64 results
   must agree to a bound set by float64 rounding, scaled by how much this computation amplifies rounding (measured
   on the fp32 runs themselves) -- some 10^8 times tighter than any fp32 comparison, so a changed formula fails.
2. **Precision, in fp32.** Each fp32 path is measured against its own float64 run. Path A may not be
   much less accurate than path B; a failure names the path that lost accuracy and by how much.
"""

from typing import Callable, Dict, Sequence

import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode

U32 = torch.finfo(torch.float32).eps / 2  # unit roundoff of fp32 (2^-24)
U64 = torch.finfo(torch.float64).eps / 2  # and of float64 (2^-53)
SAFETY = 64.0  # how far a float64 difference may exceed its estimate: rounding errors add up to sqrt(#ops)..#ops
ACCURACY_RATIO = 4.0  # path A's fp32 error may be at most this many times path B's (plus a few ulps)
ULPS_FLOOR = 64.0  # ... plus this many fp32 ulps of the tensor's scale, when B happens to round exactly


class Float64Shadow(TorchFunctionMode):
    """Inside it, ``.float()``, ``.to(torch.float32)``, ``.type(torch.float32)`` and ``dtype=torch.float32``
    give float64, and new float tensors default to float64, so code written for fp32 runs in float64 unchanged.

    The autograd engine runs backward passes without the caller's function modes, so while the shadow is active
    the ``backward`` of every custom ``torch.autograd.Function`` is run inside it too. A recomputation that
    non-reentrant gradient checkpointing makes during backward is not a ``Function``: pass
    ``context_fn=lambda: (nullcontext(), Float64Shadow())`` to ``checkpoint`` for it.

    What it cannot change: dtypes chosen inside C++ / Triton kernels (run those paths in fp32 only) and
    ``torch.finfo(torch.float32)`` constants (clamps and floors stay where the fp32 code puts them).
    """

    _CASTS = {torch.Tensor.float, torch.Tensor.to, torch.Tensor.type}

    def __enter__(self):
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        self._backward = BackwardCFunction.apply

        def backward_in_float64(ctx, *args, _apply=self._backward):
            with Float64Shadow():
                return _apply(ctx, *args)

        BackwardCFunction.apply = backward_in_float64
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._default)
        BackwardCFunction.apply = self._backward
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        if func in self._CASTS:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def _scale(t: torch.Tensor) -> float:
    """The size rounding errors of ``t`` are measured against: its largest magnitude (at least the fp32 tiny)."""
    return max(t.detach().abs().max().item() if t.numel() else 0.0, torch.finfo(torch.float32).tiny)


def _error(x32: torch.Tensor, x64: torch.Tensor) -> float:
    """Largest elementwise |x32 - x64|, in units of the float64 tensor's scale."""
    if x32.numel() == 0:
        return 0.0
    return (x32.detach().double() - x64.detach().double()).abs().max().item() / _scale(x64)


def assert_same_computation(
    name: str,
    a32: torch.Tensor,
    b32: torch.Tensor,
    a64: torch.Tensor,
    b64: torch.Tensor,
    a_name: str = "ours",
    b_name: str = "reference",
    precision: bool = True,
) -> Dict[str, float]:
    """Path A computes what path B computes (A and B: fp32 results; a64, b64: the same paths in float64).

    Asserts (see the module docstring):
      * logic: ``max|a64 - b64| <= SAFETY * max(amplification, 1) * U64 * scale``, where ``scale = max|b64|`` and
        ``amplification = max(err_a, err_b) / U32`` is how many fp32 roundings of ``scale`` the fp32 runs lost;
      * precision (unless ``precision=False``): ``err_a <= ACCURACY_RATIO * err_b + ULPS_FLOOR * U32`` and the same
        with A and B swapped, where ``err_x = max|x32 - x64| / scale``. Turn it off for results computed after an
        AdamW step: it divides by ``sqrt(v) + eps``, so a rounding-level difference on a near-zero gradient entry
        becomes a whole step's difference, at random in either path; only the logic half means something there.
    Returns the measured errors (relative to scale) for a test to print or check further.
    """
    assert a32.shape == b32.shape == a64.shape == b64.shape, f"{name}: shapes {a32.shape} {b32.shape} {a64.shape}"
    assert a64.dtype == b64.dtype == torch.float64, f"{name}: the float64 runs gave {a64.dtype} / {b64.dtype}"
    scale = _scale(b64)
    err_a, err_b = _error(a32, a64), _error(b32, b64)
    amplification = max(err_a, err_b) / U32
    logic = (a64.detach() - b64.detach()).abs().max().item() / scale if a64.numel() else 0.0
    bound64 = SAFETY * max(amplification, 1.0) * U64
    assert logic <= bound64, (
        f"{name}: the float64 runs of {a_name} and {b_name} differ by {logic:.3g} of scale {scale:.3g} "
        f"(bound {bound64:.3g} = {SAFETY:g} x amplification {amplification:.3g} x float64 roundoff): "
        "they do not compute the same thing"
    )
    pairs = ((a_name, b_name, err_a, err_b), (b_name, a_name, err_b, err_a)) if precision else ()
    for worse, better, e_worse, e_better in pairs:
        allowed = ACCURACY_RATIO * e_better + ULPS_FLOOR * U32
        assert e_worse <= allowed, (
            f"{name}: {worse} lost accuracy in fp32: {e_worse:.3g} of scale {scale:.3g} from its float64 run, "
            f"{better} {e_better:.3g} (allowed {allowed:.3g})"
        )
    return {"logic": logic, a_name: err_a, b_name: err_b, "scale": scale}


def assert_all_same_computation(
    name: str,
    a32: Sequence[torch.Tensor],
    b32: Sequence[torch.Tensor],
    a64: Sequence[torch.Tensor],
    b64: Sequence[torch.Tensor],
    **options,
) -> None:
    """:func:`assert_same_computation` for each tensor of four equally long lists (e.g. every parameter's grad)."""
    assert len(a32) == len(b32) == len(a64) == len(b64), f"{name}: {len(a32)}, {len(b32)}, {len(a64)}, {len(b64)}"
    for i, tensors in enumerate(zip(a32, b32, a64, b64)):
        assert_same_computation(f"{name}[{i}]", *tensors, **options)


def in_float64(run: Callable[[], object]) -> object:
    """``run()`` under :class:`Float64Shadow`."""
    with Float64Shadow():
        return run()


def scalars_same_computation(name: str, a32: float, b32: float, a64: float, b64: float, **options) -> None:
    """:func:`assert_same_computation` for two Python floats (a logged metric, a loss)."""
    assert_same_computation(name, *(torch.tensor([x], dtype=torch.float64) for x in (a32, b32, a64, b64)), **options)



# --- One fp32 path against the float64 truth of the same computation (kernels that only run in fp32) ---------------
#
# A C++ / Triton kernel cannot run in float64, so it is measured against a float64 run of the reference on the same
# inputs (the reference under Float64Shadow, or the float64 textbook). Its error is bounded from the computation:
# z/T is rounded once (an error of u32 * max|z/T| that passes 1:1 into logp and with a factor of about the output's
# own size into loss, KL, entropy and the gradient) and the sum of V exponentials adds about u32 * sqrt(V) (a random
# walk of V roundings). FP32_CONSTANT is the headroom over that estimate: the largest error measured on the kernel
# grid (tests/kernel_cases.py: CASES and EXTREME_CASES; reference, torch, cpp; default, AVX2 and generic CPU
# dispatch) is 0.65 of it: 12x headroom, while a changed formula is off by far more (TESTING.md).
FP32_CONSTANT = 8.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of a float dtype: the relative error of rounding one value to it."""
    return torch.finfo(dtype).eps / 2


def fp32_error_bound(magnitude: float, length: int, scale: float, dtype: torch.dtype = torch.float32,
                     constant: float = FP32_CONSTANT, unit: float = U32) -> float:  # fmt: skip
    """How far an fp32 result of size ``scale`` may be from its float64 truth: ``constant * u32 * (max(magnitude, 1)
    + sqrt(length)) * scale`` (``magnitude``: the largest input the result subtracts, max|z/T|; ``length``: the
    reduction length, V), plus one ulp of ``scale`` in ``dtype`` when the result is returned in a narrower dtype
    (a bf16 / fp16 gradient: one ulp, not half, because Triton's CPU interpreter truncates where a GPU rounds to
    nearest). ``unit``: the unit roundoff the path computes in, u32 unless it computes in a narrower dtype (an
    unfused bf16 lm_head rounds its logits to bf16)."""
    fp32 = constant * unit * (max(magnitude, 1.0) + length**0.5) * scale
    return fp32 + (2 * unit_roundoff(dtype) * scale if dtype != torch.float32 else 0.0)


def assert_near_float64(name: str, got: torch.Tensor, want64: torch.Tensor, bound: float, path: str = "ours") -> float:
    """``max|got - want64| <= bound`` (entries equal in both, infinities included, count as 0). The message names
    the path whose fp32 result is off and by how much. Returns the error."""
    got64, want64 = got.detach().cpu().double(), want64.detach().cpu().double()
    assert got64.shape == want64.shape, f"{name}: {path} has shape {tuple(got64.shape)}, want {tuple(want64.shape)}"
    diff = torch.where(got64 == want64, torch.zeros_like(got64), got64 - want64).abs()
    err = diff.max().item() if diff.numel() else 0.0
    assert err <= bound, (  # NaN fails too
        f"{name}: {path}'s fp32 result is {err:.3g} from the float64 run of the same computation "
        f"(bound {bound:.3g}; at flat index {int(diff.nan_to_num(float('inf')).argmax())})"
        if diff.numel() else f"{name}: {path}"
    )
    return err
