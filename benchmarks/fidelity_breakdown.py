"""Where a validate run's live and simulated time differ, per component (issue 34).

Reads a validate JSON (a live run recorded beside its simulation, or one simulated again with
`modelpool validate SCENARIO --from-live ...`), the live Plan log of the serve run and the simulated Plan log
of one load, and splits both sides' time the same way, from the Plan logs alone (each instance's step starts
at its plan's `at`; it ends at that instance's next plan):

- per request, TTFT = wait (arrival to the plan of its prefill) + prefill (that plan to the prefill
  instance's next plan: the call, any switch in the plan, the host time) + the rest (the way out);
  TPOT's span (first token to last) = the hand-off's first tokens on the prefill instance + the hand-off
  (to the SwapIn on the decode instance) + the decode instance's turns it is in + the waits between them;
- per step kind (prefill; decode steps on the prefill instance; decode turns on the decode instance, with
  and without a switch or a SwapIn in their plan), its duration per step by batch size, and split by whether
  a peer instance on the same GPU was busy over the step (device sharing under MPS).

The live arrival is the client's send time moved onto the server's clock by the median of (first token at the
client - prefill end in the Plan log); the simulated side is split with its own median, so both sides' `rest`
has a median of 0 and their waits compare.

Limits: a span runs from plan to plan, so it holds the controller's reaction time too (engine time and host
time are not told apart: the engines' own call timings are not in a validate run's files), and a step the
instance idles after runs on to its next plan (turns are timed only where the next step continues their batch
and no Stop cut them; a turn's steps are its max_steps).

    python benchmarks/fidelity_breakdown.py OUT.json SERVE_LOG_DIR SIM_PLANS.jsonl --load knee [--profile P]
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Step:
    """One instance's step: what its plan started at `at`, ended at `end` (its next plan; None: the log's last)."""

    instance: str
    at: float
    ops: tuple[str, ...]
    ids: tuple[str, ...]  # the requests of its Prefill or Decode
    max_steps: int = 1
    reason: str = ""
    end: float | None = None
    next_ids: tuple[str, ...] = ()  # the requests the instance's next step decodes or prefills
    stopped: bool = False  # a Stop came while it ran

    @property
    def kind(self) -> str:
        if "Prefill" in self.ops:
            return "prefill"
        if "Decode" in self.ops:
            return "handoff-decode" if "before the hand-off" in self.reason else "turn"
        return "other"

    @property
    def span_s(self) -> float | None:
        return None if self.end is None else self.end - self.at


@dataclass
class PlanLog:
    steps: list[Step] = field(default_factory=list)
    by_instance: dict[str, list[Step]] = field(default_factory=dict)


def read_plans(lines: Iterable[str]) -> PlanLog:
    """The steps of a Plan log (JSONL), each with its end: the next plan of its instance that is not a Stop."""
    log = PlanLog()
    for line in lines:
        if not line.strip():
            continue
        plan = json.loads(line)
        for iid, actions in plan["actions"].items():
            ops = tuple(a["op"] for a in actions)
            runs = log.by_instance.setdefault(iid, [])
            if ops == ("Stop",):
                if runs:
                    runs[-1].stopped = True
                continue
            work = [a for a in actions if a["op"] in ("Prefill", "Decode")]
            step = Step(iid, float(plan["at"]), ops, tuple(work[0]["request_ids"]) if work else (),
                        int(work[0].get("max_steps", 1)) if work else 1, work[0].get("reason", "") if work else "")
            if runs:
                runs[-1].end, runs[-1].next_ids = step.at, step.ids
            runs.append(step)
            log.steps.append(step)
    return log


def busy_overlap(step: Step, peers: Sequence[Step]) -> float:
    """The share of `step`'s span during which a peer instance ran a prefill or decode step (a lone SwapOut or
    Prefetch counts as idle: its span runs on to the instance's next plan, idle time included)."""
    if step.end is None or step.end <= step.at:
        return 0.0
    covered = 0.0
    for other in peers:
        if other.end is None or other.kind == "other":
            continue
        covered += max(0.0, min(step.end, other.end) - max(step.at, other.at))
    return min(1.0, covered / (step.end - step.at))


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Request:
    """One request's times on one side (server clock for the live side)."""

    index: int
    model: str
    arrival: float
    ttft: float
    tpot: float | None
    tokens: int
    prompt_tokens: int = 0
    prefill: Step | None = None
    handoff: Step | None = None  # its first tokens on the prefill instance
    turns: list[Step] = field(default_factory=list)  # the decode instance's turns it is in

    def parts(self, offset: float) -> dict[str, float]:
        """Its TTFT and TPOT span in components (`offset`: the median first token - prefill end of its side)."""
        out: dict[str, float] = {"ttft": self.ttft}
        if self.prefill is None or self.prefill.end is None:
            return out
        out["wait"] = self.prefill.at - self.arrival
        out["prefill"] = self.prefill.end - self.prefill.at
        out["rest"] = self.ttft - out["wait"] - out["prefill"]
        if self.tpot is None or self.handoff is None or self.handoff.end is None or not self.turns:
            return out
        first = self.prefill.end + offset
        last = first + self.tpot * (self.tokens - 1)
        out["tpot"] = self.tpot
        out["handoff_steps"] = self.handoff.end - first  # from the first token: the span's parts add up
        out["handoff_wait"] = self.turns[0].at - self.handoff.end
        out["in_turns"] = sum((t.end or last) - t.at for t in self.turns)
        out["between_turns"] = last - self.turns[0].at - out["in_turns"]
        out["num_turns"] = len(self.turns)
        return out


