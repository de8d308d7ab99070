"""One rank of ``LoptiGRPOTrainer`` under a real launcher (``torchrun --nproc_per_node N tests/trl_ranks.py OUT``).

Trains one Lopti round (a quantile threshold, so the ranks must gather to agree) on the tiny Llama of
tests/test_trl_trainer.py, on CPU over gloo, with a checkpoint after each optimizer step, and writes ``OUT/rank<r>.pt``:
the micro-batches the loss saw (a one-process replay of the same global batch starts from them), the logged metrics
and the trained parameters, and those of the same round replayed through the fused lm_head. Then, in the same
processes, two runs that must fail on every rank with one line: a resume from the mid-round checkpoint whose last
process's round file is gone (a multi-node run without shared storage, its checkpoint copied from node 0), and a run
whose reward function returns -inf for a completion of the last process only. tests/test_trl_processes.py reads them.
"""

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
    return settings(out, loss_type="dapo", per_device_train_batch_size=per_device_batch, num_generations=4,
                    gradient_accumulation_steps=1, steps_per_generation=1, max_steps=2, lopti_quantile=QUANTILE,
                    ar_alpha=0.3, shuffle_dataset=False, save_strategy="steps", save_steps=1, **kw)  # fmt: skip


class Replayed(GRPOTrainer):
    """Below ``LoptiGRPOTrainer`` in the MRO: with ``replay`` set, TRL's generation returns it instead of generating
    (a one-process run of the batch the ranks generated together)."""

    replay = None

    def _generate_and_score_completions(self, inputs):
        if self.replay is None:
            return super()._generate_and_score_completions(inputs)
        return {k: v.clone() if torch.is_tensor(v) else v for k, v in self.replay.items()}


class Trainer(LoptiGRPOTrainer, Replayed):
    """Records every micro-batch the loss sees."""

    def _compute_loss(self, model, inputs):
        self.trained.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return super()._compute_loss(model, inputs)


def build(out: str, tok, per_device_batch: int, replay=None, reward=distinct_words, **kw) -> Trainer:
    """The trainer of one rank (``replay`` None) or of the one-process replay; ``kw``: more settings."""
    cfg = LoptiGRPOConfig(**round_settings(out, per_device_batch, **kw))
    data = kk_dataset(1).to_list() * 8  # one prompt: every rank's prompt tokens line up (no left padding)
    from datasets import Dataset

    trainer = Trainer(model=tiny_model(tok), reward_funcs=[reward], args=cfg,
                      train_dataset=Dataset.from_list(data), processing_class=tok)  # fmt: skip
    trainer.trained, trainer.replay = [], replay
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
    resume = failure(lambda: build(out, tok, per_device_batch=4).train(resume_from_checkpoint=checkpoint))
    reward = failure(lambda: build(out, tok, per_device_batch=4, reward=last_process_only).train())
    torch.save(
        {
            "world": world,
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "trained": trainer.trained,
            "logs": trainer.state.log_history,
            "params": [p.detach().clone() for p in trainer.model.parameters()],
            "fused_params": [p.detach().clone() for p in fused.model.parameters()],
            "fused_trained": fused.trained,
            "round_files": saved,
            "resume_error": resume,
            "reward_error": reward,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
