"""The OpenRLHF reward files, loaded and called the way openrlhf 0.11.2 does (utils/agent.py)."""

import asyncio
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import openrlhf_lopti.tasks as tasks
from openrlhf_lopti.tasks import kk

TASKS_DIR = Path(tasks.__file__).parent
KK_FILE = TASKS_DIR / "reward_kk.py"
MATH_FILE = TASKS_DIR / "reward_math.py"

PUZZLE = kk.generate(3, 0)
# What PromptDataset makes of our chat prompt with a ChatML template (Qwen2.5).
PROMPT = (
    f"<|im_start|>system\n{kk.SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{PUZZLE['quiz']}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
LABEL = PUZZLE["solution_text_format"]
RIGHT = f"<think>I checked every case.</think>\n<answer>\n{LABEL}\n</answer>"


def load(path):
    """Exactly openrlhf's SingleTurnAgentExecutor.__init__ loading of a reward file."""
    spec = importlib.util.spec_from_file_location("reward_func", str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward_func


def call(func, queries, prompts, labels):
    """openrlhf calls the function in a worker thread with lists of length 1."""
    return asyncio.run(asyncio.to_thread(func, queries, prompts, labels))


def test_response_from_query():
    rq = tasks.response_from_query
    assert rq(PROMPT + RIGHT + "<|im_end|>", PROMPT) == RIGHT
    assert rq(PROMPT + RIGHT + "<|im_end|>\n<|endoftext|>\n", PROMPT) == RIGHT
    assert rq("<s>" + PROMPT + RIGHT + "</s>", PROMPT) == RIGHT  # BOS added by decode
    # prompt not found (tokenizer did not round-trip): text after the last assistant marker
    assert rq(PROMPT + RIGHT, PROMPT.replace("<|im_end|>\n", "<|im_end|>")) == RIGHT
    assert rq("Question?\nAssistant: " + RIGHT, "Question!") == " " + RIGHT
    assert rq(RIGHT, "") == RIGHT
    assert tasks.strip_special_tokens("a<|im_end|>b") == "a<|im_end|>b"  # only trailing tokens go


@pytest.mark.parametrize(
    "response, reward, fmt, ans",
    [
        (RIGHT, 3.0, 1.0, 2.0),
        (RIGHT.replace("<think>", ""), -3.0, -1.0, -2.0),
        ("<think>hm</think><answer>nobody</answer>", -1.0, 1.0, -2.0),
    ],
)
def test_kk_reward_file(response, reward, fmt, ans):
    out = call(load(KK_FILE), [PROMPT + response + "<|im_end|>"], [PROMPT], [LABEL])
    assert set(out) == {"rewards", "scores", "extra_logs"}
    assert out["rewards"].shape == (1,) and out["rewards"].item() == reward
    assert out["scores"].item() == float(ans == 2.0)  # dynamic filtering wants scores in [0, 1]
    logs = out["extra_logs"]
    assert logs["format_reward"].item() == fmt and logs["answer_reward"].item() == ans
    assert logs["accuracy"].item() == float(ans == 2.0)


def test_kk_reward_file_ignores_the_prompt_tags():
    # The system prompt itself contains <think>/<answer>: scoring the whole query would fail the format.
    out = call(load(KK_FILE), [PROMPT + RIGHT], [PROMPT], [LABEL])
    assert out["rewards"].item() == 3.0


def test_math_reward_file():
    prompt = "<|im_start|>user\nWhat is 1/2 + 0?<|im_end|>\n<|im_start|>assistant\n"
    f = load(MATH_FILE)
    queries = [prompt + "It is \\boxed{\\frac{1}{2}}.<|im_end|>", prompt + "\\boxed{2}<|endoftext|>", prompt + "0.5"]
    out = f(queries, [prompt] * 3, ["0.5"] * 3)  # a batch works too
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0]
    assert out["scores"].tolist() == [1.0, 0.0, 0.0]
    assert out["extra_logs"]["format_reward"].tolist() == [1.0, 1.0, 0.0]
    assert out["extra_logs"]["answer_reward"].tolist() == [1.0, 0.0, 0.0]
    # the prompt's own \boxed{} (few-shot examples) is never read as the answer
    boxed_prompt = "Example: \\boxed{0.5}\nAssistant:"
    assert call(f, [boxed_prompt + " no idea"], [boxed_prompt], ["0.5"])["rewards"].item() == 0.0


def test_reward_files_outputs_survive_openrlhf_postprocessing():
    """samples_generator does torch.tensor([reward]) and value.flatten()[0].item() on extra logs."""
    for path, label, resp in ((KK_FILE, LABEL, RIGHT), (MATH_FILE, "2", "\\boxed{2}")):
        out = call(load(path), [PROMPT + resp], [PROMPT], [label])
        assert torch.tensor([out["rewards"]]).shape == (1,)
        assert torch.tensor([out["scores"]]).shape == (1,)
        assert all(isinstance(v.flatten()[0].item(), float) for v in out["extra_logs"].values())


class _CharTokenizer:
    """A tokenizer whose tokens are characters, enough for SingleTurnAgentExecutor.execute."""

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        return {"input_ids": torch.tensor([[ord(c) for c in text]])}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class _FakeEngine:
    def __init__(self, response):
        self.response = response

    async def generate(self, prompt_token_ids, params, multi_modal_data=None):
        ids = [ord(c) for c in self.response]
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason="stop", logprobs=None)])


def test_reward_files_inside_openrlhf_single_turn_executor():
    agent = pytest.importorskip("openrlhf.utils.agent", reason="openrlhf not installed")
    params = SimpleNamespace(max_tokens=100_000, logprobs=None)
    cases = [
        (KK_FILE, PROMPT, LABEL, RIGHT + "<|im_end|>", 3.0, 1.0),
        (MATH_FILE, "Q: 1+1?\nAssistant:", "2", " \\boxed{2}<|endoftext|>", 1.0, 1.0),
    ]
    for path, prompt, label, response, reward, score in cases:
        executor = agent.SingleTurnAgentExecutor(remote_rm_url=str(path))
        out = asyncio.run(
            executor.execute(prompt, label, params, 200_000, _CharTokenizer(), _FakeEngine(response))
        )
        assert out["reward"] is not None, "openrlhf swallowed an exception from the reward file"
        assert out["reward"].item() == reward and out["scores"].item() == score
        assert set(out["extra_logs"]) >= {"format_reward", "answer_reward"}