def attach(requests: Mapping[str, Request], log: PlanLog) -> None:
    """Each request's prefill, hand-off decode and decode turns from the Plan log."""
    for step in log.steps:
        kind = step.kind
        for rid in step.ids:
            req = requests.get(rid)
            if req is None:
                continue
            if kind == "prefill" and req.prefill is None:
                req.prefill = step
            elif kind == "handoff-decode" and req.handoff is None:
                req.handoff = step
            elif kind == "turn":
                req.turns.append(step)


def live_ids(lines: Sequence[str]) -> list[str]:
    """The live request ids of these Plan log lines, in the order the gateway gave them (cmpl-<hex counter>)."""
    seen: dict[str, None] = {}
    for line in lines:
        for actions in json.loads(line)["actions"].values():
            for action in actions:
                for rid in action.get("request_ids", ()):
                    seen.setdefault(rid, None)
    return sorted(seen, key=lambda rid: int(rid.rpartition("-")[2], 16))


def live_requests(part: Mapping[str, Any], lines: Sequence[str], prompts: Sequence[int] | None) -> dict[str, Request]:
    """The live rows of one load keyed by their Plan log ids (rows in send order matched to ids in issue
    order), arrivals still on the client's clock."""
    rows = [r for r in part["live_rows"] if r.get("served")]
    ids = live_ids(lines)
    if len(ids) != len(rows):
        raise SystemExit(f"{len(ids)} request ids in the load's plans, {len(rows)} served rows")
    rows.sort(key=lambda r: r["sent_s"])
    return {rid: Request(r["index"], r["model"], r["sent_s"], r["ttft_s"], r.get("tpot_s"), r["tokens"],
                         prompts[r["index"]] if prompts else 0) for rid, r in zip(ids, rows)}


def sim_requests(part: Mapping[str, Any], arrivals: Sequence[float], prompts: Sequence[int],
                 outputs: Sequence[int], skip: int = 0, shift_s: float = 0.0) -> dict[str, Request]:
    """The simulated requests by their ids in the simulated Plan log: `skip` warm-up requests came first, and the
    workload `shift_s` after them (modelpool.validate.simulated)."""
    out = {}
    for row in part["requests_side_by_side"]:
        if row.get("sim_ttft_s") is None:
            continue
        k = row["index"]
        out[f"r{skip + k + 1:07d}"] = Request(k, row["model"], arrivals[k] + shift_s, row["sim_ttft_s"],
                                              row.get("sim_tpot_s"), outputs[k], prompts[k])
    return out


def move_to_server_clock(requests: Mapping[str, Request]) -> float:
    """Shift live arrivals onto the Plan log's clock; return the offset (client - server at the first token)."""
    offset = side_offset(requests)
    for req in requests.values():
        req.arrival -= offset
    return offset


def side_offset(requests: Mapping[str, Request]) -> float:
    gaps = [r.arrival + r.ttft - r.prefill.end for r in requests.values() if r.prefill and r.prefill.end]
    return statistics.median(gaps) if gaps else 0.0


def components(requests: Mapping[str, Request]) -> dict[int, dict[str, float]]:
    offset = side_offset(requests)
    return {r.index: r.parts(offset) for r in requests.values()}


