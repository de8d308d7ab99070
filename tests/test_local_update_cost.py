"""Lopti made cheaper without changing the update: the local trainer's update skips what cannot change it.

Each case compares the parameters after ``update_policy`` with those of a Lopti round written out here, from
the model's own forward and the reference loss (``algo.policy_loss_from_logits``): every micro-batch, every
response, every position, the phase's tokens as the loss mask, an optimizer step after every mini-batch.
SGD with momentum, so that an optimizer step on zero gradients (a mini-batch without a token of the phase)
still moves the weights, and a skipped one would show.
"""

import copy
import dataclasses

import pytest
import torch

import openrlhf_lopti.local.update as update_module
from openrlhf_lopti.algo import lopti_phases, policy_loss_from_logits
from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
from openrlhf_lopti.local.config import TrainConfig
from openrlhf_lopti.local.experience import Experience
from openrlhf_lopti.local.rollout import generate_rollouts, response_logits, response_logprobs
from openrlhf_lopti.local.task import compact_prompt, puzzles
from openrlhf_lopti.local.update import update_policy

from .kernel_cases import allow_float64_logits
from .numerics import Float64Shadow, assert_same_computation

N_LOW = 3  # tokens below eta: Lopti's low phase holds only these, so most of its micro-batches hold none


@pytest.fixture(scope="module")
def tiny():
    tok = build_word_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked logits: token probabilities spread over (0, 1)
    return model, tok


@pytest.fixture(scope="module")
def experience(tiny):
    """8 responses of up to 10 tokens (some end early on eos), k3 KL reference, advantages of both signs."""
    model, tok = tiny
    torch.manual_seed(0)
    records = puzzles(0, 0, 2, [2])
    rollout = generate_rollouts(model, tok, [compact_prompt(r) for r in records], 4, 10, 1.0)
    old = response_logprobs(model, rollout, 1.0)
    noise = torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    ref = (old + 0.1 * noise) * rollout.action_mask
    advantages = torch.linspace(-1.0, 1.2, len(rollout)).view(-1, 1) * rollout.action_mask
    n = len(rollout)
    return Experience(rollout, old, ref, advantages, torch.zeros(n), None, None)


def eta_with_low_tokens(exp: Experience, n_low: int) -> float:
    """A threshold with exactly ``n_low`` response tokens below it."""
    probs = exp.old_log_probs[exp.rollout.action_mask].exp().sort().values
    return float((probs[n_low - 1] + probs[n_low]) / 2)


