#!/usr/bin/env bash
# Knights & Knaves, GRPO + AR + Lopti on a Ray cluster of NUM_NODES nodes x 8 GPUs (default 2 nodes:
# Qwen2.5-7B-Instruct-1M). Every node needs the same environment (docs/INSTALL.md, the OpenRLHF-on-GPU block: with
# openrlhf==0.11.2, vLLM, flash-attn) and the same paths: data and the reward file are read on the node where
# each Ray actor runs, so put them on shared storage or install the package at the same path everywhere.
#
#   head node:    HEAD_IP=10.0.0.1 bash examples/scripts/multinode_kk_grpo_ar_lopti.sh head [ray start flags]
#   each worker:  HEAD_IP=10.0.0.1 bash examples/scripts/multinode_kk_grpo_ar_lopti.sh worker [ray start flags]
#   then, on the head node, once `ray status` lists all GPUs:
#                 HEAD_IP=10.0.0.1 bash examples/scripts/multinode_kk_grpo_ar_lopti.sh submit [extra trainer flags]
#
# CPU=1 rehearses the run without GPUs (README, "--cpu"): `ray start --num-gpus` declares logical GPUs, so two
# CPU machines (or two raylets on one) stand in for the GPU nodes; add flags that shrink the model and batch.
set -euo pipefail

ROLE=${1:?usage: $0 head|worker [ray start flags] | submit [extra trainer flags]}
shift
HEAD_IP=${HEAD_IP:?set HEAD_IP to the head node address}
NUM_NODES=${NUM_NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RAY=${RAY:-ray}
PYTHON=${PYTHON:-python3}
RAY_PORT=${RAY_PORT:-6379}
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct-1M}
DATA_DIR=${DATA_DIR:-$PWD/data/kk}
SAVE_DIR=${SAVE_DIR:-$PWD/checkpoints/kk_$(basename "$MODEL")}
RUN_NAME=${RUN_NAME:-kk_grpo_ar_lopti_${NUM_NODES}nodes}

# CPU=1: Ray starts its workers at nice 15; on a CPU they are the whole run, so beside other work they would starve
# (openrlhf_lopti/openrlhf/cpu/runtime.py does the same for a local Ray).
if [[ "${CPU:-0}" == 1 ]]; then
  export RAY_worker_niceness=${RAY_worker_niceness:-0}
fi

case "$ROLE" in
  head)
    exec "$RAY" start --head --node-ip-address "$HEAD_IP" --port "$RAY_PORT" --dashboard-host 0.0.0.0 \
      --dashboard-port "$DASHBOARD_PORT" --num-gpus "$GPUS_PER_NODE" "$@"
    ;;
  worker)
    exec "$RAY" start --address "$HEAD_IP:$RAY_PORT" --num-gpus "$GPUS_PER_NODE" --block "$@"
    ;;
  submit) ;;
  *)
    echo "unknown role '$ROLE': use head, worker or submit" >&2
    exit 2
    ;;
esac

if [[ ! -f "$DATA_DIR/train.jsonl" ]]; then
  "$PYTHON" -m openrlhf_lopti data kk --out "$DATA_DIR"
fi
REWARD_FILE=${REWARD_FILE:-$("$PYTHON" -c 'import openrlhf_lopti.tasks.reward_kk as m; print(m.__file__)')}
TOTAL_GPUS=$((NUM_NODES * GPUS_PER_NODE))

# CPU=1: the same run on a machine without a GPU (--cpu: DeepSpeed on its CPU accelerator, vLLM on its CPU
# backend, Ray GPUs as logical resources), minus what needs flash-attn; shrink it with extra flags (README, "--cpu").
if [[ "${CPU:-0}" == 1 ]]; then
  DEVICE_ARGS=(--cpu)
else
  DEVICE_ARGS=(--ds.attn_implementation flash_attention_2 --ds.packing_samples)
fi
set -x
"$RAY" job submit --address="http://127.0.0.1:$DASHBOARD_PORT" \
  --runtime-env-json='{"env_vars": {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN"}}' \
  -- "$PYTHON" -m openrlhf_lopti.cli.train_ppo_ray \
  --actor.model_name_or_path "$MODEL" \
  --actor.num_nodes "$NUM_NODES" \
  --actor.num_gpus_per_node "$GPUS_PER_NODE" \
  --ref.num_nodes "$NUM_NODES" \
  --ref.num_gpus_per_node "$GPUS_PER_NODE" \
  --vllm.num_engines $((TOTAL_GPUS / 2)) \
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
  --train.micro_batch_size 2 \
  --train.max_epochs 1 \
  --train.num_episodes 5 \
  --actor.adam.lr 1e-6 \
  --actor.lr_scheduler constant \
  --actor.eps_clip_low_high 0.2 0.24 \
  --actor.loss_agg_mode token-mean \
  --algo.kl.use_loss \
  --algo.kl.init_coef 0.001 \
  --algo.kl.estimator k3 \
  --actor.entropy_coef 0 \
  --actor.fused_loss auto \
  --algo.ar.alpha 0.3 \
  --algo.lopti.eta 0.5 \
  --ckpt.output_dir "$SAVE_DIR/$RUN_NAME" \
  --ckpt.path "$SAVE_DIR/$RUN_NAME/ckpt" \
  --ckpt.save_steps 20 \
  --logger.tensorboard_dir "$SAVE_DIR/$RUN_NAME/tensorboard" \
  --logger.wandb.run_name "$RUN_NAME" \
  "$@"
