"""Is a host-bound prefill's time the host CPU's? One engine (as calibrate builds it, one small shape of a scenario's
fleet) prefills the same prompt length back to back, call by call, under: no affinity (as the pool runs its
engine processes), pinned to one core, pinned beside a busy process on another core, pinned with a busy process
on the same core; and after idle gaps, pinned and not. Each call's time and the core it ran on (/proc/self/stat),
so a bimodal series shows whether it follows the core; the machine's CPU topology and frequency governor too.

    python benchmarks/prefill_host_cpu.py --out host_cpu.json            # on the GPU machine
    python benchmarks/prefill_host_cpu.py --tiny --out /tmp/h.json        # anywhere
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_prefill_served import _request, _sync, calibrate_spec, served_spec  # noqa: E402
from pool.actor import make_engine  # noqa: E402


def _core() -> int:
    """The core this process last ran on (field 39 of /proc/self/stat)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def _spin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        pass


def _machine() -> dict[str, Any]:
    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "CPU(s)", "CPU max MHz",
            "NUMA node(s)", "Hypervisor vendor")
    return {"lscpu": {line.split(":")[0].strip(): line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                      if line.split(":")[0].strip() in keep},
            "governor": read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
            "siblings": read("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list"),
            "affinity": sorted(os.sched_getaffinity(0))}


def series(engine: Any, model: str, tokens: int, calls: int, gap_s: float, rng: Any) -> dict[str, Any]:
    times, cores = [], []
    for _ in range(calls):
        request = _request(model, tokens, rng)
        _sync()
        if gap_s > 0:
            time.sleep(gap_s)
        elif gap_s < 0:  # a gap as long, spent spinning: the core never idles
            until = time.perf_counter() - gap_s
            while time.perf_counter() < until:
                pass
        t0 = time.perf_counter()
        engine.prefill([request])
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
        cores.append(_core())
        engine.release([request.request_id])
    q = statistics.quantiles(times, n=10)
    return {"ms_p10": round(q[0], 2), "ms_p50": round(statistics.median(times), 2), "ms_p90": round(q[-1], 2),
            "cores": sorted(set(cores)), "ms": [round(t, 2) for t in times], "on": cores}


def main() -> None:
    import random

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="small-azure-code")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from modelpool.validate import machine

    tiny = args.tiny or machine()[0] == 0
    out: dict[str, Any] = {"machine": _machine(), "tokens": args.tokens, "runs": []}
    cpus = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        served, paths, shapes, _ = served_spec(args.scenario, Path(folder), tiny)
        shape, model = next(iter(shapes.items()))
        engine = make_engine(calibrate_spec(served, (256 << 20) if tiny else (4 << 30)))
        engine.load(model, Path(paths[model]))
        engine.warm_up(args.tokens + 64)
        engine.activate(model)
        rng = random.Random(0)
        series(engine, model, args.tokens, 5, 0.0, rng)  # first touch
        mine, other = cpus[-1], cpus[len(cpus) // 2] if len(cpus) > 1 else cpus[0]
        conditions = [("no affinity", None, None, 0.0), ("pinned", mine, None, 0.0),
                      ("pinned, busy core beside", mine, other, 0.0), ("pinned, busy same core", mine, mine, 0.0),
                      ("no affinity, 1 ms gaps", None, None, 0.001), ("no affinity, 10 ms gaps", None, None, 0.01),
                      ("no affinity, 100 ms gaps", None, None, 0.1), ("pinned, 100 ms gaps", mine, None, 0.1),
                      ("no affinity, 100 ms spun gaps", None, None, -0.1),
                      ("no affinity again", None, None, 0.0)]
        for name, pin, busy, gap in conditions:
            os.sched_setaffinity(0, {pin} if pin is not None else set(cpus))
            spinner = None
            if busy is not None:
                spinner = ctx.Process(target=_spin, args=(busy,), daemon=True)
                spinner.start()
                time.sleep(0.5)
            try:
                run = series(engine, model, args.tokens, args.calls if abs(gap) < 0.05 else args.calls // 2, gap, rng)
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.join()
            out["runs"].append({"condition": name, "shape": shape, **run})
            print(f"{name:<28} {shape} {args.tokens} tokens: p10 {run['ms_p10']:7.2f}  p50 {run['ms_p50']:7.2f}  "
                  f"p90 {run['ms_p90']:7.2f} ms  cores {run['cores'][:8]}", flush=True)
        os.sched_setaffinity(0, set(cpus))
        engine.close()
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["machine"]))


if __name__ == "__main__":
    main()
