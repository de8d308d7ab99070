#!/usr/bin/env bash
# The paper's K&K setting (Yang et al. 2025, Appendix B, Table 2) with verl 0.9.1: GRPO + AR (alpha 0.3) + Lopti
# (eta 0.5, low tokens first), Qwen2.5-3B-Instruct, on one node of GPUs. See docs/VERL.md.
#
#   METHOD=ar+lopti bash examples/verl/train_kk_grpo_ar_lopti.sh        # grpo | ar | lopti | ar+lopti
#   DRY_RUN=1 bash examples/verl/train_kk_grpo_ar_lopti.sh              # print main_ppo's overrides, run nothing
#   CPU=1 MODEL=/tmp/tiny DATA=/tmp/kk bash examples/verl/train_kk_grpo_ar_lopti.sh   # rehearse it on a CPU
#   VERL_PLATFORM=cpu python -m verl.trainer.main_ppo $(CPU=1 DRY_RUN=1 MODEL=/tmp/tiny DATA=/tmp/kk bash <this>)
#                                                      # the same rehearsal by hand (DATA made first)
#
# Runs verl's own trainer, `python -m verl.trainer.main_ppo`, with vLLM as the rollout server; AR and Lopti come from
# our package's verl plugin, which verl loads in every process (no environment variable). CPU=1 runs the same
# trainer on a machine without a GPU (openrlhf_lopti/verl/cpu.py: verl's platform "cpu", vLLM's CPU build, a
# private local Ray cluster) with small defaults: NGPUS=1 actor rank, 2 RL steps of 2 prompts x 4 responses of at
# most 32 tokens. Environment: PYTHON, MODEL, DATA, NGPUS, METHOD, CPU, DRY_RUN. Extra arguments are passed to
# main_ppo as more overrides (after ours: they win), e.g. trainer.total_epochs=2.
set -euo pipefail

PYTHON=${PYTHON:-python}
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
DATA=${DATA:-data/kk}
CPU=${CPU:-}
NGPUS=${NGPUS:-$([ -n "$CPU" ] && echo 1 || echo 8)}
METHOD=${METHOD:-ar+lopti}

case "$METHOD" in
  grpo)     LOSS=vanilla; ALPHA=0.0; ETA=null ;;
  ar)       LOSS=ar;      ALPHA=0.3; ETA=null ;;
  lopti)    LOSS=vanilla; ALPHA=0.0; ETA=0.5 ;;
  ar+lopti) LOSS=ar;      ALPHA=0.3; ETA=0.5 ;;
  *) echo "METHOD must be grpo, ar, lopti or ar+lopti, got '$METHOD'" >&2; exit 2 ;;
esac

# the K&K reward as verl loads a module of an installed package (every node imports its own copy)
REWARD=pkg://openrlhf_lopti.verl.reward
ACTOR=actor_rollout_ref.actor
ARGS=(
  algorithm.adv_estimator=grpo
  algorithm.use_kl_in_reward=false
  data.train_files="$DATA/train.parquet"
  data.val_files="$DATA/test.parquet"
  data.train_batch_size=64
  data.max_prompt_length=1024
  data.max_response_length=4096
  actor_rollout_ref.model.path="$MODEL"
  actor_rollout_ref.model.use_remove_padding=true
  actor_rollout_ref.model.enable_gradient_checkpointing=true
  $ACTOR.strategy=fsdp2
  $ACTOR.optim.lr=1e-6
  $ACTOR.ppo_mini_batch_size=32
  $ACTOR.ppo_micro_batch_size_per_gpu=4
  $ACTOR.use_kl_loss=true
  $ACTOR.kl_loss_coef=0.001
  $ACTOR.kl_loss_type=low_var_kl
  $ACTOR.entropy_coeff=0
  $ACTOR.clip_ratio_low=0.2
  $ACTOR.clip_ratio_high=0.24
  $ACTOR.loss_agg_mode=token-mean
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.n=8
  actor_rollout_ref.rollout.temperature=0.7
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
  reward.custom_reward_function.path="$REWARD"
  reward.custom_reward_function.name=compute_score
  trainer.n_gpus_per_node="$NGPUS"
  trainer.nnodes=1
  trainer.total_epochs=1
  trainer.test_freq=10
  trainer.save_freq=-1
  trainer.logger='["console"]'
  trainer.project_name=lopti-kk
  trainer.experiment_name="kk-$METHOD"
)
if [ "$METHOD" != grpo ]; then  # GRPO alone is verl's own config: none of our keys
  ARGS+=(
    # AR and Lopti: our policy-loss config, the 'ar' loss, Lopti's threshold (null: off); ++: an extra argument
    # may set them again
    $ACTOR.policy_loss._target_=openrlhf_lopti.verl.LoptiPolicyLossConfig
    $ACTOR.policy_loss.loss_mode=$LOSS
    ++$ACTOR.policy_loss.ar_alpha=$ALPHA
    ++$ACTOR.policy_loss.lopti_eta=$ETA
    ++$ACTOR.policy_loss.lopti_order=low_first
  )
fi

if [ -n "$CPU" ]; then
  TEMP_DIR=()
  if [ -z "${DRY_RUN:-}" ]; then
    # a private Ray temp dir (short: Ray's socket paths must stay under 108 characters), removed at exit
    RAY_TMP=$(mktemp -d /tmp/verl-ray-XXXXXX)
    trap 'rm -rf "$RAY_TMP"' EXIT
    TEMP_DIR=(--temp-dir "$RAY_TMP")
  fi
  # main_ppo's CPU overrides (openrlhf_lopti/verl/cpu_overrides.py, run by path: it imports nothing of verl)
  OVERRIDES=$("$PYTHON" -c 'import os, openrlhf_lopti as p; print(os.path.join(os.path.dirname(p.__file__), "verl"))')
  OVERRIDES=$OVERRIDES/cpu_overrides.py
  mapfile -t CPU_ARGS < <("$PYTHON" "$OVERRIDES" --ngpus "$NGPUS" "${TEMP_DIR[@]}")
  [ "${#CPU_ARGS[@]}" -gt 0 ] || { echo "CPU=1: cpu_overrides.py printed no overrides (NGPUS=$NGPUS)" >&2; exit 2; }
  ARGS+=(
    "${CPU_ARGS[@]}"
    # small defaults for a rehearsal: 2 RL steps of 2 prompts x 4 responses, 32 tokens, no validation
    data.train_batch_size=2
    data.max_prompt_length=512
    data.max_response_length=32
    actor_rollout_ref.rollout.n=4
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5
    $ACTOR.ppo_mini_batch_size=2
    $ACTOR.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    trainer.total_training_steps=2
    trainer.test_freq=-1
    trainer.val_before_train=false
  )
  export VERL_PLATFORM=cpu
fi

if [ -n "${DRY_RUN:-}" ]; then
  printf '%s\n' "${ARGS[@]}" "$@"
  exit 0
fi

if [ ! -f "$DATA/train.parquet" ]; then
  "$PYTHON" -m openrlhf_lopti data kk --out "$DATA"       # 900 train / 100 test puzzles per size, 3 to 7 people
  "$PYTHON" -m openrlhf_lopti.verl.data "$DATA"            # -> train.parquet, test.parquet
fi

if [ -n "$CPU" ]; then
  "$PYTHON" -m verl.trainer.main_ppo "${ARGS[@]}" "$@"      # not exec: the EXIT trap removes Ray's temp dir
else
  exec "$PYTHON" -m verl.trainer.main_ppo "${ARGS[@]}" "$@"
fi
