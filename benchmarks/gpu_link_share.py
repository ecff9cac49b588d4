"""How one GPU's host link serves two copies at once, as the live pool's instances make them: from two engine
processes (serve's default backend; under MPS when the environment names a daemon, as serve starts one) or from
two threads of one process (how `modelpool calibrate` measures it, and the threads backend runs).

Each copier holds pinned host buffers of the sizes asked for and one device buffer; a copy is one
host-to-device `copy_` on its own stream, as an engine's weight switch (pool.engines.slots) and prefetch are.
Cases, each `--repeats` times:

- every size alone;
- two sizes started together (the larger on copier 0): which rule the link followed (one kept its time alone:
  "fifo"; both slowed: "fair") and the rate it moved while shared;
- a small copy (a KV move's size) started `--small-after` seconds into the largest one: under "fifo" it waits
  for the large copy's end, under "fair" it takes about twice its time alone.

    python benchmarks/gpu_link_share.py --out link.json                     # processes, as the pool serves
    python benchmarks/gpu_link_share.py --threads --out link-threads.json   # two threads of one process
    python benchmarks/gpu_link_share.py --tiny --out /tmp/l.json            # anywhere (CPU, small buffers)

The simulator takes no term from it (sims.links: a shared link moves its bytes at eff_pcie, first come first
served); this measures how far that rule is from the GPU's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pool.mps import PIPE_ENV  # noqa: E402

# the H200 fleet's weights (benchmarks/gpu_pool.py: qwen2.5 shapes in bf16) and one KV move of 8 x 2048 tokens
SIZES_GB = {"7b": 15.22, "3b": 6.18, "1.5b": 3.08, "kv": 0.6}
TINY_GB = {"7b": 0.08, "3b": 0.032, "1.5b": 0.016, "kv": 0.004}
PAIRS = [("7b", "3b"), ("7b", "1.5b"), ("3b", "1.5b")]


class Copier:
    """Pinned host buffers of each size and one device buffer; `copy(name)` times one whole copy."""

    def __init__(self, sizes: dict[str, int], device: str) -> None:
        pinned = device != "cpu"
        self.host = {name: torch.empty(n, dtype=torch.uint8, pin_memory=pinned) for name, n in sizes.items()}
        self.target = torch.empty(max(sizes.values()), dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device=device) if pinned else None
        for name in sizes:  # first touch of every page, both sides
            self.copy(name, 0.0)

    def copy(self, name: str, delay_s: float) -> tuple[float, float]:
        """Sleep `delay_s`, copy `name` in whole and wait for it: (start, end) on the host's monotonic clock."""
        if delay_s:
            time.sleep(delay_s)
        src = self.host[name]
        start = time.monotonic()
        if self.stream is None:
            self.target[: src.numel()].copy_(src)
        else:
            with torch.cuda.stream(self.stream):
                self.target[: src.numel()].copy_(src, non_blocking=True)
            self.stream.synchronize()
        return start, time.monotonic()


def _serve(sizes: dict[str, int], device: str, conn: Any, barrier: Any) -> None:
    """A copier process: build, say ready, then for each order (name or None, delay) meet the others at the
    barrier and answer its copy's (start, end) or None."""
    torch.set_num_threads(1)
    copier = Copier(sizes, device)
    conn.send("ready")
    while True:
        order = conn.recv()
        if order is None:
            return
        name, delay = order
        barrier.wait()
        conn.send(copier.copy(name, delay) if name is not None else None)


class Processes:
    """Two copier processes (spawned: CUDA in the children only)."""

    def __init__(self, sizes: dict[str, int], device: str) -> None:
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(2)
        self.conns, self.procs = [], []
        for _ in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(sizes, device, child, self.barrier), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            if conn.recv() != "ready":
                raise RuntimeError("a copier process did not start")

    def run(self, orders: Sequence[tuple[str | None, float]]) -> list[tuple[float, float] | None]:
        for conn, order in zip(self.conns, orders):
            conn.send(order)
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=30)


class Threads:
    """Two copiers in this process, each copy from its own thread (two engines of one process)."""

    def __init__(self, sizes: dict[str, int], device: str) -> None:
        self.copiers = [Copier(sizes, device) for _ in range(2)]

    def run(self, orders: Sequence[tuple[str | None, float]]) -> list[tuple[float, float] | None]:
        barrier = threading.Barrier(2)
        out: list[tuple[float, float] | None] = [None, None]

        def one(k: int) -> None:
            name, delay = orders[k]
            barrier.wait()
            if name is not None:
                out[k] = self.copiers[k].copy(name, delay)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def close(self) -> None:
        pass


