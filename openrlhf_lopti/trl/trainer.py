"""``LoptiGRPOTrainer``: TRL 1.16's ``GRPOTrainer`` with Advantage Reweighting, Lopti and our fused loss kernels.

A TRL user swaps ``GRPOTrainer`` / ``GRPOConfig`` for ``LoptiGRPOTrainer`` / ``LoptiGRPOConfig`` and sets
``ar_alpha`` and / or ``lopti_eta``. What each option changes, and where (the math is ``openrlhf_lopti.algo`` /
``openrlhf_lopti.ops``, the same functions our OpenRLHF and local trainers call):

- The anchor. ``old_per_token_logps``: the log-probs of the sampled tokens under the training model as it was
  when the batch was generated (temperature applied), computed by TRL's own ``_get_per_token_logps_and_entropies``
  under ``no_grad`` in ``_generate_and_score_completions``, before any update on the batch. TRL skips them in the
  on-policy case (``num_iterations == 1`` and the generation batch within one optimizer step) and uses the
  current log-probs detached instead; with AR, Lopti or ``track_direction`` on, this trainer always computes them
  (one extra forward per generation batch in that case), because Lopti's second phase runs on weights the first
  phase moved. With all three off it does as TRL: on the fused path the kernel reads the anchor from the loss's
  own forward first (``_own_log_probs``; a separate forward would draw other dropout masks). With
  vLLM they are still the training model's (vLLM's own are ``sampling_per_token_logps``, used by TRL's
  importance-sampling correction only). They are the PPO anchor, AR's ``p`` and Lopti's threshold variable.
- ``ar_alpha``: the ``alpha`` of ``fused_policy_loss`` (on TRL's loss path, ``algo.reweight_advantages`` on
  ``[B, T]`` advantages): each token's advantage times ``alpha * exp(old_per_token_logps) + 1 - alpha``
  (``algo.ar_weight``). Logged as ``ar/mean_weight``.
- ``lopti_eta`` / ``lopti_order`` / ``lopti_quantile``: ``algo.plan_round`` on ``old_per_token_logps`` and the
  loss mask of the whole generation batch, once per generation: the threshold (a quantile is taken over the
  generation batches of every process), each token's phase and the round's metrics (``lopti/threshold``,
  ``lopti/low_token_frac``, ``lopti/<phase>/tokens``, summed over processes). A quantile alone turns Lopti on.
  The generation batch is then trained twice (``_prepare_inputs``; ``get_train_dataloader`` delivers each
  generation batch twice as often, for map-style and streaming datasets alike): first on the low tokens, each
  phase a full pass of TRL's ``steps_per_generation x num_iterations`` micro-steps with its gradient
  accumulation and optimizer steps; then on the high tokens, whose forward runs on the weights the low phase
  left. In a phase the other tokens are out of the loss (no surrogate, KL or entropy term), while every
  normalisation of TRL's ``loss_type`` keeps counting all response tokens (``mask.sum(-1)`` for grpo,
  ``mask.sum()`` for bnpo, ``num_items_in_batch`` for dapo, the constant of dr_grpo), as our other trainers
  do: the two phases together weigh each token as one plain pass does. Per phase (fused path):
  ``lopti/<low|high>/policy_loss`` (without ``beta * KL``, as our other trainers log it) and
  ``lopti/<low|high>/clip_ratio``. On TRL's loss path a phase takes the
  gradient of TRL's loss through its own tokens' log-probs and entropies only (``algo.phase_gradient``): the
  same masking for token-level losses, and for a sequence-level importance ratio the whole sequence's ratio
  (docs/LOPTI_ROUND.md); TRL's metrics there cover every token of the micro-batch.
- Steps. The LR schedule moves once per round, as OpenRLHF's does: ``algo.RoundSchedule`` puts phase 2 back on
  the schedule phase 1 started from (``_prepare_inputs``), so both phases train at the same learning rates, and
  ``create_scheduler`` spans half the optimizer steps. TRL's own step counters (``max_steps``, ``save_steps``,
  ``eval_steps``, ``logging_steps``, ``ref_model_sync_steps``) count optimizer steps, two phases' worth per
  round; ``max_steps`` must be a whole number of rounds (refused otherwise), and one derived from
  ``num_train_epochs`` is rounded up to whole rounds, so no round is cut between its phases. A micro-step's place
  in its round comes from TRL's global optimizer step (``_round_position``), not from a counter that restarts
  on resume; a checkpoint saved mid-round also holds each process's round (``lopti_round-<process>.pt``: the
  generation batch with its phase masks, the round's LR start), so a resumed run trains the rest of that round
  on the same batch, phases and learning rates as the uninterrupted run. A checkpoint at a round's end holds
  none: the resumed run generates a new batch, as TRL does. The round file also holds the settings it means
  something under (``_round_settings``); a resume under others, or from a checkpoint without every process's
  file, is refused on every process with the same line (``_load_round``). A phase without a token on any process
  runs its micro-steps without a forward or a gradient, so it takes no optimizer step (under DeepSpeed, without
  the engine's backward and update either: ``_SkipsEmptyPhases``).
- ``track_direction``: after each round's last optimizer step, ``direction/*`` (paper Fig. 3, ``algo.direction``)
  from one forward-only pass over the round's generation batch, summed over processes.
- The loss path, decided once when the trainer is built and printed in one line (``[openrlhf-lopti] TRL loss
  path: ...``). Fused (``fused_loss=True``, the default, where the kernel computes exactly the loss TRL's options
  ask for: ``config.trl_loss_reason``): ``_compute_loss`` takes the model's logits of the completion as they
  are (in the model's dtype, no copy) and runs ``fused_policy_loss`` on the trained tokens only, in one pass
  where every token's weight is known up front (``_loss_type_weights``; the Triton and C++ kernels then write the
  gradient over the logits), not with ``top_entropy_quantile`` or a KL kept apart from the surrogate;
  ``fused_lm_head`` has the model's output layer run ``fused_linear_policy_loss`` on its input rows instead,
  inside TRL's wrapped model's forward (DDP / FSDP / DeepSpeed), so no logits exist. KL is TRL's k3 (clamped to
  [-10, 10] like OpenRLHF's, as our kernels do); the log ratio is clamped to +-20 before ``exp``; a MoE model's
  router aux loss is added as TRL adds it. TRL's metrics
  keep their names (``entropy``, ``kl``, ``clip_ratio/*``, ``entropy_coef``, ``aux_loss``). TRL's loss (every
  other option, or ``fused_loss=False``): TRL's own ``_compute_loss``, with AR's weights and the Lopti phase
  (``_trl_compute_loss``), untouched with both off.

``top_entropy_quantile`` (AR on, Lopti off) masks the surrogate only; the KL penalty stays on every token, as in
TRL's loss.

Refused at construction with one line (``config.refusals``): an entropy mask together with Lopti, a
``max_steps`` that cuts a round, AR or Lopti with a multimodal model, and ``fused_lm_head`` with an option that
runs TRL's loss (or an output layer it cannot fuse); ``lopti_eta`` with ``lopti_quantile``
(``algo.lopti_settings``). A reward function that returns NaN or inf fails the generation in
one line naming it (``reward_check``). On TRL's loss path with AR and Lopti off, this is TRL's trainer unchanged
but for that check.
"""

