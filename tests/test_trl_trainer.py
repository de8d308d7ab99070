"""``openrlhf_lopti.trl``: ``LoptiGRPOTrainer`` on TRL 1.16's real ``GRPOTrainer`` (transformers generation, CPU).

- One Lopti + AR round (two phases, gradient accumulation, SGD) gives the parameters of the same round written
  out by hand on the batch the trainer generated, for each TRL loss type's normalisation, and our local
  trainer's ``update_policy`` on the same tokens and advantages gives it too.
- With AR and Lopti off, our fused-loss path gives TRL's own ``GRPOTrainer``'s update on the same seed.
- A short K&K run with ``kk_reward`` logs the metrics and saves a checkpoint that reloads.
- What cannot be honoured is refused at construction with one line naming the option.

"Same parameters" is checked against a float64 run of the hand-written round: the trainer's fp32 result may be
at most a few times further from it than the hand-written round's own fp32 run is (tests/numerics.py).
"""

import math

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer  # noqa: E402
from openrlhf_lopti.local.task import compact_prompt, puzzles  # noqa: E402
from openrlhf_lopti.trl import LoptiGRPOConfig, LoptiGRPOTrainer, kk_reward  # noqa: E402
from openrlhf_lopti.trl.config import trl_loss_reason  # noqa: E402

from .allocations import NewTensors  # noqa: E402
from .numerics import ACCURACY_RATIO, U32, ULPS_FLOOR  # noqa: E402

LR = 0.1


def tiny_model(tok):
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked logits: token probabilities on both sides of eta = 0.5
    return model


@pytest.fixture(scope="module")
def tok():
    return build_word_tokenizer()


def kk_dataset(n: int = 4) -> Dataset:
    records = puzzles(0, 0, n, [2])
    return Dataset.from_list([{"prompt": compact_prompt(r), "label": r["solution_text_format"]} for r in records])


def settings(tmp_path, **kw) -> dict:
    base = dict(
        output_dir=str(tmp_path), use_cpu=True, seed=0, report_to="none", logging_steps=1, save_strategy="no",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, temperature=1.0,
        gradient_accumulation_steps=2, steps_per_generation=2, max_steps=1, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, beta=0.0, epsilon=0.2, epsilon_high=0.28,
        loss_backend="torch", bf16=False,  # TRL's default bf16=True is a bf16 autocast on CPU too
    )  # fmt: skip
    return {**base, **kw}


def distinct_words(prompts: list, completions: list, **kwargs) -> list:
    """A reward that varies between the random model's completions (K&K's is -3 for all of them): nonzero
    advantages for the update comparisons."""
    return [float(len(set(c.split()))) for c in completions]


def recording(cls):
    """``cls`` (TRL's trainer or ours) recording the inputs of every ``_compute_loss`` call, in order."""

    class Recording(cls):
        def _compute_loss(self, model, inputs):
            self.recorded.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
            return super()._compute_loss(model, inputs)

    return Recording


def train(cls, config, tok, dataset=None, reward=distinct_words, model=None):
    """``(initial state_dict, trainer after train(), recorded inputs)``; ``model`` defaults to the tiny Llama."""
    trainer = recording(cls)(
        model=tiny_model(tok) if model is None else model, reward_funcs=[reward], args=config, train_dataset=dataset or kk_dataset(),
        processing_class=tok,
    )  # fmt: skip
    trainer.recorded = []
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    return initial, trainer, trainer.recorded


def hand_round(tok, initial, recorded, cfg, dtype, denominators="all", beta=None, build=tiny_model, aux_coef=0.0):
    """The round the recorded micro-batches define, written out in plain torch (:func:`hand_micro_step_loss` per
    micro-batch, ``cfg.gradient_accumulation_steps`` micro-batches per SGD step) on the model ``build(tok)`` makes,
    from ``initial``, in ``dtype``. Returns the parameters."""
    beta = cfg.beta if beta is None else beta
    model = build(tok)
    model.load_state_dict(initial)
    model = model.to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    ga = cfg.gradient_accumulation_steps
    phase_items = {}
    for inp in recorded:  # the phase's tokens in the generation batch, for the planted "phase" dapo denominator
        key = inp.get("lopti_phase", 0)
        phase_items[key] = phase_items.get(key, 0) + float(inp.get("lopti_phase_mask", inp["completion_mask"]).sum())
    for start in range(0, len(recorded), ga):
        for p in params:
            p.grad = None
        for inp in recorded[start : start + ga]:
            hand_micro_step_loss(model, inp, cfg, dtype, beta, denominators, phase_items, aux_coef).backward()
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
    return [p.detach() for p in params]


