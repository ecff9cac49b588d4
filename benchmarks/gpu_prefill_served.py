"""Why a served prefill call takes longer than calibrate's: the same prompts prefilled by the torch engine built
as `modelpool calibrate` builds it, as `modelpool serve` builds it for a scenario's fleet (same options, same
models), and in an engine process under MPS called over the pool's pipe (the processes backend serve uses) -
back to back and after idle gaps. Session 27 found the pool's prefill calls 1.7-1.8x calibrate's points for the
small shapes (0.5B: 16 ms at <= 512 tokens where calibrate timed 9.1 ms at 256); this says which of the engine's
options, the process and MPS, or the idle device between calls makes the difference.

    python benchmarks/gpu_prefill_served.py --out served.json                  # on the GPU
    python benchmarks/gpu_prefill_served.py --tiny --out /tmp/served.json      # anywhere (tiny shapes, CPU)

Per variant, shape and prompt length: the engine's own time for the call (its timings, as /pool/status shows
them) and, in process, the wall time around it (synchronised); for the process variant the time from the call's
send to its answer at the backend's poll. A table on stdout, everything in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from modelpool.validate import PROMPT_VOCAB, build_fleet, machine  # noqa: E402
from benchmarks.gpu_prefill_probe import profile_one  # noqa: E402
from pool.actor import EngineSpec, make_engine  # noqa: E402
from pool.calls import Activate, GetStats, Prefill, Release  # noqa: E402
from pool.engines.base import GenRequest, SamplingParams  # noqa: E402

GiB = 1 << 30
_ids = iter(range(1, 1 << 30))


def _request(model: str, tokens: int, rng: random.Random) -> GenRequest:
    prompt = tuple(rng.randrange(10, PROMPT_VOCAB) for _ in range(tokens))  # as validate's replay draws them
    return GenRequest(f"r{next(_ids)}", model, prompt, SamplingParams(max_tokens=2, ignore_eos=True))


def served_spec(scenario: str, folder: Path, tiny: bool) -> tuple[EngineSpec, dict[str, str], dict[str, str], int]:
    """The engine `modelpool serve` runs for `scenario`'s fleet on this machine (the prefill instance's: it stages
    hand-offs in its arena): its spec, the models' folders, one
    model per shape (shape -> model) and the pool's max_prefill_tokens."""
    from modelpool.config import load_fleet
    from modelpool.deploy import fleet_deployment
    from sims.scenarios import scenario as find

    spec = find(scenario)
    gpu = machine()[1]  # from nvidia-smi: no CUDA context here before the process variant's MPS daemon
    fleet_path = build_fleet(spec.fleet_spec(), folder, gpu, tiny=tiny)
    dep = fleet_deployment(fleet_path, "torch", 0 if tiny else 1, None, "token-level", None)
    fleet = load_fleet(fleet_path)
    by_shape: dict[str, str] = {}
    for name, arch_key in spec.fleet_spec().models:
        by_shape.setdefault(arch_key, name)
    paths = {m.name: str(m.path) for m in dep.models}
    return dep.engine, paths, by_shape, fleet.pool.max_prefill_tokens


