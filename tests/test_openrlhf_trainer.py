"""LoptiActorPPOTrainer and LoptiPolicyModelActor on CPU, against OpenRLHF 0.11.2's real classes and engine.

Real: openrlhf's ``Actor`` (around a tiny random Llama), ``Experience``, ``NaiveReplayBuffer``, upstream
``ActorPPOTrainer.ppo_train`` / ``training_step`` / ``PolicyLoss``, ``RemoteExperienceMaker``'s advantage
estimators, ``PolicyModelActor.init_model_from_pretrained``, and the DeepSpeed engine: the ``--cpu`` strategy
(``CPUDeepspeedStrategy``: DeepSpeed's CPU accelerator, torch AdamW, gloo) in a one-process gloo group, fp32
(``--ds.param_dtype fp32``) and ZeRO stage 0 unless a test says otherwise, so gradients stay readable in
``param.grad``. Several data-parallel ranks are tested in ``test_openrlhf_deepspeed.py``.
"""

import copy
from contextlib import nullcontext
import functools
import math
import os
import re
import time
from types import SimpleNamespace

import pytest
import ray
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs

install_cpu_stubs()  # before openrlhf's trainer modules: they import flash_attn / vllm at the top

import openrlhf.models.actor as openrlhf_actor  # noqa: E402
import openrlhf.trainer.ray.ppo_actor as ppo_actor  # noqa: E402
import openrlhf.utils.utils as openrlhf_utils  # noqa: E402
from openrlhf.models import Actor  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from openrlhf_lopti.algo import ar_weight, round_threshold  # noqa: E402
from openrlhf_lopti.cli.train_ppo_ray import parse_args  # noqa: E402
from openrlhf_lopti.openrlhf.actor import LoptiPolicyModelActor  # noqa: E402
from openrlhf_lopti.openrlhf.cpu.strategy import get_cpu_strategy  # noqa: E402
from openrlhf_lopti.openrlhf.fused import fused_log_probs  # noqa: E402
from openrlhf_lopti.openrlhf.trainer import LoptiActorPPOTrainer, merge_phase_status  # noqa: E402

from .numerics import Float64Shadow, assert_all_same_computation, scalars_same_computation  # noqa: E402

VOCAB, PROMPT, RESPONSE = 64, 5, 6
PROMPTS, SAMPLES = 2, 4  # 8 responses: 2 prompts x 4 samples (GRPO groups)
KL_CTL = 0.01
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def record_optimizer_steps(engine, trainer, record_grads: bool) -> list:
    """Wrap ``engine.step``: one dict per real optimizer step (an accumulation boundary) with the running Lopti
    phase, the gradients DeepSpeed steps with (if asked; ZeRO stage 0 keeps them in ``param.grad``), the
    parameters after the step and the learning rate it used."""
    steps, step = [], engine.step

    def recorded(*args, **kwargs):
        boundary = engine.is_gradient_accumulation_boundary()
        params = [p for p in engine.module.parameters() if p.requires_grad]
        grads = [p.grad.detach().clone() for p in params] if boundary and record_grads else None
        lr = trainer.actor_scheduler.optimizer.param_groups[0]["lr"]  # the LR this step uses
        out = step(*args, **kwargs)
        if boundary:
            params_after = [p.detach().clone() for p in params]
            phase = getattr(trainer, "lopti_phase", None)
            steps.append({"phase": phase, "grads": grads, "params": params_after, "lr": lr})
        return out

    engine.step = recorded
    return steps


@pytest.fixture(scope="module", autouse=True)
def gloo_world():
    """A one-process gloo group, as DeepSpeed's ``init_distributed`` finds it in a rank (from the environment)."""
    if dist.is_initialized():
        yield
        return
    from .ds_ranks import free_port

    saved = {key: os.environ.get(key) for key in DIST_ENV}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def cuda_calls_on_cpu(monkeypatch):
    """The CPU strategy makes this process's bare ``torch.cuda`` calls answer for the CPU (and lets upstream read
    "fp32"); registering the originals with monkeypatch restores them after each test."""
    for name in ("current_device", "synchronize", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    monkeypatch.setattr(openrlhf_utils, "convert_to_torch_dtype", openrlhf_utils.convert_to_torch_dtype)
    return monkeypatch


@pytest.fixture(scope="module")
def model_config():
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,  # not VOCAB: the fp32-copy spy looks for [..., VOCAB] tensors
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


@pytest.fixture(scope="module")
def base_state(model_config):
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config)
    model.lm_head.weight.data *= 4  # peaky next-token distributions: sampled tokens have both low and high p
    return copy.deepcopy(model.state_dict())


@pytest.fixture
def env(model_config, base_state, rollout, cuda_calls_on_cpu):
    """What every round needs: the tiny model's config and weights, the rollout, the CUDA-call patches."""
    return SimpleNamespace(config=model_config, state=base_state, rollout=rollout, monkeypatch=cuda_calls_on_cpu)


def make_actor(env, args) -> Actor:
    model = LlamaForCausalLM(env.config)
    model.load_state_dict(env.state)
    actor = Actor(model, temperature=args.rollout.temperature)
    actor.packing_samples = args.ds.packing_samples  # set by Actor.__init__ only when it loads a checkpoint path
    return actor


@pytest.fixture(scope="module")
def rollout(model_config, base_state):
    """8 responses sampled from the tiny model: left-padded prompts, right-padded responses, rewards."""
    torch.manual_seed(1)
    model = LlamaForCausalLM(model_config)
    model.load_state_dict(base_state)
    model.eval()
    batch = PROMPTS * SAMPLES
    sequences = torch.zeros(batch, PROMPT + RESPONSE, dtype=torch.long)
    attention_mask = torch.zeros(batch, PROMPT + RESPONSE, dtype=torch.long)
    prompts = [torch.randint(1, VOCAB, (int(torch.randint(3, PROMPT + 1, ()).item()),)) for _ in range(PROMPTS)]
    with torch.no_grad():
        for i in range(batch):
            prompt = prompts[i // SAMPLES]
            tokens = prompt.clone()
            length = int(torch.randint(3, RESPONSE + 1, ()).item())  # as if EOS came early
            for _ in range(length):
                probs = torch.softmax(model(tokens[None]).logits[0, -1].float(), -1)
                tokens = torch.cat([tokens, torch.multinomial(probs, 1)])
            sequences[i, PROMPT - len(prompt) : PROMPT + length] = tokens
            attention_mask[i, PROMPT - len(prompt) : PROMPT + length] = 1
    rewards = torch.randn(batch)
    return SimpleNamespace(sequences=sequences, attention_mask=attention_mask, rewards=rewards)


def make_experience(rollout, actor: Actor, ref_noise: float = 0.1) -> Experience:
    """OpenRLHF Experience: old log-probs from the actor itself, GRPO advantages, a reference policy."""
    action_mask = rollout.attention_mask[:, PROMPT:].bool()
    with torch.no_grad():
        old = actor(rollout.sequences, action_mask, rollout.attention_mask)
    gen = torch.Generator().manual_seed(2)
    ref = (old + ref_noise * torch.randn(old.shape, generator=gen)) * action_mask
    grouped = rollout.rewards.reshape(PROMPTS, SAMPLES)
    scores = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-9)).reshape(-1)
    advantages = scores[:, None] * action_mask
    return Experience(
        sequences=rollout.sequences.clone(),
        attention_mask=rollout.attention_mask.clone(),
        action_mask=action_mask,
        action_log_probs=old,
        base_action_log_probs=ref,
        advantages=advantages,
        returns=advantages.clone(),
        rewards=rollout.rewards.clone(),
        response_length=action_mask.sum(-1).float(),
        total_length=rollout.attention_mask.sum(-1).float(),
        info={"reward": rollout.rewards.clone()},
    )


def make_args(*flags: str):
    """Real parsed args (upstream's parser and post-processing + ours): 8 samples, micro-batches of 2."""
    base = [
        "--cpu", "--actor.model_name_or_path", "tiny", "--reward.remote_url", "reward.py",
        "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(SAMPLES),
        "--rollout.batch_size", str(PROMPTS), "--train.batch_size", "4", "--train.micro_batch_size", "2",
        "--actor.eps_clip_low_high", "0.2", "0.24", "--actor.fused_loss", "off", "--actor.adam.lr", "1e-3",
        "--actor.lr_scheduler", "constant", "--ds.param_dtype", "fp32", "--ds.zero_stage", "0",
    ]  # fmt: skip
    return parse_args(base + list(flags))


def make_trainer(env, cls, args, actor, gas=1, record_grads=False, ema=None):
    """``cls`` around ``actor`` on the real DeepSpeed engine with ``gas`` micro-batches per optimizer step;
    ``strategy.steps`` records each optimizer step (:func:`record_optimizer_steps`). ``ema``: an ``Actor`` to keep
    the moving average in (``--train.enable_ema``), prepared as upstream's ``PolicyModelActor`` prepares it."""
    strategy = get_cpu_strategy(args)
    strategy.train_batch_size = gas * args.train.micro_batch_size  # one rank
    strategy.setup_distributed()
    assert strategy.accumulated_gradient == gas
    config = dict(
        optim="adam", muon=vars(args.actor.muon), adam=vars(args.actor.adam), lr_scheduler=args.actor.lr_scheduler,
        lr_warmup_ratio=args.actor.lr_warmup_ratio, min_lr_ratio=args.actor.min_lr_ratio, max_norm=1.0,
        scheduler_steps=100,
    )  # fmt: skip
    actor, optimizer, scheduler = strategy.prepare((actor, config))
    if ema is not None:
        ema._offload = True
        ema = strategy.prepare(ema)
    trainer = cls(
        strategy, actor, ema, optimizer, scheduler, ema_beta=args.train.ema_beta,
        micro_train_batch_size=args.train.micro_batch_size, dataloader_pin_memory=False,
    )  # fmt: skip
    strategy.steps = record_optimizer_steps(actor.model, trainer, record_grads)
    return trainer, strategy


def train_round(env, cls, args, gas=1, record_grads=False, edit=None, samples=None, seed=3):
    """One ``ppo_train`` round on the rollout; ``edit(experience)`` may change the experience first; ``samples``
    keeps only the first that many samples in the replay buffer; ``seed``: the DataLoader's shuffle."""
    actor = make_actor(env, args)
    experience = make_experience(env.rollout, actor)
    if edit is not None:
        edit(experience)
    trainer, strategy = make_trainer(env, cls, args, actor, gas, record_grads)
    trainer.replay_buffer.append(experience)
    if samples is not None:
        del trainer.replay_buffer.items[samples:]
    torch.manual_seed(seed)  # the DataLoader's shuffle
    status = trainer.ppo_train(KL_CTL)
    return SimpleNamespace(trainer=trainer, strategy=strategy, status=status, actor=actor, experience=experience)