def step_table(log: PlanLog, instances: Sequence[str], ids: set[str]) -> dict[tuple[str, str, str], list[float]]:
    """Per (instance, kind, batch bucket and peer busy or idle), the seconds per step of the steps of `ids`."""
    table: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for step in log.steps:
        if step.end is None or not step.ids or not ids.intersection(step.ids):
            continue
        kind = step.kind
        if kind == "turn":
            if step.stopped or not set(step.ids) & set(step.next_ids):  # cut short, or idle after: no step count
                continue
            kind = "turn+switch" if ("Switch" in step.ops or "SwapIn" in step.ops) else "turn"
        elif kind == "prefill":
            kind += "+swapout" * ("SwapOut" in step.ops) + "+switch" * ("Switch" in step.ops)
        peers = [s for iid in instances if iid != step.instance for s in log.by_instance.get(iid, ())
                 if s.end is not None and s.end > step.at and s.at < step.end]
        share = busy_overlap(step, peers)
        peer = "alone" if share < 0.1 else "beside" if share > 0.9 else "part"
        steps = step.max_steps if kind.startswith("turn") or kind == "handoff-decode" else 1
        table[(step.instance, kind, f"b{bucket(len(step.ids))}", peer)].append(step.span_s / steps)
        table[(step.instance, kind, "all", "all")].append(step.span_s / steps)
    return table


def bucket(n: int) -> str:
    for top in (1, 2, 4, 8, 16, 32, 64):
        if n <= top:
            return str(top)
    return "64+"


def summarise(live: Mapping[int, Mapping[str, float]], sim: Mapping[int, Mapping[str, float]],
              keys: Sequence[str]) -> list[str]:
    """Lines: per component, the live and simulated p50 / p90 / mean over the requests both sides split."""
    both = [k for k in live if k in sim and all(key in live[k] and key in sim[k] for key in keys)]
    lines = [f"  {len(both)} requests split on both sides"]
    lines.append(f"  {'component':15s} {'live p50':>9s} {'sim p50':>9s} {'live p90':>9s} {'sim p90':>9s} "
                 f"{'live mean':>9s} {'sim mean':>9s}  (ms)")
    for key in keys:
        a = [live[k][key] for k in both]
        b = [sim[k][key] for k in both]
        scale = 1 if key == "num_turns" else 1e3
        lines.append(f"  {key:15s} {scale * pct(a, .5):9.2f} {scale * pct(b, .5):9.2f} {scale * pct(a, .9):9.2f} "
                     f"{scale * pct(b, .9):9.2f} {scale * statistics.fmean(a):9.2f} {scale * statistics.fmean(b):9.2f}")
    return lines


def by_ttft_rank(live: Mapping[int, Mapping[str, float]], sim: Mapping[int, Mapping[str, float]],
                 keys: Sequence[str], lo: float, hi: float) -> list[str]:
    """The mean components of the requests whose TTFT is between quantiles lo and hi, each side its own."""
    lines = []
    for name, side in (("live", live), ("sim", sim)):
        rows = sorted((v for v in side.values() if all(k in v for k in keys)), key=lambda v: v["ttft"])
        chosen = rows[int(lo * len(rows)):max(int(lo * len(rows)) + 1, int(hi * len(rows)))]
        means = {k: statistics.fmean(v[k] for v in chosen) for k in keys}
        lines.append(f"  {name:4s} TTFT q{lo:.2f}-{hi:.2f} ({len(chosen)}): "
                     + ", ".join(f"{k} {1e3 * means[k]:.1f}" for k in keys) + " ms")
    return lines


def prefill_instance(log: PlanLog, requests: Mapping[str, Request], alone_s: Any, instance: str) -> dict[str, float]:
    """Per request, the prefill instance's seconds in prefill steps and in the hand-off's decode steps; the
    prefill steps' span over the cost model's time alone for them (`alone_s(model, tokens, prompts)`), with and
    without a SwapOut (the previous hand-off's export) in the same plan; and the wait of requests that arrive
    while the instance idles (> 50 ms after its last plan, a lone SwapOut): the way in, no queue."""
    steps = [s for s in log.by_instance.get(instance, ()) if s.end is not None]
    prefills = [s for s in steps if s.kind == "prefill" and all(i in requests for i in s.ids)]
    served = sum(len(s.ids) for s in prefills) or 1
    out = {"prefill_s": sum(s.span_s for s in prefills) / served,
           "handoff_s": sum(s.span_s for s in steps if s.kind == "handoff-decode") / served}
    for tag, chosen in (("with_swapout", [s for s in prefills if "SwapOut" in s.ops]),
                        ("without_swapout", [s for s in prefills if "SwapOut" not in s.ops])):
        ratios = [s.span_s / alone_s(requests[s.ids[0]].model, sum(requests[i].prompt_tokens for i in s.ids),
                                     len(s.ids)) for s in chosen]
        if ratios:
            out[f"ratio_{tag}"] = statistics.median(ratios)
            out[f"n_{tag}"] = len(ratios)
    starts = [s.at for s in steps]
    waits = []
    for req in requests.values():
        j = bisect.bisect_right(starts, req.arrival) - 1
        if req.prefill is not None and j >= 0 and steps[j].ops == ("SwapOut",) and req.arrival - starts[j] > 0.05:
            waits.append(req.prefill.at - req.arrival)
    if waits:
        out["idle_arrival_wait_s"] = statistics.median(waits)
        out["n_idle_arrivals"] = len(waits)
    return out


