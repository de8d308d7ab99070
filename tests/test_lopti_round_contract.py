"""The cross-front-end contract of the Lopti round (issue 32): one batch, every front end, the same decisions.

One batch of rollout log-probs holds ties at the threshold (p = 0.5 exactly), probabilities that underflow to 0,
padding, and (for one setting) an empty phase. For each setting:

1. each front end's configuration (local ``TrainConfig``, OpenRLHF's CLI flags, TRL's ``LoptiGRPOConfig``) maps to
   the same ``algo.LoptiSettings`` (or to no Lopti);
2. the round as the local trainer plans it (``local.update.plan_lopti_round``) is ``algo.plan_round``'s;
3. two gloo ranks, each holding half the batch, plan the round through OpenRLHF's trainer's data-parallel gather
   (``LoptiActorPPOTrainer._gather_over_dp`` / ``_sum_metrics_over_dp`` over a real ``DeviceMesh``)
   and through TRL's trainer's (``LoptiGRPOTrainer._gather_over_processes`` / ``_sum_over_processes`` on a real
   ``accelerate.Accelerator``), and decide the threshold, each token's phase and the metrics of one process
   planning the whole batch; and two ranks of one OpenRLHF data-parallel replica (a ring-attention group: both hold
   the whole batch, OpenRLHF's mesh ``(dp, sp, tp) = (1, 2, 1)``) decide what one process decides, not twice its
   counts (a sum over the world instead of the data-parallel group);
4. an empty phase (no token on any process) takes no optimizer step and leaves the LR schedule where a run without
   Lopti leaves it, in every front end: the round of the "empty phase" setting trains exactly as a plain pass,
   here for the local trainer and TRL's real trainer (under DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2 in
   tests/test_trl_processes.py, ``test_sharded_an_empty_phase_takes_no_optimizer_step``); OpenRLHF's on its real
   DeepSpeed engine in test_openrlhf_trainer.py (``test_eta_putting_every_token_in_one_phase_is_exactly_the_baseline``)
   and verl's on its real FSDP2 engine in tests/verl/test_worker.py (``test_an_empty_phase_takes_no_optimizer_step``),
   each in its own environment or fixtures.

What 3 cannot show: the trainers around those methods (they are bound to an object holding only what they
read). The whole trainers are run elsewhere: OpenRLHF's with 2 DeepSpeed ranks and a quantile
(test_openrlhf_deepspeed.py), TRL's on one process (test_trl_round.py, test_trl_trainer.py) and two
(test_trl_processes.py), the local update (test_local_update.py).
"""

import functools
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from openrlhf_lopti.algo import THRESHOLD_FLOOR, LoptiSettings, plan_round

from .ds_ranks import free_port

PAD = float("nan")  # padding: never read (masked out)
# rollout probabilities, [4, 6]: ties at 0.5, zeros that are exp() underflows, padding
PROBS = [
    [0.5, 0.2, 0.9, 0.5, PAD, PAD],
    [0.0, 0.7, 0.3, 0.05, 0.95, PAD],
    [0.6, 0.5, 0.0, 0.8, PAD, PAD],
    [0.1, 0.99, 0.4, 0.0, PAD, PAD],
]


def contract_batch():
    """``(old_log_probs [4, 6], response_mask [4, 6])``: p = 0 is written as log-probs that underflow in ``exp``."""
    probs = torch.tensor(PROBS, dtype=torch.float64)
    mask = ~torch.isnan(probs)
    old = torch.where(probs > 0, probs.clamp(min=1e-300).log(), torch.full_like(probs, -1e4)).float()
    old = torch.where(mask, old, torch.zeros_like(old))
    old[2, 2] = -200.0  # exp(-200) is 0 in fp32, not in fp64: the round's probabilities are fp32
    return old, mask