def rollout_probs(low_responses: int, low_p: float, high_p: float):
    """An ``edit`` for :func:`train_round`: rollout probability ``low_p`` on every token of the first
    ``low_responses`` responses, ``high_p`` on the others'."""

    def edit(experience):
        low = torch.arange(len(experience.sequences))[:, None] < low_responses
        p = torch.where(low, low_p, high_p).expand_as(experience.action_log_probs)
        experience.action_log_probs = torch.log(p) * experience.action_mask

    return edit


def params_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.actor.parameters(), b.actor.parameters()))


def upstream_lopti_round(env, flags, eta: float, alpha: float, edit=None, seed=3):
    """AR + Lopti written out in the test on upstream's own trainer: the independent reference of our trainer with
    ``--algo.lopti.denominator phase``. The phases are the response tokens with rollout probability p < eta, then
    the others; each is one pass of upstream's ``ppo_train`` on the experience with the phase as its action mask
    (so upstream's token-mean denominators count the phase's tokens) and advantages A * (alpha * p + 1 - alpha)
    on the phase, 0 elsewhere. The second pass starts from the weights and optimizer state the first left, and
    shuffles as the first did (the same micro-batches, in the same order)."""
    args = make_args(*flags, "--actor.fused_loss", "off")
    actor = make_actor(env, args)
    experience = make_experience(env.rollout, actor)
    if edit is not None:
        edit(experience)
    trainer, strategy = make_trainer(env, Upstream, args, actor, record_grads=True)
    p = experience.action_log_probs.exp()
    low = experience.action_mask & (p < eta)
    torch.manual_seed(seed)  # the DataLoader's shuffle, as train_round
    shuffle = torch.get_rng_state()
    statuses = []
    for phase in (low, experience.action_mask & ~low):
        torch.set_rng_state(shuffle)  # both passes draw the same order: the phases train the same micro-batches
        item = copy.copy(experience)
        item.action_mask = phase
        item.advantages = experience.advantages * (alpha * p + 1 - alpha) * phase
        trainer.replay_buffer.clear()
        trainer.replay_buffer.append(item)
        statuses.append(trainer.ppo_train(KL_CTL))
    return SimpleNamespace(strategy=strategy, statuses=statuses, actor=actor, experience=experience, low=low)


@pytest.fixture
def float64(monkeypatch):
    """Runs rounds in float64: ``with float64(): train_round(...)`` (:class:`tests.numerics.Float64Shadow`).

    Test-only widenings that let the same code take float64: DeepSpeed's CPU accelerator lists no float64 among
    the gradient dtypes it all-reduces (gloo reduces float64 as well), and the fused loss's torch backend is asked
    for float32/bf16/fp16 logits only (the reference's math is dtype-generic; the C++ and Triton kernels are not,
    so the float64 rounds use ``--actor.fused_loss torch`` or ``off``)."""
    import sys

    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    dtypes = accelerator.supported_dtypes
    monkeypatch.setattr(accelerator, "supported_dtypes", lambda: [*dtypes(), torch.float64])
    for name in ("fused_policy_loss", "fused_linear_policy_loss"):  # the [N, V] logits and the [N, H] hidden states
        module = sys.modules[f"openrlhf_lopti.ops.{name}"]
        monkeypatch.setattr(module, "LOGITS_DTYPES", (*module.LOGITS_DTYPES, torch.float64))
    return Float64Shadow


def inputs_of(run32, then=None):
    """An ``edit`` for the float64 round of a comparison: the fp32 round's rollout and reference log-probs and
    advantages (after its own edit), as float64, then ``then(experience)`` if given. Both rounds then start from the
    same numbers (the same tokens in each Lopti phase, the same clip decisions), so what differs between them is the
    rounding of the computation."""

    def edit(experience):
        for key in ("action_log_probs", "base_action_log_probs", "advantages", "returns"):
            setattr(experience, key, getattr(run32.experience, key).double())
        if then is not None:
            then(experience)

    return edit


def assert_same_update(ours, reference, ours64, reference64, steps) -> None:
    """The gradients of optimizer ``steps`` are the same computation in ``ours`` and ``reference`` (fp32 rounds) by the
    rule of :mod:`tests.numerics`: their float64 rounds agree to float64 rounding, and, for step 0 (taken at the
    round's starting weights, before any AdamW step), neither fp32 round is much less accurate than the other."""
    for i in steps:
        grads = [run.strategy.steps[i]["grads"] for run in (ours, reference, ours64, reference64)]
        assert_all_same_computation(f"gradients of optimizer step {i}", *grads, precision=i == 0)


def assert_first_step_of_each_phase_matches(ours, reference, ours64, reference64):
    """The gradients of the first optimizer step of each phase (4 steps each) equal the reference's."""
    assert [step["phase"] for step in ours.strategy.steps] == ["low"] * 4 + ["high"] * 4
    assert len(reference.strategy.steps) == len(reference64.strategy.steps) == 8
    assert_same_update(ours, reference, ours64, reference64, steps=(0, 4))


@pytest.fixture
def spy_upstream_step(monkeypatch):
    """Record what upstream's training_step receives (after our phase masking) and its forward's log-probs."""
    calls = []
    upstream = ppo_actor.ActorPPOTrainer.training_step

    def spy(self, experience, kl_ctl, step, loss_batch_info=None):
        forward = []
        handle = self.actor.register_forward_hook(lambda module, inputs, output: forward.append(output[0].detach()))
        try:
            status = upstream(self, experience, kl_ctl, step, loss_batch_info)
        finally:
            handle.remove()
        mask = experience.action_mask.bool()
        kept = experience.attention_mask.bool()
        calls.append(
            {
                "phase": getattr(self, "lopti_phase", None),
                "step": step,
                "mask": experience.action_mask.clone(),
                "response": experience.attention_mask[:, -experience.action_mask.shape[1] :].bool(),
                "advantages": experience.advantages.clone(),
                "old": experience.action_log_probs.clone(),
                # which responses the micro-batch holds: each row's tokens
                "samples": [tuple(row[row_kept].tolist()) for row, row_kept in zip(experience.sequences, kept)],
                "batch_num_tokens": float(loss_batch_info["batch_num_tokens"]),
                "global_batch_size": float(loss_batch_info["global_batch_size"]),
                # how far the step's own forward is from the rollout's log-probs on the phase's tokens
                "drift": (forward[0] - experience.action_log_probs).abs()[mask].max().item() if mask.any() else 0.0,
            }
        )
        return status

    monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "training_step", spy)
    return calls


# ---------------------------------------------------------------- Lopti phases
Lopti = LoptiActorPPOTrainer
Upstream = ppo_actor.ActorPPOTrainer


@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_phases_run_in_order_each_a_full_pass_with_its_optimizer_steps(order, env, spy_upstream_step):
    args = make_args("--algo.lopti.eta", "0.5", "--algo.lopti.order", order, "--train.max_epochs", "2")
    run = train_round(env, Lopti, args, gas=2)
    first, second = ("low", "high") if order == "low_first" else ("high", "low")
    # 8 samples / micro-batches of 2 = 4 micro-batches per epoch, 2 epochs, per phase; one step per 2 (gas)
    assert [call["phase"] for call in spy_upstream_step] == [first] * 8 + [second] * 8
    assert [step["phase"] for step in run.strategy.steps] == [first] * 4 + [second] * 4
    assert run.trainer.lopti_phase is None  # reset after the round


def test_both_phases_train_the_same_samples_in_the_same_micro_batches(env, spy_upstream_step):
    """7 responses in micro-batches of 2: upstream's pass (a shuffled DataLoader with drop_last) trains 3 micro-batches
    per epoch and leaves one response out. Each phase is such a pass; before, each drew its own order, so each left out
    its own response and some responses trained only their low or only their high tokens. Now the first phase trains
    upstream's order and the second replays it, epoch by epoch."""
    upstream = train_round(env, Upstream, make_args("--train.max_epochs", "2"), samples=7)
    assert len({sample for call in spy_upstream_step for sample in call["samples"]}) == 7  # distinct responses
    upstream_batches = [call["samples"] for call in spy_upstream_step]
    assert len(upstream_batches) == 6 and len(upstream.strategy.steps) == 6  # 3 micro-batches x 2 epochs
    spy_upstream_step.clear()
    run = train_round(env, Lopti, make_args("--algo.lopti.eta", "0.5", "--train.max_epochs", "2"), samples=7)
    assert run.status["lopti/low/tokens"] > 0 and run.status["lopti/high/tokens"] > 0
    batches = {name: [c["samples"] for c in spy_upstream_step if c["phase"] == name] for name in ("low", "high")}
    trained = {
        name: [{sample for batch in calls[e * 3 : e * 3 + 3] for sample in batch} for e in (0, 1)]
        for name, calls in batches.items()
    }
    assert trained["low"] == trained["high"]  # each epoch, the same 6 responses in both phases
    assert batches["low"] == batches["high"] == upstream_batches  # in the same micro-batches: upstream's


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64])  # int64: as upstream's samples generator makes it
@pytest.mark.parametrize("denominator", ["all", "phase"])
def test_phase_masks_advantages_and_denominators(denominator, mask_dtype, env, spy_upstream_step):
    args = make_args("--algo.lopti.eta", "0.5", "--algo.lopti.denominator", denominator)
    def mask_in_dtype(experience):
        experience.action_mask = experience.action_mask.to(mask_dtype)

    run = train_round(env, Lopti, args, edit=mask_in_dtype)
    original = make_experience(env.rollout, make_actor(env, args))
    seen_tokens = {"low": 0, "high": 0}
    for call in spy_upstream_step:
        assert call["mask"].dtype == mask_dtype  # the phase mask keeps the experience's mask dtype
        low = call["response"] & (call["old"].exp() < 0.5)
        expected = low if call["phase"] == "low" else call["response"] & ~low
        assert torch.equal(call["mask"].bool(), expected)
        assert torch.all(call["advantages"][~expected] == 0)  # the other phase's tokens: no policy gradient
        assert torch.all(call["advantages"][expected] != 0)
        # gas = 1: one micro-batch per window; "all" counts every response token, "phase" only the phase's
        count = (call["response"] if denominator == "all" else expected).sum().item()
        assert call["batch_num_tokens"] == max(count, 1)
        seen_tokens[call["phase"]] += expected.sum().item()
    response = original.action_mask
    low_total = (response & (original.action_log_probs.exp() < 0.5)).sum().item()
    assert seen_tokens == {"low": low_total, "high": response.sum().item() - low_total}
    assert 0 < low_total < response.sum().item()  # both phases are exercised
    # the rollout's old log-probs (PPO anchor, threshold) are never changed by the phases
    assert torch.equal(run.experience.action_log_probs, original.action_log_probs)