def measure(copiers: Any, names: Sequence[str], pairs: Sequence[tuple[str, str]], small: str, small_after: float,
            repeats: int, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every size alone, each pair started together, `small` started `small_after` s into the largest."""
    alone: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            got = copiers.run([(name, 0.0), (None, 0.0)])[0]
            alone[name].append(round(got[1] - got[0], 6))
    progress("alone: " + ", ".join(f"{n} {1e3 * statistics.median(v):.1f} ms" for n, v in alone.items()))
    shared = []
    for big, other in pairs:
        for _ in range(repeats):
            a, b = copiers.run([(big, 0.0), (other, 0.0)])
            shared.append({"archs": [big, other], "seconds": [round(a[1] - a[0], 6), round(b[1] - b[0], 6)],
                           "span_s": round(max(a[1], b[1]) - min(a[0], b[0]), 6)})
        last = shared[-1]
        progress(f"{big} and {other} together: {1e3 * last['seconds'][0]:.1f} and {1e3 * last['seconds'][1]:.1f} ms")
    largest = max(names, key=lambda n: statistics.median(alone[n]) if n != small else -1)
    beside = []
    for _ in range(repeats):
        a, b = copiers.run([(largest, 0.0), (small, small_after)])
        beside.append({"big": largest, "small": small, "big_s": round(a[1] - a[0], 6),
                       "small_s": round(b[1] - b[0], 6), "small_started_s": round(b[0] - a[0], 6)})
    progress(f"{small} {1e3 * small_after:.0f} ms into {largest}: {1e3 * beside[-1]['small_s']:.1f} ms "
             f"(alone {1e3 * statistics.median(alone[small]):.1f})")
    return {"alone": alone, "shared": shared, "small_beside": beside}


def link_sharing_of(alone: dict[str, float], runs: list[dict[str, Any]]) -> tuple[str, float] | None:
    """How the link served two copies started together, and its rate then as a share of one copy's alone: 'fifo'
    when one copy took its time alone (the other waited: rate (w1 + w2) / span), else 'fair' (processor sharing:
    the last ends at 2 w2 / rate + w1 - w2). `alone`: each copy's seconds alone; `runs`: {archs, seconds,
    span_s}. None when the copies did not overlap."""
    rates: dict[str, list[float]] = {"fifo": [], "fair": []}
    for run in runs:
        works = [alone[a] for a in run["archs"]]
        w1, w2 = max(works), min(works)
        if run["span_s"] <= 1.02 * w1:
            continue  # they did not overlap, or did not slow each other
        if min(t / w for t, w in zip(run["seconds"], works)) < 1.1:  # one kept its time alone
            rates["fifo"].append((w1 + w2) / run["span_s"])
        else:
            rates["fair"].append(2 * w2 / (run["span_s"] - (w1 - w2)))
    if not rates["fifo"] and not rates["fair"]:
        return None
    sharing = "fifo" if len(rates["fifo"]) >= len(rates["fair"]) else "fair"
    return sharing, statistics.median(rates[sharing])


def verdict(result: dict[str, Any]) -> str:
    """In words: which rule the pairs followed."""
    alone = {name: statistics.median(v) for name, v in result["alone"].items()}
    got = link_sharing_of(alone, result["shared"])
    if got is None:
        return "the copies did not overlap"
    rule, rate = got
    small = result["small_beside"]
    ratio = statistics.median(s["small_s"] for s in small) / alone[small[0]["small"]]
    return (f"{rule}: the link moved {rate:.3f} of one copy's rate while shared; a small copy beside the largest "
            f"took {ratio:.1f}x its time alone")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", action="store_true", help="two threads of one process (default: two processes)")
    parser.add_argument("--tiny", action="store_true", help="small buffers, CPU where there is no GPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small-after", type=float, default=0.05, help="seconds into the largest copy the small "
                        "one starts")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes_gb = TINY_GB if args.tiny else SIZES_GB
    sizes = {name: int(gb * 1e9) for name, gb in sizes_gb.items()}
    mode = "threads" if args.threads else "processes"
    copiers = Threads(sizes, device) if args.threads else Processes(sizes, device)
    try:
        small_after = args.small_after if not args.tiny else 0.0
        result = measure(copiers, list(sizes), PAIRS, "kv", small_after, args.repeats)
    finally:
        copiers.close()
    name = torch.cuda.get_device_name() if device != "cpu" else "cpu"
    out = {"mode": mode, "mps": bool(os.environ.get(PIPE_ENV)) if device != "cpu" else None, "device": name,
           "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "bytes": sizes, **result}
    out["verdict"] = verdict(out)
    print(f"{mode}{' under MPS' if out['mps'] else ''} on {name}: {out['verdict']}")
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
