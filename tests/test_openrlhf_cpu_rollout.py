"""The ``--cpu`` rollout engine and weight-sync group, against Hugging Face ``generate`` / a teacher-forced forward
and upstream's own ``stateless_init_process_group`` and agent executor."""

import asyncio
import multiprocessing

import pytest
import torch

from openrlhf_lopti.openrlhf.cpu.stubs import SamplingParams, install_cpu_stubs

install_cpu_stubs()

from openrlhf_lopti.openrlhf.cpu.rollout import CPURolloutActor  # noqa: E402

from .ds_ranks import free_port  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from openrlhf_lopti.local.tiny_model import build_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    model, tokenizer = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, vocab_size=300, max_positions=128)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaky next-token distributions: greedy and sampling differ from uniform
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    return CPURolloutActor(str(model_dir), seed=0, dtype=torch.float32, max_model_len=128)


def generate(engine, prompts, params):
    """Requests sent together, as upstream's executors do (``asyncio.gather`` over samples and prompts)."""

    async def run():
        return await asyncio.gather(*(engine.generate(prompt, params) for prompt in prompts))

    return asyncio.run(run())


PROMPTS = [[5, 17, 33, 9], [40, 41], [7, 8, 9, 10, 11, 12]]


def hf_greedy(engine, prompt, max_new_tokens):
    out = engine.model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
        max_new_tokens=max_new_tokens, pad_token_id=engine.tokenizer.pad_token_id,
        eos_token_id=engine.tokenizer.eos_token_id,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_greedy_batch_equals_hugging_face_one_prompt_at_a_time(engine):
    outputs = generate(engine, PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        expected = hf_greedy(engine, prompt, 8)
        eos = engine.tokenizer.eos_token_id
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
        assert completion.token_ids == expected  # left padding in the batch changes nothing
        assert completion.finish_reason == ("stop" if expected[-1] == eos else "length")
        assert completion.text == engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert output.prompt_token_ids == prompt


def test_max_tokens_stop_token_ids_and_stop_strings(engine):
    prompt = PROMPTS[0]
    greedy = hf_greedy(engine, prompt, 6)
    (out,) = generate(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=3))
    assert out.outputs[0].token_ids == greedy[:3] and out.outputs[0].finish_reason == "length"
    # the first token not seen before in the greedy completion, as a stop token
    at = next((i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i]), 0)
    (out,) = generate(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[greedy[at]]))
    assert out.outputs[0].token_ids == greedy[: at + 1] and out.outputs[0].finish_reason == "stop"  # token kept
    text = engine.tokenizer.decode(greedy)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    (out,) = generate(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=6, stop=[stop]))
    assert out.outputs[0].finish_reason == "stop" and stop not in out.outputs[0].text
    assert text.startswith(out.outputs[0].text)


def test_top_k_one_samples_the_greedy_token(engine):
    outputs = generate(engine, PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=5))
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf_greedy(engine, prompt, 5)
        assert output.outputs[0].token_ids == expected[: len(output.outputs[0].token_ids)]


def test_logprobs_are_the_tempered_softmax_of_a_teacher_forced_forward(engine):
    temperature = 0.7
    outputs = generate(engine, PROMPTS, SamplingParams(temperature=temperature, max_tokens=6, logprobs=1))
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        tokens = completion.token_ids
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + tokens])).logits[0].float()
        expected = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None])
        got = torch.tensor([next(iter(entry.values())).logprob for entry in completion.logprobs])
        assert [list(entry) for entry in completion.logprobs] == [[t] for t in tokens]
        torch.testing.assert_close(got, expected[:, 0], rtol=1e-4, atol=1e-4)


def test_upstream_executor_scores_responses_with_the_reward_file(engine, tmp_path):
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    reward = tmp_path / "reward.py"
    reward.write_text(
        "import torch\n"
        "def reward_func(queries, prompts, labels):\n"
        "    return {'rewards': torch.tensor([float(len(q)) for q in queries]), 'scores': torch.tensor([1.0]),\n"
        "            'extra_logs': {'label_len': torch.tensor([float(len(labels[0]))])}}\n"
    )
    engine.executor = SingleTurnAgentExecutor(str(reward))

    async def run():
        return await engine.generate_responses(
            "Who is a knight?", "abc", SamplingParams(temperature=1.0, max_tokens=4), 64, engine.tokenizer, 3
        )

    responses = asyncio.run(run())
    assert len(responses) == 3
    for response in responses:
        query = engine.tokenizer.decode(response["observation_tokens"])
        assert float(response["reward"]) == len(query)
        assert float(response["extra_logs"]["label_len"]) == 3.0
        (start, end), = response["action_ranges"]
        assert 1 <= end - start <= 4


def _receive(port, shape, queue):
    from openrlhf_lopti.openrlhf.cpu.stubs import StatelessGlooGroup

    group = StatelessGlooGroup("127.0.0.1", port, 1, 2)
    tensor = torch.empty(shape, dtype=torch.bfloat16)
    group.broadcast(tensor, src=0)
    queue.put(tensor.float().tolist())


def test_upstream_stateless_group_broadcasts_over_gloo():
    """Upstream's own ``stateless_init_process_group`` (vLLM's NCCL group on GPU) on the stand-ins: gloo."""
    from openrlhf.utils.distributed_util import stateless_init_process_group

    port, shape = free_port(), (3, 5)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    receiver = ctx.Process(target=_receive, args=(port, shape, queue))
    receiver.start()
    group = stateless_init_process_group("127.0.0.1", port, 0, 2, torch.device("cpu"))
    sent = torch.randn(shape).to(torch.bfloat16)
    group.broadcast(sent, src=0, stream=None)
    received = queue.get(timeout=60)
    receiver.join(60)
    assert torch.equal(torch.tensor(received), sent.float())