def hand_micro_step_loss(model, inp, cfg, dtype, beta, denominators="all", phase_items=None, aux_coef=0.0):
    """One micro-batch's loss, as TRL accumulates it (divided by the accumulation steps): the clipped surrogate of
    paper Eq. 1 with the AR weight of Eq. 4, on the micro-batch's Lopti phase tokens, normalised as TRL's
    ``cfg.loss_type`` does over every response token (``denominators="phase"``: over the phase's tokens, the planted
    bug; ``phase_items``: each phase's token count in the generation batch, for dapo), plus ``beta`` times the k3 KL
    to the recorded reference log-probs (times the ratio with TRL's ``use_bias_correction_kl``), minus TRL's entropy
    bonus, plus ``aux_coef`` times a MoE model's router load-balancing loss of the forward."""
    ga, alpha = cfg.gradient_accumulation_steps, cfg.ar_alpha
    ids = torch.cat([inp["prompt_ids"], inp["completion_ids"]], 1)
    attention = torch.cat([inp["prompt_mask"], inp["completion_mask"]], 1)
    t = inp["completion_ids"].size(1)
    out = model(input_ids=ids, attention_mask=attention, **({"output_router_logits": True} if aux_coef else {}))
    logits = out.logits[:, -t - 1 : -1].to(dtype)
    logp = torch.log_softmax(logits / cfg.temperature, -1).gather(-1, inp["completion_ids"][..., None])[..., 0]
    # TRL's on-policy case (no stored anchor): the anchor is this forward's log-probs, detached
    old = inp["old_per_token_logps"].to(dtype) if "old_per_token_logps" in inp else logp.detach()
    mask = inp["completion_mask"].to(dtype)
    phase = inp["lopti_phase_mask"].to(dtype) * mask if "lopti_phase_mask" in inp else mask
    adv = inp["advantages"].to(dtype)[:, None] * (alpha * old.exp() + 1 - alpha)
    ratio = (logp - old).exp()
    eps_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - cfg.epsilon, 1 + eps_high) * adv)
    if beta:
        ref = inp["ref_per_token_logps"].to(dtype)
        kl = (ref - logp).exp() - (ref - logp) - 1
        per_token = per_token + beta * (kl * ratio if cfg.use_bias_correction_kl else kl)
    per_token = per_token * phase
    norm = mask if denominators == "all" else phase
    if cfg.loss_type == "grpo":
        loss = ((per_token * norm).sum(-1) / norm.sum(-1).clamp(min=1)).mean() / ga
    elif cfg.loss_type == "bnpo":
        loss = (per_token * norm).sum() / norm.sum().clamp(min=1) / ga
    elif cfg.loss_type == "dr_grpo":
        loss = per_token.sum() / (per_token.size(0) * cfg.max_completion_length) / ga
    else:  # dapo: tokens of the generation batch, per optimizer step
        items = float(inp["num_items_in_batch"]) if denominators == "all" else phase_items[inp.get("lopti_phase", 0)]
        loss = per_token.sum() / (items * ga / cfg.steps_per_generation)
    if cfg.entropy_coef:  # TRL's bonus: mean entropy over the response tokens, per accumulation step
        probs = torch.softmax(logits / cfg.temperature, -1)
        entropy = -(probs * torch.log_softmax(logits / cfg.temperature, -1)).sum(-1)
        loss = loss - cfg.entropy_coef * (entropy * phase).sum() / mask.sum().clamp(min=1) / ga
    if aux_coef:  # TRL's router aux loss: in every micro-batch (each Lopti phase), over all its tokens
        loss = loss + aux_coef * out.aux_loss / ga
    return loss


def update_errors(initial, ours, ref32, ref64) -> list:
    """Per parameter: ``(err_ours, err_ref, allowed)``, errors of the fp32 updates against the float64 hand
    round's update, relative to its largest entry (tests/numerics.py's precision rule: ``allowed`` is
    ``ACCURACY_RATIO x err_ref + ULPS_FLOOR x U32``)."""
    out = []
    for p0, a, b, c in zip(initial, ours, ref32, ref64):
        d64 = c - p0.double()
        scale = max(d64.abs().max().item(), torch.finfo(torch.float32).tiny)
        err_a = (a.double() - c).abs().max().item() / scale
        err_b = (b.double() - c).abs().max().item() / scale
        out.append((err_a, err_b, ACCURACY_RATIO * err_b + ULPS_FLOOR * U32))
    return out


def metric_names(trainer) -> set:
    """Every key the run logged."""
    return {key for entry in trainer.state.log_history for key in entry}


def trained_params(trainer):
    return [p.detach() for p in trainer.model.parameters() if p.requires_grad]


def initial_params(tok, initial, build=tiny_model):
    model = build(tok)
    model.load_state_dict(initial)
    return [p.detach() for p in model.parameters() if p.requires_grad]


def fused_lm_head_against_the_logits_path(build) -> dict:
    """Trains ``build(fused_lm_head)`` with False, then True; asserts that every trainable parameter makes the same
    update (up to 1e-4 of its largest entry: fp32 sums in another order) and returns ``{fused_lm_head: {name:
    update (fp32)}}``."""
    steps = {}
    for fused in (False, True):
        trainer = build(fused)
        params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
        initial = {n: p.detach().float().clone() for n, p in params.items()}
        trainer.train()
        steps[fused] = {n: p.detach().float() - initial[n] for n, p in params.items()}
    assert steps[True].keys() == steps[False].keys()
    for name, step in steps[False].items():
        assert (steps[True][name] - step).abs().max() <= 1e-4 * step.abs().max(), name
    return steps


