"""The Lopti round's learning-rate rule, written once: every phase of a round trains at the learning rates the
round's first phase had, and the LR schedule moves once per round (as a single pass without Lopti would move it).

A front end only applies it to its scheduler: :meth:`RoundSchedule.start_round` before the round's first phase,
:meth:`RoundSchedule.start_phase` before every later one. The first phase moves the schedule as a plain pass would;
each later phase starts again from the round's starting point, so it replays the same rates and leaves the schedule
where the first phase left it. :meth:`RoundSchedule.state_dict` / :meth:`RoundSchedule.load_state_dict` carry the
round's starting point through a checkpoint saved between two phases of a round. Works with any scheduler that has ``state_dict`` / ``load_state_dict`` (torch's,
DeepSpeed's, transformers') and the optimizer whose ``param_groups`` it sets.
"""

import copy
from typing import Any, List, Optional


class RoundSchedule:
    """The LR-hold rule for one scheduler and its optimizer (module docstring).

    ``scheduler`` None (a framework run without one) makes both calls no-ops."""

    def __init__(self, scheduler: Optional[Any], optimizer: Optional[Any] = None) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer if optimizer is not None else getattr(scheduler, "optimizer", None)
        self._start: Optional[dict] = None  # the scheduler's state and each group's lr when the round started
        self._lrs: List[float] = []

    def start_round(self) -> None:
        """Remember where the schedule stands: call before the round's first phase."""
        if self.scheduler is None:
            return
        self._start = copy.deepcopy(self.scheduler.state_dict())
        self._lrs = [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def start_phase(self) -> None:
        """Put the schedule back where the round started: call before each phase after the first."""
        if self.scheduler is None or self._start is None:
            return
        self.scheduler.load_state_dict(copy.deepcopy(self._start))
        if self.optimizer is not None:
            for group, lr in zip(self.optimizer.param_groups, self._lrs):
                group["lr"] = lr

    def state_dict(self) -> dict:
        """Where the running round started (None before the first round): for a checkpoint saved mid-round."""
        return {"start": copy.deepcopy(self._start), "lrs": list(self._lrs)}

    def load_state_dict(self, state: dict) -> None:
        """Take a round's starting point from :meth:`state_dict`: the next :meth:`start_phase` puts it back."""
        self._start = copy.deepcopy(state["start"])
        self._lrs = list(state["lrs"])