@pytest.mark.parametrize("denominator", ["all", "phase"])
def test_quantile_phases_train_exactly_the_tokens_below_the_rounds_threshold(denominator, env, spy_upstream_step):
    flags = ["--algo.lopti.quantile", "0.4", "--algo.lopti.denominator", denominator]
    run = train_round(env, Lopti, make_args(*flags))
    p, response = run.experience.action_log_probs.exp(), run.experience.action_mask
    threshold = torch.quantile(p[response].double(), 0.4).item()  # torch's own quantile, not ours
    assert run.status["lopti/threshold"] == pytest.approx(threshold, rel=1e-6)
    assert ((p < threshold) != (p < 0.9))[response].any()  # eta's phases would differ: the threshold must be used
    seen = {"low": 0, "high": 0}
    for call in spy_upstream_step:
        low = call["response"] & (call["old"].exp() < threshold)
        expected = low if call["phase"] == "low" else call["response"] & ~low
        assert torch.equal(call["mask"].bool(), expected), call["phase"]
        assert torch.all(call["advantages"][~expected] == 0)
        seen[call["phase"]] += int(expected.sum())
    low_total = int((response & (p < threshold)).sum())
    assert seen == {"low": low_total, "high": int(response.sum()) - low_total} and low_total > 0


@pytest.mark.parametrize("fused", ["off", "torch"])
@pytest.mark.parametrize("denominator", ["all", "phase"])
def test_eta_putting_every_token_in_one_phase_is_exactly_the_baseline(fused, denominator, env, capsys):
    common = ["--actor.fused_loss", fused, "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
    baseline = train_round(env, Lopti, make_args(*common), gas=2)
    assert (baseline.experience.action_log_probs.exp()[baseline.experience.action_mask] < 1).all()
    # all "low" / all "high"; the empty phase second, then first
    for eta, order in [("1.0", "low_first"), ("1e-30", "high_first"), ("1e-30", "low_first"), ("1.0", "high_first")]:
        capsys.readouterr()
        flags = ["--algo.lopti.eta", eta, "--algo.lopti.order", order, "--algo.lopti.denominator", denominator]
        lopti = train_round(env, Lopti, make_args(*common, *flags), gas=2)
        assert len(lopti.strategy.steps) == len(baseline.strategy.steps) == 2  # the empty phase is skipped
        assert params_equal(lopti, baseline)
        # and leaves the LR schedule where the baseline's pass left it (tests/test_lopti_round_contract.py)
        assert lopti.trainer.actor_scheduler.state_dict() == baseline.trainer.actor_scheduler.state_dict()
        assert lopti.status["policy_loss"] == baseline.status["policy_loss"]
        assert lopti.status["lopti/low_token_frac"] == (1.0 if eta == "1.0" else 0.0)
        empty = "high" if eta == "1.0" else "low"
        # the round logs upstream's keys, none a phase did not report (no entropy_loss: the entropy is off), and an
        # empty phase logs its token count only (a 0 would read as a measured value)
        assert {k for k in lopti.status if "/" not in k} == {k for k in baseline.status if "/" not in k}
        assert [k for k in lopti.status if k.startswith(f"lopti/{empty}/")] == [f"lopti/{empty}/tokens"]
        assert lopti.status[f"lopti/{empty}/tokens"] == 0
        printed = capsys.readouterr().out
        assert f"[openrlhf-lopti] Lopti: no '{empty}' tokens in this batch, phase skipped\n" in printed


def test_first_phase_ignores_everything_about_the_other_tokens(env):
    flags = ["--algo.lopti.eta", "0.5", "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
    args = make_args(*flags, "--actor.fused_loss", "torch")

    def scramble_high_tokens(experience):
        high = experience.action_mask & (experience.action_log_probs.exp() >= 0.5)
        experience.advantages[high] = 100.0 * torch.randn(int(high.sum()))
        experience.base_action_log_probs[high] -= 3.0

    plain = train_round(env, Lopti, args)
    scrambled = train_round(env, Lopti, args, edit=scramble_high_tokens)
    low_steps = [i for i, step in enumerate(plain.strategy.steps) if step["phase"] == "low"]
    assert low_steps
    for i in low_steps:  # after every low-phase step the weights are the same
        same = zip(plain.strategy.steps[i]["params"], scrambled.strategy.steps[i]["params"])
        assert all(torch.equal(a, b) for a, b in same)
    assert not params_equal(plain, scrambled)  # the high phase does see them


def test_second_phase_recomputes_the_forward_with_the_updated_weights(env, spy_upstream_step):
    train_round(env, Lopti, make_args("--algo.lopti.eta", "0.5"))
    first = {}
    for call in spy_upstream_step:
        first.setdefault(call["phase"], call)
    assert first["low"]["drift"] < 1e-5  # untouched weights reproduce the rollout's log-probs
    assert first["high"]["drift"] > 1e-3  # after the low phase's optimizer steps: a fresh forward, new log-probs


@pytest.mark.parametrize("gas, phases", [(2, ["low", "low", "high", "high"]), (3, ["low", "high"])])
def test_every_phase_pass_ends_on_its_own_optimizer_step(gas, phases, env, spy_upstream_step):
    """7 samples in micro-batches of 2: each pass has 3 micro-batches (DeepSpeed's DataLoader drops the odd
    sample), which gas 2 or 3 does not divide. Each phase's last window still ends on an optimizer step, so no
    gradient of one phase is stepped with the other's, and the engine is back on DeepSpeed's own micro-step counter
    after the round."""
    run = train_round(env, Lopti, make_args("--algo.lopti.eta", "0.5"), gas, samples=7)
    assert [call["phase"] for call in spy_upstream_step] == ["low"] * 3 + ["high"] * 3
    assert [step["phase"] for step in run.strategy.steps] == phases
    assert run.actor.model._is_gradient_accumulation_boundary is None


def test_everything_off_keeps_upstreams_own_accumulation_windows(env):
    """With AR and Lopti off the boundaries are DeepSpeed's, as upstream's: 7 samples, 3 micro-batches, gas 2 take
    one optimizer step (the third micro-batch's gradient waits for the next window), exactly as upstream."""
    ours = train_round(env, Lopti, make_args(), gas=2, samples=7)
    upstream = train_round(env, Upstream, make_args(), gas=2, samples=7)
    assert len(ours.strategy.steps) == len(upstream.strategy.steps) == 1
    assert params_equal(ours, upstream)


def test_each_phase_trains_with_the_learning_rates_of_one_upstream_pass(env):
    """With a warm-up the LR changes at every optimizer step: each phase's steps use the LRs that upstream's single
    pass uses, and the RL step leaves the schedule where upstream's leaves it (it moves once per RL step)."""
    schedule = ["--actor.lr_scheduler", "cosine_with_min_lr", "--actor.lr_warmup_ratio", "0.1"]
    upstream = train_round(env, Upstream, make_args(*schedule))
    lopti = train_round(env, Lopti, make_args(*schedule, "--algo.lopti.eta", "0.5"))
    lrs = [step["lr"] for step in upstream.strategy.steps]
    assert lrs == pytest.approx([0.0, 1e-4, 2e-4, 3e-4])  # warm-up over 10 of the 100 scheduler steps
    assert [step["phase"] for step in lopti.strategy.steps] == ["low"] * 4 + ["high"] * 4
    assert [step["lr"] for step in lopti.strategy.steps] == lrs + lrs
    for trained in (upstream, lopti):
        assert trained.trainer.actor_scheduler.last_epoch == 4
        assert trained.trainer.actor_scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(4e-4)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_windows_without_tokens_of_the_phase_train_without_nans(aggregation, env, spy_upstream_step):
    """``--algo.lopti.denominator phase`` counts the phase's tokens (token-mean) or sequences (seq-mean-token-mean)
    per window; in a window with none the loss is a sum over nothing, and its denominator is 1 instead of 0
    (0/0 would make every gradient NaN)."""
    returned = []  # what our training_step hands back to upstream's ppo_train, per micro-batch
    ours = Lopti.training_step

    def record(self, *args, **kwargs):
        returned.append((self.lopti_phase, ours(self, *args, **kwargs)))
        return returned[-1][1]

    env.monkeypatch.setattr(Lopti, "training_step", record)
    flags = ["--algo.lopti.eta", "0.5", "--algo.lopti.denominator", "phase", "--actor.loss_agg_mode", aggregation]
    run = train_round(env, Lopti, make_args(*flags), edit=rollout_probs(1, low_p=0.1, high_p=0.9))
    # a micro-batch without a token of its phase reports its masked means (0/0) as 0, with a weight of 1e-6
    # in upstream's token-weighted metric means
    empty_status = [status for phase, status in returned if phase == "low" and status["num_action_tokens"] < 1]
    assert len(empty_status) == 3
    for status in empty_status:
        assert status["num_action_tokens"] == 1e-6
        for key in ("ppo_clip_ratio", "ppo_kl"):
            assert float(status["metrics"][key]) == 0.0, key
    low_calls = [call for call in spy_upstream_step if call["phase"] == "low"]
    assert len(low_calls) == 4
    empty = [call for call in low_calls if not call["mask"].any()]
    assert len(empty) == 3  # every micro-batch but response 0's
    for call in empty:
        assert call["batch_num_tokens"] == 1.0 and call["global_batch_size"] == 1.0
    (with_low,) = [call for call in low_calls if call["mask"].any()]
    assert with_low["batch_num_tokens"] == with_low["mask"].sum().item() and with_low["global_batch_size"] == 1.0
    assert all(torch.isfinite(p).all() for p in run.actor.parameters())
    assert all(math.isfinite(v) for v in run.status.values() if isinstance(v, (int, float)))


def test_quantile_threshold_with_no_and_with_one_response_token(env):
    args = make_args("--algo.lopti.quantile", "0.5")
    trainer, _ = make_trainer(env, Lopti, args, make_actor(env, args))
    old = torch.log(torch.tensor([0.2, 0.6, 0.9]))

    def threshold(response):  # the trainer's round settings and its data-parallel gather (one process here)
        return round_threshold(old.exp()[response], trainer.lopti.lopti, trainer._gather_over_dp)

    assert threshold(torch.tensor([False, False, False])) == 0.5  # nothing to take it of: the paper's eta
    assert threshold(torch.tensor([False, True, False])) == pytest.approx(0.6)
    assert threshold(torch.tensor([True, True, True])) == pytest.approx(0.6)  # the median


@pytest.mark.parametrize(
    "flags, where",
    [
        (["--algo.lopti.eta", "0.5"], "RL step 2, Lopti phase 'low', micro-batch 1 of the epoch"),
        (["--algo.ar.alpha", "0.3"], "RL step 2, micro-batch 1 of the epoch"),
    ],
    ids=["lopti", "ar-only"],
)
def test_a_fused_loss_error_names_the_rl_step_phase_micro_batch_and_rank(flags, where, env):
    """A NaN column of the output layer makes the kernel flag every row: the round fails before any optimizer step
    (the value checks are read there, once per step), with a message naming where (one rank here; several ranks:
    ``test_openrlhf_deepspeed.py``)."""
    args = make_args(*flags, "--actor.fused_loss", "torch")
    actor = make_actor(env, args)
    trainer, strategy = make_trainer(env, Lopti, args, actor)
    trainer.replay_buffer.append(make_experience(env.rollout, actor))
    trainer.ppo_train(KL_CTL)  # RL step 1 trains
    trainer.replay_buffer.clear()
    trainer.replay_buffer.append(make_experience(env.rollout, actor))
    with torch.no_grad():
        actor.model.module.get_output_embeddings().weight[5].fill_(float("nan"))
    before = [p.detach().clone() for p in actor.parameters()]
    with pytest.raises(ValueError) as raised:
        trainer.ppo_train(KL_CTL)
    cause = raised.value.__cause__
    assert isinstance(cause, ValueError) and re.match(rf"logits row \d+ \(unmasked\) at {where} has no finite", str(cause))
    assert str(raised.value) == f"fused_policy_loss found a bad input before the optimizer step, on rank 0: {cause}"
    assert len(strategy.steps) == (8 if "--algo.lopti.eta" in flags else 4)  # round 1's optimizer steps only
    assert trainer.lopti_phase is None
    for a, b in zip(before, actor.parameters()):  # no optimizer step, no gradient applied
        torch.testing.assert_close(b.detach(), a, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------- AR, fused loss, upstream equality
@pytest.fixture
def eager_entropy(monkeypatch):
    """torch.compile of upstream's ``compute_entropy`` takes ~16 s on CPU; its eager body gives the same numbers."""
    compiled = openrlhf_actor.compute_entropy
    monkeypatch.setattr(openrlhf_actor, "compute_entropy", getattr(compiled, "_torchdynamo_orig_callable", compiled))


def test_everything_off_is_upstream_exactly(env, eager_entropy):
    flags = ["--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--actor.entropy_coef", "0.01"]
    args = make_args(*flags, "--actor.dual_clip", "3", "--actor.fused_loss", "off", "--algo.ar.alpha", "0")
    ours = train_round(env, Lopti, args, gas=2, record_grads=True)
    upstream = train_round(env, Upstream, args, gas=2, record_grads=True)
    assert len(ours.strategy.steps) == len(upstream.strategy.steps) == 2
    for a, b in zip(ours.strategy.steps, upstream.strategy.steps):
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
    assert params_equal(ours, upstream)
    assert ours.status == upstream.status


def test_the_grpo_baseline_script_trains_exactly_as_upstream(env, eager_entropy, tmp_path):
    """``examples/scripts/train_kk_grpo.sh``, the baseline the AR / Lopti scripts are compared with: its loss flags
    (clip, aggregation, KL, entropy, advantage estimator, ``--actor.fused_loss off``) on our trainer give, bit for
    bit, the gradients and parameters of upstream's ``ActorPPOTrainer``."""
    from .scripts import REPO, script_launch

    argv = script_launch(REPO / "examples" / "scripts" / "train_kk_grpo.sh", tmp_path)[1]
    wanted = ("--actor.eps_clip_low_high", "--actor.loss_agg_mode", "--actor.entropy_coef", "--actor.fused_loss",
              "--algo.kl.", "--algo.advantage.estimator", "--algo.ar.", "--algo.lopti.")  # fmt: skip
    flags, keep = [], False
    for word in argv:
        if word.startswith("--"):
            keep = word.startswith(wanted)
        if keep:
            flags.append(word)
    assert "--actor.fused_loss" in flags and not any(f.startswith(("--algo.ar.", "--algo.lopti.")) for f in flags)
    args = make_args(*flags)
    ours = train_round(env, Lopti, args, gas=2, record_grads=True)
    upstream = train_round(env, Upstream, args, gas=2, record_grads=True)
    assert ours.trainer.fused_backend is None and len(ours.strategy.steps) == len(upstream.strategy.steps) == 2
    for a, b in zip(ours.strategy.steps, upstream.strategy.steps):
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
    assert params_equal(ours, upstream)


@pytest.mark.parametrize("clip", [("1.0", "0.28"), ("-0.1", "0.2")], ids=["no-lower-clip", "negative-low"])
def test_a_clip_range_the_kernel_does_not_take_trains_on_upstreams_loss_under_auto(env, clip, capsys):
    """``--actor.eps_clip_low_high 1.0 0.28`` (no lower clip) is upstream's to take: ``auto`` uses upstream's
    ``PolicyLoss`` and trains exactly as upstream; an explicit backend is refused in one line naming the flag.
    Before, ``auto`` handed it to the kernel, which raised "eps_low must be in [0, 1)" in the first step."""
    args = make_args("--actor.eps_clip_low_high", *clip, "--actor.fused_loss", "auto")
    ours = train_round(env, Lopti, args, record_grads=True)
    upstream = train_round(env, Upstream, args, record_grads=True)
    assert ours.trainer.fused_backend is None
    for a, b in zip(ours.strategy.steps, upstream.strategy.steps, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
    assert params_equal(ours, upstream)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        make_args("--actor.eps_clip_low_high", *clip, "--actor.fused_loss", "torch")
    err = capsys.readouterr().err
    low, high = (float(eps) for eps in clip)
    refused = f"--actor.fused_loss torch does not support --actor.eps_clip_low_high {low:g} {high:g} "
    assert f"error: {refused}" in err, err


def test_a_nan_clip_range_is_refused_in_one_line(capsys):
    """Upstream's clamp to [1 - low, 1 + high] with a NaN would make every ratio NaN, fused or not."""
    with pytest.raises(SystemExit):
        make_args("--actor.eps_clip_low_high", "0.2", "nan", "--actor.fused_loss", "off")
    assert "error: --actor.eps_clip_low_high must be two numbers, got 0.2 nan\n" in capsys.readouterr().err


def test_the_gspo_refusal_names_the_threshold_given(capsys):
    with pytest.raises(SystemExit):
        make_args("--algo.lopti.quantile", "0.5", "--actor.policy_loss_type", "gspo")
    assert "error: --algo.lopti.quantile with --actor.policy_loss_type gspo: " in capsys.readouterr().err


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("alpha", ["0", "0.3"])
def test_fused_loss_matches_upstream_loss_and_gradients(alpha, packing, aggregation, env, float64):
    flags = ["--algo.ar.alpha", alpha, "--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--actor.dual_clip", "3"]
    flags += ["--actor.loss_agg_mode", aggregation, "--actor.eps_clip_low_high", "0.1", "0.3"]  # not the kernel's 0.2
    if packing:
        flags += ["--ds.packing_samples", "--vllm.num_engines", "1"]
    # reference: upstream's trainer and PolicyLoss, with AR written out here on the experience's advantages
    a = float(alpha)

    def off_policy(experience):  # rollout log-probs 0.4 nats around the actor's: both clip bounds bind at step 1
        noise = torch.randn(experience.action_log_probs.shape, generator=torch.Generator().manual_seed(6))
        rollout = (experience.action_log_probs + 0.4 * noise).clamp(max=0.0)  # still log-probs (the kernel checks)
        experience.action_log_probs = rollout * experience.action_mask

    def ar(experience):
        experience.advantages = experience.advantages * (a * experience.action_log_probs.exp() + 1 - a)

    def reweight(experience):
        off_policy(experience)
        ar(experience)

    # gas 2: each optimizer step's loss is one mean over both micro-batches' tokens (upstream's loss_batch_info)
    upstream_args = make_args(*flags, "--actor.fused_loss", "off")
    reference = train_round(env, Upstream, upstream_args, gas=2, record_grads=True, edit=reweight)
    fused_args = make_args(*flags, "--actor.fused_loss", "torch")
    fused = train_round(env, Lopti, fused_args, gas=2, record_grads=True, edit=off_policy)
    with float64():
        # the same off-policy inputs, with AR written out in float64 this time
        reference64 = train_round(env, Upstream, upstream_args, gas=2, record_grads=True, edit=inputs_of(fused, ar))
        fused64 = train_round(env, Lopti, fused_args, gas=2, record_grads=True, edit=inputs_of(fused))
    assert fused.trainer.fused_backend == "torch" and fused.actor.packing_samples == packing
    ratio = (-0.4 * torch.randn(fused.experience.action_log_probs.shape, generator=torch.Generator().manual_seed(6))).exp()
    advantages, response = fused.experience.advantages, fused.experience.action_mask
    unclamped = fused.experience.action_log_probs < 0  # where the ratio is exp(-0.4 * noise)
    assert (response & unclamped & (advantages < 0) & (ratio < 0.9) & (ratio > 0.8)).any()  # clipped at 0.1, not 0.2
    assert len(fused.strategy.steps) == len(reference.strategy.steps) == 2
    assert_same_update(fused, reference, fused64, reference64, steps=(0,))
    for key in ("policy_loss", "kl", "ppo_kl"):
        values = (run.status[key] for run in (fused, reference, fused64, reference64))
        scalars_same_computation(key, *values, precision=False)  # means over the whole round: after AdamW steps
    assert fused.status["ppo_clip_ratio"] == reference.status["ppo_clip_ratio"]  # a count of clipped tokens


def test_an_infinite_dual_clip_trains_as_upstream_reads_it_no_dual_clip(env):
    """Upstream's PolicyLoss takes `--actor.dual_clip inf` (its check is `> 1`) and clips nothing more; our default
    `--actor.fused_loss auto` raised "dual_clip must be ... finite" at the first step, after the whole rollout. Now
    both read it as no dual clip: each run's update is its run without the flag, bit for bit."""
    runs = {}
    for cls, backend in ((Upstream, "off"), (Lopti, "auto")):
        for dual_clip in ((), ("--actor.dual_clip", "inf")):
            args = make_args("--actor.fused_loss", backend, "--algo.ar.alpha", "0", *dual_clip)
            runs[cls, bool(dual_clip)] = train_round(env, cls, args)
    for cls in (Upstream, Lopti):
        assert params_equal(runs[cls, True], runs[cls, False]), cls.__name__
        assert runs[cls, True].status == runs[cls, False].status
    assert runs[Lopti, True].trainer.fused_backend is not None  # the fused loss ran, not upstream's


@pytest.mark.parametrize("packing", [False, True])
def test_fused_entropy_matches_upstream_entropy_loss_and_gradients(packing, env, eager_entropy, float64):
    # Lopti masks the entropy term to each phase; temperature 0.7: the kernel divides, not Actor.forward
    # reference: upstream's trainer run once per phase with AR and the phase written out in the test
    flags = ["--actor.entropy_coef", "0.5", "--rollout.temperature", "0.7"]
    flags += ["--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--actor.dual_clip", "3"]
    if packing:
        flags += ["--ds.packing_samples", "--vllm.num_engines", "1"]
    # seed 5: a shuffle whose every micro-batch holds tokens of both phases (with packing, 4 of the 8 responses have
    # no high token); upstream's pass, the reference, divides by zero on a micro-batch without any
    seed = 5
    reference = upstream_lopti_round(env, flags, eta=0.5, alpha=0.3, seed=seed)
    lopti = ["--algo.lopti.eta", "0.5", "--algo.ar.alpha", "0.3", "--algo.lopti.denominator", "phase"]
    fused_args = make_args(*flags, *lopti, "--actor.fused_loss", "torch")
    fused = train_round(env, Lopti, fused_args, record_grads=True, seed=seed)
    with float64():
        reference64 = upstream_lopti_round(env, flags, eta=0.5, alpha=0.3, edit=inputs_of(reference), seed=seed)
        fused64 = train_round(env, Lopti, fused_args, record_grads=True, edit=inputs_of(fused), seed=seed)
    assert fused.actor.temperature == 0.7 and fused.actor.packing_samples == packing
    assert_first_step_of_each_phase_matches(fused, reference, fused64, reference64)
    for i, phase in enumerate(("low", "high")):
        for key in ("entropy_loss", "policy_loss", "kl"):
            ours32, ours64 = (run.status[f"lopti/{phase}/{key}"] for run in (fused, fused64))
            upstream32, upstream64 = (run.statuses[i][key] for run in (reference, reference64))
            scalars_same_computation(f"{phase} {key}", ours32, upstream32, ours64, upstream64, precision=False)
    assert fused.status["entropy_loss"] > 0.1  # a real entropy term, large enough to move the gradients


class VocabSizedTensorSpy(TorchDispatchMode):
    """Records every op run (forward and backward) and each tensor it returns whose last dim is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.ops = set()
        self.vocab_sized = []  # (op name, dtype, shape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == VOCAB:
                self.vocab_sized.append((str(func), tensor.dtype, tuple(tensor.shape)))
        return out

    def float32(self):
        return [seen for seen in self.vocab_sized if seen[1] == torch.float32]


def experience_making(actor, rollout, backend, lm_head=False):
    """The forward-only pass of experience making (old-policy and reference log-probs), as our Ray actors run it."""
    action_mask = rollout.attention_mask[:, PROMPT:]
    with torch.no_grad():
        if backend is None:  # --actor.fused_loss off: upstream's path
            return actor(rollout.sequences, action_mask, rollout.attention_mask)
        with fused_log_probs(actor, backend, lm_head):
            return actor(rollout.sequences, action_mask, rollout.attention_mask)


@pytest.mark.parametrize("packing", [False, True])
def test_fused_loss_never_makes_an_fp32_copy_of_the_logits(packing, env):
    from openrlhf_lopti.ops.cpp_policy_loss import cpp_available

    assert cpp_available()  # "auto" on CPU: the C++ kernel, which reads bf16 logits without upcasting them
    flags = ["--actor.entropy_coef", "0.01", "--rollout.temperature", "0.7", "--algo.ar.alpha", "0.3"]
    flags += ["--algo.track_direction"]  # its forward-only pass after the update goes through the kernels too
    if packing:
        flags += ["--ds.packing_samples", "--vllm.num_engines", "1"]
    spies = {}
    for fused in ("off", "auto"):
        args = make_args(*flags, "--actor.fused_loss", fused, "--ds.param_dtype", "bf16")
        actor = make_actor(env, args).to(torch.bfloat16)  # bf16 weights: bf16 logits, as on a GPU
        trainer, strategy = make_trainer(env, Lopti, args, actor)
        experience = make_experience(env.rollout, actor)
        with VocabSizedTensorSpy() as spies[fused]:  # a whole step: experience making, then training
            experience.action_log_probs = experience_making(actor, env.rollout, trainer.fused_backend)
            trainer.replay_buffer.append(experience)
            trainer.ppo_train(KL_CTL)
        assert len(strategy.steps) == 4 and all(torch.isfinite(p).all() for p in actor.parameters())
    # the spy sees the fp32 copy upstream's Actor.forward makes (logits.to(torch.float32)) ...
    assert any(op == "aten._to_copy.default" for op, _, _ in spies["off"].float32())
    # ... and, in the fused path, the kernel's forward and its bf16 [N, V] logits gradient, but nothing fp32
    fwd, bwd = "openrlhf_lopti.policy_loss_fwd.default", "openrlhf_lopti.policy_loss_bwd.default"
    assert {fwd, bwd} <= spies["auto"].ops
    assert (bwd, torch.bfloat16) in {seen[:2] for seen in spies["auto"].vocab_sized}
    assert spies["auto"].float32() == []


def test_fused_lm_head_never_makes_the_logits(env):
    """With --actor.fused_lm_head no [B, T, V] logits exist in a whole step: experience making, the Lopti phases'
    training and --algo.track_direction's pass after it (only [chunk, V] pieces, one chunk at a time)."""
    flags = ["--actor.fused_loss", "torch", "--actor.fused_lm_head", "--algo.lopti.eta", "0.5"]
    flags += ["--algo.track_direction", "--actor.entropy_coef", "0.01"]
    args = make_args(*flags)
    actor = make_actor(env, args)
    trainer, strategy = make_trainer(env, Lopti, args, actor)
    experience = make_experience(env.rollout, actor)
    with VocabSizedTensorSpy() as spy:
        experience.action_log_probs = experience_making(actor, env.rollout, trainer.fused_backend, lm_head=True)
        trainer.replay_buffer.append(experience)
        status = trainer.ppo_train(KL_CTL)
    assert len(strategy.steps) == 8 and "direction/pos_up_q1" in status
    assert spy.vocab_sized and all(len(shape) == 2 for _, _, shape in spy.vocab_sized), spy.vocab_sized


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("lm_head", [False, True], ids=["logits", "lm_head"])
def test_forward_only_passes_through_the_kernels_give_upstream_log_probs(lm_head, packing, env):
    flags = ["--rollout.temperature", "0.7", "--actor.fused_loss", "torch"]
    flags += ["--ds.packing_samples", "--vllm.num_engines", "1"] if packing else []
    args = make_args(*flags)
    actor = make_actor(env, args)
    upstream = experience_making(actor, env.rollout, None)  # OpenRLHF's log_probs_from_logits of fp32 logits
    ours = experience_making(actor, env.rollout, "torch", lm_head)
    torch.testing.assert_close(ours, upstream, rtol=1e-5, atol=1e-6)
    assert torch.all(ours[~env.rollout.attention_mask[:, PROMPT:].bool()] == 0)  # masked like upstream's


@pytest.mark.parametrize(
    "variant", ["plain", "tied", "packed", "gradient_checkpointing", "lora", "bias", "no_entropy"],
)
def test_fused_lm_head_trains_like_the_fused_logits_loss(variant, env, eager_entropy, float64):
    """Same loss, entropy, KL and parameter gradients, whether the kernels read the logits or the lm_head makes
    them chunk by chunk (here for every weight the model has: with tied embeddings the lm_head IS the input
    embedding, whose gradient then sums both uses)."""
    flags = ["--rollout.temperature", "0.7", "--algo.lopti.eta", "0.5"]
    flags += ["--algo.ar.alpha", "0.3", "--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--actor.fused_loss", "torch"]
    flags += [] if variant == "no_entropy" else ["--actor.entropy_coef", "0.5"]  # no entropy: upstream asks for none
    flags += ["--ds.packing_samples", "--vllm.num_engines", "1"] if variant == "packed" else []
    config = copy.deepcopy(env.config)
    config.tie_word_embeddings = variant == "tied"

    def build(args, in_float64):
        model = LlamaForCausalLM(config)
        model.load_state_dict(env.state, strict=False)
        if variant == "tied":
            model.tie_weights()
        if variant == "bias":  # an output layer with a bias (Llama's has none)
            head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
            head.weight.data.copy_(model.lm_head.weight.data)
            head.bias.data.copy_(torch.linspace(-2.0, 2.0, config.vocab_size))
            model.lm_head = head
        if variant == "gradient_checkpointing":
            kwargs = {"use_reentrant": False}
            if in_float64:  # the backward's recomputation of the forward runs in float64 too
                kwargs["context_fn"] = lambda: (nullcontext(), Float64Shadow())
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if variant == "lora":
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(5)
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        actor = Actor(model, temperature=args.rollout.temperature)
        actor.packing_samples = args.ds.packing_samples
        return actor

    def run(args, edit=None):
        actor = build(args, in_float64=edit is not None)
        experience = make_experience(env.rollout, actor)
        if edit is not None:
            edit(experience)
        trainer, strategy = make_trainer(env, Lopti, args, actor, record_grads=True)
        trainer.replay_buffer.append(experience)
        torch.manual_seed(3)
        return SimpleNamespace(status=trainer.ppo_train(KL_CTL), strategy=strategy, experience=experience)

    runs = {}
    for name, extra in (("logits", []), ("lm_head", ["--actor.fused_lm_head"])):
        args = make_args(*flags, *extra)
        runs[name] = run(args)
        with float64():
            runs[name + "64"] = run(args, edit=inputs_of(runs[name]))
    assert [step["phase"] for step in runs["lm_head"].strategy.steps] == ["low"] * 4 + ["high"] * 4
    assert len(runs["logits"].strategy.steps) == len(runs["logits64"].strategy.steps) == 8
    named = dict(a_name="lm_head", b_name="logits")
    for i in range(8):
        grads = [runs[name].strategy.steps[i]["grads"] for name in ("lm_head", "logits", "lm_head64", "logits64")]
        assert_all_same_computation(f"gradients of optimizer step {i}", *grads, precision=i == 0, **named)
    keys = ["policy_loss", "kl", "lopti/low/policy_loss"]
    keys += [] if variant == "no_entropy" else ["entropy_loss"]
    for key in keys:
        values = (runs[name].status[key] for name in ("lm_head", "logits", "lm_head64", "logits64"))
        scalars_same_computation(key, *values, precision=False, **named)
    assert runs["lm_head"].status["ppo_clip_ratio"] == runs["logits"].status["ppo_clip_ratio"]  # a share of tokens


def test_an_output_layer_the_lm_head_kernel_cannot_fuse_is_refused_naming_the_openrlhf_flag(env):
    args = make_args("--actor.fused_loss", "torch", "--actor.fused_lm_head")
    actor = make_actor(env, args)
    actor.model.config.final_logit_softcapping = 30.0  # as Gemma 2: logits transformed after the lm_head
    with pytest.raises(ValueError) as raised:
        make_trainer(env, Lopti, args, actor)
    assert str(raised.value) == (
        "--actor.fused_lm_head does not support models that transform their logits (final_logit_softcapping=30.0); "
        "run without --actor.fused_lm_head"
    )


def test_fused_lm_head_needs_the_fused_loss(capsys):
    with pytest.raises(SystemExit):
        make_args("--actor.fused_lm_head", "--actor.fused_loss", "off")
    assert "--actor.fused_lm_head needs the fused loss" in capsys.readouterr().err


def test_moe_aux_loss_counts_once_per_rl_step(env, float64):
    """``--actor.aux_loss_coef`` on a tiny Mixtral: upstream adds the router-balancing loss to every micro-batch of
    its one pass; with Lopti each phase adds it at the phase's share of the tokens, so over the round it counts once.
    Seen in the first optimizer step's gradients (taken at the initial weights, where the policy-loss part of a run
    with the aux loss equals that of a run without it): Lopti's aux-loss gradient is the low share of upstream's.
    All in float64, so the comparison is of the aux loss's weight, not of rounding."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, attn_implementation="sdpa", experts_implementation="eager",  # float64 experts
    )  # fmt: skip
    torch.manual_seed(0)
    state = MixtralForCausalLM(config).state_dict()

    def first_step_grads(cls, flags, coef):
        args = make_args(*flags, "--actor.aux_loss_coef", str(coef))
        model = MixtralForCausalLM(config)
        model.load_state_dict(state)
        actor = Actor(model, temperature=1.0)
        actor.packing_samples = False
        experience = make_experience(env.rollout, actor)
        rollout_probs(3, low_p=0.1, high_p=0.9)(experience)  # both phases have tokens
        trainer, strategy = make_trainer(env, cls, args, actor, record_grads=True)
        trainer.replay_buffer.append(experience)
        torch.manual_seed(3)
        status = trainer.ppo_train(KL_CTL)
        return strategy.steps[0]["grads"], status

    lopti = ["--algo.lopti.eta", "0.5"]
    with float64():
        ours_with, status = first_step_grads(Lopti, lopti, 0.5)
        ours_without, _ = first_step_grads(Lopti, lopti, 0.0)
        upstream_with, _ = first_step_grads(Upstream, [], 0.5)
        upstream_without, _ = first_step_grads(Upstream, [], 0.0)
    low_share = status["lopti/low_token_frac"]
    assert 0.05 < low_share < 0.95
    routers = 0
    for ow, oo, uw, uo in zip(ours_with, ours_without, upstream_with, upstream_without):
        assert ow.dtype == torch.float64
        upstream_aux = uw - uo
        if upstream_aux.abs().max() > 1e-6:  # the parameters the aux loss reaches (the routers and below)
            routers += 1
        torch.testing.assert_close(ow - oo, low_share * upstream_aux, rtol=1e-9, atol=1e-12)
    assert routers > 0


@pytest.mark.parametrize("denominator", ["all", "phase"])
def test_lopti_keeps_upstreams_sequence_gate_on_the_whole_response(env, denominator):
    """``--algo.advantage.is_correction_level seq`` (seq-mask-TIS): upstream keeps or drops each sequence on the
    geometric mean of its train/rollout ratios over the whole response. Here each response's first half has rollout
    p 0.1 and log-ratio +2, the rest p 0.9 and -2: the whole-response mean is inside the band [0.5, 5], each half's
    is not. Lopti's low phase (the first halves) must still train; gated on its own tokens it was all filtered.
    (With ``--algo.lopti.denominator phase`` the replay items hold the phase's tokens as their mask: the gate was
    still on them there, and nothing trained.)"""

    def half_and_half(experience):
        mask = experience.action_mask
        low = mask & (mask.cumsum(-1) <= mask.sum(-1, keepdim=True) // 2)
        experience.action_log_probs = torch.log(torch.where(low, 0.1, 0.9)) * mask
        experience.rollout_log_probs = (experience.action_log_probs - torch.where(low, 2.0, -2.0)) * mask

    flags = ["--algo.lopti.eta", "0.5", "--algo.advantage.is_correction_level", "seq", "--algo.lopti.denominator",
             denominator]  # fmt: skip
    run = train_round(env, Lopti, make_args(*flags), edit=half_and_half, record_grads=True)
    assert run.trainer.fused_backend is None  # the fused loss does not take IS correction: upstream's PolicyLoss
    ratios = run.experience.action_log_probs - run.experience.rollout_log_probs
    response = run.experience.action_mask
    means = (ratios * response).sum(-1) / response.sum(-1)
    assert ((means.exp() >= 0.5) & (means.exp() <= 5.0)).all()  # every sequence inside the band as a whole
    steps = run.strategy.steps
    assert [step["phase"] for step in steps] == ["low"] * 4 + ["high"] * 4
    for phase in ("low", "high"):
        assert any(any(g.abs().max() > 0 for g in step["grads"]) for step in steps if step["phase"] == phase), phase
    assert run.status["lopti/low/policy_loss"] != 0
    assert run.status["is_filter_ratio"] == 0  # upstream filters none of them


def test_lopti_with_a_sequence_gate_needs_token_mean_aggregation(capsys):
    flags = ["--algo.lopti.eta", "0.5", "--algo.advantage.is_correction_level", "seq", "--algo.lopti.denominator", "phase"]
    with pytest.raises(SystemExit):
        make_args(*flags, "--actor.loss_agg_mode", "seq-mean-token-mean")
    assert "--algo.advantage.is_correction_level seq and --actor.loss_agg_mode seq-mean-token-mean" in capsys.readouterr().err
    make_args(*flags)  # token-mean: fine


def test_ar_changes_the_update_and_logs_the_mean_weight(env):
    plain = train_round(env, Lopti, make_args())
    ar = train_round(env, Lopti, make_args("--algo.ar.alpha", "0.3"))
    assert not params_equal(plain, ar)
    old, mask = ar.experience.action_log_probs, ar.experience.action_mask
    assert ar.status["ar/mean_weight"] == pytest.approx(ar_weight(old, 0.3)[mask].mean().item(), rel=1e-6)
    assert "ar/mean_weight" not in plain.status


# ---------------------------------------------------------------- metrics, quantile, dynamic batching
def test_lopti_metrics_in_the_status(env, capsys):
    flags = ["--algo.lopti.eta", "0.5", "--algo.ar.alpha", "0.3", "--actor.fused_loss", "torch"]
    flags += ["--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
    started = time.perf_counter()
    run = train_round(env, Lopti, make_args(*flags))
    elapsed = time.perf_counter() - started
    status = run.status
    old, mask = run.experience.action_log_probs, run.experience.action_mask
    low_frac = (old.exp()[mask] < 0.5).float().mean().item()
    assert status["lopti/low_token_frac"] == pytest.approx(low_frac)
    assert status["lopti/threshold"] == 0.5
    # each phase's wall seconds, within the round's
    assert 0 < status["lopti/low/train_s"] and 0 < status["lopti/high/train_s"]
    assert status["lopti/low/train_s"] + status["lopti/high/train_s"] < elapsed
    printed = capsys.readouterr().out
    assert f"[openrlhf-lopti] Lopti phase 'low': {low_frac:.1%} of the tokens\n" in printed
    assert f"[openrlhf-lopti] Lopti phase 'high': {1 - low_frac:.1%} of the tokens\n" in printed
    for phase in ("low", "high"):
        for key in ("policy_loss", "ppo_clip_ratio", "actor_grad_norm", "ppo_kl"):
            assert f"lopti/{phase}/{key}" in status
    assert status["actor_grad_norm"] == status["lopti/high/actor_grad_norm"]  # the last step's, as upstream
    share = status["lopti/low_token_frac"]
    clip = share * status["lopti/low/ppo_clip_ratio"] + (1 - share) * status["lopti/high/ppo_clip_ratio"]
    assert status["ppo_clip_ratio"] == pytest.approx(clip)
    assert status["policy_loss"] == pytest.approx(status["lopti/low/policy_loss"] + status["lopti/high/policy_loss"])
    assert status["kl"] == pytest.approx(status["lopti/low/kl"] + status["lopti/high/kl"])  # the KL loss's shares
    assert "entropy_loss" not in status  # the entropy is off: upstream's pass logs none, nor does the round
    assert all(torch.isfinite(torch.tensor(float(v))) for v in status.values() if isinstance(v, (int, float)))


def test_merge_phase_status_rules():
    statuses = {
        "low": {"policy_loss": 1.0, "ppo_clip_ratio": 0.5, "actor_grad_norm": 3.0, "reward": 0.2},
        "high": {"policy_loss": 2.0, "ppo_clip_ratio": 0.1, "actor_grad_norm": 4.0, "reward": 0.2},
    }
    share = {"low": 0.25, "high": 0.75}
    merged = merge_phase_status(statuses, share, "all", kl_is_loss=True)
    # "all": each phase's loss comes per phase token; its share is value x token share, and the shares add up
    assert merged["policy_loss"] == pytest.approx(0.25 * 1.0 + 0.75 * 2.0)
    assert merged["lopti/low/policy_loss"] + merged["lopti/high/policy_loss"] == pytest.approx(merged["policy_loss"])
    assert merged["ppo_clip_ratio"] == pytest.approx(0.25 * 0.5 + 0.75 * 0.1)
    assert merged["actor_grad_norm"] == 4.0 and merged["reward"] == 0.2
    assert merged["lopti/low/actor_grad_norm"] == 3.0 and merged["lopti/high/policy_loss"] == pytest.approx(1.5)
    phase = merge_phase_status(statuses, share, "phase", True)
    assert phase["policy_loss"] == pytest.approx(0.25 * 1.0 + 0.75 * 2.0) and phase["lopti/high/policy_loss"] == 2.0
    assert "entropy_loss" not in merged and "kl" not in merged  # no phase reported them: no made-up 0
    only_high = merge_phase_status({"high": statuses["high"]}, {"low": 0.0, "high": 1.0}, "all", True)
    assert only_high["policy_loss"] == 2.0 and "lopti/low/policy_loss" not in only_high
    # "kl": the KL loss's phase shares add up; the rollout KL in the reward is the same number in every phase
    with_kl = {name: {**status, "kl": 0.1 * (i + 1)} for i, (name, status) in enumerate(statuses.items())}
    assert merge_phase_status(with_kl, share, "all", kl_is_loss=True)["kl"] == pytest.approx(0.25 * 0.1 + 0.75 * 0.2)
    rollout_kl = {name: {**status, "kl": 0.5} for name, status in statuses.items()}
    assert merge_phase_status(rollout_kl, share, "all", kl_is_loss=False)["kl"] == 0.5
    # a per-token metric only one phase reported: the token-weighted mean over the phases that have it is its value
    partial = {"low": {**statuses["low"], "vllm_kl": 0.4}, "high": statuses["high"]}
    assert merge_phase_status(partial, share, "phase", kl_is_loss=True)["vllm_kl"] == pytest.approx(0.4)


def test_the_rounds_losses_are_upstreams_single_pass_with_skewed_micro_batches(env, eager_entropy):
    """lr 0 (every token's loss the same in both phases and in upstream's pass), rollout p 0.1 on responses 0-3 and
    0.9 on 4-7: micro-batches of one phase each. The round's policy_loss, KL loss (which --algo.kl.target's
    controller reads) and entropy_loss are upstream's single pass; before, each phase's value was weighted by its
    own token count (policy_loss 2.42 against upstream's 1.22). One micro-batch per optimizer step: with more, each
    pass's shuffled micro-batches group into other windows, whose token counts normalise the losses.

    Each phase's pass computes its log-probs in other micro-batches than upstream's pass (other shapes, other fp32
    roundings of the forward), and k3 ~ x^2 / 2 turns an error e of the log-ratio x into a relative error of about
    2e / x: at this batch's x ~ 0.1 (KL 0.0045) the KL is ~100x more sensitive than the other losses. Measured, run
    alone: 1.7e-5 of the KL (policy_loss 1e-7), so the KL's bound is 2e-4 (12x); a token-count weighting is off by
    O(1)."""
    edit = rollout_probs(4, 0.1, 0.9)
    flags = ["--actor.adam.lr", "0", "--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--actor.entropy_coef", "0"]
    up = train_round(env, Upstream, make_args(*flags), gas=1, edit=edit)
    lo = train_round(env, Lopti, make_args(*flags, "--algo.lopti.eta", "0.5"), gas=1, edit=edit)
    for key in ("policy_loss", "kl", "entropy_loss", "ppo_kl", "ppo_clip_ratio"):
        rel = 2e-4 if key == "kl" else 1e-5
        assert lo.status[key] == pytest.approx(up.status[key], rel=rel, abs=1e-8), key
        if key in ("policy_loss", "kl", "entropy_loss"):
            assert lo.status[f"lopti/low/{key}"] + lo.status[f"lopti/high/{key}"] == pytest.approx(lo.status[key])


def test_quantile_sets_the_fraction_of_low_tokens(env):
    run = train_round(env, Lopti, make_args("--algo.lopti.quantile", "0.4"))
    probs = run.experience.action_log_probs.exp()[run.experience.action_mask]
    assert run.status["lopti/threshold"] == pytest.approx(torch.quantile(probs, 0.4).item(), rel=1e-6)
    assert run.status["lopti/low_token_frac"] == pytest.approx(0.4, abs=1.0 / probs.numel() + 1e-9)
    assert "ar/mean_weight" not in run.status  # AR is off


def test_a_quantile_of_probabilities_that_underflow_still_trains_both_phases(env):
    """Log-probs of -200 are probability 0 in fp32: the quantile of a batch where most tokens have them is 0, an eta
    that ``lopti_phases`` refuses. The threshold is floored at the smallest normal fp32 instead, so the tokens with
    p = 0 are "low" (p < threshold) and the others "high"."""

    def underflow(experience):
        low = torch.arange(len(experience.sequences))[:, None] < 6  # 6 of the 8 responses
        experience.action_log_probs = torch.where(low, -200.0, math.log(0.7)) * experience.action_mask

    run = train_round(env, Lopti, make_args("--algo.lopti.quantile", "0.5"), edit=underflow)
    assert run.status["lopti/threshold"] == torch.finfo(torch.float32).tiny
    response = run.experience.action_mask
    low = response & (torch.arange(len(response))[:, None] < 6)
    assert run.status["lopti/low_token_frac"] == pytest.approx(low.sum().item() / response.sum().item())
    assert [step["phase"] for step in run.strategy.steps] == ["low"] * 4 + ["high"] * 4


@pytest.mark.parametrize("gas, samples", [(1, None), (2, 6)], ids=["every-micro-batch", "odd-windows"])
def test_ema_updates_exactly_when_deepspeed_steps(gas, samples, env):
    """``--train.enable_ema``: after each optimizer step (and only then) the EMA model becomes
    ``(1 - beta) * params + beta * ema``, on the CPU (upstream's trainer asks the strategy for ``"cuda"``). With gas 2
    and 3 micro-batches a pass, each Lopti phase has windows of 2 and 1 micro-batches: upstream's own count of
    micro-batches (an update every 2nd) would update after micro-batches 2, 4, 6 instead of 2, 3, 5, 6."""
    beta = 0.9
    args = make_args("--algo.lopti.eta", "0.5", "--algo.ar.alpha", "0.3", "--train.enable_ema", "--train.ema_beta", str(beta))
    actor, ema = make_actor(env, args), make_actor(env, args)
    experience = make_experience(env.rollout, actor)
    trainer, strategy = make_trainer(env, Lopti, args, actor, gas=gas, ema=ema)
    expected = [p.detach().clone() for p in ema.parameters()]
    trainer.replay_buffer.append(experience)
    if samples is not None:
        del trainer.replay_buffer.items[samples:]
    torch.manual_seed(3)
    trainer.ppo_train(KL_CTL)
    steps = {1: 4, 2: 2}[gas]  # optimizer steps per phase
    assert [step["phase"] for step in strategy.steps] == ["low"] * steps + ["high"] * steps
    for step in strategy.steps:
        expected = [(1 - beta) * p + beta * e for p, e in zip(step["params"], expected)]
    for want, got in zip(expected, trainer.ema_model.parameters()):
        assert got.device.type == "cpu"
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)  # the same elementwise ops, in the same order


class CorrectlyRoundedExp(TorchFunctionMode):
    """``exp`` of fp32 tensors rounded from float64, as another device's ``exp`` may round (a GPU's differs from
    the CPU's in the last bit for some inputs)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.exp, torch.Tensor.exp) and args[0].dtype == torch.float32:
            return torch.exp(args[0].double()).float()
        return func(*args, **(kwargs or {}))


def test_each_token_trains_in_the_phase_it_was_counted_in_wherever_the_split_runs(env, spy_upstream_step):
    """The round counts the phases on the CPU; each micro-batch's step splits its tokens after moving them to the
    device. Here the step's split runs under another rounding of ``exp`` (a GPU's), and the rollout log-prob of six
    responses is one where the two roundings fall on either side of the threshold: the tokens must still train in
    the phase they were counted in, once (not in both, and not in neither when a phase counted empty is skipped)."""
    xs = -2 * torch.rand(100_000, generator=torch.Generator().manual_seed(0))
    ours, other = xs.exp(), torch.exp(xs.double()).float()
    i = int((ours != other).nonzero()[0])
    x, eta = xs[i].item(), max(ours[i].item(), other[i].item())  # one rounding says p < eta, the other p == eta
    mask_phase = Lopti._phase_mask

    def split_on_the_device(self, *args):
        with CorrectlyRoundedExp():
            return mask_phase(self, *args)

    env.monkeypatch.setattr(Lopti, "_phase_mask", split_on_the_device)

    def at_the_threshold(experience):
        disputed = torch.arange(len(experience.sequences))[:, None] < 6
        values = torch.where(disputed, torch.tensor(x), torch.tensor(math.log(0.99)))
        experience.action_log_probs = values * experience.action_mask

    run = train_round(env, Lopti, make_args("--algo.lopti.eta", str(eta)), edit=at_the_threshold)
    response = run.experience.action_mask
    counted_low = round(run.status.get("lopti/low_token_frac", 0.0) * response.sum().item())
    trained = {phase: sum(c["mask"].sum().item() for c in spy_upstream_step if c["phase"] == phase) for phase in ("low", "high")}
    assert trained == {"low": counted_low, "high": response.sum().item() - counted_low}


def test_tokens_at_the_threshold_train_in_the_high_phase(env, spy_upstream_step):
    """Low means p < threshold, strictly, in the phase masks and in the counts alike: with most tokens at p = 0.5
    the median is 0.5 itself, and those tokens are "high"."""
    args = make_args("--algo.lopti.quantile", "0.5")
    run = train_round(env, Lopti, args, edit=rollout_probs(3, low_p=0.2, high_p=0.5))
    response = run.experience.action_mask
    low = response & (torch.arange(len(response))[:, None] < 3)
    assert run.status["lopti/threshold"] == pytest.approx(0.5)
    assert run.status["lopti/low_token_frac"] == pytest.approx(low.sum().item() / response.sum().item())
    assert {call["phase"] for call in spy_upstream_step} == {"low", "high"}
    high_tokens = sum(call["mask"].sum().item() for call in spy_upstream_step if call["phase"] == "high")
    assert high_tokens == (response & ~low).sum()


@pytest.mark.parametrize("denominator", ["all", "phase"])
def test_every_phase_trains_the_tokens_the_round_put_in_it(denominator, env, spy_upstream_step):
    """The trainer reads each phase's mask from ``plan_round``, never re-derives one from another: here the round
    (planted through the trainer's ``plan_round``) puts in "high" only the tokens of p >= 0.8, not every response
    token that is not "low" (p = 0.6 too), and only those train in the high phase (a trainer taking "high" as the
    complement of "low" trains the p = 0.6 tokens too)."""
    import openrlhf_lopti.openrlhf.trainer as trainer_module

    real_plan_round = trainer_module.plan_round

    def planted(old_log_probs, response, *args, **kwargs):
        lopti_round = real_plan_round(old_log_probs, response, *args, **kwargs)
        for phase in lopti_round.phases:
            if phase.name == "high":
                phase.mask = phase.mask & (old_log_probs.exp() >= 0.8)
                phase.tokens = int(phase.mask.sum())
        return lopti_round

    env.monkeypatch.setattr(trainer_module, "plan_round", planted)

    def three_levels(experience):  # responses 0-2: p = 0.2 (low), 3-5: p = 0.6, 6-7: p = 0.9
        row = torch.arange(len(experience.sequences))[:, None]
        p = torch.where(row < 3, 0.2, torch.where(row < 6, 0.6, 0.9)).expand_as(experience.action_log_probs)
        experience.action_log_probs = torch.log(p) * experience.action_mask

    args = make_args("--algo.lopti.eta", "0.5", "--algo.lopti.denominator", denominator)
    run = train_round(env, Lopti, args, edit=three_levels)
    assert {call["phase"] for call in spy_upstream_step} == {"low", "high"}
    for call in spy_upstream_step:
        p = call["old"].exp()
        expected = call["response"] & ((p < 0.5) if call["phase"] == "low" else (p >= 0.8))
        assert torch.equal(call["mask"].bool(), expected), call["phase"]
        assert torch.all(call["advantages"][~expected] == 0)
    response = run.experience.action_mask
    row = torch.arange(len(response))[:, None]
    trained_high = sum(int(call["mask"].sum()) for call in spy_upstream_step if call["phase"] == "high")
    assert trained_high == int((response & (row >= 6)).sum()) < int((response & (row >= 3)).sum())


def test_a_batch_of_one_response_token(env, spy_upstream_step):
    """One token in the whole batch: its phase trains on it (a token mean over 1 token), the other is skipped."""

    def one_token(experience):
        keep = torch.zeros_like(experience.action_mask)
        keep[0, 0] = True
        experience.action_mask = keep
        experience.action_log_probs = torch.where(keep, math.log(0.1), 0.0)  # its rollout p: 0.1, a low token
        experience.advantages = experience.advantages * keep

    run = train_round(env, Lopti, make_args("--algo.lopti.eta", "0.5"), edit=one_token)
    assert run.status["lopti/low_token_frac"] == 1.0 and "lopti/high/train_s" not in run.status
    assert [call["phase"] for call in spy_upstream_step] == ["low"] * 4
    assert all(torch.isfinite(p).all() for p in run.actor.parameters())


@pytest.mark.parametrize("fused", ["off", "torch"])
def test_dynamic_batching(fused, env, spy_upstream_step):
    # a token budget per micro-batch (upstream then packs samples); 2 optimizer steps of 4 samples per pass
    dynamic = ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "24", "--vllm.num_engines", "1"]
    dynamic += ["--actor.fused_loss", fused, "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
    baseline = train_round(env, Lopti, make_args(*dynamic))
    assert baseline.actor.packing_samples and len(baseline.strategy.steps) == 2
    assert len(spy_upstream_step) > 2  # the token budget split the steps into several micro-batches
    whole = train_round(env, Lopti, make_args(*dynamic, "--algo.lopti.eta", "1.0"))
    assert params_equal(whole, baseline)
    spy_upstream_step.clear()
    lopti = train_round(env, Lopti, make_args(*dynamic, "--algo.lopti.eta", "0.5"))
    assert [step["phase"] for step in lopti.strategy.steps] == ["low", "low", "high", "high"]
    buffer = lopti.trainer.replay_buffer
    for call in spy_upstream_step:  # "all": each micro-batch's denominators are its optimizer step's totals
        assert call["batch_num_tokens"] == buffer.dynamic_batch_num_tokens[call["step"]]
        assert call["global_batch_size"] == buffer.dynamic_global_batch_size[call["step"]]
    assert any(call["batch_num_tokens"] > call["response"].sum().item() for call in spy_upstream_step)
    assert all(torch.isfinite(p).all() for p in lopti.actor.parameters())


# ---------------------------------------------------------------- every upstream advantage estimator
ESTIMATORS = ["gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce"]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_advantage_estimator(estimator, env, float64):
    base = ["--algo.advantage.estimator", estimator]
    flags = ["--algo.ar.alpha", "0.3", "--algo.lopti.eta", "0.5", "--algo.lopti.denominator", "phase"]
    args = make_args(*base, *flags, "--actor.fused_loss", "torch")

    def upstream_advantages(experience):
        # what OpenRLHF's experience maker does to a batch, with its own code
        experience.index = list(range(len(experience.sequences)))
        experience.kl = torch.zeros_like(experience.action_log_probs)
        noise = torch.randn(experience.action_log_probs.shape, generator=torch.Generator().manual_seed(4))
        experience.values = 0.1 * noise * experience.action_mask
        kl_ctl = FixedKLController(KL_CTL)
        maker = RemoteExperienceMaker(None, None, None, None, kl_ctl, SimpleNamespace(args=args), None)
        (done,) = maker.compute_advantages_and_returns([experience])
        experience.advantages, experience.index, experience.values = done.advantages, None, None

    run = train_round(env, Lopti, args, edit=upstream_advantages, record_grads=True)
    # reference: upstream's trainer once per phase, AR and the phase written out in the test
    reference = upstream_lopti_round(env, base, eta=0.5, alpha=0.3, edit=upstream_advantages)
    with float64():
        run64 = train_round(env, Lopti, args, edit=inputs_of(run), record_grads=True)
        reference64 = upstream_lopti_round(env, base, eta=0.5, alpha=0.3, edit=inputs_of(reference))
    assert_first_step_of_each_phase_matches(run, reference, run64, reference64)
    response, p = run.experience.action_mask, run.experience.action_log_probs.exp()
    assert ((0.3 * p + 0.7 - 1).abs()[response] > 0.05).any()  # AR changes these advantages: the match above sees it
    assert (run.experience.advantages[response] != 0).any()
    assert all(torch.isfinite(p).all() for p in run.actor.parameters())


# ---------------------------------------------------------------- start-up errors
def edited_args(edit: dict):
    """Valid parsed args, then edited the way a caller building args by hand could (past the parser's checks)."""
    args = make_args()
    for dotted, value in edit.items():
        *sections, name = dotted.split(".")
        setattr(functools.reduce(getattr, sections, args), name, value)
    return args


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"actor.policy_loss_type": "gspo", "algo.lopti.eta": 0.5}, "GSPO's ratio is one per sequence"),
        (
            {"actor.fused_loss": "torch", "algo.advantage.is_correction_level": "token"},
            "does not support --algo.advantage.is_correction_level",
        ),
        ({"algo.lopti.eta": 0.5, "actor.loss_agg_mode": "seq-mean-token-mean"}, "--algo.lopti.denominator all with"),
        # each names its flag (before: algo's bare "alpha must be ...", "quantile must be ...")
        ({"algo.ar.alpha": 2.0}, r"^--algo\.ar\.alpha: alpha must be in \[0, 1\]"),
        ({"algo.lopti.quantile": float("nan")}, r"^--algo\.lopti\.quantile: quantile must be in \(0, 1\)"),
        ({"algo.lopti.eta": 0.5, "algo.lopti.order": "sideways"}, r"^--algo\.lopti\.order: order must be one of"),
    ],
)
def test_trainer_rejects_what_cannot_work_at_start_up(edit, message, env):
    args = edited_args(edit)
    with pytest.raises(ValueError, match=message):
        make_trainer(env, Lopti, args, make_actor(env, args))


def test_start_up_says_which_policy_loss_runs(env, capsys):
    blocked = {
        "actor.fused_loss": "auto", "actor.policy_loss_type": "gspo", "algo.advantage.is_correction_level": "token",
    }  # fmt: skip
    expected = [
        ({"actor.fused_loss": "torch"}, "[openrlhf-lopti] fused policy loss: --actor.fused_loss torch -> torch"),
        (
            blocked,
            "[openrlhf-lopti] --actor.fused_loss auto: using upstream's PolicyLoss because of --actor.policy_loss_type "
            "gspo (sequence-level ratio); --algo.advantage.is_correction_level (train/rollout importance-sampling "
            "correction)",
        ),
        ({"actor.fused_loss": "off"}, None),
    ]
    for edit, line in expected:
        capsys.readouterr()
        args = edited_args(edit)
        make_trainer(env, Lopti, args, make_actor(env, args))
        said = [s for s in capsys.readouterr().out.splitlines() if "policy loss" in s or "PolicyLoss" in s]
        assert said == ([line] if line else []), edit


# ---------------------------------------------------------------- the Ray actor class, in process
@pytest.mark.parametrize("shipped", [True, False], ids=["as-ray-ships-it", "plain-class"])
def test_policy_model_actor_builds_our_trainer_and_trains(shipped, env, tmp_path, spy_upstream_step):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    assert issubclass(LoptiPolicyModelActor.__ray_actor_class__, ppo_actor.PolicyModelActor.__ray_actor_class__)
    assert LoptiPolicyModelActor.__ray_metadata__.num_gpus == 1
    actor_class = LoptiPolicyModelActor.__ray_actor_class__
    if shipped:
        # What a Ray actor process runs: the class cloudpickled by value, so its methods (upstream's too) look
        # global names up in copies of their modules' globals, not in the modules.
        modified = LoptiPolicyModelActor.__ray_metadata__.modified_class
        actor_class = ray.cloudpickle.loads(ray.cloudpickle.dumps(modified))

    model = LlamaForCausalLM(env.config)
    model.load_state_dict(env.state)
    model.save_pretrained(tmp_path)
    word_level = models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(word_level), eos_token="t2", pad_token="t0")
    tokenizer.save_pretrained(tmp_path)

    args = make_args(
        "--algo.lopti.eta", "0.5", "--algo.ar.alpha", "0.3", "--actor.fused_loss", "torch",
        "--ds.attn_implementation", "sdpa", "--vllm.sync_backend", "gloo", "--train.batch_size", "2",
    )  # fmt: skip
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):  # the actor's __init__ sets them
        env.monkeypatch.setenv(key, "0")  # so that the test's teardown restores them
    policy = actor_class(1, 0, "127.0.0.1", 29500)
    strategy = get_cpu_strategy(args)
    policy.init_model_from_pretrained(strategy, str(tmp_path), max_steps=10)
    assert type(policy.trainer) is LoptiActorPPOTrainer
    upstream_class = next(c for c in actor_class.__mro__ if c.__name__ == "PolicyModelActor")
    assert upstream_class.init_model_from_pretrained.__globals__["ActorPPOTrainer"] is Upstream  # restored
    strategy.steps = record_optimizer_steps(policy.actor.model, policy.trainer, record_grads=False)

    action_mask = env.rollout.attention_mask[:, PROMPT:]
    # upstream's forward-only pass, here through our kernel (the fused loss is on): OpenRLHF's log-probs
    old = policy.forward(env.rollout.sequences, action_mask, env.rollout.attention_mask)
    experience = make_experience(env.rollout, policy.actor)  # the Actor called directly: upstream's own path
    torch.testing.assert_close(old, experience.action_log_probs, rtol=1e-5, atol=1e-6)
    policy.append(experience)
    status = policy.fit(kl_ctl=KL_CTL)
    assert [step["phase"] for step in strategy.steps] == ["low"] * 4 + ["high"] * 4
    assert {"lopti/low/policy_loss", "lopti/high/policy_loss", "ar/mean_weight", "lopti/low_token_frac"} <= set(status)
    # the values, from the rollout's probabilities by hand: AR's mean weight, the low fraction, the phases' tokens
    p, response = experience.action_log_probs.exp(), experience.action_mask.bool()
    assert status["ar/mean_weight"] == pytest.approx((0.3 * p + 0.7)[response].mean().item(), rel=1e-6)
    assert status["lopti/low_token_frac"] == pytest.approx((p[response] < 0.5).float().mean().item())
    assert 0 < status["lopti/low_token_frac"] < 1
    for call in spy_upstream_step:
        low = call["response"] & (call["old"].exp() < 0.5)
        assert torch.equal(call["mask"].bool(), low if call["phase"] == "low" else call["response"] & ~low)
    assert [call["phase"] for call in spy_upstream_step] == ["low"] * 4 + ["high"] * 4
    assert not policy.trainer.replay_buffer.items  # fit clears the buffer, as upstream


