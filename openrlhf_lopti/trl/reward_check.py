"""A NaN or infinite reward fails the generation in one line naming its reward function, on every process at once.

TRL turns a reward function's ``None`` into NaN (``trl/trainer/grpo_trainer.py``, ``_calculate_rewards``: "not
applicable to this completion", skipped by the ``nansum`` over functions) and trains on whatever else comes
back: a NaN or inf a function returns gives NaN advantages, whose tokens then train with a loss of 0, silently.
Here each plain reward function is wrapped so that where it returned ``None`` is recorded; after TRL gathered
the rewards of every process, any value that is not finite and not a ``None`` is refused. The check runs on the
gathered rewards, so every process raises together (a process raising alone would leave the others waiting in
the next collective). Reward models (``nn.Module``) have no ``None``: a NaN from one is refused too.
"""

import functools
from typing import Callable, List, Sequence

import torch
from trl.trainer.utils import is_async_callable


class RewardCheck:
    """Wraps ``reward_funcs`` (``funcs`` is the list to hand TRL) and checks the rewards they gave."""

    def __init__(self, reward_funcs: Sequence) -> None:
        self._nones: dict = {}  # function index -> [n] bool: where this process's last call returned None
        self.funcs = [self._recording(j, func) for j, func in enumerate(reward_funcs)]

    def _recording(self, j: int, func):
        if isinstance(func, torch.nn.Module):
            return func

        def record(out):
            self._nones[j] = torch.tensor([r is None for r in out], dtype=torch.bool)
            return out

        if is_async_callable(func):

            async def wrapped(*args, **kwargs):
                return record(await func(*args, **kwargs))

        else:

            def wrapped(*args, **kwargs):
                return record(func(*args, **kwargs))

        try:
            functools.update_wrapper(wrapped, func)
        except AttributeError:  # a callable object without __name__: TRL named it already
            pass
        return wrapped

    def check(self, rewards: torch.Tensor, n: int, names: List[str], gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Raise ``ValueError`` (one line, on every process) if a reward in ``rewards`` is NaN or inf but no ``None``.

        Args:
            rewards: ``[N_all, F]`` TRL's rewards per completion of every process and per function (gathered).
            n: this process's completions (its rows of ``rewards``).
            names: TRL's ``reward_func_names``, ``F`` of them.
            gather: concatenates a ``[n, F]`` tensor over every process, in the order of ``rewards``' rows.
        """
        nones = torch.zeros(n, len(names), dtype=torch.bool)
        for j, mask in self._nones.items():
            if mask.numel() == n:  # another length: TRL has refused the call already
                nones[:, j] = mask
        self._nones = {}
        nones = gather(nones.to(rewards.device).to(torch.uint8)).bool()
        bad = ~torch.isfinite(rewards) & ~nones
        if bool(bad.any()):
            i, j = (int(k) for k in bad.nonzero()[0])
            raise ValueError(
                f"reward function {names[j]!r} returned {float(rewards[i, j])} for completion {i} of the generation "
                f"batch (over every process); rewards must be finite numbers (None: not applicable to this one)"
            )