# (name, local TrainConfig fields, OpenRLHF flags, TRL LoptiGRPOConfig fields, the settings they all mean)
SETTINGS = [
    ("eta", dict(lopti=True, eta=0.5), ["--algo.lopti.eta", "0.5"], dict(lopti_eta=0.5), LoptiSettings(0.5)),
    ("quantile alone", dict(lopti_quantile=0.3), ["--algo.lopti.quantile", "0.3"], dict(lopti_quantile=0.3),
     LoptiSettings(0.5, "low_first", 0.3)),
    ("underflowing quantile", dict(lopti_quantile=0.1), ["--algo.lopti.quantile", "0.1"], dict(lopti_quantile=0.1),
     LoptiSettings(0.5, "low_first", 0.1)),
    ("empty phase", dict(lopti=True, eta=1.0, lopti_order="high_first"),
     ["--algo.lopti.eta", "1.0", "--algo.lopti.order", "high_first"], dict(lopti_eta=1.0, lopti_order="high_first"),
     LoptiSettings(1.0, "high_first")),
    ("off", dict(), [], dict(), None),
]  # fmt: skip


def test_the_batch_holds_what_the_contract_is_about():
    old, mask = contract_batch()
    probs = old.exp()
    tie = plan_round(old, mask, LoptiSettings(0.5))
    assert not tie.low[0, 0] and not tie.low[2, 1]  # p == threshold: high
    zeros = int((probs[mask] == 0).sum())
    assert zeros == 3 and zeros / int(mask.sum()) > 0.1  # the 0.1 quantile is 0: floored
    under = plan_round(old, mask, LoptiSettings(0.5, quantile=0.1))
    assert under.threshold == THRESHOLD_FLOOR and torch.equal(under.low, mask & (probs == 0))
    empty = plan_round(old, mask, LoptiSettings(1.0, "high_first"))
    assert [p.name for p in empty.phases] == ["high", "low"] and empty.phases[0].tokens == 0


