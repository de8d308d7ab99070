#!/usr/bin/env bash
# Knights & Knaves, GRPO baseline with the paper's hyper-parameters (arXiv 2505.12929, Appendix B), single node
# with 8 GPUs. The +AR / +Lopti / +AR+Lopti scripts run this one with their flags appended; any extra
# arguments are passed to the trainer too (later flags win). The baseline runs `--actor.fused_loss off`: every step
# is upstream's PolicyLoss, bit for bit; the other scripts append `--actor.fused_loss auto` (the fused kernels). E.g.
#   MODEL=Qwen/Qwen2.5-7B-Instruct-1M bash examples/scripts/train_kk_grpo.sh --train.num_episodes 2
set -euo pipefail

PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}  # or Qwen/Qwen2.5-7B-Instruct-1M
DATA_DIR=${DATA_DIR:-data/kk}
SAVE_DIR=${SAVE_DIR:-checkpoints/kk_$(basename "$MODEL")}
RUN_NAME=${RUN_NAME:-kk_grpo}

# 3..7 people, 900 train / 100 test puzzles per size (written by the tasks module, no download)
if [[ ! -f "$DATA_DIR/train.jsonl" ]]; then
  "$PYTHON" -m openrlhf_lopti data kk --out "$DATA_DIR"
fi
# OpenRLHF loads reward_func(queries, prompts, labels) from this file (paper's K&K rule: format + answer)
REWARD_FILE=${REWARD_FILE:-$("$PYTHON" -c 'import openrlhf_lopti.tasks.reward_kk as m; print(m.__file__)')}
# GRPO: k3 KL as a loss term, coefficient 0.001. REINFORCE++ (KL_IN_REWARD=1): k1 KL folded into the reward.
if [[ "${KL_IN_REWARD:-0}" == 1 ]]; then
  KL_ARGS=(--algo.kl.init_coef 0.001 --algo.kl.estimator k1)
else
  KL_ARGS=(--algo.kl.use_loss --algo.kl.init_coef 0.001 --algo.kl.estimator k3)
fi

# CPU=1: the same run on a machine without a GPU (--cpu: DeepSpeed on its CPU accelerator, vLLM on its CPU
# backend, Ray GPUs as logical resources), minus what needs flash-attn; shrink it with extra flags (README, "--cpu").
if [[ "${CPU:-0}" == 1 ]]; then
  DEVICE_ARGS=(--cpu)
else
  DEVICE_ARGS=(--ds.attn_implementation flash_attention_2 --ds.packing_samples)
fi
set -x
"$PYTHON" -m openrlhf_lopti.cli.train_ppo_ray \
  --actor.model_name_or_path "$MODEL" \
  --actor.num_nodes 1 \
  --actor.num_gpus_per_node 8 \
  --ref.num_nodes 1 \
  --ref.num_gpus_per_node 8 \
  --vllm.num_engines 4 \
  --vllm.tensor_parallel_size 2 \
  --vllm.gpu_memory_utilization 0.6 \
  --vllm.enable_sleep \
  --ds.enable_sleep \
  --train.colocate_all \
  --ds.zero_stage 3 \
  --ds.param_dtype bf16 \
  "${DEVICE_ARGS[@]}" \
  --actor.gradient_checkpointing_enable \
  --reward.remote_url "$REWARD_FILE" \
  --data.prompt_dataset "$DATA_DIR/train.jsonl" \
  --data.input_key prompt \
  --data.label_key label \
  --data.apply_chat_template \
  --eval.dataset "$DATA_DIR/test.jsonl" \
  --eval.steps 10 \
  --eval.temperature 0.7 \
  --eval.n_samples_per_prompt 1 \
  --ckpt.best_metric_key eval_score \
  --algo.advantage.estimator group_norm \
  --rollout.batch_size 64 \
  --rollout.n_samples_per_prompt 8 \
  --rollout.temperature 0.7 \
  --rollout.max_new_tokens 4096 \
  --data.max_len 5120 \
  --rollout.micro_batch_size 8 \
  --train.batch_size 256 \
  --train.micro_batch_size 4 \
  --train.max_epochs 1 \
  --train.num_episodes 5 \
  --actor.adam.lr 1e-6 \
  --actor.lr_scheduler constant \
  --actor.eps_clip_low_high 0.2 0.24 \
  --actor.loss_agg_mode token-mean \
  "${KL_ARGS[@]}" \
  --actor.entropy_coef 0 \
  --actor.fused_loss off \
  --ckpt.output_dir "$SAVE_DIR/$RUN_NAME" \
  --ckpt.path "$SAVE_DIR/$RUN_NAME/ckpt" \
  --ckpt.save_steps 20 \
  --logger.tensorboard_dir "$SAVE_DIR/$RUN_NAME/tensorboard" \
  --logger.wandb.run_name "$RUN_NAME" \
  "$@"
