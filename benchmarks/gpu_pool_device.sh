#!/usr/bin/env bash
# One call on the lent GPU box (no Ray, no pydantic/fastapi/uvicorn: carried as wheels in .whl):
#   bash benchmarks/gpu_pool_device.sh STAGE...    stages: tests, pool, link, probe, share, mps, decode, mpsdecode, alone, copyhol, light, heavy, calibrate, tp (two GPUs), RATE=<r>,
#   BACKENDS=<a,b>; on two GPUs, GPUS_ARG='--gpus 2' gives light/heavy the prefill-GPU + decode-GPU layout
# The pool stage serves as a user would: engine processes sharing the GPU run under a private MPS daemon (serve's
# default); MPS=0 serves with --no-mps (time-sliced), MPS=1 with --mps (an error where no daemon can start).
# HOST_PROFILE_S=<s>: the pool stage samples each engine process's host time (pyinstrument, carried in .whl);
# SLOW_CALL_MS=<ms>: the stacks of engine calls slower than that (pool.procs.SlowCalls).
# `calibrate pool` with PROFILE=calibrated: calibrate on this GPU, then serve with that profile.
# `pool` is the issues-16/17 run (BACKENDS='processes threads', RATES='1 10' req/s, ~6 min; STANDALONE=' ' times the
# engine's own prefill at the live lengths too; compare with the simulator afterwards on
# the saved traces, benchmarks/gpu_pool_sim.py); PROFILE=<file> gives serve a calibration profile.
# Results go to $OUT (gpu_pool-<stage>.tgz and the logs' tails). The calibrate stage also needs typer, rich,
# click, shellingham, markdown-it-py, mdurl and pygments as wheels (download them into .whl as for the others).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used,utilization.gpu --format=csv,noheader
df -h /dev/shm | tail -1; free -g | sed -n 2p; nproc
DUR=${DUR:-40}
under_mps() {  # run "$@" with it and what it starts as clients of a private MPS daemon (pool.mps), quit after
  python3 -c "import os, sys; from pool.mps import MpsDaemon
with MpsDaemon() as env: os.environ.update(env); sys.exit(os.spawnvp(os.P_WAIT, sys.argv[1], sys.argv[1:]))" "$@"
}
pack() { tar czf "$OUT/gpu_pool-$1.tgz" -C "/tmp/gp-$1" --exclude models . 2>/dev/null; }  # plan logs kept: turns, hand-offs
for stage in "$@"; do
  case $stage in
    tests)  # MPS=1: pytest and the processes it starts as clients of a private MPS daemon (CUDA IPC between them)
      $([ "${MPS:-}" = 1 ] && echo under_mps) timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -m '' -k cuda ${PYTEST_ARGS:-} \
        ${TEST_FILES:-tests/pool/test_torch_engine.py tests/pool/test_kv_transfer.py tests/pool/test_fused_decode.py tests/pool/test_processes.py} 2>&1 | tail -30 ;;
    link)  # how the GPU's host link serves two instances' copies at once (benchmarks/gpu_link_share.py): engine
      # processes under MPS (serve's default), time-sliced, and two threads of one process
      under_mps timeout ${PROBE_S:-200} python3 benchmarks/gpu_link_share.py --out "$OUT/link_share_mps.json" 2>&1 | tail -6
      timeout ${PROBE_S:-200} python3 benchmarks/gpu_link_share.py --out "$OUT/link_share.json" 2>&1 | tail -1
      timeout ${PROBE_S:-200} python3 benchmarks/gpu_link_share.py --threads --out "$OUT/link_share_threads.json" 2>&1 | tail -1
      ;;
    pool)
      [ "${PROFILE:-}" = calibrated ] && PROFILE="$OUT/measured.json"  # the calibrate stage's, run before
      timeout ${POOL_S:-450} python3 benchmarks/gpu_pool.py --out /tmp/gp-pool $(for b in ${BACKENDS:-processes threads}; do echo --backend $b; done) \
        --layout pd $(for r in ${RATES:-1 10}; do echo --rate $r; done) --duration 30 --request-timeout 60 ${STANDALONE:---no-standalone} --no-sim ${HOST_PROFILE_S:+--host-profile-s $HOST_PROFILE_S} ${SLOW_CALL_MS:+--slow-call-ms $SLOW_CALL_MS} \
        ${PROFILE:+--serve-arg=--profile --serve-arg=$PROFILE} $(case ${MPS:-} in 1) echo --serve-arg=--mps;; 0) echo --serve-arg=--no-mps;; esac) 2>&1 | grep -v '^   {' ; pack pool ;;
    light)
      timeout ${LIGHT_S:-330} python3 benchmarks/gpu_pool.py --out /tmp/gp-light --backend processes --backend threads --layout pd \
        --rate 1 --duration "$DUR" ${GPUS_ARG:-} 2>&1 | grep -v '^   {' ; pack light ;;
    heavy)
      timeout ${HEAVY_S:-200} python3 benchmarks/gpu_pool.py --out /tmp/gp-heavy --backend ${HEAVY_BACKENDS:-processes} \
        --rate ${RATE:-8} --duration "$DUR" ${GPUS_ARG:-} 2>&1 | grep -v '^   {' ; pack heavy ;;
    probe)  # prefill alone, beside a decoding process, beside a process that only copies weights, beside a thread
      timeout ${PROBE_S:-300} python3 benchmarks/gpu_prefill_probe.py --out "$OUT/prefill_probe.json" 2>&1 | tail -12 ;;
    share)  # prefill alone, beside a decoding process (how instances on one GPU slow each other)
      timeout ${PROBE_S:-200} python3 benchmarks/gpu_prefill_probe.py --share --out "$OUT/prefill_share.json" 2>&1 | tail -4 ;;
    mps)  # the share stage under CUDA MPS (a private control daemon, quit after): do the two processes still time-slice?
      under_mps timeout ${PROBE_S:-200} python3 benchmarks/gpu_prefill_probe.py --share --out "$OUT/prefill_share_mps.json" \
        2>&1 | tail -4 ;;
    decode)  # decode steps alone and beside a prefilling process, time-sliced (--no-mps)
      timeout ${PROBE_S:-200} python3 benchmarks/gpu_prefill_probe.py --decode-share --out "$OUT/decode_share.json" \
        2>&1 | tail -4 ;;
    mpsdecode)  # the same under MPS, the prefilling process limited to each of SM_PCTS percent of the SMs in turn
      # (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE): does a cap keep the decode step beside a prefill from slowing 3x?
      under_mps timeout ${PROBE_S:-300} python3 benchmarks/gpu_prefill_probe.py --decode-share \
        $(for p in ${SM_PCTS:-100 70 40}; do echo --sm-percent $p; done) --out "$OUT/decode_share_mps.json" 2>&1 | tail -8 ;;
    alone)  # prefill alone: the fused kernels against the torch ops, fresh lengths and again
      timeout ${PROBE_S:-200} python3 benchmarks/gpu_prefill_probe.py --alone --out "$OUT/prefill_alone.json" 2>&1 | tail -4 ;;
    copyhol)  # does a weight copy hold up a step's inputs? copies behind whole or yielding weight copies, mapped reads
      timeout 120 python3 benchmarks/gpu_copy_hol.py --gb 8 --out "$OUT/copy_hol.json" \
        $(for m in ${SWAP_MB:-}; do echo --swap-mb $m; done) 2>&1 | tail -40 ;;
    tp)  # two GPUs (issue 21): the torch engine at TP1 and TP2, NCCL
      timeout ${TP_S:-550} python3 benchmarks/gpu_tp.py --out "$OUT/h200x2-tp.json" ${TP_ARGS:-} 2>&1 | tail -40 ;;
    calibrate)  # `modelpool calibrate` on this GPU (CAL_ARGS=--quick for a smoke run); `PROFILE=calibrated` has the
      # pool stage serve with the measurements file written here
      timeout ${CAL_S:-400} python3 -m modelpool.cli calibrate --device cuda --out "$OUT/measured.json" ${CAL_ARGS:-} \
        2>&1 | tail -40 ;;
  esac
done
for f in /tmp/gp-*/serve-*.log; do [ -f "$f" ] && { echo "== $f"; grep -iE "error|Traceback|lost|restart" "$f" | head -5; }; done
