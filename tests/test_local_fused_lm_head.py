"""``--fused-lm-head`` in the local trainer: the update and the log-prob passes take the last hidden states and
the lm_head weight (tied to the embedding in the tiny Llama), never the model's logits, and give the same
parameters and log-probs as the unfused path."""

import copy

import pytest
import torch

import openrlhf_lopti.local.experience as experience_module
from openrlhf_lopti.algo import token_logprobs
from openrlhf_lopti.local.cli import build_parser, config_from_args
from openrlhf_lopti.local.config import TrainConfig
from openrlhf_lopti.local.experience import Experience, make_experience
from openrlhf_lopti.local.model import build_tiny_llama, build_word_tokenizer, lm_head_parts
from openrlhf_lopti.local.rollout import generate_rollouts, response_logprobs
from openrlhf_lopti.local.task import compact_prompt, puzzles
from openrlhf_lopti.local.update import update_policy
from openrlhf_lopti.ops.cpp_policy_loss import cpp_available


@pytest.fixture(scope="module")
def tiny():
    tok = build_word_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked logits: token probabilities on both sides of Lopti's eta
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied
    return model, tok


def cfg_for(**kw) -> TrainConfig:
    base = dict(model="m", out="o", n_samples=4, prompts_per_step=2, max_new_tokens=8, temperature=0.8,
                mini_batch_size=4, micro_batch_size=3, progress=False)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def rollout_of(model, tok, seed=0):
    torch.manual_seed(seed)
    records = puzzles(0, 0, 2, [2])
    return records, generate_rollouts(model, tok, [compact_prompt(r) for r in records], 4, 8, 0.8)


class LmHeadCalls:
    """Counts forward calls of the model's lm_head (the module that makes the [B, T, V] logits)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.get_output_embeddings().register_forward_hook(self.hook)

    def hook(self, *_):
        self.count += 1


def test_response_logprobs_fused_matches_token_logprobs(tiny):
    model, tok = tiny
    _, rollout = rollout_of(model, tok)
    fused = response_logprobs(model, rollout, 0.8, micro_batch_size=3, fused_lm_head=True, backend="torch")
    with torch.no_grad():
        logits = model(input_ids=rollout.sequences, attention_mask=rollout.attention_mask,
                       position_ids=(rollout.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits  # fmt: skip
    logits = logits[:, rollout.prompt_len - 1 : -1]
    labels = rollout.sequences[:, rollout.prompt_len :]
    want, _ = token_logprobs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), 0.8)
    want = want.view_as(fused) * rollout.action_mask
    torch.testing.assert_close(fused, want, atol=1e-5, rtol=1e-5)
    assert torch.all(fused[~rollout.action_mask] == 0)


@pytest.mark.parametrize("backend", ["torch"] + (["cpp"] if cpp_available() else []))
def test_update_with_fused_lm_head_equals_unfused(tiny, backend):
    """Same batch, same seeds: parameters after the update agree to fp32 tolerance (Lopti's two phases,
    AR, k3 KL through logp, micro-batches of 3 responses)."""
    model, tok = tiny
    records, rollout = rollout_of(model, tok)
    old = response_logprobs(model, rollout, 0.8)
    ref = old + 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * rollout.action_mask
    sign = torch.tensor([1.0, -1.0] * 4).view(-1, 1)
    exp = Experience(rollout, old, ref, sign * rollout.action_mask, torch.zeros(8), torch.zeros(8, dtype=torch.bool),
                     torch.ones(8, dtype=torch.bool))  # fmt: skip
    after, metrics = [], []
    for fused in (False, True):
        cfg = cfg_for(fused_lm_head=fused, loss_backend=backend, lopti=True, alpha=0.3, kl_coef=0.05, lr=0.5)
        policy = copy.deepcopy(model)
        optimizer = torch.optim.SGD(policy.parameters(), lr=cfg.lr)  # AdamW's first step is sign(g): too lenient
        metrics.append(update_policy(policy, optimizer, exp, cfg, torch.Generator().manual_seed(0)))
        after.append(dict(policy.named_parameters()))
    assert metrics[0]["phase1_tokens"] > 0 and metrics[0]["phase2_tokens"] > 0
    for key in ("loss", "entropy", "clip_ratio", "grad_norm", "phase1_loss", "phase2_loss"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5, abs=1e-7), key
    moved = 0.0
    for name, start in model.named_parameters():
        torch.testing.assert_close(after[1][name], after[0][name], atol=1e-6, rtol=1e-5)
        moved = max(moved, float((after[0][name] - start).detach().abs().max()))
    assert moved > 1e-3  # the step did something to compare


def test_no_logits_in_experience_or_update_with_fused_lm_head(tiny, monkeypatch):
    model, tok = tiny
    records, rollout = rollout_of(model, tok)  # sampling itself needs the logits: done before counting
    monkeypatch.setattr(experience_module, "generate_rollouts", lambda *a, **k: rollout)
    prompts = [compact_prompt(r) for r in records]
    for fused in (True, False):
        policy, reference = copy.deepcopy(model), copy.deepcopy(model)
        calls = [LmHeadCalls(policy), LmHeadCalls(reference)]
        cfg = cfg_for(fused_lm_head=fused, kl_coef=0.01, loss_backend="torch")
        exp = make_experience(policy, reference, tok, records, prompts, cfg)
        update_policy(policy, torch.optim.SGD(policy.parameters(), lr=0.1), exp, cfg)
        counts = [c.count for c in calls]
        assert counts == [0, 0] if fused else min(counts) > 0, (fused, counts)


def test_cli_flag_sets_the_config_field():
    args = build_parser().parse_args(["--model", "m", "--out", "o", "--fused-lm-head"])
    assert config_from_args(args).fused_lm_head is True
    args = build_parser().parse_args(["--model", "m", "--out", "o"])
    assert config_from_args(args).fused_lm_head is False


def test_models_that_transform_their_logits_are_refused(tiny):
    model, _ = tiny
    model = copy.deepcopy(model)
    assert lm_head_parts(model)[0] is model.get_input_embeddings().weight
    model.config.final_logit_softcapping = 30.0  # Gemma 2's soft cap: lm_head(hidden) would not be the logits
    with pytest.raises(ValueError, match="fused_lm_head does not support .*final_logit_softcapping=30.0"):
        lm_head_parts(model)
