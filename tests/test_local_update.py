"""Rollouts and the policy update on a tiny random Llama: loss goes down, Lopti's phases run in order."""

import copy
import dataclasses
import math
import time

import pytest
import torch

import openrlhf_lopti.local.update as update_module
from openrlhf_lopti.algo import policy_loss_from_logp, token_logprobs
from openrlhf_lopti.local.config import TrainConfig
from openrlhf_lopti.local.experience import Experience, make_experience
from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
from openrlhf_lopti.local.rollout import Rollout, generate_rollouts, response_logits, response_logprobs
from openrlhf_lopti.local.task import compact_prompt, puzzles
from openrlhf_lopti.local.update import build_optimizers, phase_part, update_policy

from .kernel_cases import allow_float64_logits, textbook_policy_loss
from .numerics import Float64Shadow, assert_all_same_computation, assert_same_computation, scalars_same_computation


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
        fields = dataclasses.asdict(kw["options"]) if kw.get("options") is not None else {}
        self.calls.append({**record, **fields, **kw})
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
    model64, exp64 = float64_copy(model, exp)  # for the float64 run of the phase-1 comparison below
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
        # every option reaches the loss (cfg_for's values, TrainConfig's defaults otherwise)
        forwarded = {key: call[key] for key in ("eps_low", "eps_high", "kl_coef", "kl_estimator", "backend")}
        assert forwarded == {"eps_low": 0.2, "eps_high": 0.24, "kl_coef": 0.0, "kl_estimator": "k3", "backend": "torch"}
    first_name, second_name = ("low", "high") if order == "low_first" else ("high", "low")
    assert metrics[f"lopti/{first_name}/tokens"] == int(expected[0].sum())
    assert metrics[f"lopti/{second_name}/tokens"] == int(expected[1].sum())
    # phase 2 recomputed its forward with the weights phase 1 changed (rows are permuted: compare sorted values;
    # each call holds its phase's tokens only)
    assert not torch.allclose(second["logits"].sort(0).values, start[expected[1]].sort(0).values)
    # phase 1 ran on the starting weights: its logits are the starting ones, by the rule of tests/numerics.py (the
    # update and the forward again on float64 copies; sorted per column, as the rows come shuffled)
    spy64 = Spy(update_module.fused_policy_loss.real)
    monkeypatch.setattr(update_module, "fused_policy_loss", spy64)
    allow_float64_logits(monkeypatch)
    with Float64Shadow():
        start64 = response_logits(model64, exp64.rollout)[exp64.rollout.action_mask].detach()
        update_policy(model64, torch.optim.SGD(model64.parameters(), lr=cfg.lr), exp64, cfg)
    first64 = spy64.calls[0]["logits"]
    sorted_logits = [x.sort(0).values for x in (first["logits"], start[expected[0]], first64, start64[expected[0]])]
    assert_same_computation("phase-1 logits", *sorted_logits, "phase 1", "start")


