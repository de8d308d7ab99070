"""The ``--cpu`` rollout engine: a Ray actor with the methods upstream calls on vLLM's ``RolloutRayActor``.

``CPURolloutActor`` subclasses upstream's ``RolloutRayActor`` and keeps what is not vLLM: the agent executor
(``generate_responses``, which calls ``reward_func`` of ``--reward.remote_url`` or ``--train.agent_func_path``).
It replaces the engine: ``generate`` samples with Hugging Face ``generate`` on the actor's current weights and
answers with the fields upstream reads from a vLLM ``RequestOutput``; ``init_process_group`` / ``update_weight``
join upstream's own ``broadcast_to_vllm`` through a :class:`~.stubs.StatelessGlooGroup` (the policy's rank 0 is
rank 0 of that group, engine ``i`` is rank ``i + 1``); sleep / wake_up / reset_prefix_cache keep nothing to free.

Requests that arrive together (upstream sends ``n_samples_per_prompt`` of them per prompt, and prompts
concurrently) and share their sampling settings run as one left-padded ``generate`` batch.
"""

import asyncio
import dataclasses
from typing import Any, List, Optional

import ray
import torch
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from openrlhf.trainer.ray.vllm_engine import RolloutRayActor, _load_agent_executor
from openrlhf.utils.agent import SingleTurnAgentExecutor

from .stubs import StatelessGlooGroup

BATCH_WINDOW_S = 0.02  # how long a first request waits for the others of its batch to arrive


@dataclasses.dataclass
class Logprob:
    """vLLM's ``Logprob``: the log-probability of one token."""

    logprob: float


@dataclasses.dataclass
class CompletionOutput:
    """The fields of vLLM's ``CompletionOutput`` upstream reads."""

    token_ids: List[int]
    text: str
    finish_reason: str  # "stop" (eos, stop token or stop string) or "length"
    logprobs: Optional[List[dict]] = None  # per token: {token_id: Logprob}, when SamplingParams.logprobs is set


@dataclasses.dataclass
class RequestOutput:
    """The fields of vLLM's ``RequestOutput`` upstream reads."""

    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]


def _has_stop(text: str, stop_strings: List[str]) -> bool:
    return any(stop in text for stop in stop_strings)


class _StopStringsInCompletion:
    """A ``generate`` stopping criterion: a row is done once its completion's text (vLLM looks at the generated
    text only; Hugging Face's ``stop_strings`` also matches across the prompt's end) contains a stop string."""

    def __init__(self, tokenizer, stop_strings: List[str], prompt_width: int, skip_special_tokens: bool):
        self.tokenizer, self.stop_strings = tokenizer, stop_strings
        self.prompt_width, self.skip = prompt_width, skip_special_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_width :], skip_special_tokens=self.skip)
        return torch.tensor([_has_stop(text, self.stop_strings) for text in texts], device=input_ids.device)


def _sampling_key(params) -> tuple:
    """Sampling settings that must be equal for two requests to share a ``generate`` call."""
    stop = params.stop if isinstance(params.stop, (list, tuple)) else [params.stop] if params.stop else []
    return (
        float(params.temperature), float(params.top_p), int(params.top_k or 0), float(getattr(params, "min_p", 0) or 0),
        params.max_tokens, int(params.min_tokens or 0), tuple(stop), tuple(params.stop_token_ids or ()),
        bool(getattr(params, "ignore_eos", False)), params.logprobs is not None,
        bool(params.skip_special_tokens), bool(getattr(params, "include_stop_str_in_output", False)),
    )  # fmt: skip


