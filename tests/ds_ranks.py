"""Data-parallel ranks of ``LoptiPolicyModelActor`` on the real DeepSpeed engine, as ``--cpu`` runs them, without Ray.

Each rank is a spawned process that does what a Ray policy actor of a ``--cpu`` run does: the CPU runtime's
stand-ins, upstream's parser + post-processing + ours (``parse_args``), ``cpu_settings``, the CPU strategy
(real ``deepspeed.initialize`` on the CPU accelerator, gloo between the ranks) and upstream's
``PolicyModelActor.init_model_from_pretrained`` / ``append`` / ``fit``. Only the experience is made here
instead of by rollouts: synthetic token probabilities spread over (0, 1), so both Lopti phases have tokens.
What Ray adds (placement, the controller, rollouts, weight sync) is covered by the end-to-end tests.

Every optimizer-step call of the DeepSpeed engine is recorded with the running Lopti phase, the epoch-local
micro-batch and whether DeepSpeed treats it as an accumulation boundary; see :func:`run_ranks` for the rest.
"""

import json
import os
import socket
import time
import traceback
from pathlib import Path

import torch

PROMPT, RESPONSE = 4, 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_tiny_model(path: Path) -> Path:
    """The ``tiny-model`` checkpoint (random Llama + K&K tokenizer), small enough for many ranks on 2 cores."""
    from openrlhf_lopti.demo.tiny_model import build_tiny_model

    model, tokenizer = build_tiny_model(hidden_size=32, num_layers=1, num_heads=2, vocab_size=300, max_positions=64)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def synthetic_experience(rank: int, step: int, samples: int, vocab: int, kl_in_reward: bool, low_p: float = 0.5):
    """An upstream ``Experience`` of ``samples`` responses for (rank, step), deterministic.

    Old-policy probabilities are uniform in (0.02, 0.98), or in (0.02, 0.5) with ``low_p`` of the tokens'
    probability mass below 0.5 when ``low_p`` differs (ranks can be given different distributions).
    """
    from openrlhf.trainer.ppo_utils.experience import Experience

    gen = torch.Generator().manual_seed(1000 * step + rank)
    sequences = torch.randint(3, vocab, (samples, PROMPT + RESPONSE), generator=gen)
    lengths = torch.randint(2, RESPONSE + 1, (samples,), generator=gen)
    action_mask = torch.arange(RESPONSE)[None, :] < lengths[:, None]
    attention_mask = torch.cat([torch.ones(samples, PROMPT, dtype=torch.long), action_mask.long()], 1)
    sequences = sequences * attention_mask
    u = torch.rand(samples, RESPONSE, generator=gen)
    low = torch.rand(samples, RESPONSE, generator=gen) < low_p
    probs = torch.where(low, 0.02 + 0.48 * u, 0.5 + 0.48 * u)
    old = probs.log() * action_mask
    ref = (old + 0.1 * torch.randn(old.shape, generator=gen)) * action_mask
    rewards = torch.randn(samples, generator=gen)
    grouped = rewards.reshape(-1, 2)  # groups of 2 samples
    scores = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).reshape(-1)
    advantages = scores[:, None] * action_mask
    kl = (old - ref) * action_mask
    info = {"reward": rewards.clone()}
    info["kl"] = kl.sum(-1) / action_mask.sum(-1) if kl_in_reward else torch.zeros(samples)
    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=old,
        base_action_log_probs=ref,
        advantages=advantages,
        returns=advantages.clone(),
        rewards=rewards,
        response_length=action_mask.sum(-1).float(),
        total_length=attention_mask.sum(-1).float(),
        info=info,
    )