def test_per_phase_moments_keep_phase_1_out_of_phase_2s_step(peaked):
    """``lopti_moments="per-phase"``: phase 2 steps with its own optimizer. With SGD momentum 0.9 and one
    mini-batch, the paper's shared optimizer ends the round with momentum buffer ``0.9 g1 + g2`` (phase 2's step
    carries phase 1's gradient); per-phase, phase 1's buffer is ``g1`` and phase 2's is ``g2``, the same
    gradients (phase 1 is identical in both, so phase 2 starts from the same weights), and phase 2 moved the
    weights by ``-lr g2`` alone."""
    model, tok = peaked
    exp = fixed_experience(model, tok, temperature=1.0)
    settings = dict(lopti=True, eta=0.5, lr=1e-2, optimizer="sgd", momentum=0.9, grad_clip=0.0)
    shared_cfg, split_cfg = cfg_for(**settings), cfg_for(**settings, lopti_moments="per-phase")
    shared_model, split_model = copy.deepcopy(model), copy.deepcopy(model)
    shared = build_optimizers(list(shared_model.parameters()), shared_cfg)
    split = build_optimizers(list(split_model.parameters()), split_cfg)
    assert len(shared) == 1 and len(split) == 2 and split[0] is not split[1]
    assert len(build_optimizers(list(model.parameters()), cfg_for(lopti_moments="per-phase"))) == 1  # no Lopti
    update_policy(shared_model, shared, exp, shared_cfg, torch.Generator().manual_seed(0))
    update_policy(split_model, split, exp, split_cfg, torch.Generator().manual_seed(0))
    # Bounds from the computation: a few fp32 roundings of the summed magnitudes (weights p ~ 1 and steps
    # lr * g ~ 1e-3 are added and subtracted, so the bound is relative to |p|, not to the step).
    eps = torch.finfo(torch.float32).eps
    for p, q, r in zip(model.parameters(), split_model.parameters(), shared_model.parameters()):
        g1, g2 = split[0].state[q]["momentum_buffer"], split[1].state[q]["momentum_buffer"]
        buffer = shared[0].state[r]["momentum_buffer"]
        assert ((buffer - (0.9 * g1 + g2)).abs() <= 4 * eps * (0.9 * g1.abs() + g2.abs())).all()
        moved, expected = q.detach() - p.detach(), -1e-2 * (g1 + g2)
        assert ((moved - expected).abs() <= 4 * eps * (p.detach().abs() + 1e-2 * (g1.abs() + g2.abs()))).all()
    assert any(float(split[1].state[q]["momentum_buffer"].abs().max()) > 0 for q in split_model.parameters())
    with pytest.raises(ValueError, match="one per phase"):
        update_policy(copy.deepcopy(model), split * 2, exp, split_cfg)


def test_lopti_lr_scale_scales_lopti_steps_only(peaked):
    """``lopti_lr_scale=s``: Lopti at lr L steps exactly as Lopti at lr ``s * L`` (both phases); GRPO ignores it."""
    model, tok = peaked
    exp = fixed_experience(model, tok, temperature=1.0)

    def updated(**settings):
        cfg, policy = cfg_for(grad_clip=0.0, **settings), copy.deepcopy(model)  # eta unset: the paper's 0.5
        optimizers = build_optimizers(list(policy.parameters()), cfg)
        update_policy(policy, optimizers, exp, cfg, torch.Generator().manual_seed(0))
        return [optimizers[0].param_groups[0]["lr"], *policy.parameters()]

    def same(a, b):
        return a[0] == b[0] and all(torch.equal(p, q) for p, q in zip(a[1:], b[1:]))

    for optimizer in ("adamw", "sgd"):
        scaled = updated(lopti=True, lr=0.02, lopti_lr_scale=0.25, optimizer=optimizer)
        assert scaled[0] == 0.005 and same(scaled, updated(lopti=True, lr=0.005, optimizer=optimizer))
        assert not same(scaled, updated(lopti=True, lr=0.02, optimizer=optimizer))
        assert same(updated(lr=0.02, lopti_lr_scale=0.25, optimizer=optimizer), updated(lr=0.02, optimizer=optimizer))


def test_lopti_token_mean_uses_all_response_tokens(peaked, float64):
    """With a zero learning rate the two phases' losses add up to plain GRPO's loss on the batch (the rule of
    tests/numerics.py: the same comparison in float64 on float64 copies must hold to float64 rounding)."""
    model, tok = peaked
    exp = fixed_experience(model, tok, temperature=1.0)
    probs = exp.old_log_probs[exp.rollout.action_mask].exp()
    assert (probs < 0.5).any() and (probs >= 0.5).any()

    def losses(model, exp):
        runs = {}
        for lopti in (False, True):
            cfg = cfg_for(lopti=lopti, mini_batch_size=3)
            policy = copy.deepcopy(model)
            runs[lopti] = update_policy(policy, torch.optim.SGD(policy.parameters(), lr=0.0), exp, cfg)
        return runs

    runs = losses(model, exp)
    with float64():
        runs64 = losses(*float64_copy(model, exp))
    assert runs[True]["lopti/low/tokens"] + runs[True]["lopti/high/tokens"] == int(exp.rollout.action_mask.sum())
    for name, of in (("loss", lambda m: m["loss"]), ("phase sum", lambda m: m["lopti/low/policy_loss"] + m["lopti/high/policy_loss"])):
        scalars_same_computation(name, of(runs[True]), runs[False]["loss"], of(runs64[True]), runs64[False]["loss"],
                                 a_name="lopti", b_name="grpo")  # fmt: skip


