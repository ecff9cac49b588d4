"""At what rate the simulator matches a live run's figure: the knee error as a capacity planner reads it.

    python benchmarks/fidelity_rate.py RUN.json --profile P [--load LOAD]     (default: the knee load)

Near the knee TTFT grows steeply with the rate, so a TTFT error there says little about how far the simulated
capacity is off. This replays the run's own requests (its arrival times scaled by a factor, the same prompts,
outputs and layout, as `modelpool validate --from-live` simulates them) and bisects the factor at which the
simulated TTFT p50, TTFT p90 and SLO attainment equal the live ones. A factor below 1: the simulator reaches the
live figure at a lower rate (it is pessimistic about capacity by 1 - factor); above 1, optimistic.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

FIGURES = ("ttft_p50_s", "ttft_p90_s", "slo_attainment")


def figures_at(report: dict[str, Any], recorded: Path, load: str, profile: str | None,
               traces_dir: Path | None = None) -> Callable[[float], dict[str, float]]:
    """The simulated figures of the run's `load` with its arrival times divided by a factor: its requests and
    layout as `modelpool validate --from-live` simulates them (recorded_workload, recorded_layout)."""
    from modelpool import validate as v

    layout = v.recorded_layout(report, recorded, profile)
    workload = v.recorded_workload(report, recorded, load, traces_dir)
    slo = v.slo_of(layout.fleet)

    def at(factor: float) -> dict[str, float]:
        scaled = replace(workload, arrival_s=workload.arrival_s / factor)
        rows, switches, _ = v.simulated(layout, scaled)
        return v.side_figures(rows, len(scaled), slo, switches)

    return at


def matching_factor(figure: str, live: float, at: Callable[[float], dict[str, float]], low: float = 0.5,
                    high: float = 2.0, steps: int = 8) -> float | None:
    """The factor in [low, high] at which the simulated `figure` equals `live` (log bisection: TTFT grows and
    attainment falls with the rate); None where it does not cross inside."""
    rising = figure != "slo_attainment"

    def above(factor: float) -> bool:  # past the live figure: the factor is too high
        value = at(factor)[figure]
        return value is None or (value > live if rising else value < live)

    if above(low) or not above(high):
        return None
    for _ in range(steps):
        middle = math.sqrt(low * high)
        if above(middle):
            high = middle
        else:
            low = middle
    return math.sqrt(low * high)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="a `modelpool validate` JSON (served, or --from-live output)")
    parser.add_argument("--profile", help="the calibration profile to simulate with (default: the run's)")
    parser.add_argument("--load", action="append", help="loads to match (default: knee; at a light load TTFT hardly "
                                                        "moves with the rate, so a factor says little there)")
    parser.add_argument("--traces", type=Path, help="the traces folder (trace scenarios)")
    args = parser.parse_args(argv)
    report = json.loads(args.run.read_text())
    print(f"{report['scenario']} ({report['commit']}, {report['gpu']}): the factor on the run's rate at which the "
          "simulated figure equals the live one")
    print(f"{'load':6s} {'req/s':>6s} " + " ".join(f"{name:>22s}" for name in FIGURES))
    for load in args.load or ["knee"]:
        live = report["loads"][load]["live"]
        at = figures_at(report, args.run, load, args.profile, args.traces)
        cells = []
        for name in FIGURES:
            target = live.get(name)
            if name == "slo_attainment" and target is not None and target >= 1.0:
                cells.append(f"{'- (live 100%)':>22s}")
                continue
            factor = None if target is None else matching_factor(name, target, at)
            cells.append(f"{'- (outside 0.5-2x)' if factor is None else f'x{factor:.2f}':>22s}")
        print(f"{load:6s} {report['loads'][load]['rate_rps']:6.2f} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