def declare_mesh(strategy, shape: tuple) -> None:
    """After upstream's ``setup_distributed``, replace the strategy's ``(dp, sp, tp)`` device mesh by one of
    ``shape``: ranks of one ``sp`` / ``tp`` group are one data-parallel replica holding the same experience, as
    ring attention and tensor parallelism make them. Neither runs on the CPU (flash-attn's ring attention,
    DeepSpeed's AutoTP in bf16), so only the mesh says so: what the trainer's collectives over the ``dp`` group do
    with such ranks is what this lets a test see; the model's forward and DeepSpeed's gradient all-reduce stay
    those of plain data parallelism (over identical data: the same update)."""
    from torch.distributed.device_mesh import init_device_mesh

    setup = strategy.setup_distributed

    def setup_then_declare(*args, **kwargs):
        setup(*args, **kwargs)
        strategy.ds_device_mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "sp", "tp"))

    strategy.setup_distributed = setup_then_declare


def stale_gathers(module: torch.nn.Module, trials: int) -> int:
    """How many of ``trials`` blocking ZeRO-3 gathers of every parameter of ``module`` let a parameter be read before
    its values arrived.

    Each trial writes the trial's number into every rank's partition, gathers all parameters with
    ``GatheredParameters`` (DeepSpeed's blocking gather, the one its optimizer step runs for persistent parameters)
    and reads them back at once: a parameter still holding the previous trial's values or uninitialized memory is a
    stale read. DeepSpeed 0.19.6 waits only for the last of the per-parameter gathers it launches; NCCL runs them
    in order on one stream, gloo on several threads in any order (deepspeedai/DeepSpeed#8539, fixed in 0.19.8).
    """
    import deepspeed

    params = sorted(module.parameters(), key=lambda p: p.ds_id)
    assert len(params) > 1 and all(hasattr(p, "ds_tensor") and p.ds_tensor.numel() for p in params)  # ZeRO-3's
    stale = 0
    with torch.no_grad():
        for trial in range(trials):
            for p in params:
                p.ds_tensor.fill_(float(trial))
            with deepspeed.zero.GatheredParameters(params):
                stale += any(bool((p.data != float(trial)).any()) for p in params)
    return stale


