#!/usr/bin/env bash
# One GPU session in few device calls (recipe: ../shared/gpu/README.md; wheels in .whl/, sent with `carry`).
#   BUDGET_S=540 bash benchmarks/gpu_session.sh peer8b,peer17b,tests    # RoundPipe side by side + profiler traces
#   BUDGET_S=540 bash benchmarks/gpu_session.sh seqlen,tests,resident
#   BUDGET_S=420 bash benchmarks/gpu_session.sh capped
# Every step has its own time limit and writes under its own folder as it goes, packed into $OUT/STEP.tgz when it
# ends (the device tool brings back at most 8 files: one archive a step), so a call cut short keeps what it measured.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RPCOMPILE_CACHE=${RPCOMPILE_CACHE:-/tmp/rpcompile-cache}
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
# BUDGET_S: seconds this call may take in all; each step's own limit is cut to what is left of it
deadline=$(( $(date +%s) + ${BUDGET_S:-100000} ))
lim() { local left=$(( deadline - $(date +%s) )); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }
# each trace in DIR: its table (TRACE.table.json) and a slim gzipped copy (TRACE.slim.json.gz) that travel home; the
# full trace is kept gzipped only if the slim one could not be made
slim() {
  for t in "$1"/*.json; do
    [ -e "$t" ] || continue
    timeout 120 python3 benchmarks/trace_table.py "$t" --slim "${t%.json}.slim.json.gz" --json "${t%.json}.table.json" \
      >"${t%.json}.table.txt" 2>&1 && rm -f "$t" || gzip -f "$t"
  done
}
# pack STEP DIR: the files step STEP wrote (its folder DIR) as one archive $OUT/STEP.tgz; the folder goes
pack() {
  [ -n "$(ls -A "$2" 2>/dev/null)" ] && tar czf "$OUT/$1.tgz" -C "$2" . && rm -rf "$2"
}
WORK=${WORK:-/tmp/gpu-work}
for step in ${1//,/ }; do
  start=$(date +%s)
  W=$WORK/$step; mkdir -p "$W"
  case $step in
    tests) timeout $(lim 220) python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 >"$W/pytest-gpu.txt" 2>&1
           echo "pytest -m gpu rc=$?"; tail -25 "$W/pytest-gpu.txt" ;;
    retest) timeout $(lim 90) python3 -m pytest -q -m gpu -p no:cacheprovider -k "trains_like_eager" >"$W/pytest-retest.txt" 2>&1
            echo "pytest -m gpu -k trains_like_eager rc=$?"; tail -5 "$W/pytest-retest.txt" ;;
    resident) timeout $(lim 240) python3 benchmarks/gpu.py --sections link,resident --out "$W/gpu-resident.json" \
                >"$W/gpu-resident.txt" 2>&1; echo "resident rc=$?"; tail -30 "$W/gpu-resident.txt" ;;
    seqlen) timeout $(lim 110) python3 benchmarks/gpu.py --sections seqlen --out "$W/gpu-seqlen.json" \
              >"$W/gpu-seqlen.txt" 2>&1; echo "seqlen rc=$?"; tail -15 "$W/gpu-seqlen.txt" ;;
    # rpcompile and the real RoundPipe side by side under the 20 GiB cap, one process a shape, with a profiler trace
    # of one steady rpcompile step (gzipped: the trace directory comes home)
    peer8b) timeout $(lim 330) python3 benchmarks/gpu.py --sections capped --peer roundpipe --steps 3 \
              --profile "$W/traces-8b" --out "$W/gpu-peer-8b.json" >"$W/gpu-peer-8b.txt" 2>&1
            echo "peer8b rc=$?"; slim "$W/traces-8b"; tail -20 "$W/gpu-peer-8b.txt" ;;
    peer17b) timeout $(lim 200) python3 benchmarks/gpu.py --sections capped --peer roundpipe --steps 3 \
               --capped-model llama-1.7b --capped-batch 8 --capped-seq 2048 \
               --profile "$W/traces-1.7b" --out "$W/gpu-peer-1.7b.json" >"$W/gpu-peer-1.7b.txt" 2>&1
             echo "peer17b rc=$?"; slim "$W/traces-1.7b"; tail -20 "$W/gpu-peer-1.7b.txt" ;;
    trace8b) timeout $(lim 300) python3 benchmarks/gpu.py --sections capped --steps 1 --optimizer none \
               --profile "$W/traces-8b" --out "$W/gpu-trace-8b.json" >"$W/gpu-trace-8b.txt" 2>&1
             echo "trace8b rc=$?"; slim "$W/traces-8b"; tail -6 "$W/gpu-trace-8b.txt" ;;
    capped) timeout $(lim 420) python3 benchmarks/gpu.py --sections capped --steps 2 --out "$W/gpu-capped.json" \
              >"$W/gpu-capped.txt" 2>&1; echo "capped rc=$?"; tail -20 "$W/gpu-capped.txt" ;;
  esac
  pack "$step" "$W"
  echo "step $step: $(( $(date +%s) - start )) s"
done