@pytest.mark.parametrize(
    "loss_type, fused_lm_head, iterations, backend",
    [("dapo", False, 1, "torch"), ("grpo", True, 1, "torch"), ("bnpo", False, 1, "torch"),
     ("dr_grpo", False, 1, "torch"), ("dapo", False, 2, "torch"),
     ("grpo", False, 1, "triton"),  # the one-pass head writing the gradient into the model's logits (interpreted)
     ("bnpo", False, 1, "cpp")],  # the C++ backward writing it there
)  # fmt: skip
def test_lopti_ar_round_matches_hand_written(tmp_path, tok, loss_type, fused_lm_head, iterations, backend):
    cfg = LoptiGRPOConfig(
        **settings(tmp_path, loss_type=loss_type, max_steps=2 * iterations, ar_alpha=0.3, lopti_eta=0.5,
                   fused_lm_head=fused_lm_head, num_iterations=iterations, loss_backend=backend)  # fmt: skip
    )
    initial, trainer, recorded = train(LoptiGRPOTrainer, cfg, tok)
    # one generation, two phases, each num_iterations x steps_per_generation micro-batches: optimizer steps of 2
    per_phase = 2 * iterations
    assert [r["lopti_phase"] for r in recorded] == [0] * per_phase + [1] * per_phase
    assert trainer.state.global_step == 2 * iterations
    masks = [r["lopti_phase_mask"] & r["completion_mask"].bool() for r in recorded]
    low = torch.cat([m.flatten() for m in masks[:2]]).sum()
    high = torch.cat([m.flatten() for m in masks[per_phase : per_phase + 2]]).sum()
    assert low > 0 and high > 0, "the batch must hold tokens of both phases"
    assert all(bool(r["advantages"].abs().max() > 0) for r in recorded)
    for i, r in enumerate(recorded):  # low phase: old probability below eta; high phase: at or above it
        p_old = r["old_per_token_logps"].exp()[r["lopti_phase_mask"]]
        assert bool((p_old < 0.5).all()) if i < per_phase else bool((p_old >= 0.5).all())
    for a, b in zip(recorded[:2], recorded[per_phase : per_phase + 2]):  # the same micro-batch in both phases
        assert torch.equal(a["completion_ids"], b["completion_ids"])
        assert not bool((a["lopti_phase_mask"] & b["lopti_phase_mask"]).any())
        assert torch.equal(a["lopti_phase_mask"] | b["lopti_phase_mask"], a["completion_mask"].bool())

    p0 = initial_params(tok, initial)
    ours = trained_params(trainer)
    ref32 = hand_round(tok, initial, recorded, cfg, torch.float32)
    ref64 = hand_round(tok, initial, recorded, cfg, torch.float64)
    errors = update_errors(p0, ours, ref32, ref64)
    for i, (err_ours, err_ref, allowed) in enumerate(errors):
        assert err_ours <= allowed, f"param {i}: trainer's update off by {err_ours:.3g} (hand fp32 {err_ref:.3g})"
    # the comparison sees a wrong denominator (the phase's own tokens, not every response token)
    if loss_type != "dr_grpo":  # dr_grpo's denominator is a constant
        bug64 = hand_round(tok, initial, recorded, cfg, torch.float64, denominators="phase")
        bug_errors = update_errors(p0, ours, ref32, bug64)
        assert any(bug[0] > right[2] for bug, right in zip(bug_errors, errors))
    logged = {**trainer.state.log_history[-2], **trainer.state.log_history[0]}  # low phase first, then high
    assert "lopti/high/policy_loss" not in trainer.state.log_history[0]
    for key in ("lopti/low_token_frac", "lopti/threshold", "ar/mean_weight", "lopti/low/policy_loss",
                "lopti/high/policy_loss", "lopti/low/clip_ratio", "entropy", "clip_ratio/region_mean"):  # fmt: skip
        assert key in logged, key
    assert logged["lopti/threshold"] == 0.5
    assert abs(logged["lopti/low_token_frac"] - float(low / (low + high))) < 1e-6


class ChecksThePhaseLoss(LoptiGRPOTrainer):
    """Moves each micro-batch's reference log-probs 0.5 below the recorded ones (a KL that is not 0, even at the
    first step), then records per call ``(logged lopti/<phase>/policy_loss, the hand-written share without the KL,
    the share with beta * KL)``, the shares from :func:`hand_micro_step_loss` on the model as it is at that call."""

    def _compute_loss(self, model, inputs):
        inputs = dict(inputs, ref_per_token_logps=inputs["ref_per_token_logps"] - 0.5)
        undo = 1.0 if self.loss_type == "dapo" else self.args.gradient_accumulation_steps  # TRL logs it before / ga
        with torch.no_grad():
            shares = [undo * float(hand_micro_step_loss(model, inputs, self.args, torch.float32, beta))
                      for beta in (0.0, self.beta)]  # fmt: skip
        loss = super()._compute_loss(model, inputs)
        name = ("low", "high")[inputs["lopti_phase"]]
        self.checked.append((self._metrics["train"][f"lopti/{name}/policy_loss"][-1], *shares))
        return loss


@pytest.mark.parametrize("loss_type, bias_correction", [("grpo", False), ("dapo", True)])  # KL in / after the kernel
def test_the_phase_policy_loss_is_the_surrogate_without_the_kl(tmp_path, tok, loss_type, bias_correction):
    # as the local trainer, OpenRLHF and verl log it (docs/LOPTI_ROUND.md); TRL's own policy_loss keeps the KL
    cfg = LoptiGRPOConfig(
        **settings(tmp_path, loss_type=loss_type, max_steps=2, ar_alpha=0.3, lopti_eta=0.5, beta=0.1,
                   use_bias_correction_kl=bias_correction)  # fmt: skip
    )
    start = tmp_path / "tiny"  # a path: TRL loads the KL reference model from it
    tiny_model(tok).save_pretrained(start)
    trainer = ChecksThePhaseLoss(model=str(start), reward_funcs=[distinct_words], args=cfg,
                                 train_dataset=kk_dataset(), processing_class=tok)  # fmt: skip
    trainer.checked = []
    trainer.train()
    assert len(trainer.checked) == 4  # two micro-steps per phase
    for logged, without_kl, with_kl in trainer.checked:
        assert abs(with_kl - without_kl) > 1e-3  # the KL term is not 0 here
        assert abs(logged - without_kl) <= 1e-5 * max(1.0, abs(without_kl)), (logged, without_kl, with_kl)


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # one optimizer step of 2 micro-batches: TRL's on-policy case (it skips the old log-probs)
        # KL (TRL's default: times the ratio, outside our kernel); 2 optimizer steps per generated batch
        dict(beta=0.1, loss_type="grpo", gradient_accumulation_steps=1, max_steps=2),
        # KL inside the kernel (the paper's and OpenRLHF's k3 loss)
        dict(beta=0.1, use_bias_correction_kl=False, loss_type="bnpo", gradient_accumulation_steps=1, max_steps=2),
        dict(entropy_coef=0.05, loss_type="dr_grpo"),  # TRL's entropy bonus, from the kernel's entropy
        dict(entropy_coef=0.05, loss_type="grpo", loss_backend="triton"),  # the bonus in the one-pass head's sum
    ],
)
def test_off_equals_trl_grpo_trainer(tmp_path, tok, options):
    start = tmp_path / "tiny"  # a path: TRL loads the KL reference model from it
    tiny_model(tok).save_pretrained(start)
    ours_cfg = LoptiGRPOConfig(**settings(tmp_path / "a", **options))
    ours_initial, ours, ours_inputs = train(LoptiGRPOTrainer, ours_cfg, tok, model=str(start))
    base = settings(tmp_path / "b", **options)
    base.pop("loss_backend")
    trl_initial, theirs, trl_inputs = train(GRPOTrainer, GRPOConfig(**base), tok, model=str(start))
    assert all(torch.equal(ours_initial[k], trl_initial[k]) for k in ours_initial)
    assert len(ours_inputs) == len(trl_inputs) == 2
    for a, b in zip(ours_inputs, trl_inputs):  # the same seed gave the same batch
        assert torch.equal(a["completion_ids"], b["completion_ids"])
        assert torch.equal(a["advantages"], b["advantages"]) and bool(a["advantages"].abs().max() > 0)
        if not options:  # TRL's on-policy case: neither stores an anchor (the loss takes this forward's log-probs)
            assert "old_per_token_logps" not in b and "old_per_token_logps" not in a
    cfg = ours.args
    p0 = initial_params(tok, ours_initial)
    ref32 = hand_round(tok, ours_initial, ours_inputs, cfg, torch.float32)
    ref64 = hand_round(tok, ours_initial, ours_inputs, cfg, torch.float64)
    for name, trainer in (("ours", ours), ("TRL", theirs)):
        for i, (err, err_ref, allowed) in enumerate(update_errors(p0, trained_params(trainer), ref32, ref64)):
            assert err <= allowed, f"{name} param {i}: update off by {err:.3g} (hand fp32 {err_ref:.3g})"
    assert any((a - b).abs().max() > 0 for a, b in zip(trained_params(ours), p0)), "the step moved nothing"
    assert metric_names(ours) == metric_names(theirs)  # TRL's metrics, every one (entropy_coef, clip_ratio/low_min, ...)
    if cfg.beta:  # the KL term is in both updates: the hand round without it is another update
        no_kl64 = hand_round(tok, ours_initial, ours_inputs, cfg, torch.float64, beta=0.0)
        errors = update_errors(p0, trained_params(ours), ref32, ref64)
        assert any(bad[0] > right[2] for bad, right in zip(update_errors(p0, trained_params(ours), ref32, no_kl64), errors))