def report_costs(report: Mapping[str, Any], path: Path, profile: str | None) -> Any:
    """The cost model a validate report's simulation used (as modelpool.validate.resimulate builds it)."""
    from dataclasses import replace

    from modelpool.config import load_fleet
    from sims.costmodel import RooflineCostModel
    from sims.profiles import load_profile
    from sims.scenarios import scenario as find

    spec = replace(find(report["scenario"]), max_output_tokens=report["max_output_tokens"])
    fleet = (load_fleet(path.parent / f"models-{spec.fleet}" / "fleet.yaml") if report.get("tiny")
             else spec.fleet_spec().fleet(report["gpu"]))
    profile = profile or (None if report["profile"] == "default" else report["profile"])
    return RooflineCostModel(fleet, profile=load_profile(profile) if profile else None, gpus_per_host_link=1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", type=Path, help="validate JSON (recorded or --from-live output)")
    parser.add_argument("serve_logs", type=Path, help="the run's serve-logs/<scenario> folder (serve.plans.jsonl)")
    parser.add_argument("sim_plans", type=Path, help="the simulated Plan log of the load")
    parser.add_argument("--load", default="knee")
    parser.add_argument("--profile", help="the calibration profile the simulation used (default: the report's)")
    args = parser.parse_args(argv)
    from sims.scenarios import scenario as find
    from dataclasses import replace

    report = json.loads(args.report.read_text())
    part = report["loads"][args.load]
    spec = replace(find(report["scenario"]), max_output_tokens=report["max_output_tokens"])
    workload = spec.workload(part["rate_rps"], report["duration_s"], report["seed"])
    arrivals = [r.arrival_at for r in workload.requests()]
    prompts, outputs = workload.input_tokens.tolist(), workload.output_tokens.tolist()
    lo, hi = part["live_plans"]
    lines = (args.serve_logs / "serve.plans.jsonl").read_text().splitlines()[lo:hi]
    live_log, sim_log = read_plans(lines), read_plans(args.sim_plans.read_text().splitlines())
    live = live_requests(part, lines, prompts)
    from modelpool.validate import WARM_UP_S  # the simulated pool is warmed up first, as serve warms the live one

    sim = sim_requests(part, arrivals, prompts, outputs, len(workload.models), WARM_UP_S)
    attach(live, live_log)
    attach(sim, sim_log)
    move_to_server_clock(live)
    a, b = components(live), components(sim)
    print(f"{report['scenario']} {args.load}: {len(live)} live, {len(sim)} simulated requests")
    print("\n".join(summarise(a, b, ("ttft", "wait", "prefill", "rest"))))
    print("\n".join(summarise(a, b, ("tpot", "handoff_steps", "handoff_wait", "in_turns", "between_turns",
                                     "num_turns"))))
    for lo_q, hi_q in ((0.0, 0.5), (0.5, 0.8), (0.8, 0.95), (0.95, 1.0)):
        print("\n".join(by_ttft_rank(a, b, ("ttft", "wait", "prefill"), lo_q, hi_q)))
    costs = report_costs(report, args.report, args.profile)
    prefill_iid = next(s.instance for s in sim_log.steps if s.kind == "prefill")
    print(f"  prefill instance {prefill_iid}, per request and per prefill step (ratio: span / cost model alone)")
    for name, log, reqs in (("live", live_log, live), ("sim", sim_log, sim)):
        figures = prefill_instance(log, reqs, costs.prefill_s, prefill_iid)
        print(f"  {name:4s} " + ", ".join(f"{k} {1e3 * v:.1f} ms" if k.endswith("_s") else f"{k} {v:.2f}"
                                          if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()))
    instances = sorted(set(live_log.by_instance) | set(sim_log.by_instance))
    lt = step_table(live_log, instances, set(live))
    st = step_table(sim_log, instances, set(sim))
    print(f"  {'instance kind batch peer':34s} {'n live':>6s} {'n sim':>6s} {'live p50':>9s} {'sim p50':>9s} "
          f"{'live mean':>9s} {'sim mean':>9s}  (ms per step)")
    for key in sorted(set(lt) | set(st)):
        x, y = lt.get(key, []), st.get(key, [])
        fmt = lambda v: f"{1e3 * v:9.2f}" if v is not None else f"{'-':>9s}"  # noqa: E731
        print(f"  {' '.join(key):34s} {len(x):6d} {len(y):6d} {fmt(pct(x, .5))} {fmt(pct(y, .5))} "
              f"{fmt(statistics.fmean(x) if x else None)} {fmt(statistics.fmean(y) if y else None)}")


if __name__ == "__main__":
    main()
