"""LoptiTrainingWorker on verl's real classes against the local reference trainer's ``update_policy``.

The same tiny Llama, the same batch (the local trainer's own rollout and log-probs), the same mini-batches (16
responses, mini-batches of 8 in order, micro-batches of 4), the same optimizer and lr, gradient clipping at 1.0, the
paper's clip range (0.2 / 0.24), a k3 KL loss against a made-up reference, temperature 0.7. verl runs its FSDP2
engine on the CPU (world size 1); the local trainer runs ``update_policy``.

Bounds (TESTING.md, "Numerical comparisons"; tests/numerics.py): both paths run again under ``Float64Shadow`` on exact
float64 copies of the same weights and batch (verl's whole engine included: its parameters, all-gathers and
optimizer become float64 under the shadow). Logic: the float64 updates agree to ``64 x amplification x u64`` of
their scale (amplification: the larger fp32 error in units of u32); precision: with SGD each fp32 path's error
against its own float64 run is at most 4x the other's plus 64 ulps. With AdamW only the logic half (a rounding-level
difference on a near-zero gradient entry becomes a whole AdamW step). Compared: every parameter's change over the
round (after - before: a formula change shows against the step's size, not the weights'), each phase's mean
gradient norm; the round's metrics exactly (both come from ``algo.plan_round`` on the same tensor).

What is not the same, and why it does not matter here: verl's vanilla loss always has the dual clip (at
``clip_ratio_c``, set to 1e9: the local trainer has none); the local trainer shuffles its mini-batches with
``torch.randperm`` (made the identity here, as verl's ``shuffle=False``); verl right-pads the sequences it forwards
where the local trainer keeps the rollout's left padding (same positions and masks: rounding only).
"""

import copy
import dataclasses
from contextlib import contextmanager, nullcontext

import pytest
import torch

from openrlhf_lopti.local.config import TrainConfig
from openrlhf_lopti.local.update import build_optimizers, update_policy

from ..kernel_cases import allow_float64_logits
from ..numerics import Float64Shadow, assert_same_computation, scalars_same_computation
from . import harness

LR = 0.05
KL = 0.05
MINI, MICRO = 8, 4
METHODS = {
    "grpo": dict(alpha=0.0, eta=None),
    "ar": dict(alpha=0.3, eta=None),
    "lopti": dict(alpha=0.0, eta=0.5),
    "ar+lopti": dict(alpha=0.3, eta=0.5),
}


@contextmanager
def mini_batches_in_order():
    """The local trainer's mini-batches in batch order (``torch.randperm`` -> arange), as verl's ``shuffle=False``."""
    randperm = torch.randperm
    torch.randperm = lambda n, generator=None, **kw: torch.arange(n)
    try:
        yield
    finally:
        torch.randperm = randperm


def full_parameters(module) -> dict:
    """name -> a detached copy of each parameter (DTensor shards gathered)."""
    out = {}
    for name, p in module.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = value.detach().clone()
    return out


def exact_float64_buffers(module, model) -> None:
    """The float64 run's buffers as exact copies of the fp32 model's (TESTING.md: float64 copies of the same
    inputs). Built under the shadow, verl's model computes its rotary ``inv_freq`` in float64, where the fp32 model
    (and its ``.double()`` copy in the local run) has it rounded to fp32: a 1e-8 difference of every position angle."""
    buffers = dict(model.named_buffers())
    for name, buffer in module.named_buffers():
        if name in buffers and buffer.is_floating_point():
            buffer.copy_(buffers[name].double())


def run_verl(tiny, method: dict, float64: bool, optimizer: str = "SGD", epochs: int = 1, worker_cls=None,
             layout=None):  # fmt: skip
    """One RL step of verl's actor (our worker unless ``worker_cls``): (each parameter's change, metrics, worker).
    ``layout``: a function of the padded batch giving the batch handed to ``update_actor`` (default: as is)."""
    cfg = harness.compose(harness.actor_overrides(
        tiny["path"], mini_batch=MINI, micro_batch=MICRO, lr=LR, optimizer=optimizer, epochs=epochs, kl_coef=KL,
        alpha=method["alpha"], eta=method["eta"], quantile=method.get("quantile"),
    ))  # fmt: skip
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker

    saved = ActorRolloutRefWorker.actor_worker_cls
    with Float64Shadow() if float64 else nullcontext():
        try:
            if worker_cls is not None:
                ActorRolloutRefWorker.actor_worker_cls = worker_cls
            worker = harness.actor_worker(cfg)
        finally:
            ActorRolloutRefWorker.actor_worker_cls = saved
        module = worker.actor.engine.module
        if float64:
            exact_float64_buffers(module, tiny["model"])
        before = full_parameters(module)
        batch = harness.verl_batch(tiny["exp"], temperature=tiny["temperature"], mini_batch=MINI, epochs=epochs)
        if float64:
            for key in ("old_log_probs", "advantages", "ref_log_prob"):
                batch[key] = batch[key].double()
        if layout is not None:
            batch = layout(batch)
        metrics = tu.get(worker.update_actor(batch), "metrics")
        after = full_parameters(module)
    return {name: after[name] - before[name] for name in before}, metrics, worker