def test_lopti_quantile_threshold(tmp_path, tok):
    from openrlhf_lopti.algo.lopti import quantile_threshold

    cfg = LoptiGRPOConfig(
        **settings(tmp_path, max_steps=2, gradient_accumulation_steps=1, steps_per_generation=1, lopti_quantile=0.3)
    )
    _, trainer, recorded = train(LoptiGRPOTrainer, cfg, tok)
    assert [r["lopti_phase"] for r in recorded] == [0, 1]
    mask = recorded[0]["completion_mask"].bool()
    probs = recorded[0]["old_per_token_logps"].exp()[mask]
    threshold = quantile_threshold(probs, 0.3)
    logged = trainer.state.log_history[0]
    assert logged["lopti/threshold"] == pytest.approx(threshold, rel=1e-6)
    low = recorded[0]["lopti_phase_mask"]
    assert torch.equal(low, mask & (recorded[0]["old_per_token_logps"].exp() < threshold))
    assert logged["lopti/low_token_frac"] == pytest.approx(float(low.sum() / mask.sum()), rel=1e-6)


def test_kk_run_checkpoint_and_metrics(tmp_path, tok):
    from transformers import AutoModelForCausalLM

    cfg = LoptiGRPOConfig(
        **settings(tmp_path, max_steps=4, gradient_accumulation_steps=1, steps_per_generation=1, ar_alpha=0.3,
                   lopti_eta=0.5, save_strategy="steps", save_steps=4, optim="adamw_torch", max_grad_norm=1.0,
                   learning_rate=1e-3, beta=0.01, loss_backend="auto", bf16=True)  # fmt: skip
    )
    start = tmp_path / "tiny"  # a path, as a TRL user passes: TRL loads the reference model (beta != 0) from it
    tiny_model(tok).save_pretrained(start)
    tok.save_pretrained(start)
    _, trainer, recorded = train(LoptiGRPOTrainer, cfg, tok, kk_dataset(8), reward=kk_reward, model=str(start))
    assert [r["lopti_phase"] for r in recorded] == [0, 1, 0, 1]  # two generations, two phases each
    history = trainer.state.log_history
    steps = [h for h in history if "loss" in h or "reward" in h]
    assert len(steps) == 4
    for key in ("reward", "kl", "entropy", "lopti/low_token_frac", "ar/mean_weight", "rewards/kk_reward/mean",
                "lopti/threshold"):  # fmt: skip
        assert any(key in h for h in steps), key
    assert any("lopti/low/policy_loss" in h for h in steps) and any("lopti/high/policy_loss" in h for h in steps)
    evaluation = trainer.evaluate(kk_dataset(4))  # eval: the fused loss on every response token, no phases
    assert "eval_loss" in evaluation and "eval_reward" in evaluation and "eval_entropy" in evaluation
    checkpoint = tmp_path / "checkpoint-4"
    assert (checkpoint / "trainer_state.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    for (name, a), b in zip(trainer.model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    # resuming from it continues the run (a new generation, low phase first)
    cfg.max_steps = 6
    resumed = recording(LoptiGRPOTrainer)(
        model=str(start), reward_funcs=[kk_reward], args=cfg, train_dataset=kk_dataset(8), processing_class=tok
    )
    resumed.recorded = []
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6
    assert [r["lopti_phase"] for r in resumed.recorded] == [0, 1]


@pytest.mark.parametrize(
    "options, names",
    [
        (dict(ar_alpha=1.5), "ar_alpha"),
        (dict(lopti_eta=0.0), "lopti_eta"),
        (dict(lopti_eta=0.5, lopti_order="middle"), "lopti_order"),
        (dict(lopti_quantile=1.0), "lopti_quantile"),
        (dict(lopti_eta=0.5, lopti_quantile=0.3), "lopti_eta=0.5 and lopti_quantile=0.3 are two Lopti thresholds"),
        (dict(loss_backend="cuda"), "loss_backend"),
        (dict(fused_lm_head=True, fused_loss=False), "fused_lm_head=True needs fused_loss=True"),
        (dict(fused_lm_head=True, loss_type="cispo"), "fused_lm_head=True with loss_type='cispo'"),
        (dict(fused_lm_head=True, importance_sampling_level="sequence"), "fused_lm_head=True with importance_sampling"),
        (dict(lopti_eta=0.5, top_entropy_quantile=0.2), "top_entropy_quantile=0.2 with lopti_eta / lopti_quantile"),
        (dict(lopti_eta=0.5, gradient_accumulation_steps=4), "gradient_accumulation_steps"),
        (dict(lopti_eta=0.5, num_iterations=0), "num_iterations=0"),  # was a ZeroDivisionError
        (dict(ar_alpha=True), "ar_alpha"),  # not 1.0
        # TRL trains these to NaN weights with a logged loss of 0 (AR and Lopti off too)
        (dict(beta=float("nan")), "beta must be a finite number (as float32, the precision of the loss), got nan"),
        (dict(entropy_coef=float("inf")), "entropy_coef must be a finite number"),
        (dict(beta=1e39), "beta must be a finite number (as float32, the precision of the loss), got 1e+39"),
        (dict(epsilon=float("nan")), "epsilon must be a number (inf: no clip on that side), got nan"),
        (dict(epsilon_high=float("nan")), "epsilon_high must be a number (inf: no clip on that side), got nan"),
    ],
)
def test_refused_at_construction(tmp_path, options, names):
    with pytest.raises(ValueError) as info:
        LoptiGRPOConfig(**settings(tmp_path, **options))
    message = str(info.value)
    assert names in message and "\n" not in message


def test_a_backend_that_cannot_run_on_the_trainers_device_is_refused_with_the_config(tmp_path, monkeypatch):
    """(Before: accepted, then a RuntimeError at the first training step, after the model load and a generation.)"""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as info:
        LoptiGRPOConfig(**settings(tmp_path, loss_backend="triton"))
    assert str(info.value) == ("loss_backend='triton' needs a CUDA device, or TRITON_INTERPRET=1 in the environment "
                               "to run on cpu (slow); use loss_backend='auto'")  # fmt: skip
    LoptiGRPOConfig(**settings(tmp_path, loss_backend="triton", fused_loss=False))  # TRL's loss: no kernel runs


def test_off_with_trl_loss_accepts_what_trl_accepts(tmp_path):
    cfg = LoptiGRPOConfig(**settings(tmp_path, fused_loss=False, loss_type="cispo", delta=None))
    assert cfg.loss_type == "cispo"


@pytest.mark.parametrize("epsilons", [dict(epsilon=1.0), dict(epsilon=-0.1, epsilon_high=0.2)],
                         ids=["no-lower-clip", "negative"])  # fmt: skip
def test_a_clip_range_the_kernel_does_not_take_runs_trls_loss_as_trl(tmp_path, tok, epsilons):
    """``epsilon=1.0`` (no lower clip), which TRL takes: TRL's loss runs, with TRL's update. Before, the fused path
    took it and the first step raised the kernel's "eps_low must be in [0, 1)"."""
    options = settings(tmp_path / "a", **epsilons)
    ours_cfg = LoptiGRPOConfig(**options)
    assert trl_loss_reason(ours_cfg) == f"epsilon={epsilons['epsilon']!r}"  # before: None, and the step raised
    _, ours, _ = train(LoptiGRPOTrainer, ours_cfg, tok)
    options = settings(tmp_path / "b", **epsilons)
    options.pop("loss_backend")
    _, theirs, _ = train(GRPOTrainer, GRPOConfig(**options), tok)
    assert all(torch.equal(a, b) for a, b in zip(trained_params(ours), trained_params(theirs), strict=True))
    assert trl_loss_reason(LoptiGRPOConfig(**settings(tmp_path, epsilon_high=float("inf")))) == "epsilon_high=inf"


def test_trainer_needs_our_config(tmp_path, tok):
    base = settings(tmp_path)
    base.pop("loss_backend")
    with pytest.raises(ValueError, match="LoptiGRPOConfig"):
        LoptiGRPOTrainer(model=tiny_model(tok), reward_funcs=[kk_reward], args=GRPOConfig(**base),
                         train_dataset=kk_dataset(), processing_class=tok)  # fmt: skip


def test_same_update_as_local_trainer(tmp_path, tok):
    """The TRL trainer and our local trainer (``local.update.update_policy``) give the same Lopti + AR update on
    the same tokens and advantages: both within fp32 rounding of the hand-written round's float64 run."""
    from openrlhf_lopti.local.config import TrainConfig
    from openrlhf_lopti.local.experience import Experience
    from openrlhf_lopti.local.rollout import Rollout
    from openrlhf_lopti.local.update import update_policy

    one = kk_dataset(1)[0]  # one prompt for every group: no left padding, so both trainers see the same positions
    dataset = Dataset.from_list([one] * 4)
    cfg = LoptiGRPOConfig(
        **settings(tmp_path, loss_type="bnpo", gradient_accumulation_steps=1, steps_per_generation=1, max_steps=2,
                   ar_alpha=0.3, lopti_eta=0.5)  # fmt: skip
    )
    initial, trainer, recorded = train(LoptiGRPOTrainer, cfg, tok, dataset)
    assert [r["lopti_phase"] for r in recorded] == [0, 1]
    batch = recorded[0]
    assert bool(batch["prompt_mask"].all()) and bool(batch["advantages"].abs().max() > 0)
    mask = batch["completion_mask"].bool()
    rollout = Rollout(
        sequences=torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
        attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
        action_mask=mask,
        prompt_len=batch["prompt_ids"].size(1),
        responses=[""] * mask.size(0),
    )
    experience = Experience(
        rollout=rollout, old_log_probs=batch["old_per_token_logps"], ref_log_probs=None,
        advantages=batch["advantages"][:, None] * mask, rewards=torch.zeros(mask.size(0)), correct=None,
        format_ok=None,
    )  # fmt: skip
    local_cfg = TrainConfig(
        model="m", out="o", alpha=0.3, lopti=True, eta=0.5, n_samples=4, prompts_per_step=1, temperature=1.0,
        mini_batch_size=4, micro_batch_size=4, epochs=1, grad_clip=0.0, kl_coef=0.0, eps_low=0.2, eps_high=0.28,
        loss_backend="torch", progress=False,
    )  # fmt: skip
    local = tiny_model(tok)
    local.load_state_dict(initial)
    metrics = update_policy(local, torch.optim.SGD(local.parameters(), lr=LR), experience, local_cfg)
    assert metrics["optimizer_steps"] == 2 and metrics["lopti/low/tokens"] > 0 and metrics["lopti/high/tokens"] > 0
    low = (batch["old_per_token_logps"].exp() < 0.5) & mask
    assert torch.equal(batch["lopti_phase_mask"], low) and metrics["lopti/low/tokens"] == int(low.sum())

    p0 = initial_params(tok, initial)
    ref32 = hand_round(tok, initial, recorded, cfg, torch.float32)
    ref64 = hand_round(tok, initial, recorded, cfg, torch.float64)
    local_params = [p.detach() for p in local.parameters() if p.requires_grad]
    for name, params in (("TRL", trained_params(trainer)), ("local", local_params)):
        for i, (err, err_ref, allowed) in enumerate(update_errors(p0, params, ref32, ref64)):
            assert err <= allowed, f"{name} param {i}: update off by {err:.3g} (hand fp32 {err_ref:.3g})"


def test_the_logits_path_makes_no_vocab_wide_buffer_but_the_models_logits(tmp_path, tok):
    """The logits path reads the model's own ``[B, T + 1, V]`` logits as they are (no copy of the trained rows) and,
    with the one-pass Triton head, writes their gradient into them: in a micro-step's loss and backward the only new
    tensor as wide as the vocabulary is the model's logits. (Before: also the trained rows' copy, their gradient, and
    the ``[B, T, V]`` / ``[B, T + 1, V]`` zeros of the index and slice backwards.)"""
    cfg = LoptiGRPOConfig(**settings(tmp_path, ar_alpha=0.3, lopti_eta=0.5, max_steps=2, loss_backend="triton"))
    _, trainer, recorded = train(LoptiGRPOTrainer, cfg, tok)
    inputs = recorded[0]  # a low-phase micro-step: some of its response tokens are not trained
    b, t = inputs["completion_ids"].shape
    v = trainer.model.config.vocab_size
    assert 0 < int((inputs["lopti_phase_mask"] & inputs["completion_mask"].bool()).sum()) < b * t
    with NewTensors() as seen:
        loss = trainer._compute_loss(trainer.model, dict(inputs))
        loss.backward()
    wide = [(op, shape) for op, shape in zip(seen.ops, seen.shapes) if len(shape) > 1 and shape[-1] == v]
    assert [math.prod(shape) for _, shape in wide] == [b * (t + 1) * v], wide


def test_a_step_makes_no_more_weight_sized_tensors_than_trls(tmp_path, tok):
    """Per micro-step (generation, old log-probs, loss, backward, optimizer), ours makes as many ``[V, H]`` tensors
    in new memory as TRL's ``GRPOTrainer`` (the tied weight's gradients and their sum), on the logits path and with
    the fused lm_head: the CPU peak's excess over TRL's is not another copy of the output layer (benchmarks/RESULTS.md)."""
    v, h = len(tok), 48  # a width no other tensor of the step has next to V: [V, H] is the weight's shape

    def weight_sized(cls, config) -> list:
        trainer = cls(model=build_tiny_llama(tok, hidden_size=h, num_layers=1, num_heads=2, seed=0),
                      reward_funcs=[distinct_words], args=config, train_dataset=kk_dataset(), processing_class=tok)  # fmt: skip
        assert trainer.model.get_output_embeddings().weight.shape == (v, h)
        step, counts = trainer.training_step, []

        def counted(*args, **kwargs):
            with NewTensors() as seen:
                out = step(*args, **kwargs)
            counts.append(sum(shape in ((v, h), (h, v)) for shape in seen.shapes))
            return out

        trainer.training_step = counted
        trainer.train()
        return counts

    base = settings(tmp_path, optim="adamw_torch")
    theirs = weight_sized(GRPOTrainer, GRPOConfig(**{k: x for k, x in base.items() if k != "loss_backend"}))
    assert len(theirs) == 2 and min(theirs) > 0
    for fused_lm_head in (False, True):
        config = LoptiGRPOConfig(**{**base, "loss_backend": "cpp"}, fused_lm_head=fused_lm_head)
        assert weight_sized(LoptiGRPOTrainer, config) == theirs, fused_lm_head


def test_the_fused_lm_head_makes_no_logits_inside_the_models_forward(tmp_path, tok):
    """With ``fused_lm_head`` the micro-step calls the model as TRL does (its output layer runs the loss): no tensor
    as wide as the vocabulary has more rows than the phase's trained tokens, so the model's ``[B, T + 1, V]`` logits
    are never made; the output layer is the class's own again afterwards."""
    cfg = LoptiGRPOConfig(**settings(tmp_path, ar_alpha=0.3, lopti_eta=0.5, max_steps=2, fused_lm_head=True))
    _, trainer, recorded = train(LoptiGRPOTrainer, cfg, tok)
    inputs = recorded[0]
    b, t = inputs["completion_ids"].shape
    v = trainer.model.config.vocab_size
    trained = int((inputs["lopti_phase_mask"] & inputs["completion_mask"].bool()).sum())
    assert 0 < trained < b * t
    with NewTensors() as seen:
        loss = trainer._compute_loss(trainer.model, dict(inputs))
        loss.backward()
    wide = [(op, shape) for op, shape in zip(seen.ops, seen.shapes) if len(shape) > 1 and shape[-1] == v]
    assert wide and max(math.prod(shape) for _, shape in wide) <= trained * v, wide
    assert "forward" not in trainer.model.get_output_embeddings().__dict__


def test_the_fused_lm_head_trains_a_lora_model_as_the_logits_path(tmp_path, tok):
    """``peft_config`` with ``fused_lm_head`` (refused before): LoRA on the attention trains through the fused lm_head
    as through the logits (the same update); an output layer in PEFT's ``modules_to_save`` wrapper is refused in one
    line (TRL refuses LoRA on the output layer itself)."""
    from peft import LoraConfig

    def lora(fused: bool, **peft) -> LoptiGRPOTrainer:
        cfg = LoptiGRPOConfig(**settings(tmp_path / str(fused), ar_alpha=0.3, lopti_eta=0.5, max_steps=2,
                                         fused_lm_head=fused))  # fmt: skip
        # nonzero B: gradients reach A too
        peft = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **peft)
        return LoptiGRPOTrainer(model=tiny_model(tok), reward_funcs=[distinct_words], args=cfg,
                                train_dataset=kk_dataset(), processing_class=tok, peft_config=peft)  # fmt: skip

    trained = fused_lm_head_against_the_logits_path(lora)
    assert all("lora_" in n for n in trained[True])
    for name, step in trained[False].items():
        assert step.abs().max() > 0, name
    with pytest.raises(ValueError, match=r"^fused_lm_head=True needs a torch.nn.Linear output layer, got Modu"):
        lora(True, modules_to_save=["lm_head"])  # the output layer trained whole, in PEFT's wrapper


