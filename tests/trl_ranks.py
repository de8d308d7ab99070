"""One rank of ``LoptiGRPOTrainer`` under a real launcher (``torchrun --nproc_per_node N tests/trl_ranks.py OUT``).

Trains one Lopti round (a quantile threshold, so the ranks must gather to agree) on the tiny Llama of
tests/test_trl_trainer.py, on CPU over gloo, with a checkpoint after each optimizer step, and writes ``OUT/rank<r>.pt``:
the micro-batches the loss saw (a one-process replay of the same global batch starts from them), the logged metrics
and the trained parameters, and those of the same round replayed through the fused lm_head. Then, in the same
processes, two runs that must fail on every rank with one line: a resume from the mid-round checkpoint whose last
process's round file is gone (a multi-node run without shared storage, its checkpoint copied from node 0), and a run
whose reward function returns -inf for a completion of the last process only. tests/test_trl_processes.py reads them.

``tests/trl_ranks.py OUT KIND``: the same round under DeepSpeed ZeRO-2 / ZeRO-3 or FSDP2 (``KIND`` one of ``zero2
zero3 fsdp2``; :func:`main_sharded`).
"""

import math
import os
import sys

import torch
from trl import GRPOTrainer

from openrlhf_lopti.trl import LoptiGRPOConfig, LoptiGRPOTrainer
from tests.test_trl_trainer import distinct_words, kk_dataset, settings, tiny_model

QUANTILE = 0.4
OURS = ("lopti_phase_1", "lopti_phase_2", "lopti_tokens_1", "lopti_tokens_2", "lopti_phase", "lopti_phase_mask",
        "lopti_phase_tokens")  # added by the trainer to TRL's batch


def round_settings(out: str, per_device_batch: int, **kw) -> dict:
    """One round (2 optimizer steps, one per phase, a checkpoint after each), dapo's token-mean over the global batch
    (so that DDP's mean over ranks is one process's loss on the whole batch), SGD."""
    round_ = dict(loss_type="dapo", per_device_train_batch_size=per_device_batch, num_generations=4,
                  gradient_accumulation_steps=1, steps_per_generation=1, max_steps=2, lopti_quantile=QUANTILE,
                  ar_alpha=0.3, shuffle_dataset=False, save_strategy="steps", save_steps=1)  # fmt: skip
    return settings(out, **{**round_, **kw})


# Two rounds of one optimizer step per phase under a decaying learning rate (each round's phases at one rate)
TWO_ROUNDS = dict(lr_scheduler_type="linear", max_steps=4, save_strategy="no")


class Replayed(GRPOTrainer):
    """Below ``LoptiGRPOTrainer`` in the MRO: with ``replay`` set, TRL's generation returns it instead of generating
    (a one-process run of the batch the ranks generated together)."""

    replay = None

    def _generate_and_score_completions(self, inputs):
        if self.replay is None:
            return super()._generate_and_score_completions(inputs)
        return {k: v.clone() if torch.is_tensor(v) else v for k, v in self.replay.items()}


class Trainer(LoptiGRPOTrainer, Replayed):
    """Records every micro-batch the loss sees, the learning rate the optimizer holds for its step, and the global
    step of each read of the fused loss's value checks."""

    def _compute_loss(self, model, inputs):
        self.trained.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        self.rates.append(self.optimizer.param_groups[0]["lr"])
        return super()._compute_loss(model, inputs)

    def _read_value_checks(self):
        self.reads.append(self.state.global_step)
        return super()._read_value_checks()


class NaNOnTheLastProcess(Trainer):
    """A NaN advantage in the first micro-step of Lopti phase ``phase`` (0: the round's first optimizer step, 1: its
    second) on the last process (the fused loss's checks find it)."""

    phase = 0

    def _compute_loss(self, model, inputs):
        if self.accelerator.is_last_process and inputs["lopti_phase"] == self.phase and not self.poisoned:
            self.poisoned = True
            advantages = inputs["advantages"].clone()
            advantages[0] = math.nan
            inputs = dict(inputs, advantages=advantages)
        return super()._compute_loss(model, inputs)


class NaNInEvaluation(LoptiGRPOTrainer):
    """A NaN advantage in the last process's evaluation batch."""

    def _compute_loss(self, model, inputs):
        if self.accelerator.is_last_process and not self.model.training:
            advantages = inputs["advantages"].clone()
            advantages[0] = math.nan
            inputs = dict(inputs, advantages=advantages)
        return super()._compute_loss(model, inputs)


