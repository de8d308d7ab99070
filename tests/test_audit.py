"""The audit: binning, gradient norms checked against the closed form, update directions, the command."""

import copy
import dataclasses
import json
import math

import pytest
import torch

from openrlhf_lopti.__main__ import main as cli_main
from openrlhf_lopti.algo.direction import DIRECTION_EDGES, direction_bins, direction_counts, direction_metrics
from openrlhf_lopti.audit.measure import (
    bin_edges,
    bin_index,
    correct_direction,
    direction_shares,
    logit_grad_norms,
    make_optimizer,
    param_grad_norms,
    per_bin_mean,
)
from openrlhf_lopti.audit.report import format_table
from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
from openrlhf_lopti.local.config import METHODS, TrainConfig
from openrlhf_lopti.local.experience import Experience
from openrlhf_lopti.local.model import save_model
from openrlhf_lopti.local.rollout import generate_rollouts, response_logits, response_logprobs
from openrlhf_lopti.local.trainer import LocalTrainer
from openrlhf_lopti.local.task import compact_prompt, puzzles

from .kernel_cases import allow_float64_logits
from .numerics import Float64Shadow, assert_all_same_computation, assert_same_computation


def float64_copy(model, exp):
    """The same model and experience as float64 (exact copies), for the float64 run of a comparison."""
    doubled = {k: getattr(exp, k).double() for k in ("old_log_probs", "advantages", "rewards")}
    return copy.deepcopy(model).double(), dataclasses.replace(exp, **doubled)


@pytest.fixture(scope="module")
def setup():
    tok = build_word_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # spread token probabilities over (0, 1)
    torch.manual_seed(0)
    prompts = [compact_prompt(r) for r in puzzles(0, 0, 2, [2])]
    rollout = generate_rollouts(model, tok, prompts, 4, 8, temperature=0.7)
    old = response_logprobs(model, rollout, 0.7)
    adv = torch.tensor([1.5, -0.5, 1.0, -2.0, 0.0, 0.0, 1.0, -1.0]).view(-1, 1) * rollout.action_mask
    n = len(rollout)
    flags = torch.zeros(n, dtype=torch.bool)
    exp = Experience(rollout, old, None, adv, torch.zeros(n), flags, ~flags)
    cfg = TrainConfig(model="m", out="o", temperature=0.7, kl_coef=0.0, lr=1e-2, mini_batch_size=n,
                      loss_backend="torch", n_samples=4, prompts_per_step=2)  # fmt: skip
    return model, tok, exp, cfg


def test_bins():
    """The audit bins tokens by their log-probs with algo.direction's edges and function (one source of truth)."""
    p = torch.tensor([0.0, 0.1, 0.25, 0.49, 0.5, 0.74, 0.75, 1.0], dtype=torch.float64)
    assert bin_edges(p.log()) == list(DIRECTION_EDGES)
    assert bin_index(p.log(), bin_edges(p.log())).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # The boundary rule is algo's: p = exp(log-prob) in float64, bins [e_k, e_{k+1}). The audit used to bin
    # p = exp(log-prob) in the log-prob's dtype: a float32 log-prob of 0.25 gave p == 0.25 exactly (Q2); in float64
    # it is 0.2499999990 (Q1), as algo.direction_bins (and so the trainers' direction/* metrics) bins it.
    assert bin_index(torch.tensor([0.25]).log(), list(DIRECTION_EDGES)).tolist() == [0]
    logp = torch.cat([torch.rand(500).log(), torch.tensor([0.25, 0.5, 0.75, 1.0]).log(), torch.tensor([1e-7])])
    assert torch.equal(bin_index(logp, bin_edges(logp)), direction_bins(logp))
    q = torch.rand(400)
    counts = torch.bincount(bin_index(q.log(), bin_edges(q.log(), "quantile")), minlength=4)
    assert counts.tolist() == [100] * 4
    # other edges follow the same rule: [e_k, e_{k+1}), the last bin closed and taking p a hair above 1
    edges = [0.0, 0.2, 0.4, 0.6, 1.0]
    at = torch.tensor([0.0, 0.2, 0.4, 0.6, 1.0], dtype=torch.float64).log()
    assert bin_index(torch.cat([at, torch.tensor([1e-7], dtype=torch.float64)]), edges).tolist() == [0, 1, 2, 3, 3, 3]
    means = per_bin_mean(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 2]), torch.tensor([True, True, False]))
    assert means[0] == 2.0 and all(math.isnan(v) for v in means[1:])  # empty bins are NaN, not 0
    with pytest.raises(ValueError, match="bins"):
        bin_edges(p.log(), "deciles")


