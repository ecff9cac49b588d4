"""Does a weight copy hold up the step's inputs? Head-of-line blocking on the host-to-device copy engine.

A step's inputs (token ids, positions, block tables: a few KB) must reach the device while a model's weights may
be streaming in on another stream. Measured here: the latency of a small pinned copy + a tiny kernel + sync on the
default stream while a large pinned copy of `--gb` runs on a side stream - issued whole, or in pieces with nothing,
a one-element kernel, or a round trip through a stream that makes a one-element copy between them - and the
latency of the same inputs read by a kernel straight from mapped pinned memory (pool.engines.device.InputStage's
way: no copy engine). Each again beside a second process that keeps the GPU busy (`--no-busy` skips it), as the
pool's other instance does. Prints a table and writes JSON (BENCHMARKS.md has the H200's).
`--swap-mb N` (repeatable) adds a KV swap-in of N MB in place of the small input, by the copy engine and by a
kernel reading mapped pinned memory: alone (its GB/s) and during the weight copy (does it wait for the model?).

    python benchmarks/gpu_copy_hol.py --out results.json [--gb 8] [--chunk-mb 0 --chunk-mb 64 --chunk-mb 16]
        [--swap-mb 16 --swap-mb 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pool.engines.device import mapped_view  # noqa: E402


def small_copy_ms(src: torch.Tensor, dst: torch.Tensor) -> float:
    started = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    dst.add_(1)
    torch.cuda.current_stream().synchronize()
    return (time.perf_counter() - started) * 1e3


def mapped_read_ms(src: torch.Tensor, dst: torch.Tensor) -> float:
    """The small input read by a kernel straight from pinned memory (no copy engine) + a tiny kernel + sync."""
    started = time.perf_counter()
    torch.add(src, 0, out=dst)
    dst.add_(1)
    torch.cuda.current_stream().synchronize()
    return (time.perf_counter() - started) * 1e3


def during(host: torch.Tensor, device: torch.Tensor, chunk: int, src: torch.Tensor, dst: torch.Tensor,
           yields: str, small=small_copy_ms) -> dict:
    """The big copy on a side stream (whole, or in `chunk` pieces with `yields` between them: "none", "kernel" - a
    one-element kernel on that stream, "copy" - a round trip through another stream that makes a one-element
    host-to-device copy, as pool.engines.slots does) while `small` runs again and again on the default stream."""
    side, trip = torch.cuda.Stream(), torch.cuda.Stream()
    tick, one = torch.zeros(1, device="cuda"), torch.zeros(1).pin_memory()
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.cuda.stream(side):
        step = chunk or host.numel()
        for start in range(0, host.numel(), step):
            if start and yields == "kernel":
                tick.add_(1)
            elif start and yields == "copy":
                trip.wait_stream(side)
                with torch.cuda.stream(trip):
                    tick.copy_(one, non_blocking=True)
                side.wait_stream(trip)
            device[start : start + step].copy_(host[start : start + step], non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    issued_ms = (time.perf_counter() - started) * 1e3
    waits = []
    while not done.query():
        waits.append(small(src, dst))
    big_ms = (time.perf_counter() - started) * 1e3
    torch.cuda.synchronize()
    w = np.array(waits or [0.0])
    return {"small": small.__name__, "chunk_mb": chunk >> 20, "yields": yields, "big_copy_ms": round(big_ms, 2),
            "gb_s": round(host.numel() / big_ms / 1e6, 1), "issue_ms": round(issued_ms, 3), "small_copies": len(waits),
            "small_ms_p50": round(float(np.median(w)), 3), "small_ms_p90": round(float(np.percentile(w, 90)), 3),
            "small_ms_max": round(float(w.max()), 3)}


BUSY = """
import torch, sys
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize(); print("busy", flush=True)
while True:
    for _ in range(20):
        a = torch.tanh(a @ a)  # ~0.2 ms a product: another process keeping the GPU busy, as the other instance does
    torch.cuda.synchronize()