class NaNInTheSecondStep(NaNOnTheLastProcess):
    """In the high phase: after a checkpoint at the first step (FSDP's saves step a stateless optimizer)."""

    phase = 1


class EmptyHighPhase(Trainer):
    """Records the whole parameters at the first micro-step of the round's second phase (every process is there
    together: ZeRO-3's and FSDP's gathers are collectives)."""

    phase_2_start = None

    def _compute_loss(self, model, inputs):
        if inputs["lopti_phase"] == 1 and self.phase_2_start is None:
            self.phase_2_start = full_parameters(self)
        return super()._compute_loss(model, inputs)


# eta = 1 puts every token of the round in the low phase: the high phase (the second) has none. AdamW with weight
# decay and a linear schedule: a step on no gradient would still move every weight and the schedule
EMPTY_HIGH_PHASE = dict(lopti_quantile=None, lopti_eta=1.0, optim="adamw_torch", weight_decay=0.1,
                        lr_scheduler_type="linear", save_strategy="no")  # fmt: skip


def optimizer_state(trainer) -> dict:
    """The torch optimizer's step counts (inside accelerate's and DeepSpeed's wrappers), the LR scheduler's place, and
    DeepSpeed's engine counters (None without DeepSpeed)."""
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)  # accelerate's wrapper
    engine = trainer.model_wrapped if trainer.is_deepspeed_enabled else None
    return {
        "steps": sorted({int(state["step"]) for state in optimizer.state.values() if "step" in state}),
        "schedule": (scheduler.last_epoch, scheduler.get_last_lr()),
        "engine": None if engine is None else (engine.global_steps, engine.skipped_steps, engine.was_step_applied()),
    }


def build(out: str, tok, per_device_batch: int, replay=None, reward=distinct_words, cls=Trainer, **kw) -> Trainer:
    """The trainer of one rank (``replay`` None) or of the one-process replay; ``kw``: more settings."""
    cfg = LoptiGRPOConfig(**round_settings(out, per_device_batch, **kw))
    data = kk_dataset(1).to_list() * 8  # one prompt: every rank's prompt tokens line up (no left padding)
    from datasets import Dataset

    trainer = cls(model=tiny_model(tok), reward_funcs=[reward], args=cfg, train_dataset=Dataset.from_list(data),
                  processing_class=tok)  # fmt: skip
    trainer.trained, trainer.rates, trainer.reads, trainer.replay, trainer.poisoned = [], [], [], replay, False
    return trainer


def failure(run) -> str:
    """The one line ``run()`` fails with (``ValueError``), or what it did instead."""
    try:
        run()
    except ValueError as exc:
        return str(exc)
    return "no error"


def last_process_only(completions, **kwargs) -> list:
    """-inf for the first completion of the last process, 1.0 everywhere else."""
    last = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    return [float("-inf") if last and i == 0 else 1.0 for i in range(len(completions))]


def zero_settings(stage: int) -> dict:
    """Settings for DeepSpeed ZeRO-``stage`` on CPU processes. Without a GPU, accelerate gives DeepSpeed no backend
    and counts one process (DeepSpeed's batch-size check then fails, with TRL's own trainer too), so its state is
    made here first, on gloo, and the trainer uses it (``use_configured_state``); on GPUs a user needs none of it,
    nor ``stage3_allgather_sequential`` (NCCL runs the gathers in order)."""
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # PartialState initialises torch.distributed through DeepSpeed
    PartialState(backend="gloo")
    # stage3_allgather_sequential: on gloo, DeepSpeed 0.19.6's blocking ZeRO-3 gather can let a parameter be read
    # before it arrives (openrlhf_lopti/openrlhf/cpu/strategy.py, _gathers_wait_on_gloo)
    zero = {"stage": stage, "stage3_allgather_sequential": True}
    config = {"zero_optimization": zero, "bf16": {"enabled": False}, "train_batch_size": "auto",
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}  # fmt: skip
    return dict(use_cpu=False, accelerator_config={"use_configured_state": True}, deepspeed=config)