def test_an_empty_phase_is_skipped(tiny):
    model, tok = tiny
    exp = fixed_experience(model, tok, temperature=1.0)  # random model: every p << 0.99
    cfg = cfg_for(lopti=True, eta=0.99)
    m = update_policy(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=1e-3), exp, cfg)
    assert m["lopti/high/tokens"] == 0 and m["lopti/low/tokens"] > 0
    assert m["optimizer_steps"] == 1
    # the empty phase logs its token count only, as every front end (a 0 loss or grad norm would read as measured)
    assert [key for key in m if key.startswith("lopti/high/")] == ["lopti/high/tokens"]
    low = {key.split("/")[-1] for key in m if key.startswith("lopti/low/")}
    assert {"policy_loss", "clip_ratio", "grad_norm", "train_s"} <= low


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


# ---- the update against the loss written out (issue 17, survivors of the mutation run of local/update.py) ----
# Reference: `textbook_policy_loss` (tests/kernel_cases.py, the per-token loss from its definition) on
# `response_logits` of the whole, untrimmed rollout; token-mean over every response token of the batch; the step
# and the clip written out below (SGD: w - lr * g * min(1, clip / (|g| + 1e-6))).


def written_experience(model, tok, seed=0):
    """Old log-probs away from the current ones (so some ratios clip), a reference that differs, random advantages."""
    rollout = sample(model, tok, seed=seed)
    mask = rollout.action_mask
    g = torch.Generator().manual_seed(seed)
    logp = response_logprobs(model, rollout, 1.0).detach()
    old = (logp + 0.3 * torch.randn(logp.shape, generator=g)).clamp(max=-1e-3) * mask
    ref = (logp + 0.5 * torch.randn(logp.shape, generator=g)) * mask
    adv = torch.randn(len(rollout), 1, generator=g) * mask
    n = len(rollout)
    flags = torch.zeros(n, dtype=torch.bool)
    return Experience(rollout, old, ref, adv, torch.zeros(n), flags, ~flags)


def written_loss(model, exp, cfg, tokens, kl_coef):
    """textbook per-token loss of the ``tokens [B, T]`` (bool) under ``model``, in float64."""
    logits = response_logits(model, exp.rollout)[tokens]
    labels = exp.rollout.sequences[:, exp.rollout.prompt_len :][tokens]
    inputs = dict(labels=labels, old_log_probs=exp.old_log_probs[tokens], advantages=exp.advantages[tokens],
                  mask=torch.ones_like(labels, dtype=torch.bool), ref_log_probs=exp.ref_log_probs[tokens])  # fmt: skip
    opts = dict(temperature=cfg.temperature, alpha=cfg.alpha, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                dual_clip=None, kl_estimator=cfg.kl_estimator, kl_coef=kl_coef)  # fmt: skip
    out = textbook_policy_loss(inputs, opts, logits)
    return {**{key: value.detach() for key, value in out.items()}, "loss": out["loss"]}


def written_grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return grads, float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))


def with_biased_head(model, seed=0):
    """The model with its lm_head replaced by an untied Linear with a random bias (HF's forward adds it)."""
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.copy_(torch.randn(head.out_features, generator=torch.Generator().manual_seed(seed)))
    model.set_output_embeddings(biased)
    return model


@pytest.fixture
def float64(monkeypatch):
    """``with float64(): ...`` runs under tests.numerics.Float64Shadow (float64 runs of a whole update; the fused
    loss's torch backend widened to take float64 in tests)."""
    allow_float64_logits(monkeypatch)
    return Float64Shadow