def test_the_fused_lm_head_with_an_fp32_head_trains_as_the_logits_path(tmp_path, tok):
    """``cast_lm_head_to_fp32`` with ``fused_lm_head`` (refused before) on a bf16 model with tied embeddings: TRL's
    fp32 output layer (its own forward, kept) and the kernel in fp32 make the logits path's update."""
    heads = []

    def fp32_head(fused: bool) -> LoptiGRPOTrainer:
        cfg = LoptiGRPOConfig(**settings(tmp_path / str(fused), ar_alpha=0.3, lopti_eta=0.5, max_steps=2,
                                         fused_lm_head=fused, cast_lm_head_to_fp32=True))  # fmt: skip
        trainer = LoptiGRPOTrainer(model=tiny_model(tok).to(torch.bfloat16), reward_funcs=[distinct_words], args=cfg,
                                   train_dataset=kk_dataset(), processing_class=tok)  # fmt: skip
        heads.append(trainer.model.get_output_embeddings())
        assert heads[-1].weight.dtype == torch.float32 and "forward" in heads[-1].__dict__  # TRL's cast, its forward
        return trainer

    trained = fused_lm_head_against_the_logits_path(fp32_head)
    assert all("forward" in head.__dict__ for head in heads)  # TRL's forward is back after our steps
    head_step = trained[False]["model.embed_tokens.weight"]  # tied: the fp32 output layer's update
    assert head_step.abs().max() > 0