def fsdp2_settings() -> dict:
    """Settings for FSDP2 (full sharding) on CPU processes.

    A stand-in for what only a GPU machine shows: accelerate turns its state into FSDP only from a GPU-like one
    (``MULTI_GPU`` ...), never from ``MULTI_CPU``, so the state is made here on gloo and declared ``MULTI_GPU``; the
    rest is real: accelerate's FSDP plugin and ``prepare`` (torch's ``fully_shard`` over gloo, every decoder layer
    its own unit), TRL's trainer, its optimizer and checkpoints. What it cannot show: NCCL, CUDA streams, FSDP's
    mixed precision on a GPU. (FSDP1 does not run so: accelerate's FSDP1 asks for a GPU device.)"""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(backend="gloo")
    state.distributed_type = DistributedType.MULTI_GPU
    return dict(use_cpu=False, accelerator_config={"use_configured_state": True}, fsdp="full_shard",
                fsdp_config={"fsdp_version": 2})  # fmt: skip


def full_parameters(trainer) -> list:
    """The model's parameters, whole (ZeRO-3 and FSDP shard them across the processes)."""
    params = list(trainer.model.parameters())
    if trainer.is_deepspeed_enabled:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    if trainer.is_fsdp_enabled:  # FSDP2: DTensor shards
        return [p.full_tensor().detach().clone() for p in params]
    return [p.detach().clone() for p in params]


def main_sharded(out: str, kind: str) -> int:
    """The round under ``kind`` (``zero2 zero3 fsdp2``); then, on each rank's batch of it, the fused lm_head's
    round, AR and Lopti off (ours and TRL's GRPOTrainer), two rounds under a decaying schedule, a resume from the
    mid-round checkpoint (AdamW), a NaN advantage on the last process in the round's first and second step, and a
    round whose second phase is empty (AdamW, weight decay, a linear schedule)."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from trl import GRPOConfig

    from openrlhf_lopti.demo.tiny_model import build_word_tokenizer

    def sharding() -> dict:  # again after each reset of accelerate's state (FSDP's declaration is part of it)
        return zero_settings(int(kind[-1])) if kind.startswith("zero") else fsdp2_settings()

    tok = build_word_tokenizer()
    trainer = build(out, tok, per_device_batch=4, **sharding())
    trainer.train()
    own = {k: v for k, v in trainer.trained[0].items() if k not in OURS}

    def again(out_dir: str, cls=Trainer, **kw):  # another trainer in the process, on this rank's batch of the round
        AcceleratorState._reset_state()  # accelerate takes one DeepSpeed / FSDP plugin per state
        if issubclass(cls, LoptiGRPOTrainer):
            return build(os.path.join(out, out_dir), tok, per_device_batch=4, replay=own, cls=cls, **sharding(), **kw)
        config = round_settings(os.path.join(out, out_dir), 4, **sharding(), **kw)
        for key in ("lopti_quantile", "ar_alpha", "loss_backend"):  # ours
            config.pop(key)
        theirs = cls(model=tiny_model(tok), reward_funcs=[distinct_words], args=GRPOConfig(**config),
                     train_dataset=Dataset.from_list(kk_dataset(1).to_list() * 8), processing_class=tok)  # fmt: skip
        theirs.replay = own
        return theirs

    fused = again("fused", fused_lm_head=True)
    fused.train()
    off = again("off", lopti_quantile=None, ar_alpha=0.0)  # AR and Lopti off: TRL's update, on the fused loss path
    off.train()
    trl = again("trl", cls=Replayed)
    trl.train()
    schedule = again("schedule", **TWO_ROUNDS)  # a decaying schedule: the round's rewind must hold
    schedule.train()
    # the resume under AdamW: a stateful optimizer (torch's full-state-dict load of FSDP's optimizer fails on one
    # without state, plain SGD: "Expected device to be set", with TRL's own trainer too)
    adam = again("adam", optim="adamw_torch")
    adam.train()
    AcceleratorState._reset_state()
    resumed = build(os.path.join(out, "adam"), tok, per_device_batch=4, optim="adamw_torch", **sharding())
    resumed.train(resume_from_checkpoint=os.path.join(out, "adam", "checkpoint-1"))  # the engine's and the round's
    nan = again("nan", cls=NaNOnTheLastProcess)
    nan_error = failure(nan.train)  # raised before the optimizer's step, before the weights move
    nan_second = again("nan_second", cls=NaNInTheSecondStep)
    nan_second_error = failure(nan_second.train)
    empty = again("empty", cls=EmptyHighPhase, **EMPTY_HIGH_PHASE)  # last: before the fix, DeepSpeed raised in it
    try:
        empty.train()
        empty_error = None
    except Exception as exc:  # noqa: BLE001 (any error is the finding; the tests read it)
        empty_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    runs = (trainer, fused, off, trl, schedule, adam, resumed, nan, nan_second, empty)
    engines = [wrapper(t) for t in runs]
    torch.save(
        {
            "world": trainer.accelerator.num_processes,
            "engines": engines,
            "trained": trainer.trained,
            "reads": trainer.reads,
            "logs": trainer.state.log_history,
            "params": full_parameters(trainer),
            "fused_params": full_parameters(fused),
            "fused_trained": fused.trained,
            "rates": schedule.rates,
            "adam_params": full_parameters(adam),
            "adam_trained": adam.trained,
            "resumed_params": full_parameters(resumed),
            "resumed_trained": resumed.trained,
            "off_params": full_parameters(off),
            "trl_params": full_parameters(trl),
            "off_logs": off.state.log_history,
            "trl_logs": trl.state.log_history,
            "nan_error": nan_error,
            "nan_params": full_parameters(nan),
            "nan_second_error": nan_second_error,
            "nan_second_params": full_parameters(nan_second),
            "empty_error": empty_error,
            "empty_logs": empty.state.log_history,
            "empty_rates": empty.rates,
            "empty_phase_2_start": empty.phase_2_start,
            "empty_params": None if empty_error else full_parameters(empty),
            "empty_optimizer": None if empty_error else optimizer_state(empty),
        },
        os.path.join(out, f"rank{trainer.accelerator.process_index}.pt"),
    )
    return 0


def wrapper(trainer) -> tuple:
    """What the model ran in: ``("DeepSpeedEngine", stage)``, ``("FSDP", 2)``, or the wrapper's class name."""
    from torch.distributed.fsdp import FSDPModule

    if trainer.is_deepspeed_enabled:
        return type(trainer.model_wrapped).__name__, trainer.model_wrapped.zero_optimization_stage()
    if isinstance(trainer.model_wrapped, FSDPModule):  # torch's fully_shard
        return "FSDP", 2
    return type(trainer.model_wrapped).__name__, None


