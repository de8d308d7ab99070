"""TRL's vLLM colocate generation (``use_vllm=True, vllm_mode="colocate"``) on a CPU, made to work.

TRL builds a ``vllm.LLM`` inside every training process (``trl/generation/vllm_generation.py``, ``_init_vllm``;
``distributed_executor_backend="external_launcher"``: the engine runs in the calling process) and syncs the
training model into it with ``model.load_weights`` before a generation whose optimizer step changed. With vLLM's
CPU build that runs, but:

- vLLM's CPU linear layers pack their weights for its GEMMs once and drop the weight (``vllm_cpu.py``): a sync then
  fails, or leaves the engine sampling from the old packed copy without a word. Here the packing keeps the weight
  (before the engine is built) and the layers are packed again after every sync;
- TRL passes no ``dtype`` to vLLM, whose ``"auto"`` turns an fp32 checkpoint into a bf16 engine
  (``vllm/config/model.py``, ``_resolve_auto_dtype``); ``vllm_dtype="float32"`` builds an fp32 engine, whose
  sampled log-probs then match the fp32 training model's (TRL's ``sampling/sampling_logp_difference/*``);
- each process's engine reserves 0.3 x RAM of KV cache unless ``VLLM_CPU_KVCACHE_SPACE`` (GiB) is set, and vLLM
  writes its cache under the home directory unless ``VLLM_CACHE_ROOT`` is set: both get defaults here, when unset;
- vLLM has no sleep mode on CPU, and TRL's server mode syncs weights over NCCL (``trl/generation/vllm_client.py``):
  both are refused in one line when the config is built (:func:`refusals`).
"""

import contextlib
import functools
import os
from typing import Iterator, MutableMapping, Optional

from ..vllm_cpu import keep_weights_when_packing, repack_linear_layers

# vLLM's dtype argument ("auto": vLLM's choice from the checkpoint, what TRL gets)
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
# GiB of KV cache per process unless VLLM_CPU_KVCACHE_SPACE is set: room for 40k tokens of a 0.5B model in fp32,
# instead of vLLM's 0.3 x RAM in every process
KV_CACHE_GIB = "1"
CACHE_DIR = "vllm_cache"  # VLLM_CACHE_ROOT, inside the run's output_dir, unless set


def vllm_on_cpu(args) -> bool:
    """Whether ``args`` (a ``GRPOConfig``) generates with vLLM on a CPU (``args.device`` is set by the config)."""
    return bool(args.use_vllm) and args.device.type == "cpu"


def refusals(args) -> list:
    """One line per vLLM setting in ``args`` that cannot run (empty: all fine)."""
    out = []
    if args.vllm_dtype not in VLLM_DTYPES:
        out.append(f"vllm_dtype must be one of {VLLM_DTYPES}, got {args.vllm_dtype!r}")
    elif args.use_vllm and args.vllm_mode == "server" and args.vllm_dtype != "auto":
        out.append(f"vllm_dtype={args.vllm_dtype!r} sets the colocated engine's dtype; a vLLM server's is set where "
                   "it starts (trl vllm-serve --dtype)")  # fmt: skip
    if not vllm_on_cpu(args):
        return out
    if args.vllm_mode == "server":
        out.append(
            "use_vllm with vllm_mode='server' on CPU: TRL's weight sync to a vLLM server needs CUDA "
            "(trl/generation/vllm_client.py); use vllm_mode='colocate'"
        )
    if args.vllm_enable_sleep_mode:
        out.append("vllm_enable_sleep_mode=True on CPU: vLLM has no sleep mode on CPU; leave it False")
    return out


def set_environment_defaults(output_dir: str, environ: Optional[MutableMapping] = None) -> dict:
    """Set ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and ``VLLM_CACHE_ROOT`` (``<output_dir>/vllm_cache``) in ``environ``
    (default ``os.environ``) where they are unset; returns the ones it set."""
    environ = os.environ if environ is None else environ
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
        "VLLM_CACHE_ROOT": os.path.join(os.path.abspath(output_dir), CACHE_DIR),
    }
    chosen = {name: value for name, value in defaults.items() if not environ.get(name)}
    environ.update(chosen)
    return chosen


@contextlib.contextmanager
def colocated_engine(args) -> Iterator[None]:
    """Around ``GRPOTrainer.__init__`` (which builds TRL's colocated engine): the engine gets ``args.vllm_dtype``;
    on a CPU also the environment defaults and weights that survive packing. Nothing changes without colocate."""
    if not (args.use_vllm and args.vllm_mode == "colocate"):
        yield
        return
    if vllm_on_cpu(args):
        set_environment_defaults(args.output_dir)
        keep_weights_when_packing()
    if args.vllm_dtype == "auto":
        yield
        return
    from trl.generation import vllm_generation

    # TRL's _init_vllm builds the engine with vllm_generation.LLM(...) and no dtype argument: add it for this call.
    # Should a later TRL pass one, the two are compared, never one dropped without a word.
    build = vllm_generation.LLM

    @functools.wraps(build)
    def build_with_dtype(*llm_args, **llm_kwargs):
        theirs = llm_kwargs.get("dtype", args.vllm_dtype)
        if str(theirs).replace("torch.", "") != args.vllm_dtype:
            raise ValueError(f"vllm_dtype={args.vllm_dtype!r}, but TRL builds its vLLM engine with dtype={theirs!r}: "
                             "leave vllm_dtype='auto' to take TRL's")  # fmt: skip
        return build(*llm_args, **{**llm_kwargs, "dtype": args.vllm_dtype})

    vllm_generation.LLM = build_with_dtype
    try:
        yield
    finally:
        vllm_generation.LLM = build


def repack_after_every_sync(generation) -> None:
    """Make ``generation`` (TRL's ``VLLMGeneration``, colocated on a CPU) pack its engine's linear layers again
    after each ``sync_weights``, before anything is sampled from the new weights.

    TRL calls ``sync_weights`` on this object from inside its generation methods, right before it generates: the
    instance's method is the one place between the two."""
    sync = generation.sync_weights

    @functools.wraps(sync)
    def sync_and_repack() -> None:
        sync()
        repack_linear_layers(engine_model(generation))

    generation.sync_weights = sync_and_repack


def engine_model(generation):
    """The ``torch.nn.Module`` vLLM runs in this process (where TRL's colocate sync loads the weights)."""
    return generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