def test_a_bad_value_raises_before_the_optimizer_step_naming_where(tmp_path, tok, capsys):
    """The fused loss's value checks are read before each optimizer step (a pre-hook on the optimizer), not in the
    call: a non-finite advantage planted in the first micro-step raises at the first step, naming the optimizer
    step, the Lopti phase, the micro-step and the row; no weight has moved. The backend that ran is printed once."""

    class Poisoned(LoptiGRPOTrainer):
        def _compute_loss(self, model, inputs):
            advantages = inputs["advantages"].clone()
            advantages[0] = float("nan")  # the first completion's advantage
            return super()._compute_loss(model, dict(inputs, advantages=advantages))

    config = LoptiGRPOConfig(**settings(tmp_path, ar_alpha=0.3, lopti_eta=0.5, max_steps=2))
    trainer = Poisoned(model=tiny_model(tok), reward_funcs=[distinct_words], args=config, train_dataset=kk_dataset(),
                       processing_class=tok)  # fmt: skip
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^advantages must be finite .* \(row \d+ at optimizer step 1, Lopti phase "
                                         r"'low', micro-step 1\)$"):  # fmt: skip
        trainer.train()
    assert all(torch.equal(v, initial[k]) for k, v in trainer.model.state_dict().items())
    printed = [line for line in capsys.readouterr().out.splitlines() if "fused loss ran on the" in line]
    assert printed == ["[openrlhf-lopti] TRL fused loss ran on the torch backend (one pass); value checks are read "
                       "before each optimizer step"]  # fmt: skip