class CPURolloutActor(RolloutRayActor.__ray_actor_class__):
    """Upstream's rollout actor with Hugging Face ``generate`` on CPU in place of vLLM (see the module doc)."""

    def __init__(
        self,
        model: str,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_model_len: Optional[int] = None,
        agent_func_path: Optional[str] = None,
        remote_rm_url=None,
        **vllm_kwargs,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # What upstream's __init__ does besides building the vLLM engine: the agent executor.
        if agent_func_path:
            self.executor = _load_agent_executor(agent_func_path)
        else:
            self.executor = SingleTurnAgentExecutor(remote_rm_url)
        torch.manual_seed(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, trust_remote_code=True).eval()
        self.max_model_len = max_model_len
        self._params = dict(self.model.named_parameters())
        self._pending: list = []  # (prompt_token_ids, sampling_params, future)
        self._batcher: Optional[asyncio.Task] = None
        self._sync_group: Optional[StatelessGlooGroup] = None
        self.sleeping = False

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None) -> RequestOutput:
        """One sample of ``sampling_params`` for ``prompt_token_ids`` (vLLM's ``RequestOutput`` fields)."""
        if multi_modal_data:
            raise ValueError("the --cpu rollout engine generates text only: multi-modal prompts need vLLM")
        future = asyncio.get_running_loop().create_future()
        self._pending.append((list(prompt_token_ids), sampling_params, future))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.ensure_future(self._run_batches())
        return await future

    async def _run_batches(self) -> None:
        await asyncio.sleep(BATCH_WINDOW_S)
        while self._pending:
            key = _sampling_key(self._pending[0][1])
            batch = [request for request in self._pending if _sampling_key(request[1]) == key]
            self._pending = [request for request in self._pending if _sampling_key(request[1]) != key]
            try:
                outputs = self._generate_batch([prompt for prompt, _, _ in batch], batch[0][1])
            except Exception as exc:  # noqa: BLE001 - handed to every waiting request
                for _, _, future in batch:
                    future.set_exception(exc)
            else:
                for (_, _, future), output in zip(batch, outputs):
                    future.set_result(output)
            await asyncio.sleep(0)

    @torch.no_grad()
    def _generate_batch(self, prompts: List[List[int]], params) -> List[RequestOutput]:
        tokenizer, config = self.tokenizer, self.model.generation_config
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.eos_token_id
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        stop_ids = [] if params.ignore_eos else [i for i in eos if i is not None]
        stop_ids += list(params.stop_token_ids or [])
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        max_tokens = params.max_tokens
        if max_tokens is None:  # vLLM: up to the context window
            max_tokens = (self.max_model_len or self.model.config.max_position_embeddings) - width
        stop_strings = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        skip = params.skip_special_tokens
        sample = params.temperature > 0
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=sample,
            temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None,
            top_k=params.top_k if sample and params.top_k and params.top_k > 0 else None,
            min_p=(getattr(params, "min_p", 0) or None) if sample else None,
            max_new_tokens=max(int(max_tokens), 1),
            min_new_tokens=int(params.min_tokens or 0) or None,
            eos_token_id=stop_ids or None,
            pad_token_id=pad,
            stopping_criteria=[_StopStringsInCompletion(tokenizer, stop_strings, width, skip)] if stop_strings else None,
            output_scores=params.logprobs is not None,
            return_dict_in_generate=True,
        )
        new_tokens = out.sequences[:, width:]
        # output_scores are the processed scores (temperature, top-k/p applied): vLLM's "processed_logprobs".
        logprobs = torch.stack(out.scores, 1).float().log_softmax(-1) if params.logprobs is not None else None
        results = []
        for row, prompt in enumerate(prompts):
            tokens, finish = new_tokens[row].tolist(), "length"
            for i, token in enumerate(tokens):
                if token in stop_ids or _has_stop(tokenizer.decode(tokens[: i + 1], skip_special_tokens=skip), stop_strings):
                    tokens, finish = tokens[: i + 1], "stop"  # vLLM keeps the eos / stop token in token_ids
                    break
            text = tokenizer.decode(tokens, skip_special_tokens=skip)
            for stop in stop_strings:
                at = text.find(stop)
                if at >= 0:
                    text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
            token_logprobs = None
            if logprobs is not None:
                token_logprobs = [{t: Logprob(logprobs[row, i, t].item())} for i, t in enumerate(tokens)]
            results.append(RequestOutput(prompt, [CompletionOutput(tokens, text, finish, token_logprobs)]))
        return results

    def get_num_unfinished_requests(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ weight sync
    def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name, backend, use_ray):
        """Join upstream's weight-sync group as rank ``rank_offset`` (one process per engine: TP is 1)."""
        if use_ray:
            raise ValueError("--cpu weight sync runs without --vllm.sync_with_ray (see StatelessGlooGroup)")
        self._sync_group = StatelessGlooGroup(master_address, int(master_port), int(rank_offset), int(world_size))

    def update_weight(self, name, dtype, shape, empty_cache=False):
        """Receive parameter ``name`` from the policy's rank 0 (upstream's ``broadcast_to_vllm``) and load it."""
        if name not in self._params:
            raise KeyError(f"--cpu rollout engine: the policy sent {name!r}, which this model does not have")
        weight = torch.empty(shape, dtype=dtype)
        self._sync_group.broadcast(weight, src=0)
        self._params[name].data.copy_(weight)

    def update_weight_cuda_ipc(self, *args, **kwargs):
        raise RuntimeError("CUDA IPC weight sync needs GPUs: --cpu uses --vllm.sync_backend gloo")

    # ------------------------------------------------------------------ no GPU memory to manage
    async def reset_prefix_cache(self):
        pass

    async def sleep(self, level=1):
        self.sleeping = True

    async def wake_up(self, tags=None):
        self.sleeping = False

    async def pause_generation(self):
        pass

    async def resume_generation(self):
        pass


CPURolloutRayActor = ray.remote(CPURolloutActor)


def create_cpu_rollout_engines(
    num_engines: int,
    tensor_parallel_size: int,
    pretrain: str,
    seed: int,
    full_determinism: bool,
    enable_prefix_caching: bool,
    enforce_eager: bool,
    max_model_len: int,
    shared_pg=None,
    gpu_memory_utilization=None,
    vllm_enable_sleep=False,
    logprobs_mode=None,
    agent_func_path: Optional[str] = None,
    remote_rm_url: Optional[str] = None,
    max_images_per_prompt: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
) -> list:
    """Upstream's ``create_vllm_engines`` (same arguments and placement) building :class:`CPURolloutActor` s.

    Each engine takes bundle ``i`` of ``shared_pg`` (colocated with the policy under ``--train.colocate_all``)
    or of a placement group of its own, like upstream's; ``tensor_parallel_size`` must be 1 (checked at launch).
    ``dtype`` is the engine's weights' dtype (the policy's parameter dtype, see ``runtime``).
    """
    if tensor_parallel_size != 1:
        raise ValueError("--cpu: --vllm.tensor_parallel_size must be 1 (one process per rollout engine)")
    colocated = shared_pg is not None
    if not colocated:
        shared_pg = placement_group([{"GPU": 1, "CPU": 1} for _ in range(num_engines)], strategy="PACK")
        ray.get(shared_pg.ready())
    engines = []
    for i in range(num_engines):
        share = 0.2 if colocated else 1
        engines.append(
            CPURolloutRayActor.options(
                num_cpus=share,
                num_gpus=share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=shared_pg, placement_group_capture_child_tasks=True, placement_group_bundle_index=i
                ),
            ).remote(
                pretrain,
                seed=seed + i,
                dtype=dtype,
                max_model_len=max_model_len,
                agent_func_path=agent_func_path,
                remote_rm_url=remote_rm_url,
            )
        )
    if vllm_enable_sleep:
        ray.get([engine.sleep.remote() for engine in engines])
    return engines