def calibrate_spec(served: EngineSpec, kv_bytes: int) -> EngineSpec:
    """The engine as calibrate builds it (modelpool.measure.MeasureRun._engine): the device, a KV region sized for
    its own points, prefill warmed to the same length, no shared weights region, no hand-off arena."""
    keep = ("device", "dtype", "warm_prefill_tokens", "graph_batch_sizes")
    return EngineSpec("torch", {k: v for k, v in served.options.items() if k in keep} | {"kv_bytes": kv_bytes})


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def in_process(name: str, spec: EngineSpec, paths: dict[str, str], shapes: dict[str, str], lengths: list[int],
               gaps: list[float], repeats: int, max_tokens: int, profile_len: int) -> dict[str, Any]:
    """The engine in this process: per shape, length and idle gap, `repeats` prefills (after one untimed)."""
    started = time.perf_counter()
    engine = make_engine(spec)
    for model in shapes.values():
        engine.load(model, Path(paths[model]))
    engine.warm_up(max_tokens)
    out: dict[str, Any] = {"variant": name, "options": {k: str(v) for k, v in spec.options.items()},
                           "start_s": round(time.perf_counter() - started, 2), "points": []}
    rng = random.Random(0)
    for shape, model in shapes.items():
        engine.activate(model)
        for tokens in lengths:
            for gap in gaps:
                walls, inside = [], []
                for i in range(repeats + 1):
                    request = _request(model, tokens, rng)
                    _sync()
                    time.sleep(gap)
                    t0 = time.perf_counter()
                    engine.prefill([request])
                    _sync()
                    wall = time.perf_counter() - t0
                    engine.release([request.request_id])
                    if i:
                        walls.append(wall)
                        inside.append(engine.timings.prefills[-1][3])
                out["points"].append({"shape": shape, "tokens": tokens, "gap_s": gap,
                                      "wall_ms": round(statistics.median(walls) * 1e3, 3),
                                      "engine_ms": round(statistics.median(inside) * 1e3, 3)})
        if profile_len:  # one more prefill under torch.profiler: host ops, kernels, device time
            out.setdefault("profile", {})[shape] = profile_one(engine, model, profile_len,
                                                               str(spec.options.get("device", "cpu")))
    engine.close()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def in_worker(spec: EngineSpec, paths: dict[str, str], shapes: dict[str, str], lengths: list[int],
              gaps: list[float], repeats: int, max_tokens: int, mps: bool) -> dict[str, Any]:
    """The engine in a worker process (pool.procs, as serve's processes backend runs it), under MPS where asked
    and possible: the call's send to its answer at the backend, and the engine's own time (its stats)."""
    from pool.procs import ProcessBackend, start_workers

    daemon, note = None, "no MPS"
    if mps:
        from pool.mps import MpsDaemon, MpsError

        try:
            daemon = MpsDaemon()
            env = daemon.start()
            os.environ.update(env)
            note = "MPS"
        except MpsError as exc:
            daemon, note = None, f"no MPS: {exc}"
    started = time.perf_counter()
    backend = ProcessBackend(start_workers({"p0": spec}, {m: paths[m] for m in shapes.values()},
                                           max_tokens=max_tokens, timeout_s=600))
    out: dict[str, Any] = {"variant": "process" + ("+mps" if daemon else ""), "note": note,
                           "start_s": round(time.perf_counter() - started, 2), "points": []}

    def run(call: Any) -> Any:
        backend.call("p0", call)
        while True:
            done = backend.poll(60.0)
            if done:
                result = done[0][1]
                if isinstance(result, BaseException):
                    raise result
                return result

    try:
        rng = random.Random(0)
        for shape, model in shapes.items():
            run(Activate(model))
            for tokens in lengths:
                for gap in gaps:
                    walls = []
                    for i in range(repeats + 1):
                        request = _request(model, tokens, rng)
                        time.sleep(gap)
                        t0 = time.perf_counter()
                        run(Prefill((request,)))
                        wall = time.perf_counter() - t0
                        run(Release((request.request_id,)))
                        if i:
                            walls.append(wall)
                    stats = run(GetStats())
                    prefills = stats.extra["timings"]["prefills"][-repeats:]
                    out["points"].append({"shape": shape, "tokens": tokens, "gap_s": gap,
                                          "wall_ms": round(statistics.median(walls) * 1e3, 3),
                                          "engine_ms": round(statistics.median(p[3] for p in prefills) * 1e3, 3)})
    finally:
        backend.close()
        if daemon is not None:
            daemon.stop()
            for key in env:
                os.environ.pop(key, None)
    return out


def table(results: list[dict[str, Any]]) -> str:
    rows = [f"{'variant':<16} {'shape':<16} {'tokens':>6} {'gap ms':>6} {'engine ms':>9} {'wall ms':>8}"]
    for res in results:
        for p in res.get("points", []):
            rows.append(f"{res['variant']:<16} {p['shape']:<16} {p['tokens']:>6} {p['gap_s'] * 1e3:>6.0f} "
                        f"{p['engine_ms']:>9.2f} {p['wall_ms']:>8.2f}")
        for shape, prof in res.get("profile", {}).items():
            rows.append(f"  {res['variant']} {shape} profiled: wall {prof['ms']} ms, "
                        f"device {prof.get('gpu_total_ms')} ms, {prof.get('kernels')} kernels, {prof['ops']} ops; "
                        f"top host: " + "; ".join(f"{k} x{n} {ms} ms" for k, n, ms in prof["top_cpu"][:5]))
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="small-azure-code")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (a smoke run)")
    parser.add_argument("--lengths", default="256,1024,2048")
    parser.add_argument("--gaps-ms", default="0,10,100")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--variants", default="process,calibrate,served",
                        help="process first: this process opens no CUDA context before its MPS daemon")
    parser.add_argument("--no-mps", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tiny = args.tiny or machine()[0] == 0
    lengths = [int(x) for x in args.lengths.split(",")]
    gaps = [float(x) / 1e3 for x in args.gaps_ms.split(",")]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        served, paths, shapes, max_prefill = served_spec(args.scenario, Path(folder), tiny)
        max_tokens = max(lengths) + 64
        for variant in args.variants.split(","):
            try:
                if variant == "calibrate":
                    spec = calibrate_spec(served, (256 << 20) if tiny else 4 * GiB)
                    results.append(in_process(variant, spec, paths, shapes, lengths, gaps, args.repeats, max_tokens,
                                              1024 if not tiny else 64))
                elif variant == "served":
                    results.append(in_process(variant, served, paths, shapes, lengths, gaps, args.repeats,
                                              max_tokens, 1024 if not tiny else 64))
                elif variant == "process":
                    results.append(in_worker(served, paths, shapes, lengths, gaps, args.repeats, max_tokens,
                                             not args.no_mps and not tiny))
                else:
                    raise SystemExit(f"--variants: unknown {variant!r} (calibrate, served, process)")
            except Exception as exc:  # noqa: BLE001 - the next variant still runs; the error is reported
                results.append({"variant": variant, "error": repr(exc)[:2000]})
                print(f"{variant}: {exc!r}", file=sys.stderr)
            args.out.write_text(json.dumps({"scenario": args.scenario, "tiny": tiny, "max_prefill": max_prefill,
                                            "device": machine()[2],
                                            "results": results}, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