def test_args_given_by_position_as_trl_takes_them(tmp_path, tok):
    """``LoptiGRPOTrainer(model, reward_funcs, args, train_dataset)``, TRL's positional order: the config given is
    the one used (before: it was dropped for a default config, which failed on this machine's bf16)."""
    cfg = LoptiGRPOConfig(**settings(tmp_path, ar_alpha=0.3))
    trainer = LoptiGRPOTrainer(tiny_model(tok), [distinct_words], cfg, kk_dataset(), processing_class=tok)
    assert trainer.args is cfg and trainer.args.ar_alpha == 0.3 and len(trainer.train_dataset) == len(kk_dataset())
    with pytest.raises(TypeError, match="multiple values for argument 'args'"):
        LoptiGRPOTrainer(tiny_model(tok), [distinct_words], cfg, args=cfg)


class KeepsEveryPosition(torch.nn.Module):
    """A causal LM whose forward ignores ``logits_to_keep`` (as some remote-code models do): logits of every
    position. Wraps the tiny Llama, so that its update can be compared with the Llama's own."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config
        self.warnings_issued, self.generation_config = {}, model.generation_config

    def forward(self, *args, logits_to_keep=None, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


@pytest.mark.parametrize("fused_lm_head", [False, True])
def test_a_model_that_ignores_logits_to_keep_trains_as_one_that_keeps_them(tmp_path, tok, fused_lm_head):
    """Before: the kernel got every position's logits and failed on a shape mismatch (TRL's own trainer trains it)."""
    cfg = LoptiGRPOConfig(**settings(tmp_path, ar_alpha=0.3, lopti_eta=0.5, max_steps=2, fused_lm_head=fused_lm_head))
    _, plain, _ = train(LoptiGRPOTrainer, cfg, tok)
    _, wrapped, _ = train(LoptiGRPOTrainer, cfg, tok, model=KeepsEveryPosition(tiny_model(tok)))
    for (name, a), b in zip(plain.model.named_parameters(), wrapped.model.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def with_attention_dropout(tok):
    """The tiny Llama with attention dropout 0.3 (TRL's ``disable_dropout`` is False by default, and it would not
    reach a functional dropout anyway)."""
    model = tiny_model(tok)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.3
    return model


@pytest.mark.parametrize("fused_lm_head", [False, True])
def test_off_with_dropout_is_trls_on_policy_step(tmp_path, tok, fused_lm_head):
    """TRL's on-policy case anchors the ratio at the same forward's log-probs (ratio 1). Before, ours computed the
    anchor in a forward of its own: with dropout, other masks, a ratio away from 1, tokens clipped (a third of them
    here) and another update; and that extra forward drew from the random stream TRL's next dropout masks use."""
    ours_cfg = LoptiGRPOConfig(**settings(tmp_path / "a", fused_lm_head=fused_lm_head))
    _, ours, _ = train(LoptiGRPOTrainer, ours_cfg, tok, model=with_attention_dropout(tok))
    base = settings(tmp_path / "b")
    base.pop("loss_backend")
    initial, theirs, _ = train(GRPOTrainer, GRPOConfig(**base), tok, model=with_attention_dropout(tok))
    p0 = initial_params(tok, initial)
    for a, b, start in zip(trained_params(ours), trained_params(theirs), p0):
        step = b - start
        assert (a - b).abs().max() <= 1e-4 * step.abs().max() + 1e-7  # the same update, up to rounding
    logs = [{k: v for k, v in h.items() if k.startswith("clip_ratio/")} for h in (ours.state.log_history[0],
                                                                                theirs.state.log_history[0])]
    assert logs[0] == logs[1] and logs[0]["clip_ratio/region_mean"] == 0.0


