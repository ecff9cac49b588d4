"""Where each instance's time went: the engine call logs a gpu_pool.py run leaves (processes backend).

`modelpool serve` under benchmarks/gpu_pool.py writes every engine call of each instance (method, start on the
host's monotonic clock, seconds inside the engine) to serve-<backend>-<layout>.calls/calls-<instance>.json when
the instance stops. This reads them for the last `--window` seconds (the last rate's run) and prints, per
instance, the seconds per method, and the decode steps by the call before them (a step after a Prefetch, after
a swap-in, after another step: what delays a turn's first step), and the decode steps that overlapped a prefill
of another instance on the same GPU; where the folder has them, the slowest KV calls split around their
compute-stream wait (kv-*.json), the garbage collector's pauses (gc-*.json) and the slow calls' innermost frames
(slow-*.json, `--slow-call-ms`). Writes JSON.

    python benchmarks/gpu_pool_calls.py RUN_DIR/serve-processes-pd.calls --out calls.json [--window 50]
        [--run RUN_DIR/run-processes-pd-r1.json]

With `--run` (a run gpu_pool.py wrote with the requests' times on the calls' clock), each served request's
TTFT split in three: from sent to the start of the prefill call that gave its first token (the gateway and
controller's admission, the queue, any switch), that call, and from its end to the first token at the client
(delivery: the engine's reply, the controller, the gateway's stream) - medians, and over the requests sent while
that instance was idle (admission without a queue).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from collections.abc import Sequence
from typing import Any

Call = tuple[str, float, float]  # method, started at (monotonic s), seconds


def load(folder: Path) -> dict[str, list[Call]]:
    logs = {p.stem.removeprefix("calls-"): [tuple(row) for row in json.loads(p.read_text())]
            for p in sorted(folder.glob("calls-*.json"))}
    if not logs:
        raise SystemExit(f"{folder}: no calls-*.json (a gpu_pool.py run on the processes backend writes them)")
    return logs


def after(calls: list[Call], index: int) -> str:
    """What came before decode step `index`: the call that most likely delayed it."""
    before = [m for m, _, _ in calls[max(0, index - 3) : index] if m != "stats"]
    if before[-1:] == ["prefetch"]:
        return "after prefetch"
    if "activate" in before[-2:]:
        return "after a switch"
    if before[-1:] in (["restore_kv"], ["import_kv"]):
        return "after a swap-in"
    return "after a decode step" if before[-1:] == ["decode_step"] else "after " + (before[-1] if before else "-")


def overlap_s(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans if b > start and a < end)


def summarize(logs: dict[str, list[Call]], window_s: float) -> dict[str, Any]:
    end = max(t + d for calls in logs.values() for _, t, d in calls)
    start = end - window_s
    out: dict[str, Any] = {"window_s": window_s, "instances": {}}
    for iid, calls in logs.items():
        others = [(t, t + d) for other, rows in logs.items() if other != iid for m, t, d in rows
                  if m == "prefill" and t >= start]
        methods: dict[str, float] = defaultdict(float)
        steps: dict[str, list[float]] = defaultdict(list)
        moves: dict[str, list[float]] = defaultdict(list)  # KV calls and switches by the call before them
        gaps: list[tuple[float, float]] = []  # (seconds, at) from a decode step's end to the next's start
        beside: dict[str, list[float]] = defaultdict(list)
        for k, (method, t, d) in enumerate(calls):
            if t < start:
                continue
            methods[method] += d
            if method == "decode_step":
                steps[after(calls, k)].append(d)
                if k and calls[k - 1][0] == "decode_step":
                    gaps.append((t - calls[k - 1][1] - calls[k - 1][2], t - start))
                beside["beside a prefill" if overlap_s(t, t + d, others) > 0 else "alone"].append(d)
            elif method in ("import_kv", "export_kv", "restore_kv", "save_kv", "activate") and k:
                moves[f"{method} {after(calls, k)}"].append(d)
        out["instances"][iid] = {
            "seconds_by_method": {m: round(s, 3) for m, s in sorted(methods.items(), key=lambda kv: -kv[1])},
            "decode_steps": {k: _stats(v) for k, v in sorted(steps.items())},
            "moves": {k: _stats(v) for k, v in sorted(moves.items())},
            # the host outside the engine between two steps of a turn; the longest: a stall (a pause of the
            # serve process shows on every instance at once)
            "gaps_between_decode_steps": _stats([g for g, _ in gaps]) if gaps else None,
            "longest_gaps_between_decode_steps": [{"ms": round(1e3 * g, 1), "at_s": round(at, 3)}
                                                  for g, at in sorted(gaps, reverse=True)[:3]],
            "decode_steps_by_overlap": {k: _stats(v) for k, v in sorted(beside.items())}}
    return out


def ttft_parts(logs: dict[str, list[Call]], run: dict[str, Any]) -> dict[str, Any]:
    """Each served request's TTFT as (sent -> prefill call, the call, call end -> first token), on the calls' clock:
    the prefill call (of any instance) that began after the request was sent and ended last before its first
    token; medians over all and over those sent while no call of that instance was in flight. Of those sent while
    it was idle that it went straight to (nothing but their switch between), also the admission: sent -> that
    instance's next call (the gateway, the pool's loop and the backend's hop; no queue) - with the delivery, what
    the live pool adds to a request outside its engine calls (sims' request_admit_s and token_deliver_s)."""
    t0 = run["replay_t0_monotonic"]
    prefills = sorted((t, t + d, iid) for iid, rows in logs.items() for m, t, d in rows if m == "prefill")
    busy = {iid: [(t, t + d) for _, t, d in rows] for iid, rows in logs.items()}
    calls = {iid: sorted((t, m) for m, t, _ in rows if m != "stats") for iid, rows in logs.items()}  # polls aside
    parts: dict[str, list[float]] = defaultdict(list)
    for r in run["requests"]:
        if not r.get("served") or "first_s" not in r:
            continue
        sent, first = t0 + r["sent_s"], t0 + r["first_s"]
        mine = [(b, e, iid) for b, e, iid in prefills if b >= sent and e <= first]
        if not mine:
            continue
        begin, end, iid = max(mine, key=lambda c: c[1])
        split = {"to_prefill": begin - sent, "prefill": end - begin, "delivery": first - end}
        idle = not any(a < sent < b for a, b in busy[iid])
        # its admission, where the instance was idle and went straight to it: between its send and its prefill,
        # that instance ran nothing but the switch to its model (a prefetch or activate)
        between = [(t, m) for t, m in calls[iid] if sent <= t < begin]
        if idle and all(m in ("activate", "prefetch") for _, m in between):
            parts["admission (sent while idle)"].append((between[0][0] if between else begin) - sent)
        for name, value in split.items():
            parts[name].append(value)
            if idle:
                parts[f"{name} (sent while idle)"].append(value)
    return {"requests": len(parts["prefill"]), **{name: _stats(v) for name, v in parts.items()}}


def inside_calls(folder: Path, start: float) -> dict[str, Any]:
    """What else the call-log folder holds, from `start` (the calls' clock) on, per instance: the slowest KV calls
    split as the engine timed them (kv-*.json: before the compute-stream wait, the wait, after it), the garbage
    collector's pauses (gc-*.json) and, where SlowCalls sampled (slow-*.json), each slow call's innermost frame by
    how many samples it had (about a quarter of the threshold each)."""
    out: dict[str, Any] = defaultdict(dict)
    for iid, rows in load_kv(folder).items():
        mine = sorted((r for r in rows if r[3] >= start), key=lambda r: -r[4])[:5]
        out[iid]["slowest_kv_calls"] = [{"method": m, "requests": n, "ms": round(s * 1e3, 1),
                                         "before_wait_ms": round(x * 1e3, 1), "wait_ms": round(w * 1e3, 1),
                                         "after_wait_ms": round((s - w - x) * 1e3, 1)} for m, n, _, _, s, w, x in mine]
    for path in sorted(folder.glob("gc-*.json")):
        pauses = [(g, s) for g, t, s in json.loads(path.read_text()) if t >= start]
        out[path.stem.removeprefix("gc-")]["gc"] = {
            f"gen{g}": {"collections": sum(1 for h, _ in pauses if h == g),
                        "ms_sum": round(1e3 * sum(s for h, s in pauses if h == g), 2),
                        "ms_max": round(1e3 * max(s for h, s in pauses if h == g), 2)}
            for g in sorted({g for g, _ in pauses})}
    for path in sorted(folder.glob("slow-*.json")):
        frames: dict[str, int] = defaultdict(int)
        for method, t, _, stack in json.loads(path.read_text()):
            if t >= start and stack:
                frames[f"{method}: {stack[-1]}"] += 1
        out[path.stem.removeprefix("slow-")]["slow_call_frames"] = dict(sorted(frames.items(), key=lambda kv: -kv[1])[:8])
    return dict(out)


def load_kv(folder: Path) -> dict[str, list[list[Any]]]:
    """Each instance's KV call log (kv-<instance>.json: method, requests, bytes, started at, seconds, waited,
    before the wait; pool.engines.timings.StepTimings.dump_kv_calls); empty for serves that predate it."""
    return {p.stem.removeprefix("kv-"): json.loads(p.read_text()) for p in sorted(folder.glob("kv-*.json"))}


def run_kv_calls(kv_logs: dict[str, list[list[Any]]], run: dict[str, Any], drain_s: float = 2.0) -> dict[str, list]:
    """A run's KV calls per instance as [method, requests, seconds] rows: those that began during its replay (its
    last request answered: every hand-off done) or the `drain_s` after it (the calls' clock), for `modelpool calibrate --from-live` to fit a hand-off's move
    per request (the run's kv_timings only say how many and how long on average)."""
    start = run["replay_t0_monotonic"]
    end = start + run["replay_s"] + drain_s
    return {iid: [[row[0], row[1], row[4]] for row in rows if start <= row[3] <= end] for iid, rows in kv_logs.items()}


def call_gaps(logs: dict[str, list[Call]], run: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per instance, the host time between two engine calls in a run's replay (the calls' clock), by the pair of
    methods: from one call's end to the next's start - the controller's loop, the Plan, the backend's hop. Within
    a group prefill's round (activate -> prefill -> decode_step -> export_kv) the next call is always due, so
    those gaps are what the live pool adds between a round's steps; a gap after the round's last call also holds
    any wait for work. stats() polls are left out (they interleave with everything)."""
    start = run["replay_t0_monotonic"]
    end = start + run["replay_s"]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for iid, rows in logs.items():
        calls = [(m, t, d) for m, t, d in rows if m != "stats" and start <= t <= end]
        gaps: dict[str, list[float]] = defaultdict(list)
        for (m0, t0, d0), (m1, t1, _) in zip(calls, calls[1:]):
            gaps[f"{m0} -> {m1}"].append(max(0.0, t1 - t0 - d0))
        out[iid] = {pair: _stats(v) for pair, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))}
    return out


MATCH_S = 0.001  # a prefill sample and its engine call agree on their seconds within this


def prefill_overlaps(logs: dict[str, list[Call]], run: dict[str, Any]) -> dict[str, list[float | None]]:
    """For each engine's prefill samples in a run (`prefill_samples`: model, tokens, requests, seconds), the
    share of its call that other instances' decode steps overlapped on the calls' clock - a prefill beside a
    decoding process runs slower (gpu_share_slowdown), and `modelpool calibrate --from-live` fits the engine's
    own prefill in the pool to the others. The samples are an engine's latest prefills when the run ended, the
    call log all of the serve's: they are matched as the run of consecutive prefill calls whose seconds agree
    best (within MATCH_S each); None where no run of calls agrees."""
    out: dict[str, list[float | None]] = {}
    for iid, samples in (run.get("prefill_samples") or {}).items():
        if not samples or iid not in logs:
            continue
        calls = [(t, d) for m, t, d in logs[iid] if m == "prefill"]
        seconds = [row[3] for row in samples]
        best, best_err = None, None
        for start in range(len(calls) - len(seconds) + 1):
            errs = [abs(calls[start + k][1] - s) for k, s in enumerate(seconds)]
            if max(errs) <= MATCH_S and (best_err is None or sum(errs) < best_err):
                best, best_err = start, sum(errs)
        if best is None:
            out[iid] = [None] * len(samples)
            continue
        decodes = sorted((t, t + d) for other, rows in logs.items() if other != iid for m, t, d in rows
                         if m == "decode_step")
        shares: list[float | None] = []
        for t, d in calls[best : best + len(seconds)]:
            shares.append(round(overlap_s(t, t + d, decodes) / d, 4) if d > 0 else 0.0)
        out[iid] = shares
    return out


def write_run(path: Path, run: dict[str, Any]) -> None:
    """A run's JSON, compact: its requests' inter-token gaps are most of it (benchmarks/out/ keeps many runs)."""
    path.write_text(json.dumps(run, separators=(",", ":"), default=str))


def plan_summary(lines: Sequence[str]) -> dict[str, dict[str, dict[str, float]]]:
    """What a run's Plans ordered, per instance and action: how many, their requests on average, and for Decode
    the steps a turn may take - a plan log's lines (`modelpool serve --plan-log`, or the simulator's
    `plan_log`: one format), so that the live pool's and the simulator's choices on one trace line up."""
    sizes: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    steps: dict[str, list[int]] = defaultdict(list)
    for line in lines:
        for iid, actions in json.loads(line)["actions"].items():
            for action in actions:
                sizes[iid][action["op"]].append(len(action.get("request_ids", ())))
                if action["op"] == "Decode":
                    steps[iid].append(action["max_steps"])
    out: dict[str, dict[str, dict[str, float]]] = {}
    for iid, ops in sorted(sizes.items()):
        out[iid] = {op: {"actions": len(n), "requests_mean": round(statistics.fmean(n), 3)} for op, n in sorted(ops.items())}
        if steps[iid]:
            out[iid]["Decode"]["max_steps_mean"] = round(statistics.fmean(steps[iid]), 3)
    return out


def prefill_rounds(lines: Sequence[str], first: int = 0) -> dict[str, dict[str, dict[str, float | None]]]:
    """Each instance's group prefills by model, from a plan log's lines (the live pool's and the simulator's: one
    format) from line `first` on (the lines before only say which model each instance holds): how many rounds, their prompts on average, the share that began with a switch to the model, and the
    mean seconds from the round's Plan to that instance's next Plan (its switch and prefill: what the round held
    the instance for). Where the live pool and the simulator differ model by model, this says whether in how
    often a model's group is prefilled or in how long each round takes."""
    plans = [json.loads(line) for line in lines]
    next_at: list[dict[str, float]] = []  # per Plan, each instance's next Plan's time (a pass from the end)
    later: dict[str, float] = {}
    for plan in reversed(plans):
        next_at.append(dict(later))
        later.update((iid, plan["at"]) for iid in plan["actions"])
    next_at.reverse()
    rounds: dict[str, dict[str, list[tuple[int, bool, float | None]]]] = defaultdict(lambda: defaultdict(list))
    current: dict[str, str] = {}  # each instance's model: its latest Switch (a Prefill names none)
    for k, (plan, after) in enumerate(zip(plans, next_at)):
        for iid, actions in plan["actions"].items():
            switch = next((a for a in actions if a["op"] == "Switch"), None)
            if switch is not None:
                current[iid] = switch["model"]
            prefill = next((a for a in actions if a["op"] == "Prefill"), None)
            if prefill is None or k < first:
                continue
            held = after[iid] - plan["at"] if iid in after else None
            rounds[iid][current.get(iid, "?")].append((len(prefill["request_ids"]), switch is not None, held))
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for iid, models in sorted(rounds.items()):
        out[iid] = {}
        for model, rows in sorted(models.items()):
            held = [s for _, _, s in rows if s is not None]
            out[iid][model] = {"rounds": len(rows), "prompts_mean": round(statistics.fmean(n for n, _, _ in rows), 3),
                               "switched_share": round(sum(1 for _, w, _ in rows if w) / len(rows), 3),
                               "held_ms_mean": round(1e3 * statistics.fmean(held), 2) if held else None}
    return out


