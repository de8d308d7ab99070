"""``python -m openrlhf_lopti.verl.rehearse --cpu``: the actor side of main_ppo's RL steps with our loss and worker,
on the CPU, without Ray and without a vLLM server.

    python -m openrlhf_lopti tiny-model --out /tmp/tiny                 # a random tiny Llama with a chat template
    python -m openrlhf_lopti data kk --out data/kk && python -m openrlhf_lopti.verl.data data/kk
    python -m openrlhf_lopti.verl.rehearse --cpu --model /tmp/tiny --data data/kk/train.parquet --steps 2 \\
        actor_rollout_ref.actor.policy_loss._target_=openrlhf_lopti.verl.LoptiPolicyLossConfig \\
        actor_rollout_ref.actor.policy_loss.loss_mode=ar +actor_rollout_ref.actor.policy_loss.ar_alpha=0.3 \\
        +actor_rollout_ref.actor.policy_loss.lopti_eta=0.5

Each step does what ``RayPPOTrainer.fit`` does for the actor, with verl's own pieces where they run on a CPU:
main_ppo's config (hydra, the given overrides on top of the CPU ones of :mod:`.cpu`), verl's ``ActorRolloutRefWorker``
(role ``actor``: our ``LoptiTrainingWorker`` inside, verl's FSDP2 engine on a one-process gloo group), the weights
handed to the sampler with the engine's ``get_per_tensor_param`` (as verl syncs vLLM), our K&K reward file loaded
with verl's ``load_extern_object``, verl's ``compute_grpo_outcome_advantage``, the old log-probs from the worker's
``compute_log_prob``, ``left_right_2_no_padding`` and ``update_actor``. Two stand-ins: transformers' ``generate``
samples (verl's rollout is a vLLM / SGLang server), and the KL reference is the starting weights' log-probs
computed by this script (verl's would come from its reference worker).

Prints one line per step: reward, accuracy, the Lopti round, the losses. ``--cpu`` is required: on GPUs, run main_ppo
(examples/verl/train_kk_grpo_ar_lopti.sh).
"""

import copy
import os
import sys
from pathlib import Path
from typing import List, Optional

from openrlhf_lopti.errors import ArgumentParser, UserError, run_command

REWARD_FILE = Path(__file__).with_name("reward.py")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m openrlhf_lopti.verl.rehearse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="required: the rehearsal runs on the CPU only")
    parser.add_argument("--model", required=True, help="a local HF causal LM with a chat template (tiny-model)")
    parser.add_argument("--data", required=True, help="train.parquet of `python -m openrlhf_lopti.verl.data`")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (data.train_batch_size)")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (actor_rollout_ref.rollout.n)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="data.max_response_length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="main_ppo config overrides (key=value), after the CPU ones")
    return parser


def compose(overrides: List[str]):
    """main_ppo's config (``ppo_trainer``) with ``overrides``, resolved."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    import verl.trainer.main_ppo as main_ppo

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(main_ppo.__file__), "config"),
                               version_base=None):  # fmt: skip
        cfg = hydra_compose(config_name="ppo_trainer", overrides=list(overrides))
    OmegaConf.resolve(cfg)
    return cfg


def response_log_probs(model, input_ids, attention_mask, prompt_len: int, temperature: float):
    """``[B, T]`` log-probs of the response tokens under ``model`` (the KL reference's stand-in)."""
    import torch

    with torch.no_grad():
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
        logits = logits[:, prompt_len - 1 : -1].float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, input_ids[:, prompt_len:, None]).squeeze(-1)


