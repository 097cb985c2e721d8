#!/usr/bin/env bash
# The agentic job's tuning and the H200 small-math preset's reward check on one H100/H200, resumable
# across calls of at most ~10 minutes: each call works in WORKDIR (carry it to the next call) and
# archives WORKDIR into OUT/SECTION-work.tgz when it stops (so it comes back), finished or not.
#
# Usage: bench/gpu_agentic.sh SECTION WORKDIR OUT [SECONDS]
#   auto          rltune auto presets/h200-small-tool-use.yaml --trials 12, journal in WORKDIR/tool
#   math-reward   rltune reward-check of bench/results/auto-h200-d0ecb2c/tuned/small-math-h200.yaml's
#                 changes on presets/h200-small-math-learn.yaml, 80 steps, in WORKDIR/math-reward
# SECONDS (default 540): rltune is sent SIGTERM then, stops its run and leaves the journal to resume.
# Run the same command again with WORKDIR carried back: 'auto' resumes from its journal (a run cut
# off is run again under a new id); the reward check reuses every run it finished.
set -u
section=${1:?usage: bench/gpu_agentic.sh SECTION WORKDIR OUT [SECONDS]}
work=${2:?WORKDIR}; out=${3:?OUT}; budget=${4:-540}
mkdir -p "$work" "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
sha=${GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
{ echo "git $sha"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null;
  $py -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'; nproc; } >"$work/env-$section.txt"
t0=$(date +%s)
case $section in
  auto)
    timeout -s TERM -k 30 "$budget" $py -m rltune.cli.main auto presets/h200-small-tool-use.yaml --trials 12 \
      --rounds 6 --workdir "$work/tool" --tuned-dir "$work/tool/tuned" --no-live --json >"$work/tool-result.json" \
      2> >(tee -a "$work/tool-stderr.log" >&2)
    rc=$? ;;
  math-reward)
    $py bench/learning_variant.py --tuned bench/results/auto-h200-d0ecb2c/tuned/small-math-h200.yaml \
      --untuned presets/h200-small-math.yaml --learn presets/h200-small-math-learn.yaml \
      --out "$work/math-reward/tuned.yaml" || exit 2
    timeout -s TERM -k 30 "$budget" $py bench/reward_parity.py --tuned "$work/math-reward/tuned.yaml" \
      --against presets/h200-small-math-learn.yaml --steps 80 --out "$work/math-reward/check" \
      2> >(tee -a "$work/math-reward-stderr.log" >&2)
    rc=$? ;;
  *) echo "unknown section $section (auto, math-reward)"; exit 2 ;;
esac
echo "$section: rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$work/calls.log"
# What comes back: the work directory (journal, runs' stage tables and logs, tuned preset, report) as one
# archive (a device call returns a few files, not a tree), without weight files a run may have written
# (a filesystem or sparse-delta sync's checkpoints and broadcast store, the vLLM boot checkpoint).
tar -C "$work" --exclude=weights --exclude=broadcast --exclude=engine-boot --exclude='*.safetensors' \
  --exclude='*.delta' --exclude='*.anchor' -czf "$out/$section-work.tgz" .
cp "$work/calls.log" "$out/" 2>/dev/null
exit $rc
