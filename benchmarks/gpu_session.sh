#!/usr/bin/env bash
# One GPU session, one command, one report (issues 34, 44): what this project must measure on a GPU, in at most
# 7 minutes, each step under its own time budget; a failed or timed-out step prints its first error line and the
# session goes on to the next.
#
#   benchmarks/gpu_session.sh --dry-run        # list the steps and their budgets (anywhere, nothing runs)
#   benchmarks/gpu_session.sh --fetch-wheels   # HERE, with internet: the wheels the GPU image lacks -> .gpu-wheels/
#   benchmarks/gpu_session.sh                  # ON THE GPU MACHINE, from the repository root
#
# With the device tool, after --fetch-wheels here: run(command="GPU_SESSION_COMMIT=<git rev-parse --short HEAD here>
# bash benchmarks/gpu_session.sh", carry=[".gpu-wheels"], timeout_s=540): the steps take at most 420 s, the checks,
# the wheels' install and the bundling before and after them some 20 more (a timeout_s of 420 cuts the end off).
# The device's copy of the tree has commits of its own: GPU_SESSION_COMMIT names the one the report is of.
# The image (Python 3.12, torch 2.11, Triton 3.6, transformers 5.17, accelerate; no internet) lacks trl, datasets
# (+ dill, multiprocess), liger-kernel and openrlhf (+ pylatexenc, which its loss module imports): --fetch-wheels
# downloads them with --no-deps into the
# git-ignored .gpu-wheels/, and the session installs them into a temporary --target before its first step.
# Without CUDA it refuses in one line (exit 2). Logs and JSON go to $OUT when set (the device tool's folder that
# comes back), else to a temporary folder; the report is what it prints.
#
# Environment: PYTHON (default python3), GPU_SESSION_BUDGET_S (the session's total, default 420), WHEELS (default
# .gpu-wheels), GPU_SESSION_COMMIT (the commit to name in the report; default: the copy's own HEAD, said as such).
set -u

cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.gpu-wheels}
BUDGET=${GPU_SESSION_BUDGET_S:-420}
WHEEL_PINS=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5 openrlhf==0.11.2 pylatexenc==3.0a33 cut-cross-entropy==25.1.1)

# name | budget s | command (run by bash from the repository root, $PYTHON and $LOGS set). Issue 44's table: the loss
# head (ours three ways, Liger, OpenRLHF's eager loss, the torch reference), the fused lm_head against the logits
# path, Liger's fused linear GRPO loss and Cut Cross-Entropy at H = 896 and 4096, and TRL steps at Qwen2.5-0.5B's
# shapes. 420 s in all: one device call of at most 7 minutes, with time left to rerun it. The budgets follow the H100
# session of 2026-11-28 (probe: 20 s was cut off at its exit; check-gpu took 10 s, loss-head 21 s, five TRL variants
# 106 s; the lm_head steps now run their paths in one process) and what was added since (rows, a TRL warm-up).
STEPS=(
  "probe|40|\$PYTHON -m benchmarks.gpu_steps probe"
  "check-gpu|30|\$PYTHON -m openrlhf_lopti check-gpu --no-bench --quick"
  "loss-head|75|\$PYTHON -m benchmarks.gpu_steps loss-head --n 8192 --v 151936 --json \$LOGS/loss_head.json"
  "lm-head-h896|55|\$PYTHON benchmarks/bench_memory.py --device cuda --n 16384 --h 896 --paths logits_kernel,fused_linear,liger_flce,cce --entropy-coef 0 --repeats 3 --json \$LOGS/lm_head_h896.json --overwrite"
  "lm-head-h4096|60|\$PYTHON benchmarks/bench_memory.py --device cuda --n 16384 --h 4096 --paths logits_kernel,fused_linear,liger_flce,cce --entropy-coef 0 --repeats 3 --json \$LOGS/lm_head_h4096.json --overwrite"
  "trl-shapes|160|\$PYTHON -m benchmarks.gpu_steps trl-shapes --json \$LOGS/trl_shapes.json"
)

# Tests only: GPU_SESSION_STEPS_FILE replaces the steps (one "name|budget|command" a line), GPU_SESSION_ASSUME_CUDA=1
# skips the CUDA check, GPU_SESSION_MIN_STEP_S (default 15) is the least budget a step is started with, and
# GPU_SESSION_CLOCK_FILE names a file holding the session's clock in whole seconds, read in place of bash's SECONDS
# (the test's steps advance it, so what the budget lets run does not depend on how busy the machine is).
if [[ -n ${GPU_SESSION_STEPS_FILE:-} ]]; then
  mapfile -t STEPS <"$GPU_SESSION_STEPS_FILE"
fi
MIN_STEP=${GPU_SESSION_MIN_STEP_S:-15}
now() {
  if [[ -n ${GPU_SESSION_CLOCK_FILE:-} ]]; then cat "$GPU_SESSION_CLOCK_FILE"; else echo "$SECONDS"; fi
}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }  # the header above