class NaNInTheSecondTraining(LoptiGRPOTrainer):
    """A NaN advantage in every micro-batch of this trainer's second ``train()``."""

    trainings = 0

    def train(self, *args, **kwargs):
        self.trainings += 1
        return super().train(*args, **kwargs)

    def _compute_loss(self, model, inputs):
        if self.trainings == 2 and self.model.training:
            inputs = dict(inputs, advantages=torch.full_like(inputs["advantages"], float("nan")))
        return super()._compute_loss(model, inputs)


@pytest.mark.parametrize("new_optimizer", [False, True])
def test_a_second_train_call_still_reads_the_value_checks(tmp_path, tok, new_optimizer):
    """A second ``train()`` of the same trainer trained on NaN advantages: its global steps count from 0 again, and
    the checks, read once per global step, counted step 0 as read; and the hook that reads them was on the first
    ``train()``'s optimizer only, while an optimizer built again (as DeepSpeed builds one at each ``train()``; here
    ``self.optimizer = None`` makes TRL build it) does the stepping."""
    cfg = LoptiGRPOConfig(**settings(tmp_path, ar_alpha=0.3))
    trainer = NaNInTheSecondTraining(model=tiny_model(tok), reward_funcs=[distinct_words], args=cfg,
                                     train_dataset=kk_dataset(), processing_class=tok)  # fmt: skip
    trainer.train()
    trained = [p.detach().clone() for p in trainer.model.parameters()]
    if new_optimizer:
        trainer.optimizer, trainer.lr_scheduler = None, None
    with pytest.raises(ValueError, match="^advantages must be finite"):
        trainer.train()
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), trained))


def test_off_a_micro_batch_without_response_tokens_logs_trls_metrics(tmp_path, tok):
    """With AR and Lopti off, a micro-batch whose every completion is masked (truncated under
    ``mask_truncated_completions``) logs TRL's ``entropy`` and ``clip_ratio/*_mean``: 0, TRL's mean over a count
    clamped to 1 (before: NaN, which TRL's ``log`` drops, so the step logged None where TRL logs 0, and with
    ``logging_steps > 1`` another mean)."""
    start = tmp_path / "tiny"
    tiny_model(tok).save_pretrained(start)
    options = dict(mask_truncated_completions=True, max_completion_length=3)
    _, ours, ours_inputs = train(LoptiGRPOTrainer, LoptiGRPOConfig(**settings(tmp_path / "a", **options)), tok,
                                 model=str(start))  # fmt: skip
    base = settings(tmp_path / "b", **options)
    base.pop("loss_backend")
    _, theirs, _ = train(GRPOTrainer, GRPOConfig(**base), tok, model=str(start))
    assert all(int(x["completion_mask"].sum()) == 0 for x in ours_inputs)  # every completion truncated: masked
    keys = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
    logged = [{k: h.get(k) for k in keys} for h in ours.state.log_history if "loss" in h]
    assert logged == [{k: h.get(k) for k in keys} for h in theirs.state.log_history if "loss" in h]
    assert logged and all(v == 0.0 for step in logged for v in step.values())