def float64_copy(model, exp):
    """The same model and experience as float64 (exact copies), for the float64 run of a comparison."""
    doubled = {k: getattr(exp, k).double() for k in ("old_log_probs", "ref_log_probs", "advantages", "rewards")
               if getattr(exp, k) is not None}  # fmt: skip
    return copy.deepcopy(model).double(), dataclasses.replace(exp, **doubled)


def one_step_both_ways(model, exp, cfg, kl_coef, grad_clip, lr):
    """One SGD step by ``update_policy`` and by the loss written out: ``(ours, written)``, each a dict of the
    metrics and ``after`` (the parameters after the step: ``p - lr * g`` written out, as the original test did; a
    step recovered by subtracting fp32 parameters would carry a rounding of |p|, not of the step), plus the written
    loss's outputs and grad norm."""
    mask = exp.rollout.action_mask
    n = int(mask.sum())
    reference = copy.deepcopy(model)
    out = written_loss(reference, exp, cfg, mask, kl_coef)
    grads, norm = written_grads(reference, out["loss"].sum() / n)
    scale = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip > 0 else 1.0
    written = dict(loss=float(out["loss"].detach().sum()) / n, entropy=float(out["entropy"].mean()), grad_norm=norm,
                   clip_ratio=float(out["clipped"].double().mean()),
                   after=[p.detach() - lr * scale * g for p, g in zip(model.parameters(), grads)])  # fmt: skip
    policy = copy.deepcopy(model)
    m = update_policy(policy, torch.optim.SGD(policy.parameters(), lr=lr), exp, cfg, torch.Generator().manual_seed(0))
    assert all(p.grad is None for p in policy.parameters())  # gradients freed after the update
    ours = dict(m, after=[p.detach() for p in policy.parameters()])
    return ours, written, out, norm


@pytest.mark.parametrize(
    "estimator, grad_clip, fused_lm_head",
    [("grpo", 0.05, False), ("grpo", 0.0, False), ("reinforce++", 0.05, False), ("grpo", 0.05, True)],
)
def test_one_step_matches_the_loss_written_out(peaked, estimator, grad_clip, fused_lm_head, float64):
    """One SGD step against the loss written out; with ``fused_lm_head``, on an lm_head with a bias (the HF
    forward's logits, bias included, are the reference). "The same step" by the rule of tests/numerics.py: both
    run again on a float64 copy of the model and experience and must agree to float64 rounding; each fp32 run's
    error against its float64 run is judged against the other's (SGD: no AdamW in between)."""
    model, tok = peaked
    model = copy.deepcopy(model)
    if fused_lm_head:
        model = with_biased_head(model)
        assert model.get_output_embeddings().bias is not None
    exp = written_experience(model, tok)
    cfg = cfg_for(estimator=estimator, kl_coef=1.0, kl_estimator="k2", eps_low=0.1, eps_high=0.3, alpha=0.3,
                  grad_clip=grad_clip, mini_batch_size=8, micro_batch_size=3, fused_lm_head=fused_lm_head)  # fmt: skip
    kl_coef = 1.0 if estimator == "grpo" else 0.0  # REINFORCE++ has its KL in the reward, not in the loss
    lr = 0.1
    ours, written, out, norm = one_step_both_ways(model, exp, cfg, kl_coef, grad_clip, lr)
    with float64():
        ours64, written64, _, _ = one_step_both_ways(*float64_copy(model, exp), cfg, kl_coef, grad_clip, lr)
    assert grad_clip == 0 or norm > 2 * grad_clip  # the clip is exercised
    assert 0 < written["clip_ratio"] < 1  # micro-batches of 3 responses: several hold clipped tokens
    assert ours["optimizer_steps"] == 1
    assert ours["clip_ratio"] == pytest.approx(written["clip_ratio"], rel=1e-6)  # a count: the same tokens clip
    for key in ("loss", "entropy", "grad_norm"):
        scalars_same_computation(key, ours[key], written[key], ours64[key], written64[key], a_name="update_policy",
                                 b_name="written out")  # fmt: skip
    assert_all_same_computation("parameter", ours["after"], written["after"], ours64["after"], written64["after"],
                                a_name="update_policy", b_name="written out")  # fmt: skip
    assert max(float((a - p.detach()).abs().max()) for a, p in zip(ours["after"], model.parameters())) > 1e-4