import dataclasses
import inspect
import math
import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import (
    get_config_model_id,
    nanmax,
    nanmin,
    shuffle_sequence_dict,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

from openrlhf_lopti.algo import (
    PHASE_NAMES,
    RoundSchedule,
    approx_kl,
    direction_metrics,
    phase_gradient,
    plan_round,
    reweight_advantages,
    sum_direction_counts,
)
from openrlhf_lopti.models import lm_head_parts, output_layer_runs
from openrlhf_lopti.ops import (
    LossHeadOutput,
    LossOptions,
    StepChecks,
    fused_linear_policy_loss,
    fused_policy_loss,
)

from .config import LoptiGRPOConfig, optimizer_steps_per_round, refusals, trl_loss_reason
from .cpu_colocate import colocated_engine, repack_after_every_sync, vllm_on_cpu
from .reward_check import RewardCheck

PHASE_KEYS = ("lopti_phase_1", "lopti_phase_2")  # [B, T] bool masks in update order, in the generation batch
# 0-dim: each phase's token count over every process (0: the phase is skipped on every process together)
PHASE_TOKEN_KEYS = ("lopti_tokens_1", "lopti_tokens_2")
# in a checkpoint saved between two phases of a round, per process: the round's generation batch and LR start
ROUND_FILE = "lopti_round-{}.pt"


class LoptiGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with AR, Lopti and the fused loss kernels (module docstring: what changes where).

    Takes TRL's arguments; ``args`` must be a :class:`LoptiGRPOConfig`, or None (TRL's default configuration, as
    a ``LoptiGRPOConfig``: AR and Lopti off).

    Raises:
        ValueError: ``args`` is not a ``LoptiGRPOConfig``, or it asks for a combination this trainer refuses (one
            line, naming the options).
    """

    _phase_grad_mask: Optional[torch.Tensor] = None  # [B, T] bool while TRL's loss runs in a Lopti phase
    _value_checks: Optional[StepChecks] = None  # the fused loss's value checks, read before each optimizer step
    _value_checks_read_at: Optional[int] = None  # the global step they were last read at
    _optimizer_state_io = False  # saving or loading the optimizer's state: its steps there are not training steps
    _hooked_optimizer: Optional[torch.optim.Optimizer] = None  # the torch optimizer whose steps read the checks
    _print_backend = False

    def __init__(self, *args_, args: Optional[LoptiGRPOConfig] = None, **kwargs):
        if len(args_) > 2:  # TRL's positional order (model, reward_funcs, args, train_dataset, ...): by name
            names = list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
            if args is not None and len(args_) > names.index("args"):
                raise TypeError("LoptiGRPOTrainer got multiple values for argument 'args'")
            kwargs.update(zip(names, args_))
            args_, args = (), kwargs.pop("args", args)
        if args is None:  # TRL's default configuration, under TRL's default name
            model = args_[0] if args_ else kwargs.get("model")
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = LoptiGRPOConfig(f"{name.split('/')[-1]}-GRPO")
        if not isinstance(args, LoptiGRPOConfig):
            raise ValueError(f"args must be a LoptiGRPOConfig (or None), got {type(args).__name__}")
        with colocated_engine(args):  # vLLM colocated on CPU: environment, dtype, weights that survive packing
            super().__init__(*args_, args=args, **kwargs)
        if vllm_on_cpu(args) and args.vllm_mode == "colocate":
            repack_after_every_sync(self.vllm_generation)
        from transformers import ProcessorMixin

        multimodal = isinstance(self.processing_class, ProcessorMixin)
        problems = refusals(args, multimodal=multimodal)
        if problems:
            raise ValueError(problems[0])
        # the loss path, decided once: the fused kernel where it computes exactly TRL's loss, else TRL's own loss
        reason = trl_loss_reason(args, multimodal)
        self.loss_path = "fused" if reason is None else "trl"
        if self.accelerator.is_main_process:
            print(f"[openrlhf-lopti] TRL loss path: {self._loss_path_line(reason)}", flush=True)
        if args.fused_loss and args.fused_lm_head:
            lm_head_parts(self.accelerator.unwrap_model(self.model), flag="fused_lm_head=True")  # raises now for a head it cannot fuse
        self._round_schedule: Optional[RoundSchedule] = None  # the running round's LR-hold (algo.RoundSchedule)
        self._reward_check = RewardCheck(self.reward_funcs)  # a NaN / inf reward: one line naming its function
        self.reward_funcs = self._reward_check.funcs
        if args.track_direction:
            self.add_callback(_DirectionAtRoundEnd(self))

    def _loss_path_line(self, reason: Optional[str]) -> str:
        """What runs the loss, in one line (printed once, when the trainer is built)."""
        on = [name for name, value in (("AR", self.args.ar_alpha != 0), ("Lopti", self.args.lopti)) if value]
        if reason is None:
            kernel = "fused_linear_policy_loss" if self.args.fused_lm_head else "fused_policy_loss"
            return f"fused ({kernel}, {' + '.join(on) or 'AR and Lopti off'})"
        applied = f"with {' + '.join(on)} applied" if on else "untouched (AR and Lopti off)"
        return f"TRL's GRPOTrainer loss, {applied} ({reason})"

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (``[N_all, F]``, every process's); a NaN or inf one that no ``None`` stands for is refused
        on every process, naming its reward function (``reward_check``)."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._reward_check.check(rewards, len(prompts), self.reward_func_names, self.accelerator.gather)
        return rewards

    # ---- Lopti: each generation batch trained twice, low tokens first ----

    def get_train_dataloader(self):
        """TRL's loader, each generation batch delivered twice as often with Lopti (one pass per phase).

        TRL repeats a generation batch ``num_iterations x steps_per_generation`` times, through its ``RepeatSampler``
        for a map-style dataset and through ``repeat_iterable_dataset`` for a streaming one; both read
        ``num_iterations`` when the loader is built, so doubling it for that call doubles both (doubling the
        sampler alone left streaming datasets training on every second generation batch only).
        """
        if not self.args.lopti:
            return super().get_train_dataloader()
        self.num_iterations *= 2
        try:
            return super().get_train_dataloader()
        finally:
            self.num_iterations //= 2

    def _phase_cycle(self) -> int:
        """Micro-steps of one phase: TRL's ``steps_per_generation x num_iterations``."""
        return self.args.steps_per_generation * self.num_iterations

    def _round_position(self) -> int:
        """The running micro-step's place in its round (``0 .. 2 x _phase_cycle() - 1``), from TRL's global
        optimizer step and the micro-step within its accumulation: a resumed run finds every micro-step where the
        uninterrupted run had it (TRL's own ``_step`` restarts at 0 on resume)."""
        ga = self.args.gradient_accumulation_steps
        return (self.state.global_step * ga + self._step % ga) % (2 * self._phase_cycle())

    def _prepare_inputs(self, generation_batch: dict) -> dict:
        """TRL's ``_prepare_inputs``; with Lopti in training, the buffered batch serves two phases in a row and
        each micro-batch carries its phase's token mask as ``lopti_phase_mask`` (and its index as ``lopti_phase``)."""
        if not (self.args.lopti and self.model.training):
            return super()._prepare_inputs(generation_batch)
        cycle = self._phase_cycle()
        position = self._round_position()
        if position == 0 or self._buffered_inputs is None:  # None mid-round: refused at resume (_load_round)
            batch = self._generate_and_score_completions(generation_batch)
            batch = shuffle_sequence_dict(split_pixel_values_by_grid(batch))
            spg = self.args.steps_per_generation
            self._buffered_inputs = [unsplit_pixel_values_by_grid(b) for b in split_tensor_dict(batch, spg)]
            self._round_schedule = RoundSchedule(getattr(self, "lr_scheduler", None), self.optimizer)
            self._round_schedule.start_round()
        elif position == cycle:
            self._round_schedule.start_phase()  # algo's LR-hold: phase 2 at phase 1's learning rates
        inputs = dict(self._buffered_inputs[position % self.args.steps_per_generation])
        phase = position // cycle
        inputs["lopti_phase"] = phase
        inputs["lopti_phase_mask"] = inputs[PHASE_KEYS[phase]]
        inputs["lopti_phase_tokens"] = int(inputs[PHASE_TOKEN_KEYS[phase]])
        return inputs

    # ---- a checkpoint between two phases of a round carries the round ----

    def _round_file(self, checkpoint: str, process: Optional[int] = None) -> str:
        process = self.accelerator.process_index if process is None else process
        return os.path.join(checkpoint, ROUND_FILE.format(process))

    def _round_settings(self) -> dict:
        """The settings that give a saved round its meaning: how its generation batch is split into micro-steps and
        optimizer steps, over how many processes, how its phases were decided, and what its batch holds: the old
        log-probs' temperature, the reference log-probs (``beta``) and vLLM's importance-sampling ratios (before, a
        resume with another ``beta`` or ``use_vllm`` ended in a KeyError, another temperature trained on)."""
        args = self.args
        return {
            "steps_per_generation": args.steps_per_generation, "num_iterations": self.num_iterations,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "per_device_train_batch_size": args.per_device_train_batch_size, "num_generations": self.num_generations,
            "num_processes": self.accelerator.num_processes,
            "lopti_eta": args.lopti_eta, "lopti_quantile": args.lopti_quantile, "lopti_order": args.lopti_order,
            "temperature": args.temperature, "beta": args.beta, "use_vllm": args.use_vllm,
            "vllm_importance_sampling_correction": args.vllm_importance_sampling_correction,
        }  # fmt: skip

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint; cut mid-round, also each process's round (its generation batch, phase masks and the
        round's LR start, with the settings they mean something under), written first: TRL's checkpoint may push
        the folder to the Hub (``_push_from_checkpoint``) before it returns."""
        if self.args.lopti:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder = os.path.join(self._get_output_dir(trial=trial), name)
            if self._round_position() != 0 and self._buffered_inputs is not None:
                os.makedirs(folder, exist_ok=True)
                round_state = {"buffered_inputs": self._buffered_inputs, "schedule": self._round_schedule.state_dict(),
                               "settings": self._round_settings()}  # fmt: skip
                torch.save(round_state, self._round_file(folder))
            elif os.path.exists(self._round_file(folder)):  # an earlier run's, in a reused output_dir: not this one's
                os.remove(self._round_file(folder))
        super()._save_checkpoint(model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        with self._not_a_training_step():
            super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        with self._not_a_training_step():
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.args.lopti:
            self._load_round(checkpoint)

    @contextmanager
    def _not_a_training_step(self) -> Iterator[None]:
        """While the optimizer's state is saved or loaded, its steps do not read the value checks.

        FSDP's optimizer state goes through ``torch.distributed.checkpoint``, which first steps an optimizer without
        state (plain SGD; any optimizer before its first step) with zero gradients at learning rate 0 to create it.
        Counted as the global step's read, that step made the next real step skip its read: a bad value found in
        it moved the weights before it raised."""
        self._optimizer_state_io = True
        try:
            yield
        finally:
            self._optimizer_state_io = False

    def _load_round(self, checkpoint: str) -> None:
        """After TRL loaded ``checkpoint``'s state: a checkpoint cut mid-round gives back the round it cut.

        Every process learns whether the checkpoint holds the whole round (each process's file, saved under this
        run's settings) from one gather, and all raise the same line if not: a process raising alone would leave
        the others waiting in their first collective."""
        self._buffered_inputs, self._round_schedule = None, None
        path = self._round_file(checkpoint)
        device = self.accelerator.device  # "cpu:0" in a multi-process CPU run, which torch.load cannot map to
        device = "cpu" if device.type == "cpu" else device
        position = self._round_position()
        # at a round's end a round file is another run's (an output_dir reused): this checkpoint carries no round
        here = os.path.exists(path) and position != 0
        state = torch.load(path, map_location=device, weights_only=False) if here else None
        problem = None if state is None else _settings_problem(state.get("settings"), self._round_settings())
        found = self._gather_objects((state is not None, problem))
        have = [r for r, (exists, _) in enumerate(found) if exists]
        where = f"resume_from_checkpoint: {checkpoint}"
        problems = [p for _, p in found if p is not None]
        if problems:
            raise ValueError(f"{where}: its Lopti round {problems[0]}; resume with those settings, or from a "
                             "checkpoint at a whole number of rounds")  # fmt: skip
        if not have and position == 0:
            return
        if not have:
            raise ValueError(
                f"{where} was saved at micro-step {position} of a Lopti round without its round "
                f"({ROUND_FILE.format('<process>')}); resume from a checkpoint at a whole number of rounds"
            )
        if len(have) < len(found):
            missing = [r for r in range(len(found)) if r not in have]
            raise ValueError(
                f"{where} holds the Lopti round of processes {have} but not of {missing} "
                f"({', '.join(os.path.basename(self._round_file(checkpoint, r)) for r in missing)}): each process "
                "writes its own, on its node's disk; copy every node's into the checkpoint"
            )
        self._buffered_inputs = state["buffered_inputs"]
        self._round_schedule = RoundSchedule(getattr(self, "lr_scheduler", None), self.optimizer)
        self._round_schedule.load_state_dict(state["schedule"])

    def _gather_objects(self, value) -> list:
        """``value`` of every process, in process order."""
        if self.accelerator.num_processes == 1:
            return [value]
        from accelerate.utils import gather_object

        return gather_object([value])

    def _generate_and_score_completions(self, inputs: list) -> dict:
        """TRL's generation and scoring, plus ``old_per_token_logps`` always (on the fused path, and with AR or Lopti
        on TRL's: AR's ``p`` and Lopti's threshold variable) and the Lopti phase masks.

        Adds ``lopti_phase_1`` / ``lopti_phase_2`` (``[B, T]`` bool, update order) in training with Lopti.
        """
        output = super()._generate_and_score_completions(inputs)
        if self.loss_path == "trl" and self.args.ar_alpha == 0 and not self.args.lopti and not self.args.track_direction:
            return output  # TRL's trainer, untouched (track_direction reads the anchor after the round)
        mode = "train" if self.model.training else "eval"
        mask = self._loss_mask(output).bool()
        methods_off = self.args.ar_alpha == 0 and not self.args.lopti and not self.args.track_direction
        if output.get("old_per_token_logps") is None and not methods_off:
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                old, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, attention, output["completion_ids"].size(1), batch_size=batch_size
                )
            output["old_per_token_logps"] = old
        lopti = self.args.lopti_settings if mode == "train" else None
        if lopti is None and self.args.ar_alpha == 0:
            return output
        # algo.plan_round over the generation batch of every process: the threshold (a quantile over all of them),
        # each token's phase, and the round's metrics, summed over processes
        lopti_round = plan_round(
            output["old_per_token_logps"], mask, lopti, self.args.ar_alpha,
            gather=self._gather_over_processes, all_reduce=self._sum_over_processes,
        )  # fmt: skip
        for key, value in lopti_round.metrics.items():
            self._metrics[mode][key].append(value)
        if lopti is not None:
            output[PHASE_KEYS[0]], output[PHASE_KEYS[1]] = (phase.mask for phase in lopti_round.phases)
            for key, phase in zip(PHASE_TOKEN_KEYS, lopti_round.phases):
                output[key] = torch.tensor(phase.tokens)  # 0-dim: every micro-batch of the round carries it whole
        return output

    def _gather_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        """``[n]`` -> every process's values, concatenated (the quantile's scope: the whole generation batch)."""
        if self.accelerator.num_processes == 1:
            return values
        from accelerate.utils import gather_object

        return torch.cat([part.cpu() for part in gather_object([values.cpu()])])

    def _sum_over_processes(self, sums: dict) -> dict:
        """Each value summed over the processes (the round's metric sums)."""
        keys = sorted(sums)
        totals = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=self.accelerator.device)
        return dict(zip(keys, self.accelerator.reduce(totals, reduction="sum").tolist()))

    def set_initial_training_values(self, args, dataloader):
        """Transformers' run length; with Lopti, a ``max_steps`` it derives from ``num_train_epochs`` is rounded
        up to whole rounds, so that the last round trains both phases (``num_train_epochs=0.6`` of an epoch of 5
        rounds: 3 rounds, not 2.5). A ``max_steps`` given is whole rounds already (``config.refusals``)."""
        values = super().set_initial_training_values(args, dataloader)
        if not self.args.lopti or args.max_steps > 0:
            return values
        per_round = optimizer_steps_per_round(self.args)
        return (*values[:-1], -(-values[-1] // per_round) * per_round)  # max_steps is the last value

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """TRL's scheduler; with Lopti over the run's rounds: it moves on phase 1's optimizer steps only (phase 2
        replays phase 1's learning rates), so it spans half the optimizer steps."""
        if self.args.lopti:
            num_training_steps = max(num_training_steps // 2, 1)
        return super().create_scheduler(num_training_steps, optimizer)

    @torch.no_grad()
    def _direction_metrics(self) -> dict:
        """``direction/*`` of the round just trained: each token's log-prob now against its rollout one, binned by
        its rollout probability and split by the advantage's sign (``algo.direction``), over every process."""
        batches = []
        for inputs in self._buffered_inputs:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            t = inputs["completion_ids"].size(1)
            new, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attention, t, batch_size=len(ids))
            mask = self._loss_mask(inputs).bool()
            advantages = inputs["advantages"]
            advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand_as(mask)
            batches.append((inputs["old_per_token_logps"], new, advantages, mask))
        counts = sum_direction_counts(batches, device=self.accelerator.device)  # [5, 4] float64
        return direction_metrics(self.accelerator.reduce(counts, reduction="sum"))

    # ---- the loss ----

    @staticmethod
    def _loss_mask(inputs: dict) -> torch.Tensor:
        """``[B, T]`` TRL's loss mask: the completion mask, times the tool mask of multi-turn rollouts."""
        mask = inputs["completion_mask"]
        return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]

    def _loss_type_weights(self, mask: torch.Tensor, mode: str, inputs: dict) -> torch.Tensor:
        """``[B, T]`` fp32: each token's weight in TRL's ``loss_type`` reduction of this micro-step (its division by
        the gradient-accumulation steps included), so that TRL's loss is ``sum(weights * per_token_loss)``.

        Args:
            mask: ``[B, T]`` 0/1, TRL's loss mask (every response token, whatever the Lopti phase).
        """
        b = mask.shape[0]
        mask = mask.float()
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type == "grpo":  # per sequence: its token mean; then the mean over sequences
            return mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / b / normalizer
        if self.loss_type == "bnpo":
            return mask / mask.sum().clamp(min=1.0) / normalizer
        if self.loss_type == "dr_grpo":
            return mask / (b * self.max_completion_length) / normalizer
        if self.loss_type == "dapo":
            items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                items = items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return mask / items
        return mask / b / normalizer  # luspo (config.CLIPPED_LOSS_TYPES): per-sequence sums, averaged

    def _trl_compute_loss(self, model, inputs: dict) -> torch.Tensor:
        """TRL's own ``_compute_loss`` (every ``loss_type``, importance-sampling level, ``delta``, off-policy mask,
        adaptive entropy, router aux loss, as TRL computes them), with AR's weight on each token's advantage
        (``algo.reweight_advantages``: ``[B, T]`` advantages, which TRL takes) and, in a Lopti phase, the gradient
        through the phase's tokens' log-probs and entropies only (``algo.phase_gradient``; docs/LOPTI_ROUND.md).
        Every normalisation keeps counting all response tokens; the loss's value (and TRL's metrics) covers every
        token of the micro-batch. With AR and Lopti off, TRL's loss untouched."""
        phase = inputs.get("lopti_phase_mask")
        if self.args.ar_alpha == 0 and phase is None:
            return super()._compute_loss(model, inputs)
        inputs = dict(inputs)
        if self.args.ar_alpha != 0:
            old = inputs["old_per_token_logps"]
            advantages = inputs["advantages"]
            advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand_as(old)
            inputs["advantages"] = reweight_advantages(advantages, old, self.args.ar_alpha)
        self._phase_grad_mask = phase
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._phase_grad_mask = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs) -> tuple:
        """TRL's; while TRL's loss runs in a Lopti phase, the log-probs and entropies carry gradient at the phase's
        tokens only (their values unchanged)."""
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._phase_grad_mask is not None:
            logps = phase_gradient(logps, self._phase_grad_mask)
            entropies = None if entropies is None else phase_gradient(entropies, self._phase_grad_mask)
        return logps, entropies, aux_loss

    def _loss_head(self, model, inputs: dict, layout: "_KernelRows", per_token: list, options: dict,
                   on_policy: bool = False) -> tuple:
        """``(kernel_out, aux_loss)``: one forward of TRL's ``model`` (DDP / FSDP / DeepSpeed's wrapper, as TRL calls
        it) on the micro-batch, under TRL's autocast, with the loss head on the completion: ``fused_policy_loss`` on
        the model's logits (``[B * (T + 1), V]``, a view of its own ``[B, T + 1, V]`` output: a row per completion
        position and one after the last, no copy), or with ``fused_lm_head`` ``fused_linear_policy_loss`` run by the
        output layer on its ``[N, H]`` input rows (:func:`~openrlhf_lopti.models.output_layer_runs`), so no
        ``[N, V]`` logits exist. ``per_token``, ``options``: the kernel's arguments on ``layout``'s rows.
        ``on_policy``: TRL's on-policy case (AR and Lopti off, no stored anchor): the anchor ``per_token[1]`` is
        this forward's own log-probs, read first by a gradient-free call of the same kernel, so the ratio is 1 as
        in TRL (a separate forward would draw other dropout masks).
        ``aux_loss``: a MoE model's router load-balancing loss of the forward (scalar), or None."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        b, t = layout.rows.shape
        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        forward = dict(input_ids=ids, attention_mask=attention, logits_to_keep=t + 1, use_cache=False, **router)
        if not self.args.fused_lm_head:
            with self.accelerator.autocast():
                out = model(**forward)
            # no [:, :-1] slice: a slice would make the rows non-uniform and the kernel's input a copy; a model
            # that ignores logits_to_keep returns every position: its last t + 1 (then a copy)
            logits = out.logits if out.logits.shape[1] == t + 1 else out.logits[:, -(t + 1) :]
            rows_v = logits.reshape(-1, logits.shape[-1])
            if on_policy:
                per_token[1] = _own_log_probs(fused_policy_loss, (rows_v,), per_token, options)
            kernel_out = fused_policy_loss(rows_v, *per_token, **options)
            return kernel_out, out.aux_loss if router else None

        positions = torch.nn.functional.pad(layout.rows, (0, 1))  # [B, T + 1]: the trained rows among the layer's
        held = {}

        def on_hidden(hidden: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
            # the kernel in the weight's dtype (fp32 with TRL's cast_lm_head_to_fp32), outside TRL's autocast, which
            # may hand the layer the backbone's output in another dtype: as the logits path's output layer
            with torch.autocast(hidden.device.type, enabled=False):
                hidden = hidden if hidden.shape[1] == t + 1 else hidden[:, -(t + 1) :]  # logits_to_keep ignored
                rows = hidden[positions].to(weight.dtype)  # [N, H]
                if on_policy:
                    per_token[1] = _own_log_probs(fused_linear_policy_loss, (rows, weight), per_token,
                                                  dict(options, bias=bias))  # fmt: skip
                out = fused_linear_policy_loss(rows, weight, *per_token, bias=bias, **options)
            held["out"] = out
            # the fields with a gradient leave as the layer's output ([B, T + 1, k]), so that what the wrapper hooks
            # on the model's outputs (FSDP's and ZeRO-3's gathers for the backward) is on the loss's path
            fields = torch.stack([out.loss, out.logp, out.entropy], -1)  # [N, 3]
            columns = fields.new_zeros(b, t + 1, 3).index_put((positions,), fields)
            reduced = fields.new_zeros(()) if out.reduced is None else out.reduced
            return torch.cat([columns, reduced.expand(b, t + 1, 1)], -1)

        with output_layer_runs(self.accelerator.unwrap_model(model), on_hidden, flag="fused_lm_head=True"):
            with self.accelerator.autocast():
                out = model(**forward)
        fields = out.logits[positions]  # [N, 4]
        kernel_out = dataclasses.replace(
            held.pop("out"), loss=fields[:, 0], logp=fields[:, 1], entropy=fields[:, 2],
            reduced=None if options.get("loss_weights") is None else out.logits[0, 0, 3],
        )  # fmt: skip
        return kernel_out, out.aux_loss if router else None

    def _compute_loss(self, model, inputs: dict) -> torch.Tensor:
        """TRL's loss with the per-token term from ``fused_policy_loss`` (or ``fused_linear_policy_loss``),
        restricted to the Lopti phase's tokens when one is running; TRL's ``loss_type`` normalisation over all
        response tokens, its entropy bonus and its MoE router aux loss. On TRL's loss path
        (``config.trl_loss_reason``): :meth:`_trl_compute_loss`."""
        empty = inputs.get("lopti_phase_tokens") == 0
        if self.is_deepspeed_enabled and self.args.lopti and self.model.training:
            _SkipsEmptyPhases.on(self.accelerator).skip = empty  # set on every micro-step: never a stale skip
        if empty:
            # a phase without a token on any process (the count is global: every process is here together): no
            # forward, no gradient, so the optimizer step that closes the window finds none and moves no weight
            # (AdamW skips a parameter without a gradient: no moment update, no weight decay); under DeepSpeed,
            # whose backward refuses this loss and whose ZeRO step needs a gradient, _SkipsEmptyPhases skips both
            return torch.zeros((), device=self.accelerator.device, requires_grad=True)
        if self.loss_path == "trl":
            return self._trl_compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        mask = self._loss_mask(inputs)  # [B, T] 0/1
        keep = mask.bool()
        phase_mask = inputs.get("lopti_phase_mask")
        rows = keep if phase_mask is None else keep & phase_mask  # [B, T]: the tokens this micro-step trains
        b, t = keep.shape
        advantages = inputs["advantages"]
        advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand(b, t)
        old = inputs.get("old_per_token_logps")  # None: TRL's on-policy case, the anchor is this forward's log-probs
        is_ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"].expand(b, t)  # [B, T]
        # the KL term is added after TRL's masks and IS ratio, which apply to the surrogate only: not folded in the kernel
        separate_kl = is_ratio is not None or self.args.use_bias_correction_kl or self.top_entropy_quantile < 1.0
        ref = inputs["ref_per_token_logps"] if self.beta != 0.0 else None  # [B, T]
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        weights = self._loss_type_weights(mask, mode, inputs)  # [B, T]: TRL's loss = sum(weights * per-token loss)
        entropy_bonus = self._entropy_bonus_enabled  # a fixed entropy_coef (adaptive is refused)
        # One pass (the kernel writes the logits' gradient as it reads them) when every token's weight is known
        # before the kernel runs: not with the entropy mask (it needs the kernel's entropies), nor with a KL kept
        # apart from the surrogate (it needs the log-prob's gradient).
        one_pass = self.top_entropy_quantile == 1.0 and not (self.beta != 0.0 and separate_kl)

        layout = _KernelRows(rows, padded=not self.args.fused_lm_head)
        loss_options = LossOptions(
            alpha=self.args.ar_alpha, eps_low=self.epsilon_low, eps_high=self.epsilon_high,
            kl_coef=0.0 if separate_kl else self.beta, kl_estimator="k3", temperature=self.temperature,
            backend=self.args.loss_backend, check="step",
        )  # fmt: skip
        options = dict(
            ref_log_probs=None if separate_kl or ref is None else layout.to_kernel(ref), return_entropy=True,
            options=loss_options,
        )  # fmt: skip
        if one_pass:
            surrogate_weights = weights if is_ratio is None else weights * is_ratio
            options["loss_weights"] = layout.to_kernel(surrogate_weights)
            if entropy_bonus:  # TRL's bonus: the mean entropy over every response token, per micro-step
                options["entropy_weights"] = layout.to_kernel(rows * (-self.entropy_coef / keep.sum().clamp(min=1)
                                                                      / normalizer))  # fmt: skip
            if not self.args.fused_lm_head:  # the logits' buffer takes their gradient (one [N, V] less): unshared
                options["grad_in_logits"] = True
        anchor = advantages.new_zeros(b, t) if old is None else old  # replaced in _loss_head when None
        per_token = [layout.to_kernel(x) for x in (inputs["completion_ids"], anchor, advantages)] + [layout.mask]
        kernel_out, aux_loss = self._loss_head(model, inputs, layout, per_token, options, on_policy=old is None)
        if mode == "train":  # read before the optimizer step (_read_value_checks)
            self._checks_before_the_step().add(kernel_out.status, self._micro_step_name(inputs))
            if self._print_backend and self.accelerator.is_main_process:  # once per run: which kernel trains it
                print(f"[openrlhf-lopti] TRL fused loss ran on the {kernel_out.backend} backend "
                      f"({'one pass' if one_pass else 'two passes'}); value checks are read before each optimizer "
                      "step", flush=True)  # fmt: skip
            self._print_backend = False
        else:  # evaluation: read at once, on every process together (one raising alone would leave the others
            # waiting in their next collective)
            at_once = StepChecks()
            at_once.add(kernel_out.status, f"evaluation at optimizer step {self.state.global_step}")
            at_once.raise_if_bad(any_rank=self._max_over_processes)
        out = layout.on_rows(kernel_out)  # [N] per-token fields on the trained tokens, in rows' order
        if old is None:  # TRL's per_token_logps.detach(): the ratio's anchor, for the metrics below
            old = out.logp.detach().new_zeros(b, t).masked_scatter(rows, out.logp.detach())

        # TRL's order: the surrogate times the entropy mask, times the IS ratio, then + beta * KL over every token
        loss_rows = out.loss  # [N]: clipped surrogate (AR-weighted), + beta * KL when folded in
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:  # refused with Lopti: here rows == keep
            entropy_full = out.entropy.detach().new_zeros(b, t).masked_scatter(rows, out.entropy.detach())
            entropy_mask = self.get_high_entropy_mask(entropy_full, mask, 1 - self.top_entropy_quantile)[rows]
            loss_rows = loss_rows * entropy_mask
        if is_ratio is not None:
            loss_rows = loss_rows * is_ratio[rows]
        kl_rows = None
        surrogate_rows = loss_rows  # before a separate KL is added: the per-phase policy_loss's rows
        if self.beta != 0.0:
            if separate_kl:
                kl_rows = approx_kl(out.logp, ref[rows], "k3")
                if self.args.use_bias_correction_kl:
                    kl_rows = kl_rows * torch.exp(out.logp - old[rows].float())
                loss_rows = loss_rows + self.beta * kl_rows
            else:
                kl_rows = out.kl

        def reduced(per_row: torch.Tensor) -> torch.Tensor:  # [N] on rows -> TRL's loss_type reduction, a scalar
            return (per_row.new_zeros(b, t).masked_scatter(rows, per_row) * weights).sum()  # 0 outside the phase

        unaccumulated = normalizer if self.loss_type != "dapo" else 1.0  # TRL logs the loss before / accumulation
        trl_loss = reduced(loss_rows)
        policy_loss = (trl_loss * unaccumulated).detach()  # TRL's policy_loss: with beta * KL, as TRL's own
        loss = kernel_out.reduced if one_pass else trl_loss  # the one-pass sum holds the entropy bonus already

        if entropy_bonus:
            if not one_pass:  # TRL's mean entropy over the tokens it acts on; with Lopti each phase adds its share
                acting = keep
                if entropy_mask is not None:
                    acting = keep.new_zeros(b, t).masked_scatter(rows, entropy_mask.bool())
                entropy_rows = out.entropy if entropy_mask is None else out.entropy * entropy_mask
                loss = loss - self.entropy_coef * entropy_rows.sum() / acting.sum().clamp(min=1) / normalizer
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:  # TRL's metric, once per optimizer step
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if aux_loss is not None:  # TRL's MoE load-balancing loss, once per micro-step (in each Lopti phase)
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        phase_loss = None
        if "lopti_phase" in inputs:  # without the KL, as our other front ends log it (only with Lopti: no work else)
            if kl_rows is not None and not separate_kl:  # folded into the kernel's loss: taken out again
                surrogate_rows = loss_rows - self.beta * kl_rows
            phase_loss = policy_loss if kl_rows is None else (reduced(surrogate_rows.detach()) * unaccumulated)
        self._log_loss_metrics(mode, inputs, out, rows, old, advantages, kl_rows, phase_loss)
        return loss

    def _checks_before_the_step(self) -> StepChecks:
        """The ledger of the fused loss's value checks, made at the first training call: a pre-hook on the optimizer
        reads it before every real step (TRL's accumulation windows included), on every process together, and the
        backend that ran is printed once. An optimizer built again (another ``train()`` of this trainer under
        DeepSpeed, a new ``self.optimizer``) gets the hook too: the one before would never step again."""
        if self._value_checks is None:
            self._value_checks = StepChecks()
            self._print_backend = True
        optimizer = self.optimizer
        while hasattr(optimizer, "optimizer"):  # accelerate's wrapper, DeepSpeed's ZeRO one: the torch one inside
            optimizer = optimizer.optimizer
        if optimizer is not self._hooked_optimizer:
            optimizer.register_step_pre_hook(lambda *_: self._read_value_checks_once_per_step())
            self._hooked_optimizer = optimizer
        return self._value_checks

    def train(self, *args, **kwargs):
        """TRL's ``train``; the value checks' once-per-step key starts afresh (a second ``train()`` counts its global
        steps from 0 again, and its first step must read them)."""
        self._value_checks_read_at = None
        return super().train(*args, **kwargs)

    def _read_value_checks_once_per_step(self) -> None:
        """DeepSpeed's ZeRO optimizer steps the torch optimizer once per parameter group: the checks are read at its
        first call of an optimizer step (TRL's global step, the same on every process). Steps taken while the
        optimizer's state is saved or loaded are not training steps (:meth:`_not_a_training_step`)."""
        if self._optimizer_state_io:
            return
        if self._value_checks_read_at != self.state.global_step:
            self._value_checks_read_at = self.state.global_step
            self._read_value_checks()

    def _read_value_checks(self) -> None:
        """Raise, before the optimizer step and on every process, if a fused call since the last step found a bad
        row (a NaN / +inf logit, a non-finite advantage or log-prob): one 4-byte read and, on several processes,
        one all-reduce per optimizer step."""
        self._value_checks.raise_if_bad(any_rank=self._max_over_processes)

    def _max_over_processes(self, word: torch.Tensor) -> torch.Tensor:
        """``[1]`` int32 ``word`` (a value-check status word) made the max over every process, when there are several,
        on the accelerator's device: NCCL reduces CUDA tensors only, and a ledger with no call since the last step
        (no fused call on this process) holds a CPU word."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            word = word.to(self.accelerator.device)
            torch.distributed.all_reduce(word, op=torch.distributed.ReduceOp.MAX)
        return word

    def _micro_step_name(self, inputs: dict) -> str:
        """Where a fused call is, for an error message: the optimizer step, the Lopti phase, the micro-step."""
        phase = inputs.get("lopti_phase")
        where = f"optimizer step {self.state.global_step + 1}"
        if phase is not None:
            where += f", Lopti phase '{PHASE_NAMES[self.args.lopti_order][phase]}'"
        return f"{where}, micro-step {self._step % self.args.gradient_accumulation_steps + 1}"

    def _log_loss_metrics(self, mode, inputs, out, rows, old, advantages, kl_rows, phase_loss) -> None:
        """TRL's ``entropy``, ``kl`` and ``clip_ratio/*_mean`` over the trained tokens; per Lopti phase also
        ``lopti/<low|high>/policy_loss`` (``phase_loss``: the phase's share of TRL's loss without ``beta * KL``)
        and ``lopti/<low|high>/clip_ratio``. A mean over no token (a micro-step without a token of the phase on
        any process) is NaN, which TRL's ``log`` drops: a 0 there would weigh an empty micro-step into the logged
        mean (the local trainer weighs its means by token counts). Outside a Lopti phase it is TRL's 0 (TRL's
        ``global_masked_mean`` clamps the count to 1), so that a micro-batch without a response token (e.g. every
        completion truncated under ``mask_truncated_completions``) logs what TRL's trainer logs."""
        empty = math.nan if "lopti_phase" in inputs else 0.0

        def global_mean(values: torch.Tensor) -> float:
            totals = torch.stack([values.detach().float().sum(), values.new_tensor(float(values.numel()))])
            totals = self.accelerator.reduce(totals, reduction="sum")
            return (totals[0] / totals[1]).item() if totals[1] > 0 else empty

        adv = advantages[rows]
        ratio = torch.exp(out.logp.detach() - old[rows].float())
        low = (ratio < 1 - self.epsilon_low) & (adv < 0)
        high = (ratio > 1 + self.epsilon_high) & (adv > 0)
        self._metrics[mode]["entropy"].append(global_mean(out.entropy))
        if kl_rows is not None:
            self._metrics[mode]["kl"].append(global_mean(kl_rows))
        self._metrics[mode]["clip_ratio/low_mean"].append(global_mean(low.float()))
        self._metrics[mode]["clip_ratio/high_mean"].append(global_mean(high.float()))
        self._metrics[mode]["clip_ratio/region_mean"].append(global_mean((low | high).float()))

        def seq_mean(flags: torch.Tensor) -> torch.Tensor:  # [N] on rows -> [B], NaN for a sequence without rows
            per_token = rows.new_zeros(rows.shape, dtype=torch.float32).masked_scatter(rows, flags.float())
            return per_token.sum(-1) / rows.sum(-1)

        self._metrics[mode]["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(seq_mean(low))).item())
        self._metrics[mode]["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(seq_mean(high))).item())
        if "lopti_phase" in inputs:
            name = PHASE_NAMES[self.args.lopti_order][inputs["lopti_phase"]]
            self._metrics[mode][f"lopti/{name}/policy_loss"].append(self.accelerator.gather(phase_loss).mean().item())
            self._metrics[mode][f"lopti/{name}/clip_ratio"].append(global_mean(out.clipped.float()))


def _own_log_probs(loss_head, inputs: tuple, per_token: list, options: dict) -> torch.Tensor:
    """``[R]`` the log-probs ``loss_head`` (``fused_policy_loss`` or ``fused_linear_policy_loss``) reads from
    ``inputs`` (logits, or hidden states and the layer's weight) for ``per_token``'s labels: a gradient-free call,
    its values checked by the training call that follows."""
    kept = {k: options[k] for k in ("bias",) if k in options}
    loss_options = dataclasses.replace(options["options"], alpha=0.0, kl_coef=0.0, check="off")
    with torch.no_grad():
        detached = tuple(x.detach() for x in inputs)
        zeros = torch.zeros_like(per_token[2])
        return loss_head(*detached, per_token[0], zeros, zeros, per_token[3], options=loss_options, **kept).logp


class _KernelRows:
    """Where the loss head's rows sit among a micro-batch's ``[B, T]`` completion positions.

    On the logits path the kernel reads the model's ``[B, T + 1, V]`` logits as ``[B * (T + 1), V]`` rows, as they
    are (row ``(i, j)`` predicts completion token ``j``; the last row of each sequence predicts nothing and is
    masked), so a ``[B, T]`` input gets one more column; the untrained tokens are masked rows, which the kernel
    skips. With the fused lm_head the rows are the trained tokens' hidden states only (``[N, H]``, gathered).

    Args:
        rows: ``[B, T]`` bool, the tokens this micro-step trains.
        padded: the logits layout (``True``) or the gathered one.
    """

    def __init__(self, rows: torch.Tensor, padded: bool):
        self.rows, self.padded = rows, padded
        self.mask = self.to_kernel(rows)  # [R] bool

    def to_kernel(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` -> ``[R]``, one value per kernel row (0 / False on the padding rows)."""
        if not self.padded:
            return values[self.rows]
        return torch.cat([values, values.new_zeros(values.shape[0], 1)], dim=1).reshape(-1)

    def on_rows(self, out: LossHeadOutput) -> LossHeadOutput:
        """The kernel's per-token fields (``[R]``) on the trained tokens only (``[N]``, in ``rows``' order)."""
        if not self.padded:
            return out
        b, t = self.rows.shape

        def take(values: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if values is None else values.view(b, t + 1)[:, :-1][self.rows]

        return dataclasses.replace(out, loss=take(out.loss), logp=take(out.logp), kl=take(out.kl),
                                   clipped=take(out.clipped), entropy=take(out.entropy))  # fmt: skip


class _SkipsEmptyPhases:
    """accelerate's DeepSpeed backward (the engine's ``backward``, then its ``step`` at an accumulation boundary),
    except in a micro-step of a Lopti phase without a token on any process (``skip``, set by ``_compute_loss``):
    there neither runs, and the window's boundary takes DeepSpeed's step without its update
    (:func:`_engine_step_without_update`), as the trainer without DeepSpeed takes an optimizer step that finds no
    gradient. (DeepSpeed's backward refuses a loss without a graph, and ZeRO-2's reduction fails on a window in
    which no parameter got a gradient.) Every process skips the same micro-steps: the count is over every process,
    and a phase is whole accumulation windows (``config.refusals``), so no window mixes skipped and run ones."""

    skip = False

    def __init__(self, wrapped):
        # accelerate's wrapper held, not subclassed: accelerate.utils exports its class only where DeepSpeed is
        # installed, and the TRL front end imports without it
        self.wrapped, self.engine = wrapped, wrapped.engine

    def __getattr__(self, name: str):  # the rest of accelerate's wrapper (get_global_grad_norm, ...)
        return getattr(self.wrapped, name)

    @classmethod
    def on(cls, accelerator) -> "_SkipsEmptyPhases":
        """The accelerator's engine wrapper, made one of these (once per engine accelerate wraps)."""
        wrapped = accelerator.deepspeed_engine_wrapped
        if not isinstance(wrapped, cls):
            wrapped = accelerator.deepspeed_engine_wrapped = cls(wrapped)
        return wrapped

    def backward(self, loss, sync_gradients=True, **kwargs):
        if not self.skip:
            return self.wrapped.backward(loss, sync_gradients=sync_gradients, **kwargs)
        self.skip = False
        self.engine.set_gradient_accumulation_boundary(is_boundary=sync_gradients)  # as accelerate sets it
        if sync_gradients:
            _engine_step_without_update(self.engine)


def _engine_step_without_update(engine) -> None:
    """What DeepSpeed's ``engine.step()`` does at an accumulation boundary, but for the optimizer's update: the
    engine's counters, the step counted as not applied (``skipped_steps``, ``was_step_applied()``, as an fp16
    overflow's), and the LR scheduler's step where the engine holds the scheduler (a DeepSpeed config's own; the
    trainer's is stepped by transformers after the step, as without DeepSpeed). The schedule moves as without
    DeepSpeed: phase 2 replays phase 1's rates, and the round ends where a run without Lopti leaves it. The
    gradient norm the engine reports for the step is 0 (no gradient), not the previous step's."""
    if engine.lr_scheduler is not None:  # DeepSpeed's engine.step steps it (transformers' wrapper then does not)
        engine.lr_scheduler.step()
    engine._step_applied = False
    engine._global_grad_norm = 0.0
    engine.skipped_steps += 1
    engine.global_steps += 1
    engine.global_samples += engine.train_batch_size()
    engine.gas_boundary_ctr += 1
    engine.micro_steps += 1


class _DirectionAtRoundEnd(TrainerCallback):
    """``direction/*`` (paper Fig. 3, ``track_direction``) after each round's last optimizer step: the round's
    generation batch re-scored by the updated model, one forward-only pass, summed over processes."""

    def __init__(self, trainer: "LoptiGRPOTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        per_round = trainer._phase_cycle() * (2 if trainer.args.lopti else 1)  # micro-steps
        at_round_end = (state.global_step * args.gradient_accumulation_steps) % per_round == 0
        if at_round_end and trainer._buffered_inputs is not None:
            for key, value in trainer._direction_metrics().items():
                trainer._metrics["train"][key].append(value)


def _settings_problem(saved: Optional[dict], now: dict) -> Optional[str]:
    """Why a round saved under ``saved`` settings cannot go on under ``now`` (one clause naming the setting and both
    values), or None."""
    if saved is None:
        return "was saved without the settings it was made under (an older openrlhf-lopti)"
    for key, value in now.items():
        if key in saved and saved[key] != value:  # a key an older version did not record is not compared
            return f"was saved with {key}={saved.get(key)!r}, this run has {key}={value!r}"
    return None


def kk_reward(prompts: list, completions: list, label: list, **kwargs: Any) -> list:
    """TRL reward function for Knights and Knaves: ``tasks.reward_kk``'s paper rule, one float per completion.

    Args:
        prompts: the prompts (strings; a conversational prompt's last message is used).
        completions: the completions (strings, or conversational ``[{"role", "content"}]`` lists).
        label: per completion, the puzzle's ``solution_text_format`` (a dataset column named ``label``).

    Returns:
        Rewards in [-3, 3]: format +1/-1 plus answer +2/-1.5/-2 (PAPER_NOTES.md section 6).
    """
    from openrlhf_lopti.tasks.reward_kk import reward_func

    def text(x) -> str:
        return x if isinstance(x, str) else x[-1]["content"]

    prompt_texts = [text(p) for p in prompts]
    queries = [p + text(c) for p, c in zip(prompt_texts, completions)]
    return reward_func(queries, prompt_texts, list(label))["rewards"].tolist()
