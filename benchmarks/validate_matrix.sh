#!/usr/bin/env bash
# The held-out validation matrix on the lent GPU (issue 34 items 3-4), one call:
#   bash benchmarks/validate_matrix.sh [SCENARIO...]     (default: one scenario of each fleet)
# Each scenario is `modelpool validate SCENARIO` at a light load and near the simulated knee: served live on this
# GPU, replayed through the gateway, simulated on the same requests, side by side; its JSON is copied to $OUT.
# The box has no pydantic/fastapi/uvicorn/typer/rich: carry them as wheels in .whl (docs/gpu.md). The trace
# scenarios read azure-llm-2023/ from $MODELPOOL_TRACES (carry a folder holding it; without it they stop, saying so).
# CALIBRATE=1: `modelpool calibrate --device cuda` first ($CAL_ARGS, default --quick), and validate with its file;
# PROFILE=<file or shipped name>: validate with that one. DUR: seconds of arrivals per load (15); MAX_OUT: outputs
# clipped to this many tokens (512), so each run drains soon after its last arrival; PER_S: a scenario's time limit;
# EXTRA: more `modelpool validate` options (on CPU: EXTRA='--rate 1 --load light').
# $OUT/serve-logs.tgz keeps what a later diagnosis needs, per scenario: serve.log, the live Plan log
# (serve.plans.jsonl; each load's lines are the JSON's live_plans range; live_status: /pool/status's instances before and
# after each load - the KV capacity the scheduler planned with, the engines' stats), the simulated Plan logs
# (sim-LOAD.plans.jsonl) and the JSON (per-request rows live and simulated, side by side); the models are left out.
set -u
if [ -z "${NO_WHEELS:-}" ]; then  # NO_WHEELS=1: a machine that has the packages (a CPU try of the same script)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no GPU: tiny shapes on CPU"
profile=()
if [ "${CALIBRATE:-0}" = 1 ]; then
  timeout "${CAL_S:-150}" python3 -m modelpool.cli calibrate --device cuda ${CAL_ARGS:---quick} --out "$OUT/measured.json" \
    2>&1 | tail -20
  [ -f "$OUT/measured.json" ] && profile=(--profile "$OUT/measured.json")
fi
[ -n "${PROFILE:-}" ] && profile=(--profile "$PROFILE")
for s in ${*:-eight-poisson mixed-onoff large-azure-conv small-azure-code}; do
  started=$(date +%s)
  timeout "${PER_S:-240}" python3 -m modelpool.cli validate "$s" --duration "${DUR:-15}" --max-output "${MAX_OUT:-512}" \
    --request-timeout "${REQ_S:-40}" "${profile[@]}" ${EXTRA:-} --out "/tmp/validate/$s" 2>&1
  echo "== $s: $(( $(date +%s) - started )) s"
  cp "/tmp/validate/$s/$s.json" "$OUT/" 2>/dev/null
  grep -iE "error|Traceback|lost|restart" "/tmp/validate/$s/serve.log" | head -5
done
tar czf "$OUT/serve-logs.tgz" -C /tmp/validate --exclude 'models-*' . 2>/dev/null
