"""The Lopti round's learning-rate rule, written once: every phase of a round trains at the learning rates the
round's first phase had, and the LR schedule moves once per round (as a single pass without Lopti would move it).

A front end only applies it to its scheduler: :meth:`RoundSchedule.start_round` before the round's first phase,
:meth:`RoundSchedule.start_phase` before every later one. The first phase moves the schedule as a plain pass would;
each later phase starts again from the round's starting point, so it replays the same rates and leaves the schedule
where the first phase left it. :meth:`RoundSchedule.state_dict` / :meth:`RoundSchedule.load_state_dict` carry the
round's starting point through a checkpoint saved between two phases of a round.

Works with any scheduler that has ``state_dict`` / ``load_state_dict`` and the optimizer whose ``param_groups`` it
sets, judged by what its ``load_state_dict`` does, not by its class: one that restores the state it is given (torch's
and transformers' ``LambdaLR`` and the like, DeepSpeed's ``WarmupLR`` family) is used as it is; one whose
``state_dict()`` after loading differs from what it loaded is put back attribute by attribute. Megatron-Core's
``OptimizerParamScheduler`` (verl's Megatron engine) is one: its ``load_state_dict`` ends with
``self.step(increment=num_steps)``, the loaded count added to the current one (``megatron/core/
optimizer_param_scheduler.py``, ``load_state_dict``), which would roughly double the count every round. Each
optimizer group's scheduled values (``lr``, ``weight_decay``, a cyclic momentum: every key but ``params``) are
restored too, since a scheduler may write them only when it steps.
"""

import copy
from typing import Any, List, Optional

import torch


def _same(a: Any, b: Any) -> bool:
    """Whether two state dicts hold the same values (tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class RoundSchedule:
    """The LR-hold rule for one scheduler and its optimizer (module docstring).

    ``scheduler`` None (a framework run without one) makes both calls no-ops."""

    def __init__(self, scheduler: Optional[Any], optimizer: Optional[Any] = None) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer if optimizer is not None else getattr(scheduler, "optimizer", None)
        self._start: Optional[dict] = None  # the scheduler's state when the round started
        self._groups: List[dict] = []  # each optimizer group's values but its params, when the round started

    def start_round(self) -> None:
        """Remember where the schedule stands: call before the round's first phase."""
        if self.scheduler is None:
            return
        self._start = copy.deepcopy(self.scheduler.state_dict())
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        self._groups = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in groups]

    def start_phase(self) -> None:
        """Put the schedule back where the round started: call before each phase after the first.

        Raises:
            ValueError: the scheduler cannot be put back (its ``state_dict()`` differs from the round's start even
                after its attributes were set), naming its class: never a silently wrong schedule.
        """
        if self.scheduler is None or self._start is None:
            return
        self.scheduler.load_state_dict(copy.deepcopy(self._start))
        if not _same(self.scheduler.state_dict(), self._start):
            # a relative loader (Megatron-Core's adds the loaded step count to the current one): its state_dict
            # keys are its attributes, set them as they were
            for key, value in self._start.items():
                if hasattr(self.scheduler, key):
                    setattr(self.scheduler, key, copy.deepcopy(value))
            if not _same(self.scheduler.state_dict(), self._start):
                raise ValueError(
                    f"{type(self.scheduler).__name__}: the Lopti round cannot put this LR scheduler back where the "
                    "round started (its load_state_dict does not restore its state_dict, nor do its attributes)"
                )
        if self.optimizer is not None:
            for group, values in zip(self.optimizer.param_groups, self._groups):
                group.update(copy.deepcopy(values))

    def state_dict(self) -> dict:
        """Where the running round started (None before the first round): for a checkpoint saved mid-round."""
        return {"start": copy.deepcopy(self._start), "groups": copy.deepcopy(self._groups)}

    def load_state_dict(self, state: dict) -> None:
        """Take a round's starting point from :meth:`state_dict`: the next :meth:`start_phase` puts it back."""
        self._start = copy.deepcopy(state["start"])
        self._groups = copy.deepcopy(state["groups"])
