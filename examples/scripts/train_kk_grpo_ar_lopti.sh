#!/usr/bin/env bash
# Knights & Knaves, GRPO + AR + Lopti: the paper's best K&K setting (alpha = 0.3, eta = 0.5).
set -euo pipefail
RUN_NAME=${RUN_NAME:-kk_grpo_ar_lopti} exec bash "$(dirname "$0")/train_kk_grpo.sh" \
  --algo.ar.alpha 0.3 \
  --algo.lopti.eta 0.5 \
  --actor.fused_loss auto \
  "$@"