def main(out: str) -> int:
    from openrlhf_lopti.demo.tiny_model import build_word_tokenizer

    tok = build_word_tokenizer()
    trainer = build(out, tok, per_device_batch=4)
    trainer.train()
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    checkpoint = os.path.join(out, "checkpoint-1")  # after the low phase: mid-round
    saved = sorted(name for name in os.listdir(checkpoint) if name.startswith("lopti_round-"))
    torch.distributed.barrier()  # every rank has listed the files before the last one's goes
    if rank == world - 1:
        os.remove(os.path.join(checkpoint, f"lopti_round-{rank}.pt"))
    torch.distributed.barrier()
    # the same round again through the fused lm_head, each rank replaying its own generation batch: the output
    # layer runs the loss inside DDP's forward (it was refused on more than one process)
    own = {k: v for k, v in trainer.trained[0].items() if k not in OURS}
    fused = build(os.path.join(out, "fused"), tok, per_device_batch=4, replay=own, fused_lm_head=True)
    fused.train()
    schedule = build(os.path.join(out, "schedule"), tok, per_device_batch=4, replay=own, **TWO_ROUNDS)
    schedule.train()
    resume = failure(lambda: build(out, tok, per_device_batch=4).train(resume_from_checkpoint=checkpoint))
    reward = failure(lambda: build(out, tok, per_device_batch=4, reward=last_process_only).train())
    evaluation = build(os.path.join(out, "eval"), tok, per_device_batch=4, cls=NaNInEvaluation,
                       per_device_eval_batch_size=4)  # fmt: skip
    evaluation_error = failure(lambda: evaluation.evaluate(eval_dataset=evaluation.train_dataset))
    torch.save(
        {
            "world": world,
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "trained": trainer.trained,
            "reads": trainer.reads,
            "logs": trainer.state.log_history,
            "params": [p.detach().clone() for p in trainer.model.parameters()],
            "fused_params": [p.detach().clone() for p in fused.model.parameters()],
            "fused_trained": fused.trained,
            "rates": schedule.rates,
            "round_files": saved,
            "resume_error": resume,
            "reward_error": reward,
            "evaluation_error": evaluation_error,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]) if len(sys.argv) == 2 else main_sharded(sys.argv[1], sys.argv[2]))