def test_direction_shares_are_algo_directions_shares():
    """On the fixed bins the audit's "rose" shares are algo.direction's ``direction/pos_up_qk``; a bin without a
    positive-advantage token has none (NaN here, where algo leaves the key out), an unchanged log-prob is not up."""
    generator = torch.Generator().manual_seed(0)
    old = torch.rand(300, generator=generator).log()
    new = old + torch.randn(300, generator=generator) * 0.1 * (torch.rand(300, generator=generator) > 0.2)
    adv = torch.randn(300, generator=generator)
    metrics = direction_metrics(direction_counts(old, new, adv))
    shares = direction_shares(direction_bins(old), new - old, adv)
    assert shares == [metrics[f"direction/pos_up_q{k}"] for k in range(1, 5)]
    bins, delta = torch.tensor([0, 0, 2, 3]), torch.tensor([1.0, 0.0, -1.0, 2.0])
    shares = direction_shares(bins, delta, torch.tensor([1.0, 1.0, 1.0, -1.0]))
    assert shares[0] == 0.5 and shares[2] == 0.0 and math.isnan(shares[1]) and math.isnan(shares[3])


def test_logit_grad_norm_is_autograd_and_matches_the_closed_form(setup, monkeypatch):
    """At the sampling weights (ratio 1, nothing clipped): |A| / T * ||onehot - softmax(z / T)||."""
    model, _, exp, cfg = setup
    rows = exp.rollout.action_mask
    labels = exp.rollout.sequences[:, exp.rollout.prompt_len :][rows]

    def both(model, exp):
        got = logit_grad_norms(model, exp, cfg)
        with torch.no_grad():
            z = response_logits(model, exp.rollout)[rows]
        p = torch.softmax(z / cfg.temperature, -1)
        onehot = torch.nn.functional.one_hot(labels, p.shape[-1]).float()
        return got, exp.advantages[rows].abs() / cfg.temperature * (onehot - p).norm(dim=-1)

    # the same values by the rule of tests/numerics.py: both again on float64 copies of the model and experience
    got, expected = both(model, exp)
    allow_float64_logits(monkeypatch)
    model64, exp64 = float64_copy(model, exp)
    with Float64Shadow():
        # the closed form holds at ratio 1: the float64 run's old log-probs are its own model's
        exp64 = dataclasses.replace(exp64, old_log_probs=response_logprobs(model64, exp.rollout, cfg.temperature))
        got64, expected64 = both(model64, exp64)
    assert_same_computation("logit grad norms", got, expected, got64, expected64, "logit_grad_norms", "closed form")
    probs = exp.old_log_probs[rows].exp()
    assert probs.min() < 0.5 < probs.max()  # the check covered low and high tokens


def test_param_grad_norm_matches_a_single_token_backward(setup, monkeypatch):
    """Per-response forwards give the same per-token parameter gradients as a backward through the batch."""
    model, _, exp, cfg = setup
    model = copy.deepcopy(model)
    rows = exp.rollout.action_mask
    last = int(rows.sum()) - 1
    norms = param_grad_norms(model, exp, cfg, torch.tensor([last, 0, 3]))
    labels = exp.rollout.sequences[:, exp.rollout.prompt_len :][rows]
    def manual(model, exp):
        norms = []
        for t in (last, 0, 3):
            logits = response_logits(model, exp.rollout)[rows]
            logp = torch.log_softmax(logits / cfg.temperature, -1)[t, labels[t]]
            loss = -torch.exp(logp - exp.old_log_probs[rows][t]) * exp.advantages[rows][t]
            model.zero_grad()
            loss.backward()
            norms.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)))
        return torch.tensor(norms, dtype=torch.float64)

    # the same norms by the rule of tests/numerics.py: both again on float64 copies of the model and experience
    want = manual(model, exp)
    model64, exp64 = float64_copy(model, exp)
    allow_float64_logits(monkeypatch)
    with Float64Shadow():
        norms64 = param_grad_norms(model64, exp64, cfg, torch.tensor([last, 0, 3]))
        want64 = manual(model64, exp64)
    assert_same_computation("param grad norms", norms, want, norms64.double(), want64, "param_grad_norms", "by hand")


