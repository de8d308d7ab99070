"""The Triton kernel checked against the torch reference on the device it is about to run on.

``fused_policy_loss(backend="auto")`` sends CUDA tensors to Triton only after :func:`triton_verified` has run the
kernel forward and backward on a few small cases on that device, in this process, and found it within the
derived bounds below; otherwise it warns once, with the worst error, and uses the torch reference. The result is
cached per device. The check runs in its own grad mode (grad enabled, outside inference mode) whatever mode its
first caller is in (a trainer's log-prob pass runs under ``no_grad``), and only the kernel's own failures count
as a failed check: an error of the harness (the reference, the inputs, the comparison) is raised, never cached as
"use the reference". ``openrlhf-lopti check-gpu`` runs the wider :data:`WIDE_CASES` and prints a report; a case that
does not fit in the device's free memory is skipped and the report says how much it needs.

A NaN or inf where the reference has a finite value (or the reverse, or another non-finite value) fails the check
whatever its size: a kernel that writes NaN everywhere must not pass as "no finite error".

Bounds (the rule of TESTING.md, "Numerical comparisons"): both paths compute in fp32 from the same logits, so a
forward field may differ by rounding of the size of ``max|z / T|`` (log-sum-exp subtracts numbers of that size)
and of the ``V``-term sums: ``FP32_ULPS * u32 * (max|z/T| + sqrt(V))`` for log-probs and entropies, times the
loss's size for the loss and ``1 + size`` for the k3 KL (the rounding of the log-prob carried through them). Gradients come
back in the logits' dtype, rounded there by both paths, so a bf16/fp16 gradient may also differ by one ulp of that
dtype.
"""

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from openrlhf_lopti.algo import policy_loss_from_logits

FP32_ULPS = 64.0  # margin over one fp32 rounding of the magnitudes involved (several roundings add up)
FIELDS = ("loss", "logp", "kl", "entropy")
# The reference runs (and the comparison reads) this many logits at a time, so a 2^31-element case needs the
# logits and two gradients on the device, not the reference's fp32 [N, V] temporaries for all of it.
CHUNK_ELEMENTS = 1 << 25
REFERENCE_BYTES_PER_ELEMENT = 64  # the reference's fp32 temporaries per logit of a chunk, forward and backward


