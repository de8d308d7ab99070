"""One ``LoptiGRPOTrainer`` run (AR + Lopti) generating with vLLM colocated on CPU, as ``python`` or ``torchrun
--nproc_per_node N`` launches it; tests/test_trl_cpu_colocate.py runs it and reads what each rank writes.

Usage: ``python tests/trl_colocate_run.py MODEL_DIR OUT_DIR VLLM_DTYPE MAX_STEPS``. Each rank writes
``OUT_DIR/rank<r>.json``: the vLLM variables of its environment after the trainer was built (the engine reads them
then), TRL's log history, and a probe of its engine after the run: the log-probs vLLM gives to what it samples for a
fixed prompt, against the teacher-forced log-probs of the first and of the trained weights, before and after one more
``sync_weights`` (the last optimizer steps are not synced yet: TRL syncs before a generation).
"""

import json
import os
import sys
from pathlib import Path

import torch

PROBE_PROMPT = [5, 17, 33, 9, 40, 41]
PROBE_TOKENS = 8


def reward_of_text(completions: list, **kwargs) -> list:
    """A reward with spread inside nearly every group (the completion's characters, summed modulo 7), so advantages
    and updates are not zero and the weights a sync sends have moved."""
    return [float(sum(map(ord, text)) % 7) for text in completions]


def probe(trainer, first_model) -> dict:
    """Max |vLLM's sampled-token log-prob - teacher-forced log-prob| against the first and the trained weights."""
    from vllm import SamplingParams

    llm = trainer.vllm_generation.llm
    params = SamplingParams(temperature=trainer.temperature, max_tokens=PROBE_TOKENS, logprobs=0, seed=0)
    (output,) = llm.generate([{"prompt_token_ids": PROBE_PROMPT}], params, use_tqdm=False)
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    engine = torch.tensor([entry[token].logprob for entry, token in zip(completion.logprobs, tokens)])
    ids = torch.tensor([PROBE_PROMPT + tokens])
    diffs = {}
    for name, model in (("first", first_model), ("trained", trainer.accelerator.unwrap_model(trainer.model))):
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROBE_PROMPT) - 1 : -1].float() / trainer.temperature
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        diffs[name] = (engine - expected).abs().max().item()
    return diffs


def main(model_dir: str, out_dir: str, vllm_dtype: str, max_steps: int) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from openrlhf_lopti.trl import LoptiGRPOConfig, LoptiGRPOTrainer

    out = Path(out_dir)
    rank = int(os.environ.get("RANK", "0"))
    dataset = Dataset.from_list([{"prompt": f"who is a knight {i} ? the"} for i in range(16)])
    config = LoptiGRPOConfig(
        output_dir=str(out / "run"), use_cpu=True, seed=0, report_to="none", logging_steps=1, save_strategy="no",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, temperature=1.0,
        steps_per_generation=1, gradient_accumulation_steps=1, max_steps=max_steps, learning_rate=2e-3,
        lr_scheduler_type="constant", beta=0.0, bf16=False, loss_backend="torch",
        ar_alpha=0.3, lopti_eta=0.5, use_vllm=True, vllm_mode="colocate", vllm_dtype=vllm_dtype,
    )  # fmt: skip
    trainer = LoptiGRPOTrainer(model=model_dir, reward_funcs=reward_of_text, args=config, train_dataset=dataset)
    environment = {name: os.environ.get(name) for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CACHE_ROOT")}
    trainer.train()
    first = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stale = probe(trainer, first)
    trainer.vllm_generation.sync_weights()
    synced = probe(trainer, first)
    record = {
        "world_size": trainer.accelerator.num_processes,
        "backend": str(torch.distributed.get_backend()) if torch.distributed.is_initialized() else None,
        "engine_dtype": str(trainer.vllm_generation.llm.llm_engine.model_config.dtype),
        "environment": environment,
        "log_history": trainer.state.log_history,
        "global_step": trainer.state.global_step,
        "probe_before_sync": stale,
        "probe_after_sync": synced,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":  # vLLM's engine may spawn processes: the guard keeps them from running this
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