def test_the_heads_that_write_over_the_logits_take_the_reference_step(peaked):
    """``update_policy`` on the Triton (interpreted) and C++ backends, which write the gradient over the trained rows'
    logits (a copy; Triton in its one-pass forward, C++ in its backward), takes the torch reference's SGD step,
    Lopti's two phases included."""
    model, tok = peaked
    exp = written_experience(model, tok)
    steps = {}
    for backend in ("torch", "triton", "cpp"):
        policy = copy.deepcopy(model)
        cfg = cfg_for(loss_backend=backend, kl_coef=1.0, kl_estimator="k2", alpha=0.3, lopti=True, eta=0.5,
                      mini_batch_size=8, micro_batch_size=3)  # fmt: skip
        m = update_policy(policy, torch.optim.SGD(policy.parameters(), lr=0.1), exp, cfg,
                          torch.Generator().manual_seed(0))  # fmt: skip
        assert m["loss_backend"] == backend and m["optimizer_steps"] == 2
        steps[backend] = [p.detach() - p0.detach() for p, p0 in zip(policy.parameters(), model.parameters())]
    largest = max(float(step.abs().max()) for step in steps["torch"])
    assert largest > 1e-4
    for backend in ("triton", "cpp"):
        for ours, reference in zip(steps[backend], steps["torch"]):
            assert torch.allclose(ours, reference, rtol=1e-4, atol=1e-5 * largest), backend


def split_experience(model, tok):
    """``written_experience`` with rows 0-3 all below p = 0.5 (phase 1 with eta 0.5) and rows 4-7 all at p = 0.9."""
    exp = written_experience(model, tok)
    mask = exp.rollout.action_mask
    old = exp.old_log_probs.clone()
    old[:4] = old[:4].clamp(max=math.log(0.45))
    old[4:] = math.log(0.9)
    return dataclasses.replace(exp, old_log_probs=old * mask)


def test_lopti_metrics_match_the_phases_written_out(peaked, float64):
    """Two epochs, micro-batches of one response (most hold no token of the phase), lr 0: every metric by hand.
    Values by the rule of tests/numerics.py: both again on float64 copies of the model and experience."""
    model, tok = peaked
    exp = split_experience(model, tok)
    mask = exp.rollout.action_mask
    n = int(mask.sum())
    low = mask & (exp.old_log_probs.exp() < 0.5)  # Lopti's phases with eta 0.5, written out
    high = mask & ~low
    assert low[:4].equal(mask[:4]) and high[4:].equal(mask[4:])
    cfg = cfg_for(lopti=True, eta=0.5, epochs=2, mini_batch_size=8, micro_batch_size=1, alpha=0.3, eps_low=0.1,
                  eps_high=0.3)  # fmt: skip

    def both(model, exp):
        policy = copy.deepcopy(model)
        wall = time.perf_counter()
        m = update_policy(policy, torch.optim.SGD(policy.parameters(), lr=0.0), exp, cfg,
                          torch.Generator().manual_seed(0))  # fmt: skip
        m["wall"] = time.perf_counter() - wall
        written = dict(loss=0.0, clipped=0.0, entropy=0.0, norms=0.0)
        for k, tokens in (("low", low), ("high", high)):
            reference = copy.deepcopy(model)
            out = written_loss(reference, exp, cfg, tokens, 0.0)
            _, norm = written_grads(reference, out["loss"].sum() / n)
            clipped = float(out["clipped"].double().sum())
            written.update({f"lopti/{k}/policy_loss": float(out["loss"].detach().sum()) / n,
                            f"lopti/{k}/grad_norm": norm, f"lopti/{k}/clipped": clipped,
                            f"lopti/{k}/tokens": int(tokens.sum())})  # fmt: skip
            written["loss"] += float(out["loss"].detach().sum()) / n
            written["clipped"] += clipped
            written["entropy"] += float(out["entropy"].sum()) / n
            written["norms"] += norm / 2  # 2 equal steps per phase (lr 0)
        return m, written

    m, written = both(model, exp)
    with float64():
        m64, written64 = both(*float64_copy(model, exp))
    pairs = {f"lopti/{k}/{name}": f"lopti/{k}/{name}" for k in ("low", "high") for name in ("policy_loss", "grad_norm")}
    pairs.update(loss="loss", entropy="entropy", grad_norm="norms")
    for key, written_key in pairs.items():
        scalars_same_computation(key, m[key], written[written_key], m64[key], written64[written_key],
                                 a_name="update_policy", b_name="written out")  # fmt: skip
    for k in ("low", "high"):  # counts: the same tokens
        assert 0 < written[f"lopti/{k}/clipped"] < written[f"lopti/{k}/tokens"]
        assert m[f"lopti/{k}/tokens"] == written[f"lopti/{k}/tokens"]
        assert m[f"lopti/{k}/clip_ratio"] == pytest.approx(written[f"lopti/{k}/clipped"] / written[f"lopti/{k}/tokens"])
        assert m[f"lopti/{k}/train_s"] >= 0
    assert m["lopti/low/train_s"] + m["lopti/high/train_s"] <= m["wall"]
    assert m["optimizer_steps"] == 4  # 2 phases x 2 epochs x 1 mini-batch
    assert m["clip_ratio"] == pytest.approx(written["clipped"] / n)


