#!/usr/bin/env bash
# Run the project's GPU tests and benchmarks on one CUDA machine, writing every record under OUT.
# Usage: bench/gpu_suite.sh OUT [SECTION ...]   sections: tests kernels codec syncbench workload (default: all)
# Each section runs even if an earlier one failed (each under SECTION_TIMEOUT seconds, default 600);
# the exit code says whether all passed.
set -u
out=${1:?usage: bench/gpu_suite.sh OUT [SECTION ...]}; shift
mkdir -p "$out"
sections=${*:-tests kernels codec syncbench workload}
sha=${GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=${PYTHON:-python3}
status=0
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  echo "=== $name: $*"
  timeout -k 10 "${SECTION_TIMEOUT:-600}" "$@" >"$out/$name.log" 2>&1; local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 )) s"; tail -n 25 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
}
for s in $sections; do
  case $s in
    tests) run gpu-tests $py -m pytest -q -m gpu -p no:cacheprovider tests ;;
    kernels) run sync-kernels $py bench/sync_kernels.py --git-sha "$sha" --out "$out/sync_kernels.json" ;;
    codec) run sync-codec $py bench/sync_codec.py --device cuda --model-size 0.6b --out "$out/sync_codec.json" ;;
    syncbench) run sync-bench $py -m rltune.cli.main sync-bench --preset h200 --out "$out/syncbench" ;;
    workload)
      for mode in sync one_step_async fully_async; do
        run "workload-$mode" $py -m rltune.cli.main workload run presets/workload/small-math.yaml \
          --steps 10 --run-dir "$out/workload-$mode" orchestrator.rl_mode=$mode
      done ;;
    *) echo "unknown section $s"; status=1 ;;
  esac
done
exit $status