def run_local(tiny, method: dict, float64: bool, optimizer: str = "sgd", epochs: int = 1, monkeypatch=None,
              micro: int = MICRO):
    """The same step by the local reference trainer: (each parameter's change, metrics)."""
    policy, exp = copy.deepcopy(tiny["model"]), tiny["exp"]
    if float64:
        allow_float64_logits(monkeypatch)
        policy = policy.double()
        exp = dataclasses.replace(exp, **{k: getattr(exp, k).double() for k in ("old_log_probs", "ref_log_probs",
                                                                               "advantages", "rewards")})  # fmt: skip
    lopti = method["eta"] is not None or method.get("quantile") is not None
    cfg = TrainConfig(
        model="unused", out="unused", alpha=method["alpha"], lopti=lopti, eta=method["eta"],
        lopti_quantile=method.get("quantile"), optimizer=optimizer, lr=LR, mini_batch_size=MINI,
        micro_batch_size=micro, epochs=epochs, grad_clip=1.0, kl_coef=KL, kl_estimator="k3", eps_low=0.2,
        eps_high=0.24, temperature=tiny["temperature"], n_samples=4, loss_backend="torch",
    )  # fmt: skip
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    with Float64Shadow() if float64 else nullcontext(), mini_batches_in_order():
        (opt,) = build_optimizers([p for p in policy.parameters() if p.requires_grad], cfg)
        metrics = update_policy(policy, opt, exp, cfg)
    return {name: p.detach() - before[name] for name, p in policy.named_parameters()}, metrics


def phase_names(method: dict) -> tuple:
    return ("low", "high") if method["eta"] is not None or method.get("quantile") is not None else ()


def mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values)


@pytest.mark.parametrize("name", list(METHODS))
def test_one_step_equals_the_local_update_with_sgd(tiny, name, monkeypatch):
    """GRPO, AR, Lopti, AR+Lopti: verl's actor with our loss and worker makes the local trainer's update."""
    method = METHODS[name]
    v32, vm32, _ = run_verl(tiny, method, float64=False)
    v64, vm64, _ = run_verl(tiny, method, float64=True)
    l32, lm32 = run_local(tiny, method, float64=False)
    l64, lm64 = run_local(tiny, method, float64=True, monkeypatch=monkeypatch)

    assert set(v32) == set(l32), f"parameter names differ: {sorted(set(v32) ^ set(l32))}"
    for param in l32:
        assert_same_computation(f"{name}: change of {param}", v32[param], l32[param], v64[param], l64[param],
                                a_name="verl", b_name="local")  # fmt: skip
    # the round, from algo.plan_round on the same tensors: the same numbers exactly
    round_keys = [k for k in lm32 if k.startswith(("lopti/threshold", "lopti/low_token_frac", "ar/")) or
                  (k.startswith("lopti/") and k.endswith("/tokens"))]  # fmt: skip
    assert round_keys == [k for k in round_keys if k in vm32], f"verl lacks {set(round_keys) - set(vm32)}"
    assert {k: vm32[k] for k in round_keys} == {k: lm32[k] for k in round_keys}
    if method["alpha"] > 0:
        assert "ar/mean_weight" in vm32
    # each phase's optimizer steps: as many, with the same mean gradient norm (before clipping)
    for phase in phase_names(method):
        assert len(vm32[f"lopti/{phase}/grad_norm"]) == 2  # 16 responses / mini-batches of 8
        scalars_same_computation(f"{name}: {phase} phase's mean grad norm",
                                 mean(vm32[f"lopti/{phase}/grad_norm"]), lm32[f"lopti/{phase}/grad_norm"],
                                 mean(vm64[f"lopti/{phase}/grad_norm"]), lm64[f"lopti/{phase}/grad_norm"])  # fmt: skip
    steps = 2 * max(len(phase_names(method)), 1)
    assert len(vm32["grad_norm"]) == steps == lm32["optimizer_steps"]
    scalars_same_computation(f"{name}: mean grad norm", mean(vm32["grad_norm"]), lm32["grad_norm"],
                             mean(vm64["grad_norm"]), lm64["grad_norm"])  # fmt: skip
    assert set(vm32["lr"]) == {LR}  # every phase at the round's lr (the schedule's once per round: the test below)