def rehearse(ns) -> List[dict]:
    import numpy as np
    import pandas as pd
    import torch
    import torch.distributed as dist
    from tensordict import TensorDict
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils import tensordict_utils as tu
    from verl.utils.import_utils import load_extern_object
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from .cpu import CPU_OVERRIDES, use_cpu

    use_cpu()
    if not dist.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))  # fmt: skip
        dist.init_process_group("gloo", rank=0, world_size=1)
    batch = ns.prompts * ns.n
    cfg = compose(list(CPU_OVERRIDES) + [
        f"actor_rollout_ref.model.path={ns.model}",
        f"data.train_batch_size={ns.prompts}",
        f"data.max_response_length={ns.max_new_tokens}",
        f"actor_rollout_ref.rollout.n={ns.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={max(ns.prompts // 2, 1)}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={max(batch // 4, 1)}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={max(batch // 4, 1)}",
        "++actor_rollout_ref.actor.optim.total_training_steps=" + str(ns.steps),
        "actor_rollout_ref.actor.optim.lr=1e-3",
    ] + list(ns.overrides))  # fmt: skip
    actor = cfg.actor_rollout_ref.actor
    rollout_cfg = cfg.actor_rollout_ref.rollout

    import openrlhf_lopti.verl  # noqa: F401  (what VERL_USE_EXTERNAL_MODULES=openrlhf_lopti.verl does)

    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    tokenizer = AutoTokenizer.from_pretrained(ns.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    sampler = AutoModelForCausalLM.from_pretrained(ns.model, attn_implementation="eager")
    reference = copy.deepcopy(sampler).eval() if actor.use_kl_loss else None
    compute_score = load_extern_object(module_path=str(REWARD_FILE), object_name="compute_score")
    rows = pd.read_parquet(ns.data).to_dict("records")
    if not rows:
        raise UserError(f"--data {ns.data}: no rows")
    temperature = float(rollout_cfg.temperature)
    torch.manual_seed(ns.seed)
    results = []
    for step in range(ns.steps):
        # the rollout: the engine's weights, as verl hands them to vLLM, sampled with transformers
        weights = dict(worker.actor.engine.get_per_tensor_param()[0])
        sampler.load_state_dict(weights, strict=False)
        picked = [rows[(step * ns.prompts + i) % len(rows)] for i in range(ns.prompts)]
        texts = [tokenizer.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False)
                 for r in picked]  # fmt: skip
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        prompts = enc["input_ids"].repeat_interleave(ns.n, 0)
        prompt_mask = enc["attention_mask"].repeat_interleave(ns.n, 0)
        sampler.eval()
        with torch.no_grad():
            out = sampler.generate(input_ids=prompts, attention_mask=prompt_mask, do_sample=True,
                                   temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=ns.max_new_tokens,
                                   pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        P = prompts.shape[1]
        responses = out[:, P:]
        is_eos = responses == tokenizer.eos_token_id
        response_mask = ((is_eos.long().cumsum(-1) - is_eos.long()) == 0).long()  # up to and including eos
        responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, tokenizer.pad_token_id))
        input_ids = torch.cat([prompts, responses], 1)
        attention_mask = torch.cat([prompt_mask, response_mask], 1)
        # the reward and GRPO's advantages, verl's way: the score on each response's last token, groups by prompt
        scores = []
        for i in range(batch):
            text = tokenizer.decode(responses[i][response_mask[i].bool()], skip_special_tokens=True)
            record = picked[i // ns.n]
            scores.append(compute_score(data_source=record["data_source"], solution_str=text,
                                        ground_truth=record["reward_model"]["ground_truth"]))  # fmt: skip
        token_rewards = torch.zeros(responses.shape, dtype=torch.float32)
        last = response_mask.sum(-1).clamp(min=1) - 1
        token_rewards[torch.arange(batch), last] = torch.tensor([s["score"] for s in scores])
        index = np.array([i // ns.n for i in range(batch)], dtype=object)
        advantages, _ = compute_grpo_outcome_advantage(token_rewards, response_mask.float(), index)
        fields = {
            "prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "response_mask": response_mask,
            "advantages": advantages,
        }  # fmt: skip
        if reference is not None:
            fields["ref_log_prob"] = response_log_probs(reference, input_ids, attention_mask, P, temperature)
        td = left_right_2_no_padding(TensorDict(fields, batch_size=[batch]))
        tu.assign_non_tensor(td, temperature=temperature, compute_loss=False, calculate_entropy=False)
        old = worker.compute_log_prob(td.copy())
        td["old_log_probs"] = no_padding_2_padding(old["log_probs"], td).float() * response_mask
        mini = actor.ppo_mini_batch_size * ns.n
        tu.assign_non_tensor(
            td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
            global_batch_size=mini, mini_batch_size=mini, epochs=actor.ppo_epochs, seed=actor.data_loader_seed,
            dataloader_kwargs={"shuffle": actor.shuffle}, compute_loss=True,
        )  # fmt: skip
        metrics = tu.get(worker.update_actor(td), "metrics")
        result = {
            "step": step + 1,
            "reward": sum(s["score"] for s in scores) / batch,
            "accuracy": sum(s["acc"] for s in scores) / batch,
            "metrics": metrics,
        }
        results.append(result)
        print(step_line(result), flush=True)
    return results


def _mean(value) -> float:
    values = value if isinstance(value, list) else [value]
    return sum(float(v) for v in values) / max(len(values), 1)


def step_line(result: dict) -> str:
    """One line per step: reward, accuracy, the Lopti round and the losses (actor/ as verl's driver logs them)."""
    m = result["metrics"]
    parts = [f"step {result['step']}", f"reward {result['reward']:+.3f}", f"acc {result['accuracy']:.3f}"]
    for key in ("lopti/threshold", "lopti/low_token_frac", "lopti/low/tokens", "lopti/high/tokens", "ar/mean_weight",
                "actor/pg_loss", "kl_loss", "grad_norm", "lr"):  # fmt: skip
        if key in m:
            parts.append(f"actor/{key} {_mean(m[key]):.4g}" if not key.startswith("actor/") else f"{key} {_mean(m[key]):.4g}")
    return " | ".join(parts)


def main(argv: Optional[list] = None) -> int:
    def run(args: list) -> int:
        ns = build_parser().parse_args(args)
        if not ns.cpu:
            raise UserError("--cpu is required: the rehearsal runs verl's actor on the CPU; on GPUs run main_ppo "
                            "(examples/verl/train_kk_grpo_ar_lopti.sh)")  # fmt: skip
        for name in ("model", "data"):
            if not Path(getattr(ns, name)).exists():
                raise UserError(f"--{name} {getattr(ns, name)}: no such file or folder")
        if min(ns.steps, ns.prompts, ns.n, ns.max_new_tokens) < 1 or ns.n < 2:
            raise UserError("--steps, --prompts, --max-new-tokens must be >= 1 and --n >= 2 (GRPO's groups)")
        rehearse(ns)
        return 0

    return run_command("openrlhf_lopti.verl.rehearse", run, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