case "${1:-}" in
  --dry-run)
    echo "gpu_session: dry run: ${#STEPS[@]} steps, session budget ${BUDGET} s (each step: its budget or what is left)"
    for step in "${STEPS[@]}"; do
      IFS='|' read -r name budget command <<<"$step"
      printf '  %-16s %4s s  %s\n' "$name" "$budget" "$command"
    done
    echo "  (before the steps: install ${WHEELS}/*.whl, if any, into a temporary --target; PYTHONPATH=that:repo)"
    exit 0 ;;
  --fetch-wheels)
    mkdir -p "$WHEELS"
    exec "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d "$WHEELS" "${WHEEL_PINS[@]}" ;;
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) echo "gpu_session: unknown argument ${1}: use --dry-run, --fetch-wheels or nothing (see --help)"; exit 2 ;;
esac

if [[ ${GPU_SESSION_ASSUME_CUDA:-} == 1 ]]; then
  cuda="True (assumed by GPU_SESSION_ASSUME_CUDA, tests only)"
else
  # stderr apart: a warning printed at torch's import must not stand before the answer (the last line of stdout)
  errors=$(mktemp -t gpu_session_check-XXXXXX)
  if ! cuda=$("$PYTHON" -c 'import torch; print(torch.cuda.is_available(), torch.__version__)' 2>"$errors"); then
    echo "gpu_session: refusing: torch does not import with $PYTHON ($(tail -n1 "$errors")); --dry-run lists the steps"
    exit 2
  fi
  cuda=$(tail -n1 <<<"$cuda")
fi
if [[ $cuda != True* ]]; then
  echo "gpu_session: refusing: no CUDA device visible to torch ${cuda#* } on this machine; --dry-run lists the steps"
  exit 2
fi

START=$(now)
LOGS=${OUT:-$(mktemp -d -t gpu_session-XXXXXX)}
mkdir -p "$LOGS"
REPORT=$LOGS/gpu_session.log
# The step logs stay out of $LOGS, bundled into it after each step: the device tool brings back at most 8 files from
# $OUT (the report, 4 JSON files and the bundle), also when the call is cut short.
STEP_LOGS=$(mktemp -d -t gpu_session_logs-XXXXXX)
bundle_logs() { [[ -n ${OUT:-} ]] && tar -czf "$LOGS/step_logs.tgz" -C "$STEP_LOGS" . 2>/dev/null; return 0; }
export PYTHON LOGS PYTHONUNBUFFERED=1 OPENRLHF_LOPTI_NO_JIT=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
say() { echo "$*" | tee -a "$REPORT"; }

gpu=$(nvidia-smi -L 2>/dev/null | head -n1)
commit=${GPU_SESSION_COMMIT:-"$(git rev-parse --short HEAD 2>/dev/null || echo '?') (this copy's HEAD: GPU_SESSION_COMMIT unset)"}
say "gpu_session: $(date -u +%FT%TZ), ${gpu:-nvidia-smi: none}, commit ${commit}, budget ${BUDGET} s"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=$(mktemp -d -t gpu_session_site-XXXXXX)
  if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl >"$STEP_LOGS/wheels.log" 2>&1; then
    export PYTHONPATH="$SITE:$PYTHONPATH"
    say "wheels: installed $(ls "$WHEELS"/*.whl | wc -l) from $WHEELS into $SITE"
  else
    say "wheels: install FAILED: $(grep -m1 -iE 'error' "$STEP_LOGS/wheels.log" || tail -n1 "$STEP_LOGS/wheels.log")"
  fi
else
  say "wheels: none in $WHEELS (trl / liger-kernel / openrlhf steps will say what they miss; see --fetch-wheels)"
fi

failed=0
for step in "${STEPS[@]}"; do
  IFS='|' read -r name budget command <<<"$step"
  left=$((BUDGET - ($(now) - START)))
  ((budget > left)) && budget=$left
  if ((budget < MIN_STEP)); then
    say "== $name: SKIPPED (session budget spent: ${left} s left)"
    failed=$((failed + 1))
    continue
  fi
  say "== $name (budget ${budget} s): $command"
  log=$STEP_LOGS/step_${name}.log
  t0=$(now)
  timeout --kill-after=5 "$budget" bash -c "$command" >"$log" 2>&1
  rc=$?
  grep -vE '^\s*$|it/s\]|s/it\]|%\|' "$log" | tail -n 40 | tee -a "$REPORT"
  if ((rc == 124 || rc == 137)); then
    say "== $name: TIMED OUT after ${budget} s; first error line: $(grep -m1 -E 'Error|error:|Exception' "$log" || echo none)"
    failed=$((failed + 1))
  elif ((rc != 0)); then
    say "== $name: FAILED (exit $rc) after $(($(now) - t0)) s; first error line: $(grep -m1 -E 'Error|error:|Exception|FAILED' "$log" || tail -n1 "$log")"
    failed=$((failed + 1))
  else
    say "== $name: ok in $(($(now) - t0)) s"
  fi
  bundle_logs
done
where=$([[ -n ${OUT:-} ]] && echo "$LOGS (step logs in step_logs.tgz)" || echo "$LOGS, step logs in $STEP_LOGS")
say "gpu_session: done in $(($(now) - START)) s, ${failed} of ${#STEPS[@]} steps failed, skipped or timed out; logs in $where"
exit $((failed > 0))