def _rank_main(rank: int, world: int, port: int, config: dict, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
        DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    result = {"rank": rank, "steps": [], "engine_steps": []}
    try:
        from openrlhf_lopti.openrlhf.cpu.runtime import cpu_settings, setup_cpu_worker

        setup_cpu_worker()
        import deepspeed
        from openrlhf_lopti.cli.train_ppo_ray import parse_args
        from openrlhf_lopti.openrlhf.actor import LoptiPolicyModelActor
        from openrlhf_lopti.openrlhf.cpu.strategy import get_cpu_strategy

        args = parse_args(config["argv"])
        errors, _ = cpu_settings(args)
        assert not errors, errors
        strategy = get_cpu_strategy(args)
        if "mesh" in config:
            declare_mesh(strategy, tuple(config["mesh"]))
        actor = LoptiPolicyModelActor.__ray_actor_class__(world, rank, "127.0.0.1", port)
        actor.init_model_from_pretrained(strategy, config["model"], config["max_steps"], None)
        engine, trainer = actor.actor.model, actor.trainer

        def param_sums() -> list:  # one per parameter, gathered from the ranks' partitions under ZeRO-3
            params = list(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, enabled=args.ds.zero_stage == 3):
                return [float(p.detach().double().sum()) for p in params]

        result["initial_params"] = param_sums()
        if config.get("gather_trials"):
            result["stale_gathers"] = stale_gathers(engine.module, config["gather_trials"])

        def recorded_step(*a, _step=engine.step, **k):
            result["engine_steps"].append(
                {"phase": trainer.lopti_phase, "boundary": bool(engine.is_gradient_accumulation_boundary())}
            )
            return _step(*a, **k)

        engine.step = recorded_step
        for step in range(config["steps"]):
            samples = config["samples_per_rank"][rank] if "samples_per_rank" in config else config["samples"]
            low_p = config.get("low_p_per_rank", [0.5] * world)[rank]
            data_rank = config.get("data_rank_per_rank", list(range(world)))[rank]
            experience = synthetic_experience(data_rank, step, samples, config["vocab"], config["kl_in_reward"], low_p)
            if config.get("poison") == [rank, step]:  # fused_policy_loss rejects it on this rank only
                if config.get("poison_logits"):  # a NaN logit column: the kernel's per-row flag catches it
                    with torch.no_grad():
                        engine.module.get_output_embeddings().weight[5].fill_(float("nan"))
                else:
                    experience.advantages[0, 0] = float("nan")
            actor.append(experience)
            status = actor.fit(config.get("kl_ctl", 0.01))
            result["steps"].append(
                {
                    "status": {k: v for k, v in status.items() if isinstance(v, (int, float))},
                    "lr": trainer.actor_scheduler.get_last_lr()[0],
                    "threshold": trainer.lopti_threshold,
                    "optimizer_steps": int(engine.global_steps),
                    "params": param_sums(),
                }
            )
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # Like a Ray actor whose method raised, the process stays up (its sockets open) until every rank is done:
    # a rank stuck in a collective with it then hangs instead of failing on a closed connection.
    deadline = time.monotonic() + config.get("linger_s", 0)
    while time.monotonic() < deadline and len(list(Path(out_dir).glob("rank*.json"))) < world:
        time.sleep(0.5)


def run_ranks(tmp_path: Path, world: int, config: dict, timeout: float = 600) -> list:
    """Run ``world`` ranks of ``config`` (``argv``, ``model``, ``max_steps``, ``steps``, ``samples``, ``vocab``,
    ``kl_in_reward``, optional ``samples_per_rank``, ``low_p_per_rank``, ``poison=[rank, step]``: a NaN advantage,
    or with ``poison_logits`` a NaN row of the output layer, on that rank before that step; ``data_rank_per_rank``:
    whose synthetic experience each rank gets (default its own), with ``mesh`` ``[dp, sp, tp]``: the device mesh
    the strategy declares, see :func:`declare_mesh`; ``gather_trials``: count :func:`stale_gathers` before training).

    Returns:
        One dict per rank: ``initial_params``, ``steps`` (per ``fit``: numeric status, scheduler lr, Lopti threshold,
        DeepSpeed's optimizer-step count, ``params``: the sum of each parameter's values), ``engine_steps`` (per
        ``engine.step()`` call: phase, boundary), ``stale_gathers`` (with ``gather_trials``) and ``error``
        (the exception text) if the rank raised. A rank still running after ``timeout`` seconds is killed and
        reported with ``error = "timeout"``: a hang (a one-step run of 2 ranks takes ~1 min idle, ~3 min beside
        busy processes).
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = tmp_path / f"ranks-{free_port()}"
    out.mkdir()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, config, str(out))) for r in range(world)]
    for proc in procs:
        proc.start()
    results = []
    for rank, proc in enumerate(procs):
        proc.join(timeout)
        if proc.is_alive():
            for p in procs:
                p.kill()
            results.append({"rank": rank, "error": "timeout"})
            continue
        path = out / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "error": "no result"})
    return results


def base_argv(model: Path, *flags: str, micro: int = 1, batch: int = 4, n_samples: int = 2, prompts: int = 4) -> list:
    """A ``--cpu`` command line of the tiny policy; ``flags`` are appended (later flags win)."""
    return [
        "--cpu", "--actor.model_name_or_path", str(model), "--reward.remote_url", "reward.py",
        "--ds.param_dtype", "fp32", "--ds.zero_stage", "2", "--vllm.num_engines", "1",
        "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(n_samples),
        "--rollout.batch_size", str(prompts), "--train.batch_size", str(batch),
        "--train.micro_batch_size", str(micro), "--rollout.micro_batch_size", "1",
        "--actor.eps_clip_low_high", "0.2", "0.24",
        "--actor.adam.lr", "1e-3", "--actor.lr_scheduler", "cosine_with_min_lr", "--actor.lr_warmup_ratio", "0.25",
        "--actor.fused_loss", "auto",
        *flags,
    ]  # fmt: skip