def test_a_mini_batch_without_phase_tokens_still_steps_adamw(peaked):
    """Mini-batches of one response: half of each phase's 8 hold none of its tokens; AdamW steps every param 16x."""
    model, tok = peaked
    model = copy.deepcopy(model)
    exp = split_experience(model, tok)
    cfg = cfg_for(lopti=True, eta=0.5, mini_batch_size=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    m = update_policy(model, optimizer, exp, cfg, torch.Generator().manual_seed(0))
    assert m["optimizer_steps"] == 16
    assert all(int(optimizer.state[p]["step"]) == 16 for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_a_batch_of_one_token(peaked, float64):
    """One trained token, clipped (ratio e, advantage +1), with a KL gradient: every mean is that token's value."""
    model, tok = peaked
    model = copy.deepcopy(model)
    exp = written_experience(model, tok)
    mask = torch.zeros_like(exp.rollout.action_mask)
    mask[0, 0] = True
    logp = response_logprobs(model, exp.rollout, 1.0).detach()
    exp = dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, action_mask=mask),
                              old_log_probs=(logp - 1.0) * mask, ref_log_probs=(logp + 0.5) * mask,
                              advantages=mask.float())  # fmt: skip
    cfg = cfg_for(lopti=True, eta=0.5, kl_coef=1.0, kl_estimator="k2", grad_clip=0.0, mini_batch_size=8)

    def both(model, exp):
        reference = copy.deepcopy(model)
        out = written_loss(reference, exp, cfg, mask, 1.0)
        _, norm = written_grads(reference, out["loss"].sum())  # the token-mean over 1 token
        policy = copy.deepcopy(model)
        m = update_policy(policy, torch.optim.SGD(policy.parameters(), lr=0.1), exp, cfg,
                          torch.Generator().manual_seed(0))  # fmt: skip
        written = dict(loss=float(out["loss"][0].detach()), entropy=float(out["entropy"][0]), grad_norm=norm)
        policy_loss = float(out["loss"][0].detach() - cfg.kl_coef * out["kl"][0])  # without the KL, as OpenRLHF's
        return m, dict(written, **{"lopti/low/policy_loss": policy_loss}), bool(out["clipped"][0])

    # values by the rule of tests/numerics.py: both again on float64 copies of the model and experience
    m, written, clipped = both(model, exp)
    with float64():
        m64, written64, _ = both(*float64_copy(model, exp))
    assert clipped and written["grad_norm"] > 0
    assert abs(written["loss"] - written["lopti/low/policy_loss"]) > 1e-3  # the KL term is not 0 here
    assert m["lopti/low/tokens"] == 1 and m["lopti/high/tokens"] == 0
    for key in ("loss", "lopti/low/policy_loss", "entropy", "grad_norm"):
        scalars_same_computation(key, m[key], written[key], m64[key], written64[key], a_name="update_policy",
                                 b_name="written out")  # fmt: skip
    assert m["clip_ratio"] == 1.0 and m["lopti/low/clip_ratio"] == 1.0
    assert [key for key in m if key.startswith("lopti/high/")] == ["lopti/high/tokens"]  # the empty phase: no zeros


