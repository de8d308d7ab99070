"""What the verl tests share: verl's own config (hydra, main_ppo's ``ppo_trainer``), verl's own actor worker on the
CPU platform (``openrlhf_lopti.verl.cpu``), a tiny Llama, and one batch of experience seen by both trainers.

Nothing of verl is replaced: the worker is verl's ``ActorRolloutRefWorker`` (role ``actor``) built from the config
main_ppo would build, its ``actor_worker_cls`` our ``LoptiTrainingWorker``, its engine verl's FSDP2 engine on a gloo
process group, the batch converted by verl's own ``left_right_2_no_padding`` as ``RayPPOTrainer._update_actor`` does.
Only Ray is left out: the worker's methods are called in this process (as Ray's worker process would call them).
"""

import os
import tempfile
from typing import List, Optional

import torch
import torch.distributed as dist

ACTOR = "actor_rollout_ref.actor"


def init_process_group(rank: int = 0, world_size: int = 1, port: Optional[int] = None) -> None:
    """A gloo process group for verl's worker (its env vars as Ray would set them)."""
    if port is None:
        port = free_port()
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    from openrlhf_lopti.verl.cpu import use_cpu

    use_cpu()
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compose(overrides: List[str]):
    """main_ppo's config (``ppo_trainer``) with ``overrides``, as hydra builds it for ``python -m
    verl.trainer.main_ppo`` (resolved)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    import verl.trainer.main_ppo as main_ppo

    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = hydra_compose(config_name="ppo_trainer", overrides=list(overrides))
    OmegaConf.resolve(cfg)
    return cfg


def actor_overrides(model_dir: str, *, mini_batch: int, micro_batch: int, lr: float, optimizer: str = "SGD",
                    epochs: int = 1, kl_coef: float = 0.0, clip_grad: float = 1.0, eps_low: float = 0.2,
                    eps_high: float = 0.24, alpha: float = 0.0, eta: Optional[float] = None,
                    order: str = "low_first", quantile: Optional[float] = None, reshard_after_forward: bool = False,
                    loss_mode: Optional[str] = None,
                    extra: tuple = ()) -> List[str]:  # fmt: skip
    """Overrides for a CPU actor: FSDP2, fp32, eager attention, no padding removal, no torch.compile, constant lr,
    no weight decay, ``shuffle=False``; our loss config with AR / Lopti as given.

    ``reshard_after_forward=False`` by default (verl's default is True; the same numbers in fp32, where an all-gather
    copies exactly): with True, FSDP2 all-gathers the parameters again for the backward pass, from autograd hooks
    that run outside ``Float64Shadow``, i.e. in the configured fp32, and the float64 run's backward would see its
    weights rounded to fp32 (measured: float64 runs 4e-8 apart instead of 1e-13)."""
    from openrlhf_lopti.verl.cpu import CPU_OVERRIDES

    a = ACTOR
    cpu = [o for o in CPU_OVERRIDES if "reshard_after_forward" not in o]
    out = cpu + [
        f"actor_rollout_ref.model.path={model_dir}",
        f"{a}.fsdp_config.reshard_after_forward={str(reshard_after_forward).lower()}",
        f"{a}.ppo_mini_batch_size={mini_batch}",
        f"{a}.ppo_micro_batch_size_per_gpu={micro_batch}",
        f"{a}.ppo_epochs={epochs}",
        f"{a}.shuffle=false",
        f"{a}.optim.lr={lr}",
        f"{a}.optim.weight_decay=0.0",
        f"{a}.optim.optimizer={optimizer}",
        f"{a}.optim.clip_grad={clip_grad}",
        f"++{a}.optim.total_training_steps=10",
        f"{a}.clip_ratio_low={eps_low}",
        f"{a}.clip_ratio_high={eps_high}",
        # verl's vanilla loss always applies dual clip (at ratio 3 by default); the local trainer has none: out of reach
        f"{a}.clip_ratio_c=1e9",
        f"{a}.use_kl_loss={str(kl_coef > 0).lower()}",
        f"{a}.kl_loss_coef={kl_coef}",
        f"{a}.kl_loss_type=low_var_kl",
        f"{a}.entropy_coeff=0",
        f"{a}.policy_loss._target_=openrlhf_lopti.verl.LoptiPolicyLossConfig",
        f"{a}.policy_loss.loss_mode={loss_mode or ('ar' if alpha > 0 else 'vanilla')}",
        f"++{a}.policy_loss.ar_alpha={alpha}",
        f"++{a}.policy_loss.lopti_eta={'null' if eta is None else eta}",
        f"++{a}.policy_loss.lopti_order={order}",
        f"++{a}.policy_loss.lopti_quantile={'null' if quantile is None else quantile}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=" + str(micro_batch),
    ]
    return out + list(extra)


def actor_worker(cfg):
    """verl's ``ActorRolloutRefWorker`` (role ``actor``) with its model, engine and loss built (``init_model``)."""
    from verl.workers.engine_workers import ActorRolloutRefWorker  # its actor_worker_cls: as our plugin set it

    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


