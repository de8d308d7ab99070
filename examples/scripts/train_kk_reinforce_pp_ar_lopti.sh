#!/usr/bin/env bash
# Knights & Knaves, REINFORCE++ (paper Appendix D) + AR + Lopti. Same setting as train_kk_grpo.sh except the
# advantage: rewards normalised over the whole batch (upstream's `reinforce` estimator), with the k1 KL folded
# into the reward instead of a loss term. Drop the --algo.ar.alpha / --algo.lopti.eta lines for the baseline.
set -euo pipefail
KL_IN_REWARD=1 RUN_NAME=${RUN_NAME:-kk_reinforce_pp_ar_lopti} exec bash "$(dirname "$0")/train_kk_grpo.sh" \
  --algo.advantage.estimator reinforce \
  --algo.ar.alpha 0.3 \
  --algo.lopti.eta 0.5 \
  --actor.fused_loss auto \
  "$@"