def test_ar_and_lopti_with_adamw_and_two_epochs(tiny, monkeypatch):
    """AR+Lopti with AdamW (one optimizer for both phases, phase 2 inheriting phase 1's moments) and two epochs:
    the logic half only (AdamW turns rounding on near-zero gradients into whole steps)."""
    method = METHODS["ar+lopti"]
    v32, _, _ = run_verl(tiny, method, float64=False, optimizer="AdamW", epochs=2)
    v64, vm64, _ = run_verl(tiny, method, float64=True, optimizer="AdamW", epochs=2)
    l32, _ = run_local(tiny, method, float64=False, optimizer="adamw", epochs=2)
    l64, lm64 = run_local(tiny, method, float64=True, optimizer="adamw", epochs=2, monkeypatch=monkeypatch)
    for param in l32:
        assert_same_computation(f"adamw: change of {param}", v32[param], l32[param], v64[param], l64[param],
                                a_name="verl", b_name="local", precision=False)  # fmt: skip
    assert len(vm64["grad_norm"]) == lm64["optimizer_steps"] == 8  # 2 phases x 2 epochs x 2 mini-batches


def test_without_ar_and_lopti_the_worker_is_verls(tiny):
    """GRPO through LoptiTrainingWorker (``ar`` loss absent, Lopti off) is verl's TrainingWorker bit for bit."""
    from verl.workers.engine_workers import TrainingWorker

    ours, ours_metrics, worker = run_verl(tiny, METHODS["grpo"], float64=False)
    verls, verl_metrics, plain = run_verl(tiny, METHODS["grpo"], float64=False, worker_cls=TrainingWorker)
    assert type(worker.actor).__name__ == "LoptiTrainingWorker" and type(plain.actor) is TrainingWorker
    for param in ours:
        assert torch.equal(ours[param], verls[param]), param
    for key in ("loss", "grad_norm", "actor/pg_loss", "kl_loss", "lr"):
        assert ours_metrics[key] == verl_metrics[key], key


def test_lr_schedule_steps_once_per_rl_step_and_both_phases_share_its_lr(tiny):
    """With a warm-up schedule (lr changes every scheduler step), every optimizer step of a Lopti round (2 phases x
    2 mini-batches) runs at the same lr, and the schedule advances by one step per RL step."""
    extra = ("actor_rollout_ref.actor.optim.lr_warmup_steps=4",)
    cfg = harness.compose(harness.actor_overrides(tiny["path"], mini_batch=MINI, micro_batch=MICRO, lr=LR, eta=0.5,
                                                  extra=extra))  # fmt: skip
    worker = harness.actor_worker(cfg)
    optimizer = worker.actor.engine.optimizer
    seen = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    for _ in range(3):
        worker.update_actor(harness.verl_batch(tiny["exp"], temperature=tiny["temperature"], mini_batch=MINI))
    rounds = [seen[i : i + 4] for i in range(0, 12, 4)]
    assert len(seen) == 12
    for lrs in rounds:
        assert len(set(lrs)) == 1, f"one round's optimizer steps ran at different lrs: {lrs}"
    warmup = [LR * step / 4 for step in range(3)]  # verl's constant schedule with 4 warm-up steps, 0-indexed
    assert [lrs[0] for lrs in rounds] == pytest.approx(warmup)


def test_the_default_trainers_nested_batch_trains_as_the_padded_one(tiny):
    """verl's default trainer (``use_v1=true``) hands ``update_actor`` per-response fields as jagged nested tensors,
    the legacy one padded ``[batch, response_len]``: AR+Lopti on the same data in both layouts decides the same
    phases token by token, logs the same metrics and makes the same update (issue 38: the nested batch raised).

    Bit for bit: the engine forwards the same unpadded sequences either way; only the width to which ``ppo_loss``
    pads the response fields differs (each mini-batch's longest response vs the batch's), i.e. zeros."""
    method = dict(alpha=0.3, eta=0.4)
    padded, padded_metrics, padded_worker = run_verl(tiny, method, float64=False)
    nested, nested_metrics, nested_worker = run_verl(tiny, method, float64=False, layout=harness.nested_batch)
    response = tiny["exp"].rollout.action_mask.bool()
    pr, nr = padded_worker.actor.last_round, nested_worker.actor.last_round
    assert [p.name for p in nr.phases] == ["low", "high"] and all(p.mask.is_nested for p in nr.phases)
    for p, n in zip(pr.phases, nr.phases):
        assert torch.equal(p.mask[response], n.mask.values()) and p.tokens == n.tokens > 0, p.name
    assert nested_metrics["lopti/threshold"] == 0.4 and nested_metrics.keys() == padded_metrics.keys()
    measured = [key for key in padded_metrics if "perf/" in key or "mfu" in key]  # memory, time: not the update's
    assert {k: v for k, v in nested_metrics.items() if k not in measured} == {
        k: v for k, v in padded_metrics.items() if k not in measured}  # fmt: skip
    for param in padded:
        assert padded[param].abs().max() > 0 and torch.equal(nested[param], padded[param]), param


