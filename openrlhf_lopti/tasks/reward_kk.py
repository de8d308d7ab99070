"""OpenRLHF reward file for Knights and Knaves: pass its path to `--reward.remote_url`.

    --reward.remote_url openrlhf_lopti/tasks/reward_kk.py
    --data.prompt_dataset kk/train.jsonl --data.input_key prompt --data.label_key label
    --data.apply_chat_template --eval.dataset kk/test.jsonl

OpenRLHF 0.11.2 loads this file with importlib (module name "reward_func") and calls
`reward_func(queries, prompts, labels)` per response, where each query is the decoded prompt + response
(special tokens kept) and each label is the puzzle's `solution_text_format` (what `openrlhf-lopti data
kk` writes as `label`).

Returned, one value per query:
- rewards: the paper's rule, format (+1/-1) + answer (+2/-1.5/-2), in [-3, 3]; this is what GRPO uses;
- scores: 1.0 when every role is right with a valid format, else 0.0; OpenRLHF's dynamic filtering
  (`--algo.dynamic_filtering_range`, default (0, 1)) reads these, so all-solved and all-failed groups
  are the ones it drops;
- extra_logs: format_reward, answer_reward, accuracy (logged by OpenRLHF as means).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

try:
    from openrlhf_lopti.tasks import kk, response_from_query
except ImportError:  # loaded by path from a checkout where the package is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from openrlhf_lopti.tasks import kk, response_from_query


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """Paper reward of each (prompt + response) query against its solution_text_format label."""
    fmt, ans = [], []
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        f, a = kk.reward_parts(response_from_query(query, prompt), label)
        fmt.append(f)
        ans.append(a)
    format_reward = torch.tensor(fmt, dtype=torch.float32)
    answer_reward = torch.tensor(ans, dtype=torch.float32)
    accuracy = (answer_reward == 2.0).float()
    return {
        "rewards": format_reward + answer_reward,
        "scores": accuracy,
        "extra_logs": {"format_reward": format_reward, "answer_reward": answer_reward, "accuracy": accuracy},
    }
