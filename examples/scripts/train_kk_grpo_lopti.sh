#!/usr/bin/env bash
# Knights & Knaves, GRPO + Lopti (eta = 0.5: tokens with p_old < 0.5 are updated first, then the rest).
set -euo pipefail
RUN_NAME=${RUN_NAME:-kk_grpo_lopti} exec bash "$(dirname "$0")/train_kk_grpo.sh" \
  --algo.lopti.eta 0.5 \
  --algo.lopti.order low_first \
  --actor.fused_loss auto \
  "$@"