def test_correct_direction_leaves_the_model_alone(setup):
    model, _, exp, cfg = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    old_log_probs = exp.old_log_probs[exp.rollout.action_mask]
    bins = bin_index(old_log_probs, bin_edges(old_log_probs))
    fractions, deltas = correct_direction(model, exp, cfg, bins, list(METHODS), optimizer="sgd")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert set(fractions) == set(METHODS) and all(len(v) == 4 for v in fractions.values())
    positive = exp.advantages[exp.rollout.action_mask] > 0
    for m in METHODS:
        assert deltas[m].abs().sum() > 0
        # among positive tokens, most log-probs rise after an SGD step on this small batch
        assert (deltas[m][positive] > 0).float().mean() > 0.5
    zero = TrainConfig.from_dict({**cfg.to_dict(), "lr": 1e-30})
    frozen, _ = correct_direction(model, exp, zero, bins, ["grpo"], optimizer="fresh-adamw")
    assert all(v == 0 or math.isnan(v) for v in frozen["grpo"])  # nothing moves: nothing counts as up


def test_audit_command_default_model(tmp_path, capsys):
    out = tmp_path / "audit"
    argv = ["audit", "--out", str(out), "--warmup-steps", "5", "--warmup-target", "0", "--prompts", "2",
            "--n-samples", "4", "--param-grad-tokens", "2"]  # fmt: skip
    assert cli_main(argv) == 0
    result = json.loads((out / "audit.json").read_text())
    assert len(result["grad_norm_by_quartile"]) == 4 and len(result["param_grad_norm_by_quartile"]) == 4
    assert list(result["correct_direction_by_quartile"]) == list(METHODS)
    assert all(len(v) == 4 for v in result["correct_direction_by_quartile"].values())
    assert sum(result["token_count_by_quartile"]) == result["tokens"] > 0
    assert (out / "audit.png").stat().st_size > 0 and (out / "warmup_model" / "config.json").exists()
    printed = capsys.readouterr().out
    assert "| Q1 |" in printed and "| Q4 |" in printed and "up: ar+lopti" in printed
    assert cli_main(argv) == 2  # refuses to overwrite


def test_audit_command_any_model_quantile_bins(tmp_path, setup):
    model, tok, _, _ = setup
    save_model(model, tok, tmp_path / "m", prompt_style="compact")
    out = tmp_path / "a"
    argv = ["audit", "--model", str(tmp_path / "m"), "--out", str(out), "--prompts", "2", "--n-samples", "2",
            "--bins", "quantile", "--optimizer", "sgd", "--param-grad-tokens", "0",
            "--methods", "grpo,lopti"]  # fmt: skip
    assert cli_main(argv) == 0
    result = json.loads((out / "audit.json").read_text())
    assert result["param_grad_norm_by_quartile"] is None
    assert list(result["correct_direction_by_quartile"]) == ["grpo", "lopti"]
    assert result["bin_edges"][0] == 0.0 and result["bin_edges"][-1] == 1.0
    assert "|grad| params" not in format_table(result)


AUDIT_CFG = TrainConfig(model="m", out="o", lr=1e-3, weight_decay=0.1)


def state_after_steps(net, optimizer, steps: int) -> dict:
    """``optimizer``'s state dict (a copy) after ``steps`` steps of ``net`` on random inputs: a run's checkpoint."""
    for _ in range(steps):
        optimizer.zero_grad()
        net(torch.randn(5, 3)).pow(2).sum().backward()
        optimizer.step()
    return copy.deepcopy(optimizer.state_dict())


