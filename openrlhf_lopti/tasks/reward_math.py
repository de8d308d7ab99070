r"""OpenRLHF reward file for math: pass its path to `--reward.remote_url`.

    --reward.remote_url openrlhf_lopti/tasks/reward_math.py
    --data.prompt_dataset math/train.jsonl --data.input_key prompt --data.label_key label
    --data.apply_chat_template

OpenRLHF 0.11.2 loads this file with importlib (module name "reward_func") and calls
`reward_func(queries, prompts, labels)` per response, where each query is the decoded prompt + response
(special tokens kept) and each label is the ground-truth final answer (a string, e.g. "\frac{1}{2}").

Returned, one value per query:
- rewards and scores: 1.0 when the response's last \boxed{} is equivalent to the label, else 0.0
  (the paper's binary math reward);
- extra_logs: format_reward (1.0 when a \boxed{} answer was found) and answer_reward (= rewards).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

try:
    from openrlhf_lopti.tasks import math as math_task
    from openrlhf_lopti.tasks import response_from_query
except ImportError:  # loaded by path from a checkout where the package is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from openrlhf_lopti.tasks import math as math_task
    from openrlhf_lopti.tasks import response_from_query


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    r"""Binary reward of each (prompt + response) query against its ground-truth answer label."""
    boxed, correct = [], []
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        pred = math_task.last_boxed(response_from_query(query, prompt))
        boxed.append(float(pred is not None))
        correct.append(float(math_task.is_equiv(pred, str(label))))
    answer_reward = torch.tensor(correct, dtype=torch.float32)
    return {
        "rewards": answer_reward,
        "scores": answer_reward.clone(),
        "extra_logs": {"format_reward": torch.tensor(boxed, dtype=torch.float32), "answer_reward": answer_reward},
    }
