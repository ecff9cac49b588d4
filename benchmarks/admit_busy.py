"""What an arrival waits for on a busy pool: a request's first token while another request decodes on the other
instance (the `sim` engine on threads: prefill 5 ms, decode steps of --step-ms), with the loop woken by each
submit (`LivePool._wake`, the pool as it runs) and without (the loop waits for the running call's answer, or
its poll timeout `poll_s`, before it plans the arrival).

    OMP_NUM_THREADS=1 python benchmarks/admit_busy.py [--step-ms 2 --probes 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pool.engines.base import SamplingParams  # noqa: E402
from tests.factories import LinearCosts  # noqa: E402
from tests.pool.sim_gateway import sim_pool  # noqa: E402


def first_tokens(woken: bool, step_s: float, probes: int, gap_s: tuple[float, float] = (0.01, 0.03),
                 poll_s: float | None = None, seed: int = 0) -> list[float]:
    """Seconds from submit to first token of `probes` requests, one at a time `gap_s` apart (uniform), while a
    long request decodes in steps of `step_s` on the other instance; the loop woken by each submit or not, its
    poll timeout `poll_s` (None: the pool's default)."""
    pool = sim_pool(num_instances=2, costs=LinearCosts(step_s=step_s, per_token_s=0.0, prefill_per_token_s=0.0,
                                                       switch_s=0.0), **({} if poll_s is None else {"poll_s": poll_s}))
    if not woken:
        pool._wake = lambda: None  # type: ignore[method-assign]  # the loop as it was: no wake on submit
    pool.start()
    rng = random.Random(seed)
    out = []
    try:
        streaming, failed = threading.Event(), []
        pool.submit("long", "alpha", [1, 2, 3], SamplingParams(max_tokens=8000, ignore_eos=True),
                    lambda item: (failed.append(item) if isinstance(item, BaseException) else None, streaming.set()))
        if not streaming.wait(30) or failed:
            raise RuntimeError(f"the streaming request did not start: {failed}")
        for k in range(probes):
            time.sleep(rng.uniform(*gap_s))
            first = threading.Event()
            started = time.monotonic()
            pool.submit(f"p{k}", "beta", [1, 2, 3], SamplingParams(max_tokens=1), lambda item, f=first: f.set())
            if not first.wait(30):
                raise RuntimeError(f"probe p{k}: no token in 30 s")
            out.append(time.monotonic() - started)
    finally:
        pool.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--probes", type=int, default=200)
    args = parser.parse_args()
    print(f"first token of a request arriving while another decodes ({args.step_ms:g} ms steps), "
          f"{args.probes} probes; prefill 5 ms")
    print(f"{'loop':<22} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8}")
    for woken in (False, True):
        times = [t * 1e3 for t in first_tokens(woken, args.step_ms / 1e3, args.probes)]
        q = statistics.quantiles(times, n=10)
        print(f"{'woken by submit' if woken else 'waits for an answer':<22} {statistics.median(times):>8.2f} "
              f"{q[-1]:>8.2f} {statistics.mean(times):>8.2f}")


if __name__ == "__main__":
    main()