def test_checkpoint_optimizer_continues_training_adamw_state():
    """``make_optimizer("checkpoint")`` takes the moments and step count of a saved AdamW: its next step is
    Adam's formula on those moments (written out here), not a fresh AdamW's ~lr * sign(grad); the saved
    state is not modified, so every audited method starts from it."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    trained = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    saved = state_after_steps(net, trained, 3)
    x = torch.randn(5, 3)

    def steps(net, saved, x):
        """The step of each optimizer kind, and Adam's formula written out on the saved moments."""
        results = {}
        for kind in ("checkpoint", "fresh-adamw"):
            copy_net = copy.deepcopy(net)
            (opt,) = make_optimizer(copy_net.parameters(), kind, AUDIT_CFG, states=[saved])
            copy_net(x).pow(2).sum().backward()
            grads = [p.grad.clone() for p in copy_net.parameters()]
            opt.step()
            results[kind] = [new.detach() - old.detach() for new, old in zip(copy_net.parameters(), net.parameters())]
        beta1, beta2, eps, lr, wd = 0.9, 0.999, 1e-8, 1e-3, 0.1
        written = {"checkpoint": [], "fresh-adamw": []}
        for i, (param, g) in enumerate(zip(net.parameters(), grads)):
            state = saved["state"][i]
            t = float(state["step"]) + 1
            m = beta1 * state["exp_avg"] + (1 - beta1) * g
            v = beta2 * state["exp_avg_sq"] + (1 - beta2) * g * g
            expected = -lr * wd * param.detach() - lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
            written["checkpoint"].append(expected)
            # first step: m/sqrt(v) = sign(g)
            written["fresh-adamw"].append(-lr * wd * param.detach() - lr * g / (g.abs() + eps))
        return results, written

    # The same steps by the logic half of the rule of tests/numerics.py (these are AdamW steps: no precision
    # half): on float64 copies of the net, the saved moments and the input, the optimizer's step and the formula
    # agree to float64 rounding.
    results, written = steps(net, saved, x)
    saved64 = copy.deepcopy(saved)
    for state in saved64["state"].values():
        state.update({k: v.double() for k, v in state.items() if k != "step"})
    results64, written64 = steps(copy.deepcopy(net).double(), saved64, x.double())
    for kind in results:
        assert_all_same_computation(f"{kind} step", results[kind], written[kind], results64[kind], written64[kind],
                                    a_name="make_optimizer", b_name="written out", precision=False)  # fmt: skip
    assert all(torch.equal(saved["state"][i]["exp_avg"], trained.state_dict()["state"][i]["exp_avg"]) for i in (0, 1))
    with pytest.raises(ValueError, match="checkpoint"):
        make_optimizer(net.parameters(), "checkpoint", AUDIT_CFG)
    with pytest.raises(ValueError, match="optimizer"):
        make_optimizer(net.parameters(), "adam", AUDIT_CFG)