def switch_times(lines: Sequence[str], logs: dict[str, list[Call]], first: int = 0,
                 end: int | None = None) -> dict[str, dict[str, list[float]]]:
    """Each instance's switches by model in plan-log lines [first, end): the seconds of the `activate` call that
    ran each Switch (a prefetched model's: what was left of its copy), matched in order - an engine runs its
    Switches as it is handed them, one activate each, so the n-th Switch of the whole log is its n-th activate.
    An instance whose counts differ (a restart: the log and the calls no longer line up) is left out."""
    switches: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for k, line in enumerate(lines):
        for iid, actions in json.loads(line)["actions"].items():
            switches[iid] += [(k, a["model"]) for a in actions if a["op"] == "Switch"]
    out: dict[str, dict[str, list[float]]] = {}
    for iid, rows in sorted(switches.items()):
        activates = [d for m, _, d in logs.get(iid, []) if m == "activate"]
        if len(activates) != len(rows):
            continue
        by_model: dict[str, list[float]] = defaultdict(list)
        for (k, model), seconds in zip(rows, activates):
            if first <= k < (len(lines) if end is None else end):
                by_model[model].append(round(seconds, 6))
        out[iid] = dict(sorted(by_model.items()))
    return out


def switch_summary(by_model: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per model: how many switches, their mean and p90 ms (the live and the simulated side alike)."""
    return {model: {"n": len(v), "mean_ms": round(1e3 * statistics.fmean(v), 1),
                    "p90_ms": round(1e3 * sorted(v)[int(0.9 * (len(v) - 1))], 1)}
            for model, v in sorted(by_model.items()) if v}


def _stats_line(label: str, s: dict[str, float]) -> str:
    return (f"   {label:34s} n={s['n']:5d} mean {s['mean_ms']:7.2f} ms  p50 {s['p50_ms']:7.2f}  max {s['max_ms']:7.1f}"
            f"  sum {s['sum_s']:6.2f} s")


def _stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "mean_ms": round(1e3 * statistics.fmean(values), 2),
            "p50_ms": round(1e3 * statistics.median(values), 2), "max_ms": round(1e3 * max(values), 1),
            "sum_s": round(sum(values), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("calls", type=Path, help="a serve-<backend>-<layout>.calls folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--window", type=float, default=50.0, help="seconds before the last call (the last run)")
    parser.add_argument("--run", type=Path, help="a run JSON of the same serve: split its requests' TTFT")
    parser.add_argument("--save", action="store_true", help="with --run: also write the split into the run JSON as "
                        "its ttft_parts, its prefill samples' overlap with decode steps as prefill_overlap and its KV calls as "
                        "kv_calls "
                        "(gpu_pool.py does for its runs; for runs recorded before it did)")
    args = parser.parse_args()
    logs = load(args.calls)
    result = summarize(logs, args.window)
    end = max(t + d for calls in logs.values() for _, t, d in calls)
    result["inside"] = inside_calls(args.calls, end - args.window)
    if args.run is not None:
        run = json.loads(args.run.read_text())
        result["ttft_parts"] = ttft_parts(logs, run)
        result["prefill_overlap"] = prefill_overlaps(logs, run)
        kv = load_kv(args.calls)
        if args.save:
            saved = {**run, "ttft_parts": result["ttft_parts"], "prefill_overlap": result["prefill_overlap"]}
            write_run(args.run, {**saved, "kv_calls": run_kv_calls(kv, run)} if kv else saved)
        for name, s in result["ttft_parts"].items():
            if isinstance(s, dict):
                print(f"TTFT {name:32s} n={s['n']:5d} mean {s['mean_ms']:7.2f} ms  p50 {s['p50_ms']:7.2f}"
                      f"  max {s['max_ms']:7.1f}")
    for iid, r in result["instances"].items():
        print(f"{iid}: " + ", ".join(f"{m} {s:.2f} s" for m, s in r["seconds_by_method"].items()))
        for group in ("decode_steps", "decode_steps_by_overlap"):
            for name, s in r[group].items():
                print(_stats_line(f"decode_step {name}", s))
        if r["gaps_between_decode_steps"]:
            print(_stats_line("gap between two decode steps", r["gaps_between_decode_steps"]) + "; longest: " + ", ".join(
                f"{x['ms']:.1f} ms at {x['at_s']:.1f} s" for x in r["longest_gaps_between_decode_steps"]))
        for name, s in r["moves"].items():
            print(_stats_line(name, s))
        inside = result["inside"].get(iid, {})
        for call in inside.get("slowest_kv_calls", []):
            print(f"   slow KV call {call['method']:18s} {call['requests']:3d} requests {call['ms']:7.1f} ms: "
                  f"{call['before_wait_ms']} before the wait, {call['wait_ms']} waiting, {call['after_wait_ms']} after")
        if inside.get("gc"):
            print("   garbage collections: " + ", ".join(f"{g} {f['collections']} x, {f['ms_sum']} ms, max {f['ms_max']}"
                                                       for g, f in inside["gc"].items()))
        for frame, count in inside.get("slow_call_frames", {}).items():
            print(f"   slow calls' innermost frame {count:5d} samples  {frame}")
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