@pytest.mark.parametrize("fused", ["off", "torch"])
def test_track_direction_counts_what_the_update_did(fused, env):
    """``direction/*`` against the same counts taken by hand: the round's experience before and after the update,
    read through upstream's own Actor."""
    args = make_args("--algo.track_direction", "--algo.lopti.eta", "0.5", "--actor.fused_loss", fused)
    run = train_round(env, Lopti, args)
    experience, status = run.experience, run.status
    with torch.no_grad():
        new = run.actor(experience.sequences, experience.action_mask, experience.attention_mask)
    old, mask = experience.action_log_probs, experience.action_mask.bool()
    p = old.exp()
    for q, (low, high) in enumerate([(0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 2.0)], start=1):
        in_bin = mask & (p >= low) & (p < high)
        assert status[f"direction/tokens_q{q}"] == in_bin.sum().item()
        pos, neg = in_bin & (experience.advantages > 0), in_bin & (experience.advantages < 0)
        if pos.any():
            assert status[f"direction/pos_up_q{q}"] == pytest.approx((new > old)[pos].float().mean().item())
        if neg.any():
            assert status[f"direction/neg_down_q{q}"] == pytest.approx((new < old)[neg].float().mean().item())
    assert sum(status[f"direction/tokens_q{q}"] for q in range(1, 5)) == mask.sum().item()