def test_checkpoint_optimizer_continues_training_sgd_momentum():
    """A run trained with SGD (momentum 0.9) is audited with SGD and its momentum buffers: the step is
    ``-lr * (0.9 * buf + g)``, not AdamW's; per-phase runs get one optimizer per phase from their states."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    sgd_cfg = dataclasses.replace(AUDIT_CFG, optimizer="sgd", momentum=0.9, weight_decay=0.0)
    saved = state_after_steps(net, torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9), 2)
    copy_net = copy.deepcopy(net)
    (opt,) = make_optimizer(copy_net.parameters(), "checkpoint", sgd_cfg, states=[saved])
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == AUDIT_CFG.lr
    copy_net(torch.randn(5, 3)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in copy_net.parameters()]
    opt.step()
    eps = torch.finfo(torch.float32).eps
    for i, (new, old, g) in enumerate(zip(copy_net.parameters(), net.parameters(), grads)):
        buffer = saved["state"][i]["momentum_buffer"]
        expected = -AUDIT_CFG.lr * (0.9 * buffer + g)
        # a few fp32 roundings of the magnitudes added (the step is ~1e-3 of the weight): relative to their sum
        bound = 4 * eps * (old.detach().abs() + AUDIT_CFG.lr * (0.9 * buffer.abs() + g.abs()))
        assert ((new.detach() - old.detach() - expected).abs() <= bound).all()
    per_phase = dataclasses.replace(sgd_cfg, lopti=True, lopti_moments="per-phase")
    pair = make_optimizer(net.parameters(), "checkpoint", per_phase, states=[saved, saved])
    assert len(pair) == 2 and pair[0] is not pair[1]
    with pytest.raises(ValueError, match="1 saved optimizer state"):
        make_optimizer(net.parameters(), "checkpoint", per_phase, states=[saved])
    # a lopti_lr_scale run: its Lopti methods step at the scaled lr, whatever lr the saved state holds
    scaled = dataclasses.replace(sgd_cfg, lopti=True, lopti_lr_scale=0.5)
    (opt,) = make_optimizer(net.parameters(), "checkpoint", scaled, states=[saved])
    assert opt.param_groups[0]["lr"] == 0.5 * AUDIT_CFG.lr


def test_audit_command_from_a_training_checkpoint(tmp_path, setup, capsys):
    model, tok, _, _ = setup
    save_model(model, tok, tmp_path / "m", prompt_style="compact")
    run = tmp_path / "run"
    cfg = TrainConfig(model=str(tmp_path / "m"), out=str(run), steps=2, prompts_per_step=2, n_samples=4,
                      max_new_tokens=8, temperature=0.9, lr=3e-3, seed=5, loss_backend="torch", progress=False)  # fmt: skip
    LocalTrainer(cfg).run()
    out = tmp_path / "a"
    argv = ["audit", "--checkpoint", str(run), "--out", str(out), "--param-grad-tokens", "0", "--methods", "grpo,ar"]
    assert cli_main(argv) == 0
    result = json.loads((out / "audit.json").read_text())
    assert result["checkpoint"] == {"run_dir": str(run), "step": 2, "run_seed": 5, "optimizer": "adamw",
                                    "momentum": 0.0, "lopti_moments": "shared", "lopti_lr_scale": 1.0}  # fmt: skip
    settings = result["settings"]
    assert settings["optimizer"] == "checkpoint" and settings["lr"] == 3e-3 and settings["temperature"] == 0.9
    assert (settings["prompts"], settings["n_samples"], settings["max_new_tokens"]) == (2, 4, 8)
    assert result["tokens"] > 0 and list(result["correct_direction_by_quartile"]) == ["grpo", "ar"]
    assert sorted(p.name for p in run.iterdir()) == sorted(
        ["config.json", "metrics.jsonl", "checkpoint.pt", "plots.png", "final_model"])  # fmt: skip
    # the fresh optimizer remains available, by name
    assert cli_main([*argv[:3], "--out", str(tmp_path / "b"), "--optimizer", "fresh-adamw", *argv[5:]]) == 0
    assert json.loads((tmp_path / "b" / "audit.json").read_text())["settings"]["optimizer"] == "fresh-adamw"
    capsys.readouterr()
    assert cli_main(["audit", "--checkpoint", str(tmp_path / "m"), "--out", str(tmp_path / "c")]) == 2
    assert "checkpoint.pt" in capsys.readouterr().err
    assert cli_main(["audit", "--checkpoint", str(run), "--model", str(tmp_path / "m")]) == 2
    assert cli_main(["audit", "--optimizer", "checkpoint", "--out", str(tmp_path / "d")]) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_audit_command_from_an_sgd_and_a_per_phase_checkpoint(tmp_path, setup, capsys):
    """``audit --checkpoint`` of a run trained with SGD + momentum steps with SGD and that run's momentum
    buffers (what the run's next step would do), at the run's lr (scaled for Lopti by its lopti_lr_scale);
    a per-phase Lopti run gives each phase its own state."""
    model, tok, _, _ = setup
    save_model(model, tok, tmp_path / "m", prompt_style="compact")
    common = dict(model=str(tmp_path / "m"), steps=2, prompts_per_step=2, n_samples=4, max_new_tokens=8,
                  temperature=0.9, lr=0.05, seed=5, loss_backend="torch", progress=False)  # fmt: skip
    runs = {"sgd": dict(optimizer="sgd", momentum=0.9, lopti=True, lopti_lr_scale=0.5),
            "phase": dict(lopti=True, lopti_moments="per-phase")}  # fmt: skip
    for name, extra in runs.items():
        LocalTrainer(TrainConfig(out=str(tmp_path / name), **common, **extra)).run()
    out = tmp_path / "a"
    argv = ["audit", "--checkpoint", str(tmp_path / "sgd"), "--out", str(out), "--param-grad-tokens", "0",
            "--methods", "grpo,lopti"]  # fmt: skip
    assert cli_main(argv) == 0
    result = json.loads((out / "audit.json").read_text())
    assert result["checkpoint"]["optimizer"] == "sgd" and result["checkpoint"]["momentum"] == 0.9
    assert result["checkpoint"]["lopti_lr_scale"] == 0.5
    # the run's lr, not the scaled one its Lopti optimizer held: the audited Lopti methods scale it once, themselves
    assert result["settings"]["optimizer"] == "checkpoint" and result["settings"]["lr"] == 0.05
    phase_argv = ["audit", "--checkpoint", str(tmp_path / "phase"), "--param-grad-tokens", "0"]
    capsys.readouterr()
    assert cli_main([*phase_argv, "--out", str(tmp_path / "b")]) == 2  # grpo and ar have no phases
    assert "--methods lopti,ar+lopti" in capsys.readouterr().err
    assert cli_main([*phase_argv, "--out", str(tmp_path / "c"), "--methods", "lopti,ar+lopti"]) == 0
    result = json.loads((tmp_path / "c" / "audit.json").read_text())
    assert result["checkpoint"]["lopti_moments"] == "per-phase"
    assert list(result["correct_direction_by_quartile"]) == ["lopti", "ar+lopti"]


@pytest.mark.parametrize("people", ["3,x", "x", ",", "9", "1,3", "2.5", "3,,4"])
def test_audit_people_must_be_kk_sizes_in_one_line_before_any_model(tmp_path, capsys, monkeypatch, people):
    """--people 3,x was `ValueError: invalid literal for int()` (a traceback) after the model loaded; now the same
    one line as `study`'s, before a model is looked at or --out is made."""
    from openrlhf_lopti.audit import cli as audit_cli
    from openrlhf_lopti.audit.study import PEOPLE_FORM

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before --people was checked")

    monkeypatch.setattr(audit_cli, "run_audit", no_model)
    out = tmp_path / "audit"
    argv = ["audit", "--model", str(tmp_path / "model"), "--out", str(out), "--people", people]
    assert cli_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"openrlhf-lopti audit: error: --people {PEOPLE_FORM}, got {people!r}"]
    assert not out.exists()
    assert audit_cli.parse_people(" 3, 4") == [3, 4]


