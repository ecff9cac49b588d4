"""The live pool's own host costs on each backend: what `modelpool calibrate` measures, side by side.

    OMP_NUM_THREADS=1 python benchmarks/pool_host.py [--backends threads processes ray] [--probes 30]
                                                     [--tokens 48] [--repeats 1] [--out FILE]

Per backend (threads: engines in this process; processes: an OS process per instance, no Ray; ray: an actor per
instance on an embedded cluster), `modelpool.measure_live.measure_host` runs an idle pool on the sim engine at
time scale 0 - every engine call returns at once - with each call timed where the pool makes it (this process),
and `sims.profiles.measurements.host_terms` fits the terms calibrate would write from it. One row per backend and
repeat: the terms (microseconds), the median time between decode calls per batch, and the probe's wall time.
`modelpool calibrate` measures on serve's default backend (`modelpool.serve.default_backend`), marked `*`.

Then, per backend and prompt length, the requests through the gateway (`measure_live.gateway_points`: the gateway
app under uvicorn on a loopback port, a streaming client in its own process, as validate's): medians of the
client's TTFT and its parts - the gateway's way in (client send to the pool's submit), the pool's admission
(submit to the prefill call), the engine call (its hop; the engine takes no time), the pool's delivery (the
call's answer to the pool's stream), the gateway's way out (the pool's stream to the client's read) - and per
later token the gateway's way out, the gap between tokens at the client and at the pool's stream.
Wall-clock on a shared machine: read ratios between backends, not digits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modelpool.extras import installed  # noqa: E402
from modelpool.measure_live import measure_host  # noqa: E402
from modelpool.serve import default_backend  # noqa: E402
from sims.profiles.measurements import host_terms  # noqa: E402

TERMS = ("host_call_s", "host_token_s", "request_admit_s", "request_prompt_token_s", "token_deliver_s",
         "kv_call_host_s")
BATCHES = (1, 4, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", choices=("threads", "processes", "ray"),
                        default=["threads", "processes", *(["ray"] if installed("ray") else [])])
    parser.add_argument("--probes", type=int, default=30, help="single requests and hand-offs (calibrate: 30, "
                                                               "--quick 8)")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps per batch (calibrate: 48, --quick 16)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    serve = default_backend("torch")
    rows = []
    for _ in range(args.repeats):
        for backend in args.backends:
            started = time.perf_counter()
            host = measure_host(backend, probes=args.probes, batches=BATCHES, tokens=args.tokens)
            wall = time.perf_counter() - started
            terms = {term: value for term, (value, _) in host_terms(host).items()}
            rows.append({"backend": backend, "serve_default": backend == serve, "terms": terms,
                         "step_s_by_batch": host.step_s_by_batch, "wall_s": round(wall, 2),
                         "gateway": [p.model_dump() for p in host.gateway]})
    print(f"the idle pool's host costs by backend on {platform.processor() or platform.machine()} "
          f"({os.cpu_count()} cores), {args.probes} probes, {args.tokens} steps per batch; microseconds; "
          f"* = serve's default here")
    head = ["backend"] + [t.removesuffix("_s") for t in TERMS] + [f"step b={b}" for b in BATCHES] + ["wall s"]
    print(" ".join(f"{h:>16}" if i else f"{h:<11}" for i, h in enumerate(head)))
    for row in rows:
        cells = [row["terms"].get(t, float("nan")) * 1e6 for t in TERMS]
        cells += [row["step_s_by_batch"].get(b, float("nan")) * 1e6 for b in BATCHES]
        name = row["backend"] + ("*" if row["serve_default"] else "")
        print(f"{name:<11} " + " ".join(f"{c:>16.1f}" for c in cells) + f" {row['wall_s']:>16.1f}")
    print(f"\nthrough the gateway, one request at a time, {args.probes} per prompt length; medians, milliseconds")
    head = ["backend", "prompt", "client ttft", "gw in", "pool admit", "engine hop", "pool deliver", "gw out",
            "gw out later", "client gap", "pool gap"]
    print(" ".join(f"{h:>12}" if i else f"{h:<11}" for i, h in enumerate(head)))
    for row in rows:
        for n in sorted({p["prompt_tokens"] for p in row["gateway"]}):
            points = [p for p in row["gateway"] if p["prompt_tokens"] == n]

            def med(values: list[float]) -> float:
                return statistics.median(values) * 1e3 if values else float("nan")

            hop = [p["ttft_s"] - p["in_s"] - p["admit_s"] - p["deliver_s"] - p["out_s"][0] for p in points]
            cells = [med([p["ttft_s"] for p in points]), med([p["in_s"] for p in points]),
                     med([p["admit_s"] for p in points]), med(hop), med([p["deliver_s"] for p in points]),
                     med([p["out_s"][0] for p in points]), med([x for p in points for x in p["out_s"][1:]]),
                     med([x for p in points for x in p["client_gap_s"]]),
                     med([x for p in points for x in p["pool_gap_s"]])]
            print(f"{row['backend']:<11} {n:>12} " + " ".join(f"{c:>12.3f}" for c in cells))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"probes": args.probes, "tokens": args.tokens, "cores": os.cpu_count(),
                                        "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
