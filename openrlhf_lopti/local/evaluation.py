"""Greedy evaluation of a model on K&K puzzles: accuracy, format rate and mean reward."""

import torch

from .rollout import generate_rollouts
from .task import score


@torch.no_grad()
def greedy_eval(model, tokenizer, records: list, prompts: list, max_new_tokens: int, batch_size: int = 256) -> dict:
    """One greedy response per record; returns ``accuracy`` (fraction with every role right),
    ``format_rate`` and ``reward`` (mean of the paper's reward, in [-3, 3])."""
    rewards, correct, formats = [], [], []
    for start in range(0, len(records), batch_size):
        chunk = slice(start, start + batch_size)
        rollout = generate_rollouts(model, tokenizer, prompts[chunk], 1, max_new_tokens, greedy=True)
        for text, record in zip(rollout.responses, records[chunk]):
            r, c, f = score(text, record)
            rewards.append(r)
            correct.append(c)
            formats.append(f)
    n = max(len(records), 1)
    return {"accuracy": sum(correct) / n, "format_rate": sum(formats) / n, "reward": sum(rewards) / n}