@pytest.mark.parametrize(
    "flags, message",
    [(["--threads", "-1"], "--threads must be >= 0, got -1"),
     (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
     (["--temperature", "1e-40"], "--temperature must be a finite number > 0, got 1e-40"),
     (["--temperature", "1e39"], "--temperature must be a finite number > 0, got 1e+39")],
    ids=["threads", "max-new-tokens", "temperature-tiny", "temperature-huge"],
)  # fmt: skip
def test_audit_refuses_bad_numbers_in_one_line_before_any_model(tmp_path, capsys, monkeypatch, flags, message):
    """(Before: --threads -1 was torch's RuntimeError traceback; --max-new-tokens 0 silently became 512 (20 for the demo
    model); --temperature 1e-40 crashed in sampling, after the model was built.)"""
    from openrlhf_lopti.audit import cli as audit_cli

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(audit_cli, "run_audit", no_model)
    out = tmp_path / "audit"
    assert cli_main(["audit", "--model", str(tmp_path / "model"), "--out", str(out), *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"openrlhf-lopti audit: error: {message}"]
    assert not out.exists()


def fake_run(folder, **settings):
    """A `train` run folder whose checkpoint.pt holds ``settings`` (no real model: refused before one is loaded)."""
    from openrlhf_lopti.local.checkpoint import save_checkpoint

    folder.mkdir()
    net = torch.nn.Linear(2, 2)
    config = TrainConfig(model=str(folder / "model"), out=str(folder), **settings).to_dict()
    save_checkpoint(folder, model=net, optimizer=torch.optim.AdamW(net.parameters()), step=1, metrics_offset=0,
                    config=config)  # fmt: skip
    return folder


@pytest.mark.parametrize(
    "settings, shown",
    [(dict(data="rows.jsonl", reward_file="reward.py"), "--data rows.jsonl, --reward-file reward.py"),
     (dict(reward_file="reward.py"), "--reward-file reward.py"),
     (dict(lopti_quantile=0.2), "--lopti-quantile 0.2"),
     (dict(estimator="reinforce++"), "--estimator reinforce++"),
     (dict(lopti=True, lopti_order="high_first"), "--lopti-order high_first")],
    ids=["data", "reward-file", "quantile", "estimator", "order"],
)  # fmt: skip
def test_audit_checkpoint_refuses_a_run_whose_update_it_cannot_reproduce(tmp_path, capsys, settings, shown):
    """The audit samples K&K puzzles, scores them by the paper's rule, takes GRPO advantages and splits Lopti by eta,
    low first. (Before: a --data run, a quantile or a REINFORCE++ run was audited that way all the same, as "the batch
    it would sample next".)"""
    run = fake_run(tmp_path / "run", **settings)
    assert cli_main(["audit", "--checkpoint", str(run), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--checkpoint {str(run)!r}: the run trained with {shown}, which the audit cannot" in err[0]


def test_audit_checkpoint_that_is_damaged_is_one_line(tmp_path, capsys):
    """(Before: torch's RuntimeError traceback.)"""
    run = fake_run(tmp_path / "run")
    (run / "checkpoint.pt").write_bytes((run / "checkpoint.pt").read_bytes()[:500])
    assert cli_main(["audit", "--checkpoint", str(run), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"openrlhf-lopti audit: error: --checkpoint: {run / 'checkpoint.pt'} cannot be read as a checkpoint "
                   "(PytorchStreamReader failed reading zip archive: failed finding central directory): pass the "
                   "folder of a `train` run that has saved a checkpoint"]  # fmt: skip