"""


def variants(host, device, src, dst, chunks) -> list[dict]:
    rows = [during(host, device, mb << 20, src, dst, y) for mb in chunks for y in (("none", "kernel", "copy") if mb else ("none",))]
    try:  # the step's inputs read by a kernel from pinned memory, during one whole weight copy
        mapped = mapped_view(src)
        torch.add(mapped, 0, out=dst)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), src), "a kernel read of mapped pinned memory gave other values"
        rows.append(during(host, device, 0, mapped, dst, "none", small=mapped_read_ms))
    except Exception as exc:  # noqa: BLE001 - a platform without mapped pinned memory: say so in the table
        print(f"mapped pinned read not possible here: {exc!r}")
    return rows


def swap_rows(host: torch.Tensor, device: torch.Tensor, sizes_mb: list[int]) -> list[dict]:
    """A swap-in of each size: alone, then during one whole weight copy, by copy and by a mapped-memory kernel."""
    rows = []
    for mb in sizes_mb:
        src = torch.randint(0, 1 << 30, ((mb << 20) // 8,), dtype=torch.int64).pin_memory()
        dst = torch.zeros_like(src, device="cuda")
        for small, source in ((small_copy_ms, src), (mapped_read_ms, mapped_view(src))):
            for _ in range(3):
                small(source, dst)
            alone = float(np.median([small(source, dst) for _ in range(10)]))
            assert torch.equal((dst - 1).cpu(), src), f"{small.__name__} of {mb} MB gave other values"
            row = during(host, device, 0, source, dst, "none", small=small)
            rows.append(dict(row, swap_mb=mb, alone_ms=round(alone, 3), alone_gb_s=round((mb << 20) / alone / 1e6, 1)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gb", type=float, default=8.0)
    parser.add_argument("--chunk-mb", type=int, action="append", help="0: one copy (repeatable)")
    parser.add_argument("--no-busy", action="store_true", help="skip the runs beside a busy second process")
    parser.add_argument("--swap-mb", type=int, action="append", default=[],
                        help="a KV swap-in of this many MB instead of the small input (repeatable)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: this measures the GPU's copy engines")
    nbytes = int(args.gb * 1e9)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src = torch.arange(8192, dtype=torch.int64).pin_memory()
    dst = torch.zeros(8192, dtype=torch.int64, device="cuda")
    for _ in range(20):
        small_copy_ms(src, dst)
    idle = np.array([small_copy_ms(src, dst) for _ in range(200)])
    rows = [dict(r, busy=False) for r in variants(host, device, src, dst, args.chunk_mb or [0, 64, 16])]
    rows += [dict(r, busy=False) for r in swap_rows(host, device, args.swap_mb)]
    if not args.no_busy:  # again while another process keeps the GPU busy (CUDA time-slices the two)
        busy = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
        try:
            busy.stdout.readline()
            time.sleep(0.5)
            rows += [dict(r, busy=True) for r in variants(host, device, src, dst, args.chunk_mb or [0, 64, 16])]
            rows += [dict(r, busy=True) for r in swap_rows(host, device, args.swap_mb)]
        finally:
            busy.kill()
    result = {"device": torch.cuda.get_device_name(), "gb": args.gb, "idle_small_ms_p50": round(float(np.median(idle)), 3),
              "idle_small_ms_max": round(float(idle.max()), 3), "runs": rows}
    print(f"{result['device']}: small copy + kernel + sync alone: p50 {result['idle_small_ms_p50']} ms")
    print(f"{'busy':>4s} {'small':>15s} {'swap MB':>8s} {'alone ms':>9s} {'GB/s':>6s} {'chunk MB':>9s} {'yield':>6s} "
          f"{'big ms':>8s} {'GB/s':>6s} {'issue ms':>9s} {'n':>6s} {'small p50':>10s} {'p90':>8s} {'max':>8s}")
    for r in rows:
        print(f"{str(r['busy'])[0]:>4s} {r['small']:>15s} {r.get('swap_mb', 0):8d} {r.get('alone_ms', 0):9.3f} "
              f"{r.get('alone_gb_s', 0):6.1f} {r['chunk_mb']:9d} {r['yields']:>6s} {r['big_copy_ms']:8.1f} {r['gb_s']:6.1f} "
              f"{r['issue_ms']:9.2f} {r['small_copies']:6d} {r['small_ms_p50']:10.3f} {r['small_ms_p90']:8.3f} {r['small_ms_max']:8.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