def config(**kw) -> TrainConfig:
    base = dict(model="m", out="o", n_samples=4, prompts_per_step=2, max_new_tokens=10, temperature=1.0, lr=0.2,
                mini_batch_size=2, micro_batch_size=1, epochs=2, kl_coef=0.05, alpha=0.3, lopti=True,
                loss_backend="torch", progress=False)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def reference_round(policy, optimizer, exp: Experience, cfg: TrainConfig, generator: torch.Generator) -> list:
    """The update written out without any skipping; returns the phase's ``[b, T]`` tokens of each micro-batch."""
    rollout = exp.rollout
    params = [p for p in policy.parameters() if p.requires_grad]
    phases = lopti_phases(exp.old_log_probs, rollout.action_mask, cfg.eta, cfg.lopti_order, None)
    micro_batches = []
    policy.train()
    for phase in phases:
        if not phase.any():
            continue
        advantages = exp.advantages * phase
        for _ in range(cfg.epochs):
            for mini in torch.randperm(len(rollout), generator=generator).split(cfg.mini_batch_size):
                optimizer.zero_grad(set_to_none=True)
                denom = rollout.action_mask[mini].sum()
                for rows in mini.split(cfg.micro_batch_size):
                    mask = rollout.attention_mask[rows]
                    logits = policy(input_ids=rollout.sequences[rows], attention_mask=mask,
                                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits  # fmt: skip
                    logits = logits[:, rollout.prompt_len - 1 : -1].flatten(0, 1)
                    out = policy_loss_from_logits(
                        logits, rollout.sequences[rows, rollout.prompt_len :].flatten(),
                        exp.old_log_probs[rows].flatten(), advantages[rows].flatten(), phase[rows].flatten(),
                        ref_log_probs=exp.ref_log_probs[rows].flatten(), alpha=cfg.alpha, eps_low=cfg.eps_low,
                        eps_high=cfg.eps_high, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                        temperature=cfg.temperature,
                    )  # fmt: skip
                    (out.loss.sum() / denom).backward()
                    micro_batches.append(phase[rows])
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                optimizer.step()
    return micro_batches


class DecoderCalls:
    """The ``[b, L]`` shapes of the token ids the model's decoder ran on, one per micro-batch the update computes."""

    def __init__(self, model):
        self.shapes = []
        model.get_decoder().register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.shapes.append(tuple(kwargs["input_ids"].shape))


def run_both(model, exp: Experience, cfg: TrainConfig) -> tuple:
    """``(ours, reference)``: each ``(policy after the update, decoder forwards, extra)``."""
    runs = []
    for update in (update_policy, reference_round):
        policy = copy.deepcopy(model)
        calls = DecoderCalls(policy)
        optimizer = torch.optim.SGD(policy.parameters(), lr=cfg.lr, momentum=0.9)
        extra = update(policy, optimizer, exp, cfg, torch.Generator().manual_seed(0))
        runs.append((policy, calls.shapes, extra))
    return tuple(runs)


def assert_same_parameters(model, ours, reference, experience: Experience, cfg: TrainConfig, monkeypatch) -> None:
    """The same update, by the rule of tests/numerics.py: both rounds run again on float64 copies of the model and
    the experience (the fused loss's torch backend widened to float64 in tests) and must agree to float64
    rounding; each fp32 round's error against its float64 run is judged against the other's (SGD with
    momentum: no AdamW step in between)."""
    allow_float64_logits(monkeypatch)
    doubled = {k: getattr(experience, k).double() for k in ("old_log_probs", "ref_log_probs", "advantages", "rewards")}
    with Float64Shadow():
        experience64 = dataclasses.replace(experience, **doubled)
        (ours64, _, _), (reference64, _, _) = run_both(copy.deepcopy(model).double(), experience64, cfg)
    runs = zip(model.named_parameters(), ours.parameters(), reference.parameters(), ours64.parameters(),
               reference64.parameters())  # fmt: skip
    for (name, _), *tensors in runs:
        assert_same_computation(name, *tensors, a_name="update_policy", b_name="written out")
    moved = max(float((b - start).detach().abs().max()) for start, b in zip(model.parameters(), reference.parameters()))
    assert moved > 1e-3  # the update did something to compare


@pytest.mark.parametrize("fused_lm_head", [False, True])
def test_micro_batches_without_a_phase_token_are_skipped_and_the_update_is_unchanged(tiny, experience, fused_lm_head,
                                                                                     monkeypatch):  # fmt: skip
    model, _ = tiny
    cfg = config(eta=eta_with_low_tokens(experience, N_LOW), fused_lm_head=fused_lm_head)
    (ours, our_forwards, metrics), (reference, _, micro_batches) = run_both(model, experience, cfg)
    phase_tokens = [int(tokens.sum()) for tokens in micro_batches]
    assert metrics["lopti/low/tokens"] == N_LOW
    assert phase_tokens.count(0) >= 8  # micro-batches of one response, 3 low tokens: most hold none
    # whole mini-batches of the low phase without a low token: their optimizer step must still happen
    pairs = [phase_tokens[i : i + 2] for i in range(0, 16, 2)]  # the low phase: 2 epochs x 4 mini-batches of 2
    assert [0, 0] in pairs
    assert len(our_forwards) == sum(1 for n in phase_tokens if n > 0)  # no forward (nor backward) for the others
    assert metrics["optimizer_steps"] == 2 * 2 * 4  # 2 phases x 2 epochs x 4 mini-batches: none dropped
    assert_same_parameters(model, ours, reference, experience, cfg, monkeypatch)


class LossHeadRows:
    """Records the rows each call of the update's loss head gets, then runs the real function."""

    def __init__(self, real):
        self.real, self.rows = real, []

    def __call__(self, rows, *args, **kwargs):
        self.rows.append(rows.shape[0])
        return self.real(rows, *args, **kwargs)


@pytest.mark.parametrize("fused_lm_head", [False, True])
def test_each_forward_runs_on_the_phases_responses_up_to_its_last_token(tiny, experience, fused_lm_head, monkeypatch):
    """Micro-batches of 4: the decoder runs only on the responses holding a token of the phase, cut after the
    micro-batch's last such token (later positions cannot change earlier outputs of a causal LM), and the lm_head
    and loss only on the phase's tokens; the update is the one written out."""
    model, _ = tiny
    cfg = config(eta=eta_with_low_tokens(experience, N_LOW), fused_lm_head=fused_lm_head, micro_batch_size=4,
                 mini_batch_size=8, epochs=1)  # fmt: skip
    name = "fused_linear_policy_loss" if fused_lm_head else "fused_policy_loss"
    head = LossHeadRows(getattr(update_module, name))
    monkeypatch.setattr(update_module, name, head)
    (ours, our_forwards, metrics), (reference, _, micro_batches) = run_both(model, experience, cfg)
    prompt_len = experience.rollout.prompt_len
    expected = []
    for tokens in micro_batches:
        responses = tokens.any(-1)
        if responses.any():
            last = int(tokens.any(0).nonzero().max())
            expected.append((int(responses.sum()), prompt_len + last + 1))
    assert our_forwards == expected
    # the low phase (its 2 micro-batches come first): 3 tokens, so at most 3 responses, cut before the end
    low = [(int(t.any(-1).sum()), int(t.any(0).nonzero().max()) + 1) for t in micro_batches[:2] if t.any()]
    assert sum(n for n, _ in low) <= N_LOW and min(last for _, last in low) < micro_batches[0].shape[1]
    assert head.rows == [int(tokens.sum()) for tokens in micro_batches if tokens.any()]
    assert metrics["lopti/low/tokens"] == N_LOW and metrics["optimizer_steps"] == 2
    assert_same_parameters(model, ours, reference, experience, cfg, monkeypatch)


def test_response_logits_run_the_lm_head_on_the_response_positions_only(tiny, experience):
    """The prompt's logits are never used: the lm_head runs on the T positions predicting response tokens, and
    their logits equal the full forward's."""
    model, _ = tiny
    rollout = experience.rollout
    inputs = []
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: inputs.append(args[0].shape))
    try:
        logits = response_logits(model, rollout)
    finally:
        handle.remove()
    batch, width = rollout.action_mask.shape
    assert inputs == [(batch, width, model.config.hidden_size)]
    mask = rollout.attention_mask

    def full(model):
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        return model(input_ids=rollout.sequences, attention_mask=mask, position_ids=position_ids).logits

    # the same values by the rule of tests/numerics.py: both again on a float64 copy of the model
    model64 = copy.deepcopy(model).double()
    with Float64Shadow():
        logits64, full64 = response_logits(model64, rollout), full(model64)
    cut = slice(rollout.prompt_len - 1, -1)
    assert_same_computation("logits", logits, full(model)[:, cut], logits64, full64[:, cut], "response_logits", "full")
