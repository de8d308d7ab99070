#!/usr/bin/env bash
# Knights & Knaves, GRPO + Advantage Reweighting (alpha = 0.3, the paper's K&K value).
set -euo pipefail
RUN_NAME=${RUN_NAME:-kk_grpo_ar} exec bash "$(dirname "$0")/train_kk_grpo.sh" \
  --algo.ar.alpha 0.3 \
  --actor.fused_loss auto \
  "$@"