@dataclass(frozen=True)
class Case:
    """One input of the check: ``[n, v]`` logits of ``dtype`` at ``temperature``; ``neg_inf`` puts -inf in two columns
    half a vocabulary apart (one when ``v < 4``) on every row but the first, never at a row's label."""

    n: int
    v: int
    dtype: torch.dtype
    temperature: float = 1.0
    neg_inf: bool = False

    def label(self) -> str:
        """``N=.. V=.. T=..`` and `` -inf`` when it has -inf columns (the report's name of the case)."""
        return f"N={self.n} V={self.v} T={self.temperature}{' -inf' if self.neg_inf else ''}"

    def chunk_rows(self) -> int:
        """Rows of one reference chunk (:data:`CHUNK_ELEMENTS` logits, at least one row)."""
        return max(1, CHUNK_ELEMENTS // max(self.v, 1))

    def bytes_needed(self) -> int:
        """Device bytes the check of this case holds at once: the logits, the kernel's and the reference's
        gradients (``[N, V]`` in the logits' dtype each) and one reference chunk's fp32 temporaries."""
        element = torch.finfo(self.dtype).bits // 8
        chunk = min(self.n, self.chunk_rows()) * self.v
        return 3 * self.n * self.v * element + REFERENCE_BYTES_PER_ELEMENT * chunk + 64 * self.n


# The shapes `auto` checks: V not a multiple of any block size, -inf columns, temperature != 1, fp32 / bf16 / fp16.
# V=1000 is one 1024-wide block with 4 warps; V=8200 is what every real vocabulary compiles (policy_loss.py's
# _launch_config: 4096-wide blocks, 8 warps), three blocks with the online rescaling between them and its -inf
# columns in different blocks.
QUICK_CASES: Tuple[Case, ...] = (
    Case(16, 1000, torch.float32, temperature=0.7, neg_inf=True),
    Case(16, 1000, torch.bfloat16, temperature=1.0, neg_inf=True),
    Case(16, 8200, torch.bfloat16, temperature=0.7, neg_inf=True),
    Case(16, 8200, torch.float16, temperature=1.0, neg_inf=True),
)
# Past the launch limits: more rows than the 65535 programs (each program strides over several rows), and
# N * V >= 2^31 logits (row offsets past int32). Each is skipped, and reported, where it does not fit.
LARGE_CASES: Tuple[Case, ...] = (
    Case(70000, 1000, torch.bfloat16, temperature=1.0, neg_inf=True),
    Case(14336, 151936, torch.bfloat16, temperature=1.0),
)
WIDE_CASES: Tuple[Case, ...] = (
    QUICK_CASES
    + tuple(
        Case(n, v, dtype, temperature)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
        for n, v in ((1, 1), (64, 4099), (257, 32000), (512, 151936))
        for temperature in (1.0, 0.6)
    )
    + LARGE_CASES
)


@dataclass
class SelfCheck:
    """What :func:`run_self_check` found. ``worst``: dtype name -> the largest error of any field, in units of its
    bound (<= 1 passes; inf: a NaN / inf where the reference is finite, or the reverse); ``error``: the exception
    text when the kernel could not compile or run; ``skipped``: the cases that did not fit in the device's free
    memory, each ``"<case> <dtype> (needs X GB, Y GB free)"``."""

    ok: bool
    seconds: float
    worst: Dict[str, float] = field(default_factory=dict)
    worst_case: Dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None
    skipped: List[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: pass / fail, the worst error per dtype (in units of its bound), the time taken, the skips."""
        if self.error is not None:
            return f"could not run ({self.error}) after {self.seconds:.1f} s"
        errors = ", ".join(f"{dtype} {value:.2g} ({self.worst_case[dtype]})" for dtype, value in self.worst.items())
        verdict = "passed" if self.ok else "FAILED"
        line = f"{verdict} in {self.seconds:.1f} s; worst error / bound per dtype: {errors or 'no case ran'}"
        return line + "".join(f"; skipped: {case}" for case in self.skipped)


def _inputs(case: Case, device: torch.device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, case.v, (case.n,), generator=g)
    old = (torch.randn(case.n, generator=g) * 0.5 - 1.5).clamp(max=0.0)  # log-probs: above 0 is flagged
    rows = dict(
        labels=labels,
        old_log_probs=old,
        advantages=torch.randn(case.n, generator=g),
        mask=torch.rand(case.n, generator=g) > 0.2,
        ref_log_probs=old + 0.1 * torch.randn(case.n, generator=g),
        weights=torch.randn(3, case.n, generator=g),  # upstream gradients of loss, logp, entropy
    )
    columns: List[int] = []
    if case.neg_inf and case.v > 1:
        # Never row 0's label; the second column is half a vocabulary away (another block when V > BLOCK_V).
        first = int(labels[0])
        columns = sorted({(first + 1) % case.v} | ({(first + case.v // 2) % case.v} if case.v >= 4 else set()))
        hit = torch.isin(labels[1:], torch.tensor(columns))
        labels[1:] = torch.where(hit, labels[0], labels[1:])
    out = {k: v.to(device) for k, v in rows.items()}
    # Drawn on the device a chunk at a time: a 2^31-element case never has an fp32 [N, V] copy anywhere.
    logits = torch.empty(case.n, case.v, dtype=case.dtype, device=device)
    draw = torch.Generator(device=device).manual_seed(seed)
    largest = 0.0  # max |finite logit|, for the bounds: taken here, before any kernel could write to the logits
    for rows_ in _row_chunks(case):
        chunk = (torch.randn(rows_.stop - rows_.start, case.v, generator=draw, device=device) * 4).to(case.dtype)
        largest = max(largest, chunk.float().abs().max().item())
        if columns:
            chunk[max(0, 1 - rows_.start) :, columns] = float("-inf")  # every row but row 0
        logits[rows_] = chunk
    out["logits"] = logits
    out["magnitude"] = largest / case.temperature + case.v**0.5
    return out


def _row_chunks(case: Case) -> List[slice]:
    step = case.chunk_rows()
    return [slice(start, min(start + step, case.n)) for start in range(0, case.n, step)]


def _call(
    run, logits: torch.Tensor, inputs: dict, rows: slice, case: Case
) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """``run``'s forward on ``logits`` (the ``rows`` of the case): its detached ``[rows]`` fields, and the scalar
    that backpropagates ``inputs["weights"]`` into the loss, logp and entropy (the caller calls ``backward``)."""
    out = run(
        logits, inputs["labels"][rows], inputs["old_log_probs"][rows], inputs["advantages"][rows],
        inputs["mask"][rows], ref_log_probs=inputs["ref_log_probs"][rows], alpha=0.3, eps_low=0.2,
        eps_high=0.28, dual_clip=3.0, kl_coef=0.01, kl_estimator="k3", temperature=case.temperature,
        return_entropy=True,
    )  # fmt: skip
    w = inputs["weights"][:, rows]
    total = (out.loss * w[0]).sum() + (out.logp * w[1]).sum() + (out.entropy * w[2]).sum()
    return {name: getattr(out, name).detach() for name in FIELDS}, total


class KernelFailed(Exception):
    """The kernel under check raised (did not compile, crashed): a failed check, not an error of the harness."""


def _forward_backward(run, inputs: dict, case: Case) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """``run`` on the whole ``[N, V]`` logits at once (the kernel: its launch over all rows is what is checked). A
    kernel that flags a row of these valid inputs gives that row NaN, which fails the comparison."""
    # no copy (a 2^31-element case has no room for one): the reference has already run on these logits
    logits = inputs["logits"].detach().requires_grad_(True)
    try:
        fields, total = _call(run, logits, inputs, slice(None), case)
        total.backward()
    except Exception as exc:  # a kernel that does not compile or crashes on this device: not usable here
        raise KernelFailed(f"{type(exc).__name__}: {exc}") from exc
    return fields, logits.grad


def _reference(inputs: dict, case: Case) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """The torch reference, :data:`CHUNK_ELEMENTS` logits at a time (it is row by row, so chunks change nothing)."""
    parts: Dict[str, List[torch.Tensor]] = {name: [] for name in FIELDS}
    grad = torch.empty_like(inputs["logits"])
    for rows in _row_chunks(case):
        logits = inputs["logits"][rows].detach().requires_grad_(True)
        fields, total = _call(policy_loss_from_logits, logits, inputs, rows, case)
        total.backward()
        grad[rows] = logits.grad
        for name in FIELDS:
            parts[name].append(fields[name])
    return {name: torch.cat(parts[name]) for name in FIELDS}, grad


def _not_nan(value: float) -> float:
    """``value``, with NaN read as inf: every comparison with NaN is False, so ``max(0.0, nan)`` is ``0.0``."""
    return math.inf if math.isnan(value) else value


def _distance(got: torch.Tensor, want: torch.Tensor) -> Tuple[float, float]:
    """``(max |got - want| over the entries where want is finite, max |want| there)``; the first is inf where the
    two differ in which entries are finite, or in a non-finite value (NaN vs inf, -inf vs +inf)."""
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite):
        return math.inf, 0.0
    special = ~finite
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if bool((special & ~same).any()):
        return math.inf, 0.0
    zero = want.new_zeros(())
    diff = torch.where(finite, got - want, zero).abs().max().item() if got.numel() else 0.0
    size = torch.where(finite, want, zero).abs().max().item() if want.numel() else 0.0
    return _not_nan(diff), size


def _errors(case: Case, inputs: dict, got, want) -> float:
    """The largest error of any field, in units of its bound (see the module docstring); inf for a non-finite
    value where the reference is finite, or the reverse. Never NaN."""
    (out, grad), (ref, ref_grad) = got, want
    unit = FP32_ULPS * torch.finfo(torch.float32).eps / 2 * inputs["magnitude"]
    worst = 0.0
    for name in FIELDS:
        diff, size = _distance(out[name], ref[name])
        # logp and entropy carry the log-sum-exp's rounding itself; the loss (A * ratio) and the k3 KL
        # (exp(ref - logp) - ...) carry it times their own size
        factor = {"loss": max(size, 1.0), "kl": size + 1.0}.get(name, 1.0)
        worst = max(worst, _not_nan(diff / (unit * factor)))
    diff = scale = 0.0
    for rows in _row_chunks(case):
        chunk_diff, chunk_scale = _distance(grad[rows], ref_grad[rows])
        diff, scale = max(diff, chunk_diff), max(scale, chunk_scale)
    # A row's gradient is a sum of terms of the size of its upstream gradient over T that cancel where the softmax
    # is peaked: at V=1 every entry is exactly 0 in the reference while a GPU's rounding leaves ~1e-15 (seen on an
    # H100: "4.8e+25" bounds). Rounding is relative to the terms, not to what is left after they cancel.
    scale = max(scale, inputs["weights"].abs().max().item() / case.temperature, torch.finfo(torch.float32).tiny)
    # the gradient is rounded to the logits' dtype by both paths: one ulp of that dtype apart at most
    rounding = torch.finfo(case.dtype).eps if case.dtype != torch.float32 else 0.0
    return max(worst, _not_nan(diff / ((unit + rounding) * scale)))


def _free_bytes(device: torch.device) -> Optional[int]:
    """Free memory on a CUDA ``device``; None elsewhere (no gate: the CPU cases are the small ones)."""
    if device.type != "cuda":
        return None
    # what the driver has free plus what torch's caching allocator holds unused (earlier cases' buffers)
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def run_self_check(device: torch.device, cases: Sequence[Case] = QUICK_CASES) -> SelfCheck:
    """Run the Triton kernel and the torch reference forward and backward on ``cases`` on ``device``.

    A case larger than the device's free memory (:meth:`Case.bytes_needed`) is skipped and listed in
    ``skipped``; the check passes when every case that ran is within its bounds and at least one ran.
    Returns a :class:`SelfCheck`; never raises for a kernel that fails to compile or run (that is a failed check).
    Runs with grad enabled and outside inference mode, whatever the caller's mode.

    Raises:
        Exception: whatever the harness itself raised (the reference, the inputs, the comparison): an error of ours,
            not a verdict on the kernel.
    """
    with torch.inference_mode(False), torch.enable_grad():
        return _run_self_check(device, cases)


def _run_self_check(device: torch.device, cases: Sequence[Case]) -> SelfCheck:
    from . import triton_policy_loss

    started = time.perf_counter()
    worst: Dict[str, float] = {}
    worst_case: Dict[str, str] = {}
    skipped: List[str] = []
    try:
        for i, case in enumerate(cases):
            dtype = str(case.dtype).replace("torch.", "")
            free = _free_bytes(device)
            if free is not None and case.bytes_needed() > free:
                needs = f"needs {case.bytes_needed() / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
                skipped.append(f"{case.label()} {dtype} ({needs})")
                continue
            inputs = _inputs(case, device, seed=i)
            want = _reference(inputs, case)  # first: a kernel that wrote into its logits cannot change it
            got = _forward_backward(triton_policy_loss, inputs, case)
            error = _errors(case, inputs, got, want)
            del got, want
            del inputs
            if error >= worst.get(dtype, -1.0):  # never NaN (_errors)
                worst[dtype] = error
                worst_case[dtype] = case.label()
    except KernelFailed as exc:
        return SelfCheck(False, time.perf_counter() - started, error=str(exc), skipped=skipped)
    ok = bool(worst) and all(e <= 1.0 for e in worst.values())
    return SelfCheck(ok, time.perf_counter() - started, worst, worst_case, skipped=skipped)


_VERIFIED: Dict[str, SelfCheck] = {}


def triton_verified(device: torch.device) -> bool:
    """Whether ``auto`` may use the Triton kernel on ``device``: the quick self-check, once per device and process.

    Prints one line the first time: its cost when it passes; a warning with the worst error when it fails (the
    torch reference is then used on that device).
    """
    key = str(device)
    if key not in _VERIFIED:
        result = run_self_check(torch.device(device))
        _VERIFIED[key] = result
        if result.ok:
            print(f"[openrlhf-lopti] Triton self-check on {key}: {result.summary()}", file=sys.stderr)
        else:
            print(
                f"[openrlhf-lopti] WARNING: Triton self-check on {key} {result.summary()}; "
                "--actor.fused_loss auto uses the torch reference on this device (`openrlhf-lopti check-gpu` reports more)",
                file=sys.stderr,
            )
    return _VERIFIED[key].ok


def forget_self_checks() -> List[str]:
    """Drop the cached results (tests; a process that changed its Triton install). Returns the devices dropped."""
    dropped = list(_VERIFIED)
    _VERIFIED.clear()
    return dropped
