"""Reward files in the local trainer: loaded as OpenRLHF loads them, queries built as its executor builds them,
every return checked."""

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

from openrlhf_lopti.demo.tiny_model import build_tiny_model
from openrlhf_lopti.errors import UserError
from openrlhf_lopti.local.reward import RewardFile, batch_means, queries_of
from openrlhf_lopti.local.rollout import generate_rollouts

RECORDER = '''
SEEN = []

def reward_func(queries, prompts, labels):
    SEEN.append((list(queries), list(prompts), list(labels)))
    return {"rewards": [float(len(q)) for q in queries]}
'''


def reward_file(tmp_path, body, name="r.py"):
    path = tmp_path / name
    path.write_text(body)
    return RewardFile(str(path))


def test_queries_are_the_ones_openrlhfs_executor_hands_to_reward_func(tmp_path):
    """Our rollout's response ids given to OpenRLHF's SingleTurnAgentExecutor as vLLM's output: the query the
    real executor passes to reward_func is the one queries_of builds."""
    agent = pytest.importorskip("openrlhf.utils.agent")
    model, tok = build_tiny_model(32, 1, 2, 256, 300, seed=0)
    tok.padding_side = "left"
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
               for c in ("1+1?", "Is Alice a knight?")]  # fmt: skip
    torch.manual_seed(0)
    rollout = generate_rollouts(model, tok, prompts, 2, 6, temperature=1.0)
    # a random model rarely stops: end row 0's response at its 3rd token with the eos, padded after it, as
    # generate_rollouts lays out a response that stopped
    p = rollout.prompt_len
    rollout.sequences[0, p + 2], rollout.sequences[0, p + 3 :] = tok.eos_token_id, tok.pad_token_id
    rollout.action_mask[0, 3:], rollout.attention_mask[0, p + 3 :] = False, 0
    ours = queries_of(rollout.sequences, rollout.attention_mask, tok)

    (tmp_path / "rec.py").write_text(RECORDER)
    executor = agent.SingleTurnAgentExecutor(remote_rm_url=str(tmp_path / "rec.py"))
    params = SimpleNamespace(max_tokens=100, logprobs=None)
    for row, query in enumerate(ours):
        response_ids = rollout.sequences[row, rollout.prompt_len :][rollout.action_mask[row]].tolist()
        engine = SimpleNamespace(generate=None)

        async def generate(prompt_token_ids, sampling, multi_modal_data=None, ids=response_ids):
            return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason="stop", logprobs=None)])

        engine.generate = generate
        out = asyncio.run(executor.execute(prompts[row // 2], "L", params, 10_000, tok, engine))
        assert out["reward"] == [float(len(query))]
    seen = executor.reward_func.__globals__["SEEN"]
    assert [s[0][0] for s in seen] == ours  # the very strings, special tokens and eos included
    assert any(q.endswith("<|im_end|>") for q in ours)


def test_a_dict_or_a_tensor_with_scores_and_extra_logs(tmp_path):
    full = reward_file(tmp_path, '''
import torch
def reward_func(queries, prompts, labels):
    r = torch.tensor([float(q == l) for q, l in zip(queries, labels)])
    return {"rewards": r * 2 - 1, "scores": r, "extra_logs": {"len": [len(q) for q in queries], "batch": 7}}
''')
    out = full(["a", "b", "c"], ["p"] * 3, ["a", "x", "c"], "step 1")
    assert out.rewards.tolist() == [1.0, -1.0, 1.0] and out.scores.tolist() == [1.0, 0.0, 1.0]
    assert out.extra["len"].tolist() == [1.0, 1.0, 1.0] and out.extra["batch"].tolist() == [7.0]
    expected = {"reward": 1 / 3, "accuracy": 2 / 3, "reward/len": 1.0, "reward/batch": 7.0}
    assert batch_means(out) == pytest.approx(expected)
    bare = reward_file(tmp_path, "import torch\ndef reward_func(q, p, l):\n    return torch.ones(len(q))\n", "t.py")
    out = bare(["a", "b"], ["p"] * 2, ["l"] * 2, "step 1")
    assert out.rewards.tolist() == [1.0, 1.0] and out.scores is None and out.extra == {}


@pytest.mark.parametrize(
    "body, message",
    [
        ("def reward_func(q, p, l):\n    raise KeyError('answer')\n",
         "reward_func raised KeyError: 'answer' (step 3, 2 responses)"),
        ("def reward_func(q, p, l):\n    return [1.0]\n", "reward_func's return has 1 values for 2 responses (step 3)"),
        ("def reward_func(q, p, l):\n    return {'rewards': [1.0, float('nan')]}\n",
         "reward_func 'rewards'[1] is nan (step 3); rewards must be finite numbers"),
        ("def reward_func(q, p, l):\n    return {'rewards': [1.0, 'good']}\n",
         "reward_func 'rewards'[1] is 'good', not a number (step 3)"),
        ("def reward_func(q, p, l):\n    return {'score': [1.0, 0.0]}\n",
         "reward_func returned a dict without 'rewards' (keys: ['score']) (step 3)"),
        ("def reward_func(q, p, l):\n    return 'fine'\n",
         "reward_func's return must be a tensor or list of 2 numbers, got str (step 3)"),
        ("def reward_func(q, p, l):\n    return {'rewards': [0, 1], 'extra_logs': {'f': [1, 2, 3]}}\n",
         "reward_func 'extra_logs'['f'] has 3 values for 2 responses (step 3)"),
    ],
)  # fmt: skip
def test_bad_returns_name_the_file_the_step_and_the_problem(tmp_path, body, message):
    reward = reward_file(tmp_path, body)
    with pytest.raises(UserError) as e:
        reward(["a", "b"], ["p", "p"], ["l", "l"], "step 3")
    assert str(e.value) == f"--reward-file {tmp_path / 'r.py'}: {message}"


def test_files_that_cannot_be_reward_files(tmp_path):
    with pytest.raises(UserError, match=r"r.py: defines no function reward_func\(queries, prompts, labels\)"):
        reward_file(tmp_path, "def reward(queries, prompts, labels):\n    return [0.0]\n")
    with pytest.raises(UserError, match="r.py: importing it raised ModuleNotFoundError: No module named 'nope'"):
        reward_file(tmp_path, "import nope\n")
    with pytest.raises(UserError, match="missing.py: no such file"):
        RewardFile(str(tmp_path / "missing.py"))


def test_the_packages_reward_files_load_and_score(tmp_path):
    from openrlhf_lopti.tasks import kk, reward_kk, reward_math

    math_reward = RewardFile(reward_math.__file__)
    out = math_reward(["Q? \\boxed{4}", "Q? 4"], ["Q?", "Q?"], ["4", "4"], "step 1")
    assert out.rewards.tolist() == [1.0, 0.0] and out.scores.tolist() == [1.0, 0.0]
    p = kk.generate(3, 0)
    right = f"<think>.</think><answer>{p['solution_text_format']}</answer>"
    out = RewardFile(reward_kk.__file__)(["P" + right], ["P"], [p["solution_text_format"]], "step 1")
    assert out.rewards.tolist() == [kk.reward(right, p["solution_text_format"])] == [3.0]
    assert math.isclose(batch_means(out)["reward/accuracy"], 1.0)


def test_a_reward_file_that_calls_sys_exit_is_a_user_error(tmp_path):
    """SystemExit passed `except Exception`: `train` exited 3 with no message."""
    with pytest.raises(UserError, match=r"r.py: importing it raised SystemExit: 3$"):
        reward_file(tmp_path, "import sys\nsys.exit(3)\n")
    reward = reward_file(tmp_path, "import sys\ndef reward_func(queries, prompts, labels):\n    sys.exit(3)\n")
    with pytest.raises(UserError) as e:
        reward(["a"], ["p"], ["l"], "step 2")
    assert str(e.value) == f"--reward-file {tmp_path / 'r.py'}: reward_func raised SystemExit: 3 (step 2, 1 responses)"