WORDS = ("says", ":", ".", "is", "a", "knight", "knave", "it", "false", "that", "and", "or", "if", "then", "only",
         "<think>", "</think>", "<answer>", "</answer>", "Alice", "Bob", "Carol", "Dave")  # fmt: skip


def tiny_model_dir(seed: int = 0, peak: float = 1.0, hidden: int = 32, layers: int = 2) -> str:
    """A random tiny Llama (from a transformers config, tied embeddings) and a word-level tokenizer saved as a HF
    checkpoint: no download. ``peak`` scales the embedding, so that the output distributions are peaked and sampled
    tokens span low and high probabilities."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + list(WORDS))}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", padding_side="left")  # fmt: skip
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(peak)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path = tempfile.mkdtemp(prefix="verl-tiny-")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_tiny(path: str):
    """(model with eager attention, left-padding tokenizer) from :func:`tiny_model_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager"), tokenizer


def sample_experience(model, tokenizer, *, prompts: int, n: int, max_new_tokens: int, temperature: float,
                      seed: int, ref_noise: float = 0.0):  # fmt: skip
    """A GRPO batch sampled from ``model`` (the local trainer's own rollout and log-prob code), with rewards drawn
    at random per response (the advantages are what matters here) and a made-up reference (old + noise)."""
    from openrlhf_lopti.local.advantages import grpo_advantages
    from openrlhf_lopti.local.experience import Experience
    from openrlhf_lopti.local.rollout import generate_rollouts, response_logprobs
    g = torch.Generator().manual_seed(seed)
    words = list(WORDS)
    texts = []
    for i in range(prompts):
        length = 2 + i % 3  # different prompt lengths: left padding in some rows
        texts.append(" ".join(words[int(j)] for j in torch.randint(len(words), (length,), generator=g)))
    torch.manual_seed(seed)
    rollout = generate_rollouts(model, tokenizer, texts, n, max_new_tokens, temperature)
    old = response_logprobs(model, rollout, temperature)
    rewards = torch.randn(len(rollout), generator=g)
    advantages = grpo_advantages(rewards, n, rollout.action_mask)
    ref = None
    if ref_noise:
        ref = (old + ref_noise * torch.randn(old.shape, generator=g)) * rollout.action_mask
    return Experience(rollout, old, ref, advantages, rewards, None, None)


def verl_batch(exp, *, temperature: float, mini_batch: int, epochs: int = 1, seed: int = 0):
    """The batch ``RayPPOTrainer._update_actor`` hands ``update_actor``: verl's left-right padded fields converted
    by verl's ``left_right_2_no_padding``, with the trainer's non-tensor settings."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    rollout = exp.rollout
    P = rollout.prompt_len
    attention = rollout.attention_mask.long()
    fields = {
        "prompts": rollout.sequences[:, :P],
        "responses": rollout.sequences[:, P:],
        "input_ids": rollout.sequences,
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "response_mask": rollout.action_mask.long(),
        "old_log_probs": exp.old_log_probs.float(),
        "advantages": exp.advantages.float(),
    }
    if exp.ref_log_probs is not None:
        fields["ref_log_prob"] = exp.ref_log_probs.float()
    td = TensorDict(fields, batch_size=[len(rollout)])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td,
        temperature=temperature,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini_batch,
        mini_batch_size=mini_batch,
        epochs=epochs,
        seed=seed,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    return td


RESPONSE_FIELDS = ("response_mask", "loss_mask", "old_log_probs", "advantages", "ref_log_prob")


def nested_batch(padded):
    """The batch of :func:`verl_batch` as verl's default trainer (``trainer.use_v1=true``) hands ``update_actor``:
    ``prompts``, ``responses`` and every per-response field as jagged nested tensors, one row per response of its
    own length (``agent_loop_tq.py:199``, ``trainer_base.py:1797``: verl's own ``response_to_nested``), no
    ``attention_mask`` and no ``max_response_len`` (``no_padding_2_padding`` then pads to each mini-batch's longest
    response, as ``ppo_loss`` pads the nested fields). Needs responses whose mask is a prefix of their row."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import response_to_nested

    td = padded.copy()
    response = td["response_mask"].bool()
    lengths = response.sum(-1)
    assert torch.equal(response, torch.arange(response.shape[1]) < lengths[:, None]), "responses must be prefixes"
    rows = torch.nested.as_nested_tensor([r[:n] for r, n in zip(td["response_mask"], lengths)], layout=torch.jagged)
    for key in RESPONSE_FIELDS:
        if key in td.keys():
            td[key] = response_to_nested(td[key], rows)
    prompt_valid = td["attention_mask"][:, : td["prompts"].shape[1]].bool()
    td["prompts"] = torch.nested.as_nested_tensor([p[v] for p, v in zip(td["prompts"], prompt_valid)],
                                                  layout=torch.jagged)  # fmt: skip
    td["responses"] = torch.nested.as_nested_tensor([r[:n] for r, n in zip(td["responses"], lengths)],
                                                    layout=torch.jagged)  # fmt: skip
    del td["attention_mask"]
    tu.pop(td, key="max_response_len")
    return td
