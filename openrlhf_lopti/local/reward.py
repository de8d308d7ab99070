"""An OpenRLHF reward file in the local trainer: ``reward_func(queries, prompts, labels)`` from any ``.py`` file.

OpenRLHF 0.11.2 (``openrlhf/utils/agent.py``, ``SingleTurnAgentExecutor``) loads the file given as
``--reward.remote_url`` with ``importlib`` under the module name ``reward_func`` and calls
``reward_func(queries, prompts, labels)``, where a query is the prompt and response token ids decoded
together with special tokens kept, the prompt is the prompt string and the label is the dataset's label
field. It reads ``rewards``, ``scores`` (default: the rewards) and ``extra_logs`` from the returned dict.
Here the same file is loaded the same way and called once per step on the whole batch (OpenRLHF calls it
once per response, with lists of length 1), with queries built the same way. A function written for
OpenRLHF returns a dict; a plain tensor / list of rewards is accepted here too.

Every return is checked: one finite number per response for ``rewards`` and ``scores``, and for each
``extra_logs`` entry one number per response or a single number. A failure names the file, the step and
what was wrong (:class:`~openrlhf_lopti.errors.UserError`).
"""

import importlib.util
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from openrlhf_lopti.errors import UserError


@dataclass
class RewardOutput:
    """What a reward function gave for ``B`` responses.

    Fields:
        rewards: ``[B]`` float32, what the advantages are computed from.
        scores: ``[B]`` float32 or None; OpenRLHF's "score" (accuracy: 1 right, 0 wrong).
        extra: name -> ``[B]`` float32 (or a one-element tensor for a batch-level value).
    """

    rewards: torch.Tensor
    scores: Optional[torch.Tensor]
    extra: dict = field(default_factory=dict)


class RewardFile:
    """``reward_func`` of a Python file, called and checked as the local trainer needs it."""

    def __init__(self, path: str, flag: str = "--reward-file"):
        self.path, self.flag = str(path), flag
        file = Path(path)
        if not file.is_file():
            raise UserError(f"{flag} {path}: no such file; pass a .py file that defines reward_func(queries, "
                            "prompts, labels), e.g. the installed tasks/reward_math.py")  # fmt: skip
        # As OpenRLHF loads it: module name "reward_func", executed from its path.
        spec = importlib.util.spec_from_file_location("reward_func", file)
        if spec is None or spec.loader is None:
            raise UserError(f"{flag} {path}: not a Python file importlib can load (name it *.py)")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:  # the user's code: any exception (sys.exit too) is the file's problem
            raise UserError(f"{flag} {path}: importing it raised {type(e).__name__}: {e}") from e
        func = getattr(module, "reward_func", None)
        if not callable(func):
            raise UserError(f"{flag} {path}: defines no function reward_func(queries, prompts, labels) (the "
                            "name OpenRLHF calls)")  # fmt: skip
        self.func = func

    def __call__(self, queries: list, prompts: list, labels: list, when: str) -> RewardOutput:
        """Call ``reward_func`` on ``B`` responses and check what it returns.

        Args:
            queries: ``B`` decoded prompt + response strings (special tokens kept).
            prompts: ``B`` prompt strings.
            labels: ``B`` labels.
            when: where in the run this is (``"step 5"``), for messages.
        """
        n = len(queries)
        where = f"{self.flag} {self.path}: reward_func"
        try:
            out = self.func(list(queries), list(prompts), list(labels))
        except (Exception, SystemExit) as e:  # the user's code; a sys.exit() there would end train without a word
            raise UserError(f"{where} raised {type(e).__name__}: {e} ({when}, {n} responses)") from e
        if isinstance(out, dict):
            if "rewards" not in out:
                raise UserError(f"{where} returned a dict without 'rewards' (keys: {sorted(out)}) ({when})")
            rewards = _numbers(out["rewards"], n, f"{where} 'rewards'", when)
            scores = None if out.get("scores") is None else _numbers(out["scores"], n, f"{where} 'scores'", when)
            extra_logs = out.get("extra_logs") or {}
            if not isinstance(extra_logs, dict):
                raise UserError(f"{where} 'extra_logs' must be a dict of name -> values, got "
                                f"{type(extra_logs).__name__} ({when})")  # fmt: skip
            extra = {
                str(k): _numbers(v, n, f"{where} 'extra_logs'[{k!r}]", when, allow_scalar=True)
                for k, v in extra_logs.items()
            }
            return RewardOutput(rewards, scores, extra)
        return RewardOutput(_numbers(out, n, f"{where}'s return", when), None)


def _numbers(value, n: int, what: str, when: str, allow_scalar: bool = False) -> torch.Tensor:
    """``value`` (tensor, list, tuple, number) as a float32 ``[n]`` tensor, or a UserError saying why not."""
    if isinstance(value, numbers.Number) and not isinstance(value, bool) and allow_scalar:
        value = [value]
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_complex():
            raise UserError(f"{what} must hold real numbers, got a {value.dtype} tensor ({when})")
        flat = value.detach().float().cpu().flatten()
    elif isinstance(value, (list, tuple)):
        bad = [i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, numbers.Real)]
        if bad:
            raise UserError(f"{what}[{bad[0]}] is {value[bad[0]]!r}, not a number ({when})")
        flat = torch.tensor([float(v) for v in value], dtype=torch.float32)
    else:
        raise UserError(f"{what} must be a tensor or list of {n} numbers, got {type(value).__name__} ({when})")
    if flat.numel() != n and not (allow_scalar and flat.numel() == 1):
        raise UserError(f"{what} has {flat.numel()} values for {n} responses ({when})")
    bad = (~torch.isfinite(flat)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise UserError(f"{what}[{i}] is {float(flat[i])} ({when}); rewards must be finite numbers")
    return flat


def queries_of(sequences: torch.Tensor, attention_mask: torch.Tensor, tokenizer) -> list:
    """OpenRLHF's reward queries: each row's real prompt and response tokens (padding dropped), decoded
    together with special tokens kept, as ``SingleTurnAgentExecutor`` decodes ``observation_tokens``.

    Args:
        sequences: ``[B, L]`` token ids (left-padded prompt, then the response).
        attention_mask: ``[B, L]`` 1 on real tokens (the response up to and including its eos).
    """
    keep = attention_mask.bool().cpu()
    ids = sequences.cpu()
    return [tokenizer.decode(ids[b][keep[b]].tolist(), skip_special_tokens=False) for b in range(ids.shape[0])]


def batch_means(out: RewardOutput) -> dict:
    """``{"reward", "accuracy" (mean score, when given), "reward/<extra>"}`` over a batch, as floats."""
    metrics = {"reward": float(out.rewards.mean())}
    if out.scores is not None:
        metrics["accuracy"] = float(out.scores.mean())
    metrics.update({f"reward/{k}": float(v.mean()) for k, v in out.extra.items()})
    return metrics


def check_once(reward: RewardFile, prompts: list, labels: list, flag: str) -> None:
    """Call ``reward`` before training on ``prompts`` with empty responses, so a reward file that cannot
    handle the dataset's labels (or returns the wrong thing) fails before the first step, not after it."""
    reward(list(prompts), list(prompts), list(labels), f"start-up check on the first {len(prompts)} rows of "
           f"{flag} with empty responses")  # fmt: skip