@pytest.mark.parametrize("layout", ["padded", "nested"])
def test_a_phase_batch_holds_its_tokens_and_their_advantages_only(tiny, layout):
    """The contract of ``LoptiTrainingWorker.phase_batch`` (issue 37: leaving the other phase's advantages in place
    went unnoticed, as every allowed verl loss masks by ``response_mask``; a loss that read advantages unmasked would
    train the wrong tokens): ``response_mask`` is the phase's tokens, ``advantages`` are the phase's and 0 on every
    other token, every other field and setting is the batch's, the batch itself is left as it was."""
    from verl.utils import tensordict_utils as tu

    from openrlhf_lopti.algo import LoptiSettings, plan_round
    from openrlhf_lopti.verl.worker import LoptiTrainingWorker

    batch = harness.verl_batch(tiny["exp"], temperature=tiny["temperature"], mini_batch=MINI)
    if layout == "nested":
        batch = harness.nested_batch(batch)
    flat = lambda t: t.values() if t.is_nested else t  # noqa: E731  (a nested field's tokens, concatenated)
    before = batch.copy()
    response, advantages = flat(batch["response_mask"]).bool(), flat(batch["advantages"])
    lopti_round = plan_round(batch["old_log_probs"], batch["response_mask"], LoptiSettings(0.5))
    for phase in lopti_round.phases:
        part = LoptiTrainingWorker.phase_batch(batch, phase.mask)
        mine = flat(phase.mask)
        assert 0 < int(mine.sum()) < int(response.sum()), phase.name
        assert torch.equal(flat(part["response_mask"]).bool(), mine)
        assert torch.equal(flat(part["advantages"]), torch.where(mine, advantages, torch.zeros_like(advantages)))
        assert bool((flat(part["advantages"])[response & ~mine] == 0).all())
        assert bool(advantages[mine].abs().gt(0).any())  # the phase's own advantages are there to keep
        for key in ("loss_mask", "old_log_probs", "ref_log_prob", "input_ids"):
            assert torch.equal(flat(part[key]), flat(batch[key])), key
        assert tu.get(part, "mini_batch_size") == MINI and tu.get(part, "temperature") == tiny["temperature"]
    for key in [k for k in before.keys() if isinstance(before[k], torch.Tensor)]:
        assert torch.equal(flat(batch[key]), flat(before[key])), f"phase_batch changed the batch's {key}"
    if layout == "nested":  # advantages whose rows are not old_log_probs' (one token moved to the next row)
        offsets = batch["advantages"].offsets().clone()
        offsets[1] -= 1
        shifted = batch.copy()
        shifted["advantages"] = torch.nested.nested_tensor_from_jagged(batch["advantages"].values(), offsets)
        with pytest.raises(ValueError, match=r"^advantages: a nested field of the Lopti round must have the rows of "
                                             r"old_log_probs") as info:  # fmt: skip
            LoptiTrainingWorker.phase_batch(shifted, lopti_round.phases[0].mask)
        assert "\n" not in str(info.value)  # (before: accepted, each token kept by the phase mask of another row)


def test_an_empty_phase_takes_no_optimizer_step(tiny):
    """The cross-front-end contract (tests/test_lopti_round_contract.py): eta = 1 puts every token in the low phase;
    the empty high phase is not run, so the round is one plain pass: verl's GRPO step exactly, with its optimizer
    steps only and the LR schedule where GRPO leaves it."""
    plain, plain_metrics, plain_worker = run_verl(tiny, METHODS["grpo"], float64=False)
    lopti, metrics, worker = run_verl(tiny, dict(alpha=0.0, eta=1.0), float64=False)
    assert metrics["lopti/high/tokens"] == 0 and metrics["lopti/low/tokens"] > 0
    assert len(metrics["grad_norm"]) == len(plain_metrics["grad_norm"]) == 2 and "lopti/high/grad_norm" not in metrics
    schedulers = [w.actor.engine.lr_scheduler.state_dict() for w in (worker, plain_worker)]
    assert schedulers[0]["last_epoch"] == schedulers[1]["last_epoch"] == 1
    for param in plain:
        assert torch.equal(lopti[param], plain[param]), param
