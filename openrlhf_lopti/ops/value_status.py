"""Value checks without a host sync: per-row status bits, the check policy, and the ledger read at the optimizer step.

Every backend of the loss head writes, per row, an int32 word of the bits below (0 on masked rows and on good
rows) in the pass it already makes, and ORs every row's word into one int32 ``word``. Nothing is read on the host
until the check policy (``LossOptions.check``) says so:

- ``"eager"``: the call reads ``word`` at once (one 4-byte read) and raises the ``ValueError`` for the first bad
  row before returning. The default of a standalone call.
- ``"step"``: the call returns its :class:`ValueStatus`; the trainer adds it to a :class:`StepChecks` and reads every
  call's word once, before its optimizer step (:meth:`StepChecks.raise_if_bad`), naming the call and the row. The
  default in our trainers: no host sync in the loss head.
- ``"off"``: nothing is read.

A flagged row never trains silently: its ``loss`` and ``logp`` are NaN on every backend (whatever the policy),
so a run with ``"off"`` shows NaN losses rather than training on a clamped label. -inf logits stay legal and exact
(``algo.policy_loss``'s docstring); only a row without a finite log-sum-exp is flagged.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..algo.advantage import OLD_LOG_PROB_MAX
from ..algo.policy_loss import bad_logit_row_error

CHECK_POLICIES = ("eager", "step", "off")

# One bit per kind of bad value on an unmasked row (the Triton kernel has the same numbers as constexprs).
BAD_LABEL = 1  # label outside [0, V)
BAD_OLD = 2  # old_log_probs not finite or above OLD_LOG_PROB_MAX (as float32): not a log-prob
BAD_ADVANTAGE = 4  # advantages not finite (as float32)
BAD_REF = 8  # ref_log_probs not finite (as float32)
BAD_LOGITS = 16  # the row has no finite log-sum-exp: a NaN or +inf logit, only -inf, or an overflow at T

_IN_FP32 = "on unmasked rows (as float32, the precision of the loss)"


def check_policy(check: str) -> str:
    """``check`` itself when it is a policy name; else a one-line ``ValueError``."""
    if check not in CHECK_POLICIES:
        raise ValueError(f"check must be one of {CHECK_POLICIES}, got {check!r}")
    return check


def input_status(
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    ref_log_probs: Optional[torch.Tensor],
    vocab_size: int,
) -> torch.Tensor:
    """The status bits of the per-token inputs, in torch (the reference the Triton kernel's bits are tested against).

    Args:
        labels: ``[N]`` integer ids; old_log_probs, advantages, ref_log_probs (or None): ``[N]`` floats.
        keep: ``[N]`` bool, the rows that are computed (masked rows get 0).
        vocab_size: ``V``.

    Returns:
        ``[N]`` int32 on the inputs' device: :data:`BAD_LABEL` | :data:`BAD_OLD` | :data:`BAD_ADVANTAGE` |
        :data:`BAD_REF` per kept row. No host sync.
    """
    status = ((labels < 0) | (labels >= vocab_size)).to(torch.int32) * BAD_LABEL
    old = old_log_probs.float()
    status |= (~(torch.isfinite(old) & (old <= OLD_LOG_PROB_MAX))).to(torch.int32) * BAD_OLD
    status |= (~torch.isfinite(advantages.float())).to(torch.int32) * BAD_ADVANTAGE
    if ref_log_probs is not None:
        status |= (~torch.isfinite(ref_log_probs.float())).to(torch.int32) * BAD_REF
    return torch.where(keep, status, 0)


def poison_flagged_rows(values: Tuple[torch.Tensor, ...], rows: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``values`` (``[N]`` floats each) with NaN on the rows whose status ``rows [N]`` is not 0 (no host sync)."""
    bad = rows != 0
    return tuple(torch.where(bad, torch.full_like(v, float("nan")), v) for v in values)


@dataclass
class ValueStatus:
    """What one loss-head call found: ``rows`` ``[N]`` int32 bits per row (in the caller's row numbering), ``word``
    ``[1]`` int32, their OR, both on the logits' device. ``row_logits`` (row ``i`` -> its ``[V]`` logits, or None
    once they are gone) only serves the message, which then says what a bad row holds; ``temperature`` divides
    them."""

    rows: torch.Tensor
    word: torch.Tensor
    vocab_size: int
    temperature: float = 1.0
    row_logits: Optional[Callable[[int], torch.Tensor]] = None

    @classmethod
    def of_rows(cls, rows: torch.Tensor, vocab_size: int, temperature: float, row_logits=None) -> "ValueStatus":
        """The status of per-row bits ``rows [N]`` (``word`` is their OR, one reduction, no host sync)."""
        return cls(rows, _or_reduce(rows), vocab_size, temperature, row_logits)

    def error(self, where: str = "") -> Optional[ValueError]:
        """The ``ValueError`` for the first bad row, or None when every row is good (reads ``word``: a host sync)."""
        if not int(self.word.item()):
            return None
        row = int((self.rows != 0).to(torch.int32).argmax())
        bits = int(self.rows[row])
        at = f" at {where}" if where else ""
        if bits & BAD_LABEL:
            return ValueError(f"labels must be token ids in [0, V) = [0, {self.vocab_size}) on unmasked rows "
                              f"(row {row}{at})")  # fmt: skip
        if bits & BAD_OLD:
            return ValueError(f"old_log_probs must be finite log-probabilities (<= 0, up to {OLD_LOG_PROB_MAX:g} of "
                              f"rounding) {_IN_FP32} (row {row}{at})")  # fmt: skip
        for bit, name in ((BAD_ADVANTAGE, "advantages"), (BAD_REF, "ref_log_probs")):
            if bits & bit:
                return ValueError(f"{name} must be finite {_IN_FP32} (row {row}{at})")
        if self.row_logits is not None:
            error = bad_logit_row_error(row, self.row_logits(row), self.temperature)
            return ValueError(f"{error}{at}") if where else error
        return ValueError(
            f"logits row {row} (unmasked){at} has no finite log-sum-exp: a NaN or +inf logit, only -inf, or values "
            f"that overflow float32 when divided by temperature={self.temperature}; logits must be finite or -inf, "
            "with a finite value in every unmasked row (NaN / +inf logits usually mean the model diverged)"
        )

    def raise_if_bad(self) -> None:
        """Raise :meth:`error` (the ``"eager"`` policy): one 4-byte device-to-host read when every row is good."""
        error = self.error()
        if error is not None:
            raise error


def _or_reduce(rows: torch.Tensor) -> torch.Tensor:
    """``[1]`` int32: the bitwise OR of ``rows [N]`` int32 (0 for N = 0), one max per bit (bits are few)."""
    word = torch.zeros(1, dtype=torch.int32, device=rows.device)
    if rows.numel():
        for bit in (BAD_LABEL, BAD_OLD, BAD_ADVANTAGE, BAD_REF, BAD_LOGITS):
            word |= (rows & bit).amax()
    return word


class StepChecks:
    """The ``"step"`` policy's ledger: the status of every loss-head call since the last optimizer step.

    A trainer adds each call's :class:`ValueStatus` with a name for the call (``add``; one small device op, no
    host sync) and calls :meth:`raise_if_bad` right before its optimizer step: one host read of the OR of every
    call's word (after ``any_rank``, a collective, when the trainer runs on several processes), and the ledger is
    emptied. Nothing is read per call.
    """

    def __init__(self) -> None:
        self._calls: List[Tuple[ValueStatus, str]] = []
        self._word: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, status: Optional[ValueStatus], where: str) -> None:
        """Remember ``status`` (None: a call that checked nothing) under the name ``where``, e.g. ``"RL step 3,
        Lopti phase 'low', micro-batch 2"``. Drops its logits: only the rows' bits are kept until the step."""
        if status is None:
            return
        status.row_logits = None  # the step comes after the backward: the logits are not kept alive for a message
        self._calls.append((status, where))
        word = status.word.to(torch.int32)
        self._word = word.clone() if self._word is None else self._word.bitwise_or_(word.to(self._word.device))

    def raise_if_bad(self, any_rank: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """Raise the first recorded call's error, if any call since the last step found a bad row; then forget them.

        Args:
            any_rank: for a trainer on several processes, a collective that turns this process's ``[1]`` int32 word
                into the OR (or max) over every process, so that every process raises together (none is left
                waiting in the next collective). The message then names the process that found it when it is
                another one.
        """
        calls, word = self._calls, self._word
        self._calls, self._word = [], None
        local = torch.zeros(1, dtype=torch.int32) if word is None else word
        every = local if any_rank is None else any_rank(local)
        if not int(every.reshape(-1)[0].item()):
            return
        for status, where in calls:
            error = status.error(where)
            if error is not None:
                raise error
        raise ValueError("a loss-head call on another process found a bad input (its own error names the call and "
                         "the row)")  # fmt: skip
