#!/usr/bin/env bash
# Math (paper Sec. 5.2: Qwen2.5-7B on DSR-Uniform), GRPO + AR with alpha = 0.1, single node with 8 GPUs.
# On math, AR and Lopti each helped and the two together did not: for GRPO + Lopti instead, replace the
# --algo.ar.alpha line by `--algo.lopti.eta 0.5` (or pass `--algo.ar.alpha 0 --algo.lopti.eta 0.5`).
#
# Data: convert your local copy of the training set (a jsonl/json/parquet with `problem` and `answer`):
#   python -m openrlhf_lopti data math --input dsr_uniform.jsonl --benchmark dsr --out data/math/train.jsonl
#   python -m openrlhf_lopti data math --input math500.jsonl --benchmark math500 --out data/math/math500.jsonl
set -euo pipefail

PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-Qwen/Qwen2.5-7B}
TRAIN_DATA=${TRAIN_DATA:-data/math/train.jsonl}
EVAL_DATA=${EVAL_DATA:-data/math/math500.jsonl}
SAVE_DIR=${SAVE_DIR:-checkpoints/math_$(basename "$MODEL")}
RUN_NAME=${RUN_NAME:-math_grpo_ar}

for f in "$TRAIN_DATA" "$EVAL_DATA"; do
  [[ -f "$f" ]] || { echo "missing $f: see the data commands at the top of $0" >&2; exit 1; }
done
# binary reward: 1 when the last \boxed{} answer is equivalent to the label
REWARD_FILE=${REWARD_FILE:-$("$PYTHON" -c 'import openrlhf_lopti.tasks.reward_math as m; print(m.__file__)')}

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
  --data.prompt_dataset "$TRAIN_DATA" \
  --data.input_key prompt \
  --data.label_key label \
  --data.apply_chat_template \
  --eval.dataset "$EVAL_DATA" \
  --eval.steps 10 \
  --eval.temperature 0.0 \
  --eval.n_samples_per_prompt 1 \
  --algo.advantage.estimator group_norm \
  --rollout.batch_size 128 \
  --rollout.n_samples_per_prompt 8 \
  --rollout.temperature 1.0 \
  --rollout.max_new_tokens 4096 \
  --data.max_len 5120 \
  --rollout.micro_batch_size 8 \
  --train.batch_size 512 \
  --train.micro_batch_size 4 \
  --train.max_epochs 1 \
  --train.num_episodes 1 \
  --actor.adam.lr 1e-6 \
  --actor.lr_scheduler constant \
  --actor.eps_clip_low_high 0.2 0.24 \
  --actor.loss_agg_mode token-mean \
  --algo.kl.use_loss \
  --algo.kl.init_coef 0.001 \
  --algo.kl.estimator k3 \
  --actor.entropy_coef 0 \
  --actor.fused_loss auto \
  --algo.ar.alpha 0.1 \
  --ckpt.output_dir "$SAVE_DIR/$RUN_NAME" \
  --ckpt.path "$SAVE_DIR/$RUN_NAME/ckpt" \
  --ckpt.save_steps 20 \
  --logger.tensorboard_dir "$SAVE_DIR/$RUN_NAME/tensorboard" \
  --logger.wandb.run_name "$RUN_NAME" \
  "$@"