def nested_rows(padded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's response tokens (a prefix of the row here) as one jagged nested tensor ``[B, j]``: the layout of
    verl's default trainer (``response_to_nested``)."""
    return torch.nested.as_nested_tensor([row[m] for row, m in zip(padded, mask)], layout=torch.jagged)


@pytest.mark.parametrize("name, settings", [(s[0], s[4]) for s in SETTINGS], ids=[s[0] for s in SETTINGS])
def test_a_nested_batch_gets_the_padded_batchs_round(name, settings):
    """The same tokens as jagged nested rows (verl's default trainer) or padded ``[B, T]``: the same threshold,
    phases token by token, counts and metrics; the phases' masks come back nested with the rows' offsets. A nested
    batch with a padded mask is refused in one line naming it."""
    old, mask = contract_batch()
    nested_old, nested_mask = nested_rows(old, mask), nested_rows(mask, mask)
    padded, nested = plan_round(old, mask, settings, 0.3), plan_round(nested_old, nested_mask, settings, 0.3)
    weight = "ar/mean_weight"  # an fp32 sum over [4, 6] or over [17]: another order of the same 17 terms
    assert nested.metrics.pop(weight) == pytest.approx(padded.metrics.pop(weight), rel=17 * 2**-23)
    assert (nested.threshold, nested.metrics) == (padded.threshold, padded.metrics)
    assert [(p.name, p.tokens) for p in nested.phases] == [(p.name, p.tokens) for p in padded.phases]
    for n, p in zip(nested.phases, padded.phases):
        assert n.mask.is_nested and torch.equal(n.mask.offsets(), nested_old.offsets())
        assert torch.equal(n.mask.values(), p.mask[mask]), n.name
    with pytest.raises(ValueError, match=r"^response_mask: a nested round needs .* got a padded tensor") as info:
        plan_round(nested_old, mask, settings)
    assert "\n" not in str(info.value)
    # rows cut out of a longer buffer (narrow): values() also holds the gaps between the rows, which would count as
    # tokens (before: accepted, and the gaps planned as response tokens)
    buffer = torch.cat([old, torch.zeros_like(old)], dim=1)
    cut = torch.nested.narrow(buffer, 1, torch.zeros(4, dtype=torch.long), mask.sum(-1), layout=torch.jagged)
    cut_mask = torch.nested.narrow(torch.cat([mask, mask], 1), 1, torch.zeros(4, dtype=torch.long), mask.sum(-1),
                                   layout=torch.jagged)  # fmt: skip
    with pytest.raises(ValueError, match=r"^old_log_probs: a nested round needs contiguous jagged rows") as info:
        plan_round(cut, cut_mask, settings)
    assert "\n" not in str(info.value)
    assert plan_round(cut.contiguous(), cut_mask.contiguous(), settings).threshold == padded.threshold


@pytest.mark.parametrize("name, local, openrlhf, trl, expected", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_every_front_end_maps_its_options_to_the_same_settings(name, local, openrlhf, trl, expected, tmp_path):
    from openrlhf_lopti.local.config import TrainConfig

    local_cfg = TrainConfig(model="m", out="o", **local)
    assert local_cfg.lopti_settings == expected
    pytest.importorskip("openrlhf")
    from openrlhf_lopti.cli.train_ppo_ray import parse_args
    from openrlhf_lopti.openrlhf.flags import lopti_config

    base = ["--actor.model_name_or_path", "m", "--reward.remote_url", "reward.py"]
    assert lopti_config(parse_args(base + openrlhf)).lopti == expected
    pytest.importorskip("trl")
    from openrlhf_lopti.trl import LoptiGRPOConfig

    trl_cfg = LoptiGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, **trl)
    assert trl_cfg.lopti_settings == expected


def test_every_front_end_refuses_eta_and_a_quantile_together_in_one_line_naming_both(tmp_path, capsys):
    """algo.lopti_settings' one rule (docs/LOPTI_ROUND.md): two thresholds, neither silently wins. (Before: the
    quantile won in every front end and eta was ignored without a word.)"""
    from openrlhf_lopti.algo import lopti_settings
    from openrlhf_lopti.local.config import TrainConfig

    def refusal(build) -> str:
        with pytest.raises(ValueError) as info:
            build()
        message = str(info.value)
        assert "\n" not in message and "two Lopti thresholds" in message, message
        return message

    assert "eta=0.3 and quantile=0.2" in refusal(lambda: lopti_settings(True, 0.3, "low_first", 0.2))
    message = refusal(lambda: TrainConfig(model="m", out="o", lopti=True, eta=0.3, lopti_quantile=0.2))
    assert "eta=0.3" in message and "lopti_quantile=0.2" in message
    pytest.importorskip("openrlhf")
    from openrlhf_lopti.cli.train_ppo_ray import parse_args

    base = ["--actor.model_name_or_path", "m", "--reward.remote_url", "reward.py"]
    with pytest.raises(SystemExit):  # the CLI's argparse error: usage, then one line
        parse_args(base + ["--algo.lopti.eta", "0.3", "--algo.lopti.quantile", "0.2"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--algo.lopti.eta=0.3 and --algo.lopti.quantile=0.2 are two Lopti thresholds" in line
    pytest.importorskip("trl")
    from openrlhf_lopti.trl import LoptiGRPOConfig

    trl = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, lopti_eta=0.3, lopti_quantile=0.2)
    assert "lopti_eta=0.3 and lopti_quantile=0.2" in refusal(lambda: LoptiGRPOConfig(**trl))
    # verl's key (actor_rollout_ref.actor.policy_loss.lopti_eta / .lopti_quantile): tests/verl/test_config.py


def test_every_front_end_refuses_an_order_without_lopti_in_one_line_naming_it(tmp_path, capsys):
    """The paper's ablation asked for (`high_first`) with no threshold ran plain GRPO without a word, in every front
    end."""
    from openrlhf_lopti.algo import lopti_settings
    from openrlhf_lopti.errors import UserError
    from openrlhf_lopti.local.cli import build_parser, config_from_args
    from openrlhf_lopti.local.config import TrainConfig

    said = "=high_first orders Lopti's phases, but Lopti is off, so it would order nothing"
    with pytest.raises(ValueError, match=f"^order{said}"):
        lopti_settings(False, None, "high_first", None)
    assert lopti_settings(False, None, "low_first", None) is None
    with pytest.raises(UserError, match=f"^--lopti-order{said}"):
        config_from_args(build_parser().parse_args(["--model", "m", "--out", "o", "--lopti-order", "high_first"]))
    # the local trainer's --eta alone is not refused: without Lopti it is the threshold of lopti/low_token_frac
    assert config_from_args(build_parser().parse_args(["--model", "m", "--out", "o", "--eta", "0.3"])).eta == 0.3
    assert TrainConfig(model="m", out="o", lopti=True, lopti_order="high_first").lopti_settings.order == "high_first"
    pytest.importorskip("openrlhf")
    from openrlhf_lopti.cli.train_ppo_ray import parse_args

    base = ["--actor.model_name_or_path", "m", "--reward.remote_url", "reward.py"]
    with pytest.raises(SystemExit):
        parse_args(base + ["--algo.lopti.order", "high_first"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: --algo.lopti.order{said}: turn Lopti "
                                                                     "on, or leave the order low_first")  # fmt: skip
    pytest.importorskip("trl")
    from openrlhf_lopti.trl import LoptiGRPOConfig

    trl = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, lopti_order="high_first")
    with pytest.raises(ValueError, match=f"^lopti_order{said}"):
        LoptiGRPOConfig(**trl)
    # verl's key (actor_rollout_ref.actor.policy_loss.lopti_order): tests/verl/test_config.py


@pytest.mark.parametrize("name, local, openrlhf, trl, expected", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_the_local_trainer_plans_algos_round(name, local, openrlhf, trl, expected):
    from openrlhf_lopti.local.config import TrainConfig
    from openrlhf_lopti.local.update import plan_lopti_round

    old, mask = contract_batch()
    cfg = TrainConfig(model="m", out="o", alpha=0.3, **local)
    exp = SimpleNamespace(old_log_probs=old, rollout=SimpleNamespace(action_mask=mask))
    ours, reference = plan_lopti_round(exp, cfg), plan_round(old, mask, expected, 0.3)
    assert_same_round(summary(ours), summary(reference))


def summary(lopti_round) -> dict:
    return {
        "threshold": lopti_round.threshold,
        "phases": [[p.name, p.mask.tolist(), p.tokens] for p in lopti_round.phases],
        "metrics": lopti_round.metrics,
    }


def assert_same_round(got: dict, want: dict) -> None:
    assert got["threshold"] == want["threshold"]  # the same fp32 values sorted: bit-equal
    assert got["phases"] == want["phases"]
    assert got["metrics"].keys() == want["metrics"].keys()
    # an all-reduce may sum in fp32 (TRL's): a sum of n <= 17 weights in [0, 1] may differ by n fp32 roundings of
    # itself (17 * 2^-24 < 1.1e-6); counts (< 2^24) and the threshold (not reduced) are exact
    for key, value in want["metrics"].items():
        assert math.isclose(got["metrics"][key], value, rel_tol=17 * 2.0**-24, abs_tol=0.0), key


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One of two gloo ranks: rows [2 rank, 2 rank + 2) of the batch through both front ends' collectives."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    result = {}
    try:
        from accelerate import Accelerator
        from torch.distributed.device_mesh import init_device_mesh

        from openrlhf_lopti.openrlhf.cpu.stubs import install_cpu_stubs

        install_cpu_stubs()
        from openrlhf_lopti.openrlhf.cpu.strategy import answer_cuda_calls_on_cpu
        from openrlhf_lopti.openrlhf.trainer import LoptiActorPPOTrainer
        from openrlhf_lopti.trl.trainer import LoptiGRPOTrainer

        answer_cuda_calls_on_cpu()
        accelerator = Accelerator(cpu=True)  # initialises the gloo group from the environment
        strategy = SimpleNamespace(ds_device_mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
        openrlhf = LoptiActorPPOTrainer.__new__(LoptiActorPPOTrainer)  # only its collectives run: they read strategy
        openrlhf.strategy = strategy
        # one data-parallel replica of `world` ranks (a ring-attention group): every rank holds the whole batch
        replica = LoptiActorPPOTrainer.__new__(LoptiActorPPOTrainer)
        replica.strategy = SimpleNamespace(
            ds_device_mesh=init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("dp", "sp", "tp"))
        )
        trl = SimpleNamespace(accelerator=accelerator)
        drivers = {
            "openrlhf": dict(gather=openrlhf._gather_over_dp, all_reduce=openrlhf._sum_metrics_over_dp),
            "trl": dict(gather=functools.partial(LoptiGRPOTrainer._gather_over_processes, trl),
                        all_reduce=functools.partial(LoptiGRPOTrainer._sum_over_processes, trl)),
        }  # fmt: skip
        old, mask = contract_batch()
        rows = slice(2 * rank, 2 * rank + 2)
        for name, _, _, _, settings in SETTINGS:
            for front_end, collectives in drivers.items():
                lopti_round = plan_round(old[rows], mask[rows], settings, 0.3, **collectives)
                result[f"{name}/{front_end}"] = summary(lopti_round)
            collectives = dict(gather=replica._gather_over_dp, all_reduce=replica._sum_metrics_over_dp)
            result[f"{name}/openrlhf replica"] = summary(plan_round(old, mask, settings, 0.3, **collectives))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_two_ranks_decide_what_one_process_decides_for_the_whole_batch(tmp_path):
    pytest.importorskip("openrlhf")
    pytest.importorskip("trl")
    world = 2
    context = mp.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=_rank, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)  # a hang guard: the ranks take ~30 s, more beside busy processes
        if p.is_alive():
            p.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, result in enumerate(results):
        assert "error" not in result, f"rank {r}: {result.get('error')}"
    old, mask = contract_batch()
    for name, _, _, _, settings in SETTINGS:
        whole = summary(plan_round(old, mask, settings, 0.3))
        for front_end in ("openrlhf", "trl"):
            parts = [result[f"{name}/{front_end}"] for result in results]
            for r, part in enumerate(parts):
                assert part["threshold"] == whole["threshold"], (name, front_end, r)
                want_phases = [[n, m[2 * r : 2 * r + 2], t] for n, m, t in whole["phases"]]
                assert part["phases"] == want_phases, (name, front_end, r)
                assert_same_round(part, {**whole, "phases": want_phases})
        for r, result in enumerate(results):  # (before: the replica's ranks summed over the world counted 2x)
            assert_same_round(result[f"{name}/openrlhf replica"], whole)


def _local_round(settings: dict):
    """The local trainer's ``update_policy`` on a tiny Llama's own samples, AdamW: (parameters after, metrics)."""
    from openrlhf_lopti.demo.tiny_model import build_tiny_llama, build_word_tokenizer
    from openrlhf_lopti.local.config import TrainConfig
    from openrlhf_lopti.local.experience import Experience
    from openrlhf_lopti.local.rollout import generate_rollouts, response_logprobs
    from openrlhf_lopti.local.update import build_optimizers, update_policy

    tok = build_word_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    torch.manual_seed(0)
    rollout = generate_rollouts(model, tok, ["Alice says", "Bob is a"], 4, 6, 1.0)
    old = response_logprobs(model, rollout, 1.0)
    advantages = torch.tensor([1.0, -1.0] * 4).view(-1, 1) * rollout.action_mask
    flags = torch.zeros(len(rollout), dtype=torch.bool)
    exp = Experience(rollout, old, None, advantages, torch.zeros(len(rollout)), flags, ~flags)
    cfg = TrainConfig(model="m", out="o", mini_batch_size=4, kl_coef=0.0, loss_backend="torch", progress=False,
                      weight_decay=0.1, **settings)  # fmt: skip
    optimizer = build_optimizers([p for p in model.parameters() if p.requires_grad], cfg)
    metrics = update_policy(model, optimizer, exp, cfg, torch.Generator().manual_seed(0))
    return [p.detach().clone() for p in model.parameters()], metrics


def _trl_round(tmp_path, lopti: bool):
    """TRL's real trainer, AdamW with weight decay and a linear schedule: one generation batch, one optimizer step per
    phase. With ``lopti_eta=1`` every token is low: the high phase is empty. (parameters, AdamW step counts, the
    scheduler's count and last rate)."""
    from openrlhf_lopti.trl import LoptiGRPOConfig, LoptiGRPOTrainer

    from .test_trl_trainer import distinct_words, kk_dataset, settings, tiny_model
    from openrlhf_lopti.demo.tiny_model import build_word_tokenizer

    tok = build_word_tokenizer()
    extra = dict(lopti_eta=1.0, max_steps=2) if lopti else dict(max_steps=1)
    cfg = LoptiGRPOConfig(**settings(tmp_path, gradient_accumulation_steps=1, steps_per_generation=1,
                                     optim="adamw_torch", weight_decay=0.1, lr_scheduler_type="linear",
                                     shuffle_dataset=False, **extra))  # fmt: skip
    trainer = LoptiGRPOTrainer(model=tiny_model(tok), reward_funcs=[distinct_words], args=cfg,
                               train_dataset=kk_dataset(8), processing_class=tok)  # fmt: skip
    trainer.train()
    if lopti:
        logged = {k: v for h in trainer.state.log_history for k, v in h.items()}
        assert logged["lopti/high/tokens"] == 0 and logged["lopti/low/tokens"] > 0
    steps = sorted({int(state["step"]) for state in trainer.optimizer.state.values()})
    schedule = (trainer.lr_scheduler.last_epoch, trainer.lr_scheduler.get_last_lr())
    return [p.detach().clone() for p in trainer.model.parameters()], steps, schedule


@pytest.mark.parametrize("front_end", ["local", "trl"])
def test_an_empty_phase_takes_no_optimizer_step(front_end, tmp_path):
    """The "empty phase" setting's eta = 1 puts every token in the low phase: the round is its low phase alone, a
    plain pass; the high phase takes no optimizer step (no AdamW moment update, no weight decay) and leaves the
    schedule as a run without Lopti leaves it. (Before, TRL: AdamW stepped on zero gradients in the empty phase,
    moving every weight by its momentum and weight decay.)"""
    if front_end == "local":
        plain, plain_metrics = _local_round({})
        lopti, metrics = _local_round(dict(lopti=True, eta=1.0))
        assert metrics["lopti/high/tokens"] == 0 and metrics["optimizer_steps"] == plain_metrics["optimizer_steps"]
    else:
        pytest.importorskip("trl")
        from openrlhf_lopti.demo.tiny_model import build_word_tokenizer

        from .test_trl_trainer import tiny_model

        plain, plain_steps, plain_schedule = _trl_round(tmp_path / "plain", lopti=False)
        lopti, steps, schedule = _trl_round(tmp_path / "lopti", lopti=True)
        assert steps == plain_steps == [1]  # one AdamW step per parameter: the empty phase took none
        assert schedule == plain_schedule
        # the plain run anchors the ratio at its loss's own forward (TRL's on-policy case), Lopti at the rollout's
        # stored log-probs: the same values up to rounding, so the same step up to rounding (an AdamW step in the
        # empty phase would add a whole step's worth of momentum and weight decay)
        for a, b, start in zip(lopti, plain, tiny_model(build_word_tokenizer()).parameters()):
            step = (b - start.detach()).abs().max()
            assert step > 0 and (a - b).abs().max() <= 1e-3 * step
        return
    assert all(torch.equal(a, b) for a, b in zip(lopti, plain))
