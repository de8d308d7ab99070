"""Held-out evaluation: K&K accuracy with the paper's rule (greedy, or k samples), or any prompts scored by a reward
file."""

import torch

from .reward import RewardFile, RewardOutput, batch_means, queries_of
from .rollout import generate_rollouts
from .task import score


@torch.no_grad()
def kk_eval(
    model,
    tokenizer,
    records: list,
    prompts: list,
    max_new_tokens: int,
    batch_size: int = 256,
    n_samples: int = 1,
    temperature: float = 1.0,
) -> dict:
    """K&K records scored by the paper's rule: one greedy response each (``n_samples == 1``), else ``n_samples``
    sampled at ``temperature`` (as :func:`reward_eval`). Returns ``accuracy`` (fraction of responses with every
    role right: avg@k for k samples), ``format_rate`` and ``reward`` (mean of the paper's reward, in [-3, 3])."""
    rewards, correct, formats = [], [], []
    per_batch = max(1, batch_size // n_samples)
    for start in range(0, len(records), per_batch):
        chunk = slice(start, start + per_batch)
        rollout = generate_rollouts(model, tokenizer, prompts[chunk], n_samples, max_new_tokens, temperature,
                                    greedy=n_samples == 1)  # fmt: skip
        for text, record in zip(rollout.responses, [r for r in records[chunk] for _ in range(n_samples)]):
            r, c, f = score(text, record)
            rewards.append(r)
            correct.append(c)
            formats.append(f)
    n = max(len(rewards), 1)
    return {"accuracy": sum(correct) / n, "format_rate": sum(formats) / n, "reward": sum(rewards) / n}


@torch.no_grad()
def reward_eval(
    model,
    tokenizer,
    prompts: list,
    labels: list,
    datasources: list,
    reward: RewardFile,
    max_new_tokens: int,
    n_samples: int = 1,
    temperature: float = 1.0,
    batch_size: int = 256,
) -> dict:
    """Responses to held-out prompts scored by ``reward`` (greedy for ``n_samples == 1``, else sampled).

    Returns:
        ``reward`` (mean), ``accuracy`` (mean of the reward file's ``scores``, when it gives them: with 0/1
        scores the fraction right, avg@k for k samples), ``reward/<name>`` per ``extra_logs`` entry, and
        with several datasources ``accuracy@<datasource>`` (else ``reward@<datasource>``) per group.
    """
    parts, groups = [], []
    per_batch = max(1, batch_size // n_samples)
    for start in range(0, len(prompts), per_batch):
        chunk = slice(start, start + per_batch)
        rollout = generate_rollouts(model, tokenizer, prompts[chunk], n_samples, max_new_tokens, temperature,
                                    greedy=n_samples == 1)  # fmt: skip
        repeat = lambda xs: [x for x in xs for _ in range(n_samples)]  # noqa: E731
        queries = queries_of(rollout.sequences, rollout.attention_mask, tokenizer)
        parts.append(reward(queries, repeat(prompts[chunk]), repeat(labels[chunk]), "held-out evaluation"))
        groups += repeat([str(d) for d in datasources[chunk]])
    rewards = torch.cat([p.rewards for p in parts])
    scores = None if any(p.scores is None for p in parts) else torch.cat([p.scores for p in parts])
    # an extra_logs entry per response is averaged over all; a batch-level one over the batches
    extra = {k: torch.cat([p.extra[k] for p in parts if k in p.extra]) for k in parts[0].extra}
    metrics = batch_means(RewardOutput(rewards, scores, extra))
    names = sorted(set(groups))
    if len(names) > 1:
        values, key = (scores, "accuracy") if scores is not None else (rewards, "reward")
        for name in names:
            rows = torch.tensor([g == name for g in groups])
            metrics[f"{key}@{name}"] = float(values[rows].mean())
    return metrics
