"""Rollouts and the policy update on a tiny random Llama: loss goes down, Lopti's phases run in order."""

import copy

import pytest
import torch

import openrlhf_lopti.local.update as update_module
from openrlhf_lopti.algo import policy_loss_from_logp, token_logprobs
from openrlhf_lopti.local.config import TrainConfig
from openrlhf_lopti.local.experience import Experience, make_experience
from openrlhf_lopti.local.model import build_tiny_llama, build_word_tokenizer
from openrlhf_lopti.local.rollout import generate_rollouts, response_logits, response_logprobs
from openrlhf_lopti.local.task import compact_prompt, puzzles
from openrlhf_lopti.local.update import update_policy


@pytest.fixture(scope="module")
def tiny():
    tok = build_word_tokenizer()
    return build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0), tok


@pytest.fixture(scope="module")
def peaked(tiny):
    """The tiny model with large output logits, so sampled tokens spread over (0, 1) in probability."""
    model, tok = tiny
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # tied to the input embedding, which is fine here
    return model, tok


def cfg_for(**kw):
    base = dict(model="m", out="o", n_samples=4, prompts_per_step=2, max_new_tokens=8, temperature=1.0,
                mini_batch_size=8, kl_coef=0.0, loss_backend="torch", progress=False)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def sample(model, tok, prompts=2, n=4, new=8, temperature=1.0, seed=0):
    torch.manual_seed(seed)
    records = puzzles(0, 0, prompts, [2])
    return generate_rollouts(model, tok, [compact_prompt(r) for r in records], n, new, temperature)


def fixed_experience(model, tok, temperature=1.0, seed=0):
    """A batch with advantages +1 / -1 on alternate responses (a stand-in for rewards)."""
    rollout = sample(model, tok, temperature=temperature, seed=seed)
    old = response_logprobs(model, rollout, temperature)
    sign = torch.tensor([1.0, -1.0] * (len(rollout) // 2)).view(-1, 1)
    adv = sign * rollout.action_mask
    n = len(rollout)
    flags = torch.zeros(n, dtype=torch.bool)
    return Experience(rollout, old, None, adv, torch.zeros(n), flags, ~flags)


def test_rollout_masks_stop_after_eos(tiny):
    model, tok = tiny
    rollout = sample(model, tok, new=12)
    response = rollout.sequences[:, rollout.prompt_len :]
    assert rollout.sequences.shape[0] == 8 and response.shape[1] <= 12
    for row, mask in zip(response, rollout.action_mask):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # contiguous from the first response token
        eos = (row == tok.eos_token_id).nonzero()
        if len(eos):
            assert n == int(eos[0]) + 1  # the eos itself is trained on, nothing after it
        assert (row[n:] == tok.pad_token_id).all()
    assert rollout.attention_mask[:, rollout.prompt_len :].bool().equal(rollout.action_mask)


def test_training_forward_sees_what_generate_saw(tiny):
    """Left-padded prompts: our position ids must reproduce generate's logits exactly."""
    model, tok = tiny
    records = puzzles(0, 0, 3, [2, 3])  # different prompt lengths, so there is left padding
    enc = tok([compact_prompt(r) for r in records], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=5, do_sample=True, top_k=0, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=tok.pad_token_id, eos_token_id=-1)  # fmt: skip
    from openrlhf_lopti.local.rollout import Rollout

    p = enc["input_ids"].shape[1]
    attn = torch.cat([enc["attention_mask"], torch.ones_like(out.sequences[:, p:])], 1)
    rollout = Rollout(out.sequences, attn, torch.ones_like(out.sequences[:, p:], dtype=torch.bool), p, [])
    assert torch.allclose(response_logits(model, rollout), torch.stack(out.logits, 1), atol=1e-5)


def test_response_logprobs_match_token_logprobs_and_are_zero_outside(tiny):
    model, tok = tiny
    rollout = sample(model, tok)
    lp = response_logprobs(model, rollout, 0.7, micro_batch_size=3)
    logits = response_logits(model, rollout)
    labels = rollout.sequences[:, rollout.prompt_len :]
    ref, _ = token_logprobs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), 0.7)
    ref = ref.view_as(lp) * rollout.action_mask
    assert torch.allclose(lp, ref, atol=1e-6)
    assert (lp[~rollout.action_mask] == 0).all()


def surrogate(model, exp, cfg):
    logits = response_logits(model, exp.rollout)[exp.rollout.action_mask]
    labels = exp.rollout.sequences[:, exp.rollout.prompt_len :][exp.rollout.action_mask]
    logp, _ = token_logprobs(logits, labels, cfg.temperature)
    rows = exp.rollout.action_mask
    return float(policy_loss_from_logp(logp, exp.old_log_probs[rows], exp.advantages[rows]).loss.mean().detach())