def test_a_batch_without_response_tokens_takes_no_step(tiny):
    model, tok = tiny
    model = copy.deepcopy(model)
    exp = fixed_experience(model, tok)
    mask = torch.zeros_like(exp.rollout.action_mask)
    exp = dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, action_mask=mask))
    before = [p.detach().clone() for p in model.parameters()]
    m = update_policy(model, torch.optim.SGD(model.parameters(), lr=0.1), exp, cfg_for())
    assert m == {"loss": 0.0, "optimizer_steps": 0, "clip_ratio": 0.0, "entropy": 0.0, "grad_norm": 0.0,
                 "loss_backend": None}  # no loss-head call
    assert all(p.equal(b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("poison", ["advantage", "logits"])
def test_a_bad_value_raises_before_the_optimizer_step_naming_the_phase_and_row(tiny, poison):
    """The loss head's value checks are read once per optimizer step (check="step"), before it: a non-finite
    advantage (or a NaN logit from a diverged lm_head) raises there, naming the phase, the mini-batch and the row,
    and no weight has moved. The first mini-batch of the round holds the bad token (one mini-batch here)."""
    model, tok = tiny
    model = copy.deepcopy(model)
    exp = fixed_experience(model, tok)
    response = exp.rollout.action_mask
    if poison == "advantage":
        advantages = exp.advantages.clone()
        advantages[response.nonzero()[3].tolist()] = float("nan")  # the 4th response token of the batch
        exp = dataclasses.replace(exp, advantages=advantages)
        expected = r"advantages must be finite .* \(row \d+ at phase 'all', mini-batch 1\)"
    else:
        with torch.no_grad():
            model.get_output_embeddings().weight[7, 0] = float("nan")
        expected = r"logits row \d+ \(unmasked\) at phase 'all', mini-batch 1 has no finite log-sum-exp"
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=expected):
        update_policy(model, torch.optim.SGD(model.parameters(), lr=0.1), exp, cfg_for(loss_backend="cpp"))
    assert all(torch.equal(p.detach(), b) or (torch.isnan(b).any() and torch.equal(p.detach().isnan(), b.isnan()))
               for p, b in zip(model.parameters(), before))  # fmt: skip


def test_phase_part_by_hand():
    """Rows 0 and 2 hold phase tokens (last one at response column 3): cut after column 3, row 1 left out."""
    prompt, width = 2, 6
    sequences = torch.arange(3 * (prompt + width)).view(3, prompt + width)
    action_mask = torch.ones(3, width, dtype=torch.bool)
    rollout = Rollout(sequences, torch.ones_like(sequences), action_mask, prompt, ["a", "b", "c"])
    phase = torch.zeros(3, width, dtype=torch.bool)
    phase[0, 1] = phase[2, 3] = True
    part, rows, tokens = phase_part(rollout, torch.tensor([0, 1, 2]), phase)
    assert rows.tolist() == [0, 2]
    assert tokens.tolist() == [[False, True, False, False], [False, False, False, True]]
    assert part.sequences.equal(sequences[[0, 2], : prompt + 4]) and part.action_mask.shape == (2, 4)
    assert part.responses == ["a", "c"]
    assert phase_part(rollout, torch.tensor([1]), phase) is None