@pytest.mark.parametrize("lopti", [False, True])
def test_loss_decreases_on_a_fixed_batch(tiny, lopti):
    model, tok = tiny
    model = copy.deepcopy(model)
    exp = fixed_experience(model, tok)
    cfg = cfg_for(lopti=lopti, lopti_quantile=0.5 if lopti else None, alpha=0.3, lr=1e-2, mini_batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses = [surrogate(model, exp, cfg)]
    for _ in range(5):
        metrics = update_policy(model, optimizer, exp, cfg, torch.Generator().manual_seed(0))
        losses.append(surrogate(model, exp, cfg))
    assert losses[-1] < losses[0] - 0.05, losses
    assert metrics["optimizer_steps"] == (4 if lopti else 2)  # 8 responses / 4 per mini-batch, per phase
    assert metrics["grad_norm"] > 0


class Spy:
    """Records every call to fused_policy_loss made by the update, then runs the real function."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, logits, labels, old, adv, mask, **kw):
        record = dict(logits=logits.detach().clone(), labels=labels, old=old, adv=adv, mask=mask.clone())
        self.calls.append({**record, **kw})
        return self.real(logits, labels, old, adv, mask, **kw)


@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_lopti_runs_two_phases_in_order_on_updated_weights(peaked, monkeypatch, order):
    model, tok = peaked
    model = copy.deepcopy(model)
    exp = fixed_experience(model, tok, temperature=1.0)
    spy = Spy(update_module.fused_policy_loss)
    monkeypatch.setattr(update_module, "fused_policy_loss", spy)
    cfg = cfg_for(lopti=True, lopti_order=order, eta=0.5, alpha=0.3, temperature=1.0, lr=1e-2)
    start = response_logits(model, exp.rollout)[exp.rollout.action_mask].detach()
    metrics = update_policy(model, torch.optim.SGD(model.parameters(), lr=cfg.lr), exp, cfg)

    probs = exp.old_log_probs[exp.rollout.action_mask].exp()
    low, high = probs < 0.5, probs >= 0.5
    assert low.any() and high.any()
    assert len(spy.calls) == 2  # one mini-batch holds the whole batch: one call per phase
    first, second = spy.calls
    expected = (low, high) if order == "low_first" else (high, low)
    for call, tokens in zip((first, second), expected):
        # rows come in shuffled order: compare as sets of (old log-prob, label) pairs
        chosen = sorted(zip(call["old"][call["mask"]].tolist(), call["labels"][call["mask"]].tolist()))
        rows = exp.rollout.action_mask
        labels = exp.rollout.sequences[:, exp.rollout.prompt_len :][rows]
        want = sorted(zip(exp.old_log_probs[rows][tokens].tolist(), labels[tokens].tolist()))
        assert chosen == want
        assert (call["adv"][~call["mask"]] == 0).all()  # other-phase advantages are zeroed
        assert call["alpha"] == 0.3 and call["temperature"] == 1.0
    assert metrics["phase1_tokens"] == int(expected[0].sum()) and metrics["phase2_tokens"] == int(expected[1].sum())
    # phase 2 recomputed its forward with the weights phase 1 changed (rows are permuted: compare sorted values;
    # each call holds its phase's tokens only)
    assert not torch.allclose(second["logits"].sort(0).values, start[expected[1]].sort(0).values)
    assert torch.allclose(first["logits"].sort(0).values, start[expected[0]].sort(0).values, atol=1e-6)


def test_lopti_token_mean_uses_all_response_tokens(peaked):
    """With a zero learning rate the two phases' losses add up to plain GRPO's loss on the batch."""
    model, tok = peaked
    exp = fixed_experience(model, tok, temperature=1.0)
    losses = {}
    probs = exp.old_log_probs[exp.rollout.action_mask].exp()
    assert (probs < 0.5).any() and (probs >= 0.5).any()
    for lopti in (False, True):
        cfg = cfg_for(lopti=lopti, mini_batch_size=3)
        m = update_policy(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0), exp, cfg)
        losses[lopti] = m
    assert losses[True]["phase1_tokens"] + losses[True]["phase2_tokens"] == int(exp.rollout.action_mask.sum())
    assert losses[True]["loss"] == pytest.approx(losses[False]["loss"], abs=1e-6)
    assert losses[True]["phase1_loss"] + losses[True]["phase2_loss"] == pytest.approx(losses[False]["loss"], abs=1e-6)


def test_an_empty_phase_is_skipped(tiny):
    model, tok = tiny
    exp = fixed_experience(model, tok, temperature=1.0)  # random model: every p << 0.99
    cfg = cfg_for(lopti=True, eta=0.99)
    m = update_policy(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=1e-3), exp, cfg)
    assert m["phase2_tokens"] == 0 and m["phase1_tokens"] > 0
    assert m["optimizer_steps"] == 1


def test_make_experience_scores_and_normalises_groups(tiny):
    model, tok = tiny
    records = puzzles(0, 0, 2, [2])
    cfg = cfg_for(kl_coef=0.001)
    torch.manual_seed(0)
    exp = make_experience(model, model, tok, records, [compact_prompt(r) for r in records], cfg)
    assert exp.rewards.shape == (8,) and exp.ref_log_probs.shape == exp.old_log_probs.shape
    assert torch.equal(exp.ref_log_probs, exp.old_log_probs)  # reference = the same weights here
    assert (exp.rewards == -3.0).all()  # a random model writes no tags: format -1, answer -2
    assert (exp.advantages == 0).all()  # all-equal groups
