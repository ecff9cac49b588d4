"""A calibration profile from `modelpool calibrate`'s measurements, with the provenance of every term.

The engine's own times (prefill, decode steps, switches, KV moves) are fitted
by `sims.profiles.fitting`, as the shipped profiles are. On top of them:

- eff_pcie_shared, from two engines switching in models on one device at the
  same time: under processor sharing (sims.links) the last of two copies of
  w1 >= w2 seconds alone ends at 2 w2 / s + (w1 - w2), s the link's shared
  rate; s from the span measured, times eff_pcie;
- a check, recorded in link_sharing's provenance: KV moves measured beside
  another engine's switch on the same device against what the host links of
  that rule charge them (the restore shares the switch's direction, the save
  does not); the simulator has no term of its own for them;
- prefill_host_s and decode_host_s, from the live pool's load
  (`modelpool.measure_live`): what the sink saw less what the fitted engine
  terms predict (first token after submit; the gap between tokens);
- gpu_share_slowdown, from benchmarks/gpu_prefill_probe.py (measurements'
  "gpu_share", added by `with_gpu_share`): the median over prompts of a prefill's
  time while another process decodes on the same GPU, over its time alone;
- decode_host_s and decode_host_request_s from a run of the live pool itself
  (`with_live_host`: a benchmarks/gpu_pool.py run, on the backend and layout
  that served): each decode step's time outside the engine (the backend hop,
  the controller, the runner: period less the engine's call), per batch size,
  fitted as a + b x batch; with it, where the run has them, kv_handoff_fixed_s
  (its staged hand-offs' calls), prefill_fresh_s (the engine alone at the
  run's shapes) and request_admit_s / token_deliver_s (its requests sent to an
  idle instance: the client's send to the next engine call, the prefill call's
  end to the first token at the client; gpu_pool.py's ttft_parts).

Terms not measured (the NVLink ones; a family with no points) keep the base
profile's value and provenance. No torch here: the measurements are plain data.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from scheduler.costs import InstanceSpec
from scheduler.fleet import Arch, GpuSpec
from sims.costmodel import RooflineCostModel
from sims.links import HostLinks
from sims.profiles import CalibrationProfile, CalibrationRun, ProfileTerms, Provenance, load_profile
from sims.profiles.fitting import Anchor, Check, Fit, fit, predict, sig


def anchors_from(measurements: Mapping[str, Any]) -> list[Anchor]:
    """The measured engine times as fitting anchors (a KV move counts out and back)."""
    out = [Anchor("prefill", p["arch"], p["seconds"], p["batch"], p["tokens"]) for p in measurements["prefill"]]
    out += [Anchor("decode", d["arch"], d["seconds"], d["batch"], d["context"], cuda_graphs=d["graphs"])
            for d in measurements["decode"]]
    out += [Anchor("swap", s["arch"], s["seconds"], swap_bytes=s["bytes"]) for s in measurements["swap"]]
    for k in measurements["kv_move"]:
        out += [Anchor("kv_move", k["arch"], k[key], k["batch"], swap_bytes=k["bytes"]) for key in ("save_s", "restore_s")]
    return out


def build_profile(measurements: Mapping[str, Any], archs: Mapping[str, Arch], gpu: str, spec: GpuSpec, *,
                  run: Mapping[str, Any], name: str = "", base: CalibrationProfile | None = None) -> CalibrationProfile:
    """The profile of `measurements` (modelpool.measure's result) on GPU type `gpu` (figures `spec`). `run`:
    the CalibrationRun fields but figures and measurements (command, device, measured_at, ...)."""
    base = base or load_profile("default")
    where = f"modelpool calibrate on {measurements['device']} ({gpu}), {str(run['measured_at'])[:10]}"
    terms: dict[str, Any] = dict(base.terms_for(gpu).model_dump())
    provenance = {term: base.entry(term, gpu) for term in terms}
    fitted, sources = _engine_fit(measurements, archs, gpu, spec, where)
    terms.update(fitted)
    provenance.update(sources)
    figures = {key: float(value) for key, value in measurements.get("figures", {}).items()}
    fresh = [max(0.0, p["first_s"] - p["seconds"]) for p in measurements["prefill"] if "first_s" in p]
    if fresh:
        terms["prefill_fresh_s"] = sig(statistics.median(fresh))
        provenance["prefill_fresh_s"] = Provenance(status="measured", gpus=(gpu,), source=(
            f"the median over {len(fresh)} prefill shapes of the first run's time over the repeats' "
            f"({min(fresh) * 1e3:.2f}-{max(fresh) * 1e3:.2f} ms) ({where})"))
    if "prefill_padded" in figures:  # a setting of the engine measured (its CUDA default; calibrate's lengths are
        # padded counts already, so the fit above saw the same rows either way)
        terms["prefill_padded"] = bool(figures["prefill_padded"])
        provenance["prefill_padded"] = Provenance(status="measured", gpus=(gpu,), source=(
            f"measured setting: the engine {'padded' if terms['prefill_padded'] else 'did not pad'} its prefills' "
            f"tokens (scheduler.costs.padded_prefill_tokens) ({where})"))
    link = _link_terms(measurements, float(terms["eff_pcie"]), gpu, f" ({where})")
    if link is not None:
        link_terms, link_sources, figures["shared_link_rate"] = link
        terms.update(link_terms)
        provenance.update(link_sources)
    if measurements.get("gpu_share"):
        sharing_terms, sharing_sources, sharing_spread = _gpu_share_terms(measurements["gpu_share"], gpu)
        terms.update(sharing_terms)
        provenance.update(sharing_sources)
        figures.update(sharing_spread)
    draft = CalibrationProfile(name="draft", terms=ProfileTerms.model_validate({**terms, "prefill_host_s": 0.0,
                                                                               "prefill_fresh_s": 0.0,
                                                                               "decode_host_s": 0.0}),
                               provenance=provenance)  # the engine alone: what the live pool's times are held against
    if measurements.get("kv_shared"):
        checked, spread = _kv_beside_copy(measurements, draft, spec, gpu)
        entry = provenance["link_sharing"]
        provenance["link_sharing"] = entry.model_copy(update={"source": f"{entry.source}; {checked} ({where})"})
        figures.update(spread)
    live = measurements.get("live")
    if live:
        _host_terms(draft, live, archs, gpu, spec, terms, provenance, figures, where)
    return CalibrationProfile(
        name=name or f"calibrated-{gpu}", terms=ProfileTerms.model_validate(terms), provenance=provenance,
        description=f"Measured by `{run['command']}` on {measurements['device']} ({gpu}); terms it did not measure "
                    f"come from the {base.name} profile. On other GPUs its numbers are extrapolations.",
        calibration=CalibrationRun(**{**run, "gpu": gpu, "device": measurements["device"], "figures": figures,
                                      "software": {**measurements.get("software", {}), **run.get("software", {})},
                                      "measurements": dict(measurements)}))


def _engine_fit(measurements: Mapping[str, Any], archs: Mapping[str, Arch], gpu: str, spec: GpuSpec,
                where: str) -> tuple[dict[str, Any], dict[str, Provenance]]:
    """The engine terms `measurements` determine (sims.profiles.fitting) and where each came from."""
    fitted = fit(anchors_from(measurements), spec, archs.__getitem__)
    sources = _sources(measurements, fitted)
    provenance = {term: Provenance(status="measured", gpus=(gpu,), source=(
        f"{sources[term]}{_HELD.get(term, '') if term in fitted.held else ''} ({where})")) for term in fitted.terms}
    return dict(fitted.terms), provenance


def with_engine_refit(profile: CalibrationProfile, archs: Mapping[str, Arch], spec: GpuSpec,
                      name: str = "") -> CalibrationProfile:
    """`profile` (one `modelpool calibrate` measured) with its engine terms fitted again to the measurements it
    carries, by this modelpool's fits; every other term kept (the live pool's were fitted on top of the old
    engine terms: where those moved, refit them too). `archs`: the measured shapes by their key in the
    measurements (the fleet's arch names), on a GPU of figures `spec`."""
    if profile.calibration is None:
        raise ValueError(f"profile {profile.name!r} carries no calibration measurements (a shipped profile, or one "
                         f"written before calibrate kept them)")
    run = profile.calibration
    missing = sorted(set(run.measurements.get("shapes", {})) - set(archs))
    if missing:
        raise ValueError(f"the shapes {', '.join(missing)} the profile measured are not in the fleet given")
    where = (f"modelpool calibrate on {run.device} ({run.gpu}), {str(run.measured_at)[:10]}; refitted "
             f"{datetime.date.today().isoformat()}")
    fitted, sources = _engine_fit(run.measurements, archs, run.gpu, spec, where)
    moved = sorted(t for t, v in fitted.items() if getattr(profile.terms, t) != v)
    return CalibrationProfile.model_validate({
        **profile.model_dump(), "name": name or profile.name,
        "description": f"{profile.description} Engine terms refitted to its measurements"
                       + (f" ({', '.join(moved)} moved)." if moved else " (none moved)."),
        "terms": {**profile.terms.model_dump(), **fitted},
        "provenance": {**profile.model_dump()["provenance"], **{k: v.model_dump() for k, v in sources.items()}}})


def with_gpu_share(profile: CalibrationProfile, probe: Mapping[str, Any], where: str) -> CalibrationProfile:
    """`profile` (one `modelpool calibrate` wrote) with gpu_share_slowdown fitted to `probe`, the result of
    benchmarks/gpu_prefill_probe.py, measured `where` (device and date, in words); the probe's series go into
    its measurements, so a refit (build_profile) keeps the term."""
    if profile.calibration is None:
        raise ValueError(f"profile {profile.name!r} has no calibration run to add the probe's measurements to")
    beside = probe["with_decode_process"]
    entry = {"with_decode_process": beside, "alone": {model: probe[model]["fresh_again"] for model in beside},
             "where": where, "mps": probe.get("mps")}
    if probe.get("decode_share"):
        entry["decode_share"] = probe["decode_share"]
    terms, provenance, spread = _gpu_share_terms(entry, profile.calibration.gpu)
    run = profile.calibration.model_copy(update={
        "measurements": {**profile.calibration.measurements, "gpu_share": entry},
        "figures": {**profile.calibration.figures, **spread}})
    return profile.model_copy(update={
        "terms": ProfileTerms.model_validate({**profile.terms.model_dump(), **terms}),
        "provenance": {**profile.provenance, **provenance}, "calibration": run})


def with_link_share(profile: CalibrationProfile, probe: Mapping[str, Any], where: str) -> CalibrationProfile:
    """`profile` (one `modelpool calibrate` wrote) with link_sharing and eff_pcie_shared read from `probe`, the
    result of benchmarks/gpu_link_share.py, measured `where` (device and date, in words): two engine processes
    copying at once, as the live pool's instances do (calibrate's own pair comes from two threads of one process,
    which the copy engine may serve otherwise). The probe goes into the measurements, so a refit keeps it."""
    if profile.calibration is None:
        raise ValueError(f"profile {profile.name!r} has no calibration run to add the probe's measurements to")
    entry = {key: probe[key] for key in ("mode", "mps", "device", "alone", "shared", "small_beside", "bytes")
             if key in probe}
    entry["where"] = where
    measurements = {**profile.calibration.measurements, "link_share": entry}
    link = _link_terms(measurements, float(profile.terms.eff_pcie), profile.calibration.gpu)
    if link is None:
        raise ValueError("the probe's copies did not overlap: nothing to read the link's sharing from")
    terms, provenance, rate = link
    run = profile.calibration.model_copy(update={
        "measurements": measurements, "figures": {**profile.calibration.figures, "shared_link_rate": rate}})
    return profile.model_copy(update={
        "terms": ProfileTerms.model_validate({**profile.terms.model_dump(), **terms}),
        "provenance": {**profile.provenance, **provenance}, "calibration": run})


def _gpu_share_terms(entry: Mapping[str, Any], gpu: str) -> tuple[dict[str, float], dict[str, Provenance],
                                                                   dict[str, float]]:
    """The GPU-sharing terms a probe entry measures (gpu_share_slowdown; gpu_share_decode_slowdown where it has the
    decode series), their provenance and their spread figures."""
    value, source, spread = _gpu_share(entry, gpu)
    terms, provenance = {"gpu_share_slowdown": value}, {"gpu_share_slowdown": source}
    if entry.get("decode_share"):
        terms["gpu_share_decode_slowdown"], provenance["gpu_share_decode_slowdown"], more = _gpu_share_decode(entry, gpu)
        spread = {**spread, **more}
    return terms, provenance, spread


def _sharing(entry: Mapping[str, Any]) -> str:
    """How the probe's two processes shared the GPU, as its result says (older results do not)."""
    mps = entry.get("mps")
    return "under MPS" if mps else "time-sliced, no MPS" if mps is not None else "MPS not recorded"


def _gpu_share_decode(entry: Mapping[str, Any], gpu: str) -> tuple[float, Provenance, dict[str, float]]:
    """gpu_share_decode_slowdown from the probe's decode series: per model and repetition, the decode step's time
    while another process prefilled back to back, over the median of its times alone; the median."""
    share = entry["decode_share"]
    ratios = sorted(ms / statistics.median(share["alone"][model])
                    for model, series in share["beside_prefill_process"].items() for ms in series)
    if not ratios:
        raise ValueError("the probe has no decode step measured beside a prefilling process")
    value = sig(statistics.median(ratios))
    source = (f"decode steps of {', '.join(share['alone'])} (batch {share['batch']}, CUDA graphs) while another "
              f"process prefilled back to back on the same GPU ({_sharing(entry)}), over the same steps alone: ratio "
              f"median {value}, range {ratios[0]:.2f}-{ratios[-1]:.2f} (benchmarks/gpu_prefill_probe.py, "
              f"{entry['where']})")
    spread = {"gpu_share_decode_ratio_min": round(ratios[0], 4), "gpu_share_decode_ratio_max": round(ratios[-1], 4)}
    return value, Provenance(status="measured", gpus=(gpu,), source=source), spread


def _gpu_share(entry: Mapping[str, Any], gpu: str) -> tuple[float, Provenance, dict[str, float]]:
    """gpu_share_slowdown from the probe's series: per prompt, its prefill beside a process decoding on the
    same GPU over the same prompt length alone (the second pass over the fresh lengths: warm); the median.
    Also the ratios' p10 and p90, as figures."""
    ratios: list[float] = []
    what = []
    for model, beside in entry["with_decode_process"].items():
        alone = {int(tokens): ms for tokens, ms in entry["alone"][model]}
        ratios += [ms / alone[int(tokens)] for tokens, ms in beside if int(tokens) in alone]
        lengths = [int(tokens) for tokens, _ in beside]
        what.append(f"{len(beside)} prefills of {model} ({min(lengths)}-{max(lengths)} tokens)")
    if not ratios:
        raise ValueError("the probe has no prefill measured both alone and beside a decoding process")
    ratios.sort()
    value = sig(statistics.median(ratios))
    deciles = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else [ratios[0]] * 9
    source = (f"{', '.join(what)} while another process decoded continuously on the same GPU (CUDA-graph steps, "
              f"{_sharing(entry)}), over the same lengths alone: ratio median {value}, range "
              f"{ratios[0]:.2f}-{ratios[-1]:.2f} (benchmarks/gpu_prefill_probe.py, {entry['where']})")
    spread = {"gpu_share_ratio_p10": round(deciles[0], 4), "gpu_share_ratio_p90": round(deciles[-1], 4)}
    return value, Provenance(status="measured", gpus=(gpu,), source=source), spread


def fit_errors(profile: CalibrationProfile, archs: Mapping[str, Arch], spec: GpuSpec) -> list[Check]:
    """Every measured engine time of a calibrated profile, predicted by it without the live pool's host terms
    (the engine was timed alone): the fit's error table."""
    assert profile.calibration is not None
    engine = profile.model_copy(update={"terms": profile.terms.model_copy(update={"prefill_host_s": 0.0,
                                                                                  "prefill_fresh_s": 0.0,
                                                                                  "decode_host_s": 0.0})})
    return predict(engine, anchors_from(profile.calibration.measurements), spec, profile.calibration.gpu,
                   archs.__getitem__)


_NEGATIVE = "; held at 0 (the fit wanted it negative)"
_HELD = {"prefill_layer_s": "; held at 0", "kv_move_fixed_s": "; held at 0",
         "launch_s_per_layer": "; held at 0 (eager steps no slower than the fitted ones)",
         **{term: _NEGATIVE for term in ("prefill_fixed_s", "decode_fixed_s", "decode_layer_s", "decode_request_s",
                                         "switch_fixed_s", "prefill_request_s")}}
_HELD.update({eff: "; held at 1 (the times did not grow with the work, or grew less than the datasheet allows)"
              for eff in ("eff_compute", "eff_mem", "eff_kv", "eff_pcie", "eff_kv_move")})


def _sources(m: Mapping[str, Any], fitted: Fit) -> dict[str, str]:
    def values(rows: list[dict[str, Any]], key: str) -> str:
        return "/".join(str(v) for v in sorted({r[key] for r in rows}))

    shapes = ", ".join(m["shapes"])
    decode = [d for d in m["decode"] if d["graphs"]] or m["decode"]
    mode = "CUDA-graph" if decode and decode[0]["graphs"] else "eager"
    dec = f"fitted to {len(decode)} {mode} decode steps of {shapes}, batch {values(decode, 'batch')}, " \
          f"context {values(decode, 'context')} per request"
    pre = f"fitted to {len(m['prefill'])} prefills of {shapes}, {values(m['prefill'], 'tokens')} tokens x " \
          f"{values(m['prefill'], 'batch')} prompts"
    swap = f"fitted to {len(m['swap'])} weight switches (activate from pinned host memory) of {shapes}"
    kv = (f"fitted to {2 * len(m['kv_move'])} KV moves (save_kv and restore_kv) of {values(m['kv_move'], 'batch')} "
          f"requests" + (f" x {values(m['kv_move'], 'context')} tokens" if "context" in m["kv_move"][0] else "")
          if m["kv_move"] else "")
    eager = [d for d in m["decode"] if not d["graphs"]]
    launch = (f"eager decode ({len(eager)} steps) less the fitted overheads of its step, per layer" if mode == "CUDA-graph" else
              "no CUDA graphs on this device: the linear decode terms fit the eager steps; no separate floor")
    out = {"eff_mem": dec, "eff_kv": dec, "decode_fixed_s": dec + " (intercept)", "launch_s_per_layer": launch,
           "decode_layer_s": dec + " (per layer)", "decode_request_s": dec + " (per request of the batch)",
           "decode_cuda_graphs": f"measured setting: the decode steps ran {mode}",
           "eff_compute": pre, "prefill_fixed_s": pre + " (intercept)",
           "prefill_layer_s": pre if len({m["shapes"][a]["num_layers"] for a in m["shapes"]}) > 1 else
           "one layer count among the shapes measured: a per-layer term cannot be told from prefill_fixed_s",
           "prefill_request_s": pre, "prefill_cuda_graphs": "measured setting: the engine prefills eagerly",
           "eff_pcie": swap, "switch_fixed_s": swap + " (intercept)", "eff_kv_move": kv,
           "kv_move_fixed_s": kv + " (intercept: per move)"}
    return {term: out[term] for term in fitted.terms}


def _link_terms(m: Mapping[str, Any], eff_pcie: float, gpu: str, where: str = "") -> tuple[
        dict[str, Any], dict[str, Provenance], float] | None:
    """link_sharing and eff_pcie_shared as the measurements' pairs of copies say (`_link_sharing`), their
    provenance (`where`: appended to each source) and the link's shared rate; None when no pair overlapped."""
    link = _link_sharing(m)
    if link is None:
        return None
    sharing, shared = link
    what = _link_words(m)
    rule = "one copy kept its time alone, the other waited" if sharing == "fifo" else "both copies slowed down together"
    terms = {"link_sharing": sharing, "eff_pcie_shared": min(1.0, sig(shared * eff_pcie))}
    provenance = {
        "eff_pcie_shared": Provenance(status="measured", gpus=(gpu,), source=(
            f"{what}: the link moved {shared:.3f} of one copy's rate, times eff_pcie{where}")),
        "link_sharing": Provenance(status="measured", gpus=(gpu,), source=f"{what}: {rule}{where}")}
    return terms, provenance, round(shared, 4)


def _link_runs(m: Mapping[str, Any]) -> tuple[dict[str, float], Sequence[Mapping[str, Any]]]:
    """Each copy's seconds alone and the pairs started together: the probe of two engine processes where the
    measurements have one (`with_link_share`: as the live pool's instances copy), else calibrate's two threads."""
    probe = m.get("link_share")
    if probe:
        return {name: statistics.median(v) for name, v in probe["alone"].items()}, probe["shared"]
    return {s["arch"]: s["seconds"] for s in m["swap"]}, m.get("shared", [])


def _link_words(m: Mapping[str, Any]) -> str:
    """What the link rule was measured on, in words (the runs `_link_sharing` read)."""
    probe = m.get("link_share")
    alone, runs = _link_runs(m)
    if probe:
        run = runs[0]
        how = " (under MPS)" if probe.get("mps") else " (time-sliced, no MPS)" if probe.get("mps") is not None else ""
        small = probe.get("small_beside") or []
        beside = (f"; a {small[0]['small']} copy {1e3 * small[0]['small_started_s']:.0f} ms into the {small[0]['big']} "
                  f"took {statistics.median(x['small_s'] for x in small) / alone[small[0]['small']]:.1f}x its time "
                  f"alone" if small else "")
        on = f" {probe['device']}" if probe.get("device") else " device"
        return (f"two engine {probe['mode']}{how} on one{on} copying {' and '.join(run['archs'])} at once "
                f"({len(runs)} pairs of sizes; e.g. {', '.join(f'{t:.3f}' for t in run['seconds'])} s "
                f"against {', '.join(f'{alone[a]:.3f}' for a in run['archs'])} s alone{beside}; "
                f"benchmarks/gpu_link_share.py, {probe['where']})")
    together = ", ".join(f"{t:.3f}" for t in runs[0]["seconds"])
    apart = ", ".join(f"{alone[a]:.3f}" for a in runs[0]["archs"])
    return (f"two engines on one device switching in {' and '.join(runs[0]['archs'])} at once, from two threads "
            f"({len(runs)} times; {together} s against {apart} s alone)")


def _link_sharing(m: Mapping[str, Any]) -> tuple[str, float] | None:
    """How the link served two copies at once (link_sharing_of), from the runs `_link_runs` picks."""
    return link_sharing_of(*_link_runs(m))


def link_sharing_of(alone: Mapping[str, float], runs: Sequence[Mapping[str, Any]]) -> tuple[str, float] | None:
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


KV_RULE_TOLERANCE = 0.25  # measured / charged within 1 +- this: a KV move beside a switch follows the link rule


def _kv_beside_copy(m: Mapping[str, Any], profile: CalibrationProfile, spec: GpuSpec,
                    gpu: str) -> tuple[str, dict[str, float]]:
    """KV moves measured beside another engine's weight switch on the same device ("kv_shared") against what the
    simulator charges them there: `profile`'s host links (sims.links, from the cost model) with both instances
    on one link, each copy booked at its time alone (the kv_move and the swap measured of that point and model).
    A restore shares the switch's direction; a save goes the other way, which the links charge as if alone. The
    charge depends on which copy the link books first (an earlier booking keeps its end): both are given, and
    the move follows the rule when the nearer is within KV_RULE_TOLERANCE. The simulator has no term of its own
    for this, so nothing is fitted: words for link_sharing's provenance, and figures."""
    costs = RooflineCostModel.for_models({}, spec, profile, gpu_name=gpu, gpus_per_host_link=1)
    probe = costs.host_links(_PAIR, _ONE_GPU)
    assert isinstance(probe, HostLinks)  # gpus_per_host_link 1: the pair shares one link
    alone = {(k["arch"], k["batch"], k.get("context")): k for k in m["kv_move"]}
    switch_s = {s["arch"]: s["seconds"] for s in m["swap"]}
    words: list[str] = []
    figures: dict[str, float] = {}
    for way, to_device, direction in (("restore", True, "the switch's direction"),
                                      ("save", False, "the other direction")):
        ratio: dict[str, list[float]] = {"first": [], "behind": [], "alone": []}
        for row in m["kv_shared"]:
            kv_s, measured = alone[(row["arch"], row["batch"], row["context"])][f"{way}_s"], row[f"{way}_s"]
            ratio["alone"].append(measured / kv_s)
            for order in ("first", "behind"):
                charged = _charged_beside(costs, kv_s, switch_s[row["copied"]], to_device, order == "behind")
                ratio[order].append(measured / charged)
        median = {order: statistics.median(values) for order, values in ratio.items()}
        follows = min(abs(median[order] - 1.0) for order in ("first", "behind")) <= KV_RULE_TOLERANCE
        words.append(f"{way} ({direction}) took {median['alone']:.2f}x its time alone, {median['first']:.2f}x the "
                     f"links' charge booked first and {median['behind']:.2f}x booked behind the switch: "
                     + ("follows the rule" if follows else "does NOT follow the rule"))
        figures |= {f"kv_shared_{way}_{key}": round(value, 4) for key, value in
                    (("slowdown", median["alone"]), ("vs_rule_first", median["first"]),
                     ("vs_rule_behind", median["behind"]))}
    shapes = ", ".join(f"{r['arch']} {r['batch']}x{r['context']} tokens" for r in m["kv_shared"])
    return (f"checked against KV moves beside another engine's switch of {m['kv_shared'][0]['copied']} on the "
            f"same device ({shapes}; medians; rule {probe.sharing}, shared rate {probe.shared_rate:.3f}): "
            f"{'; '.join(words)}"), figures


_PAIR, _ONE_GPU = (InstanceSpec("kv", 1, 0.0), InstanceSpec("copy", 1, 0.0)), {"kv": 0, "copy": 0}


def _charged_beside(costs: RooflineCostModel, kv_s: float, switch_s: float, to_device: bool, behind: bool) -> float:
    """What the simulator charges a KV move of `kv_s` alone that starts with another instance's switch of
    `switch_s` alone on the same GPU, booked before the switch or `behind` it."""
    links = costs.host_links(_PAIR, _ONE_GPU)
    assert links is not None
    if behind:
        links.copy_end_at("copy", True, 0.0, switch_s, 0.0)
    return links.copy_end_at("kv", to_device, 0.0, kv_s, 0.0)


def _host_terms(draft: CalibrationProfile, live: Mapping[str, Any], archs: Mapping[str, Arch], gpu: str,
                spec: GpuSpec, terms: dict[str, Any], provenance: dict[str, Provenance], figures: dict[str, float],
                where: str) -> None:
    """prefill_host_s and decode_host_s: the live pool's times less the fitted engine's predictions."""
    name = live["arch"]
    costs = RooflineCostModel.for_models({name: (archs[name], 1)}, spec, draft, gpu_name=gpu)
    how = f"the live pool ({live['backend']} backend, {live['policy']}, one instance, {name})"
    if live["prefill"]:
        tokens = live["prefill"][0]["tokens"]
        ttft = statistics.median(p["ttft_s"] for p in live["prefill"])
        engine = statistics.median(p["engine_s"] for p in live["prefill"])
        predicted = costs.prefill_s(name, tokens, 1)
        terms["prefill_host_s"] = sig(max(0.0, ttft - predicted))
        provenance["prefill_host_s"] = Provenance(status="measured", gpus=(gpu,), source=(
            f"{how}: first token {ttft * 1e3:.3f} ms after submit (median of {len(live['prefill'])} prompts of "
            f"{tokens} tokens), less the fitted prefill {predicted * 1e3:.3f} ms; the engine's call took "
            f"{engine * 1e3:.3f} ms in the pool ({where})"))
        figures.update(live_prefill_ttft_s=round(ttft, 6), live_prefill_engine_s=round(engine, 6),
                       live_prefill_predicted_s=round(predicted, 6))
    decode = live["decode"]
    if decode.get("gap_s") is not None:
        batch, context = decode["batch"], decode["context"]
        predicted = costs.decode_step_s(name, batch, batch * context)
        terms["decode_host_s"] = sig(max(0.0, decode["gap_s"] - predicted))
        engine = decode["engine_s"]
        provenance["decode_host_s"] = Provenance(status="measured", gpus=(gpu,), source=(
            f"{how}: {decode['gap_s'] * 1e3:.3f} ms between tokens at the sink (median of {decode['num_gaps']} "
            f"gaps, batch {batch}, ~{context} tokens of context each), less the fitted decode step "
            f"{predicted * 1e3:.3f} ms; the engine's call took {(engine or 0.0) * 1e3:.3f} ms in the pool ({where})"))
        figures.update(live_decode_gap_s=decode["gap_s"], live_decode_predicted_s=round(predicted, 7))
        if engine is not None:
            figures["live_decode_engine_s"] = engine


MIN_STEPS = 20  # batch buckets with fewer decode steps are left out of the live fit
MIN_HANDOFF_CALLS = 10  # a hand-off side with fewer calls is not fitted


def _handoff_move_s(run: Mapping[str, Any]) -> tuple[float, float, str] | None:
    """Seconds per staged hand-off move and per request of it in a live run, and the figures in words; None where
    the run staged no hand-offs in device memory (or too few). With the run's KV calls one by one (`kv_calls`:
    benchmarks/gpu_pool_calls.py), a least-squares line through both sides' calls - the export on the prefill
    instance, the import on the decode instance - as a + b x requests (both >= 0): a move of one request costs
    what one of thirty does not (on the H200, 3-5 ms a call at 1 req/s, 9-14 at 22 with 4-8 requests a call).
    Else each side's mean call, averaged (b = 0): the mean, not the median, as the simulator charges every move
    and over a run it should add up to what the live pool paid; runs that predate `ms_mean` give it by their
    `call_s_by_engine` (the few hand-offs through host memory among them), older ones their median."""
    rows = [(n, seconds) for calls in (run.get("kv_calls") or {}).values() for method, n, seconds in calls or []
            if method in ("export_kv(device)", "import_kv(device)") and n > 0]
    sides_seen = {method for calls in (run.get("kv_calls") or {}).values() for method, _, _ in calls or []}
    if len(rows) >= 2 * MIN_HANDOFF_CALLS and {"export_kv(device)", "import_kv(device)"} <= sides_seen:
        mean_n = statistics.fmean(n for n, _ in rows)
        mean_s = statistics.fmean(s for _, s in rows)
        var = sum((n - mean_n) ** 2 for n, _ in rows)
        per = max(0.0, sum((n - mean_n) * (s - mean_s) for n, s in rows) / var) if var > 0 else 0.0
        fixed = max(0.0, mean_s - per * mean_n)
        return fixed, per, (f"a least-squares line through its {len(rows)} export and import calls (1 to "
                            f"{max(n for n, _ in rows)} requests each): {fixed * 1e3:.2f} ms a call + "
                            f"{per * 1e3:.3f} ms a request")
    sides: dict[str, tuple[str, Mapping[str, Any]]] = {}
    for engine, timings in (run.get("kv_timings") or {}).items():
        for method, figures in (timings or {}).items():
            if method in ("export_kv(device)", "import_kv(device)") and figures.get("calls", 0) >= MIN_HANDOFF_CALLS:
                sides[method] = engine, figures
    if len(sides) < 2:
        return None
    totals = run.get("call_s_by_engine") or {}
    per_call, statistic = {}, "means"
    for method, (engine, figures) in sorted(sides.items()):
        total = (totals.get(engine) or {}).get(method.removesuffix("(device)"))
        if "ms_mean" in figures:
            per_call[method] = figures["ms_mean"], figures["calls"]
        elif total and total.get("calls"):
            per_call[method] = total["s"] * 1e3 / total["calls"], total["calls"]
        else:
            per_call[method], statistic = (figures["ms_p50"], figures["calls"]), "medians"
    if statistic == "medians":  # one side without a mean: both by their median, alike
        per_call = {method: (figures["ms_p50"], figures["calls"]) for method, (_, figures) in sides.items()}
    seconds = sum(ms for ms, _ in per_call.values()) / len(per_call) / 1e3
    return seconds, 0.0, "the average of the export's and the import's call, " + f"{statistic}: " + ", ".join(
        f"{m} {ms:.2f} ms over {n} calls" for m, (ms, n) in sorted(per_call.items()))


MIN_IDLE_REQUESTS = 10  # requests sent to an idle instance: fewer, and the request path is not fitted


def _request_path_terms(run: Mapping[str, Any], gpu: str, where: str) -> tuple[dict[str, float],
                                                                               dict[str, Provenance]] | None:
    """request_admit_s and token_deliver_s fitted to a live run's requests that an idle instance went straight to
    (gpu_pool.py's `ttft_parts`, from the engines' call logs: the median send-to-engine-call and prefill-end-to-
    first-token), with their provenance; None where the run has fewer than MIN_IDLE_REQUESTS of them (under load
    an instance is seldom idle: a light run is the one to fit these to)."""
    parts = run.get("ttft_parts") or {}
    admission, delivery = parts.get("admission (sent while idle)"), parts.get("delivery (sent while idle)")
    if not admission or not delivery or admission["n"] < MIN_IDLE_REQUESTS:
        return None
    source = (f"the live pool itself ({run.get('backend', '?')} backend, {run.get('layout', '?')} layout, "
              f"{run.get('rate_rps', '?')} req/s): over the {admission['n']} requests an idle instance went straight "
              f"to (nothing but their switch between), the median")
    terms = {"request_admit_s": sig(admission["p50_ms"] / 1e3), "token_deliver_s": sig(delivery["p50_ms"] / 1e3)}
    provenance = {
        "request_admit_s": Provenance(status="measured", gpus=(gpu,), source=(
            f"{source} time from the client's send to that instance's next engine call, {admission['p50_ms']} ms: "
            f"the gateway, the pool's loop and the backend's hop ({where})")),
        "token_deliver_s": Provenance(status="measured", gpus=(gpu,), source=(
            f"{source} time from the end of their prefill call to the first token at the client, "
            f"{delivery['p50_ms']} ms ({where})"))}
    return terms, provenance


def with_request_path(profile: CalibrationProfile, run: Mapping[str, Any], where: str, gpu: str | None = None,
                      name: str = "") -> CalibrationProfile:
    """`profile` with request_admit_s and token_deliver_s (only) fitted to a live pool run (`_request_path_terms`:
    a light-load benchmarks/gpu_pool.py run with its `ttft_parts`) measured `where` on GPU type `gpu`."""
    gpu = _live_gpu(profile, gpu)
    path = _request_path_terms(run, gpu, where)
    if path is None:
        parts = run.get("ttft_parts")
        raise ValueError("the run has no ttft_parts (benchmarks/gpu_pool.py writes them from its engines' call logs; "
                         "benchmarks/gpu_pool_calls.py --run RUN --save for a run recorded before)" if not parts else
                         f"{(parts.get('admission (sent while idle)') or {}).get('n', 0)} requests that an idle "
                         f"instance went straight to; the fit needs {MIN_IDLE_REQUESTS} (a light load has them)")
    return _refitted(profile, *path, "request_admit_s and token_deliver_s", where, gpu, name)


def _live_gpu(profile: CalibrationProfile, gpu: str | None) -> str:
    """The GPU type a live run was on: `gpu`, else the one `profile` was calibrated on (a run JSON does not say)."""
    gpu = (gpu or (profile.calibration.gpu if profile.calibration is not None else "")).lower()
    if not gpu:
        raise ValueError(f"profile {profile.name!r} has no calibration run to say which GPU type the live run was "
                         f"on: name it (modelpool calibrate ... --gpu TYPE)")
    return gpu


def _refitted(profile: CalibrationProfile, terms: Mapping[str, Any], provenance: Mapping[str, Provenance],
              fitted: str, where: str, gpu: str, name: str) -> CalibrationProfile:
    """`profile` with `terms` (named `fitted`, in words) fitted to a live pool run measured `where` on `gpu`, their
    provenance with them; named `name` (default: the profile's)."""
    description = (f"{profile.description} " if profile.description else "") + (
        f"{fitted} from the live pool run {where} (on {gpu}), on top of profile {profile.name}.")
    return CalibrationProfile.model_validate({**profile.model_dump(), "name": name or profile.name,
                                              "description": description,
                                              "terms": {**profile.terms.model_dump(), **terms},
                                              "provenance": {**profile.model_dump()["provenance"],
                                                             **{k: v.model_dump() for k, v in provenance.items()}}})


MIN_PREFILL_SAMPLES = 20  # prefills matched to their calls: fewer, and prefill_live_scale is not fitted


def _prefill_scale(profile: CalibrationProfile, run: Mapping[str, Any], archs: Mapping[str, tuple[Arch, int]],
                   gpu: str) -> tuple[float, str] | None:
    """prefill_live_scale fitted to a live run's prefills (`prefill_samples`: model, tokens, prompts, seconds, with
    `prefill_overlap`: the share of each call other instances' decode steps overlapped, benchmarks/gpu_pool_calls.py)
    and the figures in words; None where fewer than MIN_PREFILL_SAMPLES are matched to their calls and of models in
    `archs`. Each prefill less the neighbour's slowdown the simulator charges it (gpu_share_slowdown over its
    overlapped share) and less the host terms, over the engine terms' prediction of its GPU part: the ratio of the
    sums (so that the simulator's prefill seconds add up to the live pool's), on top of the base profile's scale."""
    overlaps = run.get("prefill_overlap") or {}
    terms = profile.terms
    share = terms.gpu_share_slowdown or 1.0
    models = {name: archs[name] for name in archs}
    costs = RooflineCostModel.for_models(models, gpu, profile, gpu_name=gpu) if models else None
    live_sum = predicted_sum = 0.0
    count, alone = 0, []
    for iid, samples in (run.get("prefill_samples") or {}).items():
        for (model, tokens, prompts, seconds), overlap in zip(samples or [], overlaps.get(iid) or []):
            if overlap is None or costs is None or model not in models:
                continue
            host = costs.prefill_host_s(model)
            engine = (costs.prefill_s(model, tokens, prompts) - host) / terms.prefill_live_scale  # the base's own
            live = seconds / (1.0 + (share - 1.0) * overlap) - host
            live_sum, predicted_sum, count = live_sum + live, predicted_sum + engine, count + 1
            if overlap < 0.2:
                alone.append(live / engine)
    if count < MIN_PREFILL_SAMPLES or predicted_sum <= 0:
        return None
    scale = live_sum / predicted_sum
    shown = (f"{count} prefills: {live_sum:.3f} s live less the neighbour's slowdown ({share:.3f}x over each one's "
             f"overlapped share) and the host terms, over {predicted_sum:.3f} s predicted by the engine terms"
             + (f"; the {len(alone)} that ran mostly alone (under 20% overlapped) {statistics.median(alone):.3f}x at "
                f"the median" if alone else ""))
    return scale, shown


def with_live_host(profile: CalibrationProfile, run: Mapping[str, Any], where: str, gpu: str | None = None,
                   name: str = "", archs: Mapping[str, tuple[Arch, int]] | None = None) -> CalibrationProfile:
    """`profile` with decode_host_s and decode_host_request_s fitted to a live pool run (benchmarks/gpu_pool.py's
    run JSON: `decode_timings`, each engine's decode figures per batch bucket) measured `where` (in words) on GPU
    type `gpu` (default: the one `profile` was calibrated on; a profile without a calibration run needs it: the
    run JSON does not say). The result is named `name` (default: the profile's name).

    The engine that decoded most steps (the decode instance) gives, per bucket of at least MIN_STEPS steps, the
    mean time a step adds to the engine's own (StepTimings' `added`; the median in runs that predate the mean) and
    the bucket's mean batch (the bucket's middle in runs that did not record it); a least-squares line through
    them, weighted by steps, is a + b x batch (both held >= 0). With `archs` (the run's models: name -> (arch, tp))
    and a run whose prefills are matched to their calls, also prefill_live_scale (`_prefill_scale`)."""
    gpu = _live_gpu(profile, gpu)
    timings = run.get("decode_timings") or {}
    if not timings:
        raise ValueError("the run has no decode_timings (a benchmarks/gpu_pool.py run JSON has them per engine)")
    engine, buckets = max(timings.items(), key=lambda kv: sum(b.get("steps", 0) for b in kv[1].values()))
    points = []  # (batch, outside seconds, steps)
    low = 0
    for key, figures in sorted(buckets.items(), key=lambda kv: int(kv[0].removeprefix("<="))):
        high = int(key.removeprefix("<="))
        # what a step adds to the engine's own (StepTimings: outside the call, or with async decode period -
        # forward; runs before async decode recorded only the time outside the call), its mean - stalls included,
        # what a turn of many steps adds up to - or in runs that predate the mean, its median
        added = figures.get("added_ms_mean", figures.get("added_ms_p50", figures.get("outside_ms_p50")))
        if figures.get("steps", 0) >= MIN_STEPS and added is not None:
            batch = figures.get("batch_mean") or (low + 1 + high) / 2
            points.append((float(batch), added / 1e3, figures["steps"]))
        low = high
    if len(points) < 2:
        raise ValueError(f"engine {engine!r}: {len(points)} batch bucket(s) with {MIN_STEPS}+ decode steps and an "
                         f"outside time; the fit needs two (a run that predates StepTimings' in-engine time has none)")
    total = sum(w for _, _, w in points)
    mean_x = sum(x * w for x, _, w in points) / total
    mean_y = sum(y * w for _, y, w in points) / total
    var = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    slope = max(0.0, sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / var) if var > 0 else 0.0
    intercept = max(0.0, mean_y - slope * mean_x)
    backend, layout = run.get("backend", "?"), run.get("layout", "?")
    shown = ", ".join(f"{x:g}: {y * 1e3:.3f} ms" for x, y, _ in points)
    statistic = "mean" if any("added_ms_mean" in f for f in buckets.values()) else "median"
    source = (f"the live pool itself ({backend} backend, {layout} layout, {run.get('rate_rps', '?')} req/s; engine "
              f"{engine}): the time each decode step adds to the engine's (outside its call; with async decode, "
              f"period less forward), {statistic} per batch bucket ({shown}), fitted as a + b x batch ({where})")
    provenance = {
        "decode_host_s": Provenance(status="measured", gpus=(gpu,), source=f"a of {source}"),
        "decode_host_request_s": Provenance(status="measured", gpus=(gpu,), source=f"b of {source}")}
    terms: dict[str, Any] = {"decode_host_s": sig(intercept), "decode_host_request_s": sig(slope)}
    fitted = "decode_host_s and decode_host_request_s"
    handoff = _handoff_move_s(run)
    if handoff is not None:
        seconds, per_request, shown = handoff
        terms["kv_handoff_fixed_s"], terms["kv_handoff_request_s"] = sig(seconds), sig(per_request)
        source = (f"the live pool itself ({backend} backend, {layout} layout, {run.get('rate_rps', '?')} req/s): "
                  f"hand-offs staged in device memory, {shown} (their copies within the GPU included) ({where})")
        provenance["kv_handoff_fixed_s"] = Provenance(status="measured", gpus=(gpu,), source=source)
        provenance["kv_handoff_request_s"] = Provenance(status="measured", gpus=(gpu,), source=source)
        fitted += " and kv_handoff_fixed_s and kv_handoff_request_s"
    path = _request_path_terms(run, gpu, where)
    if path is not None:
        terms.update(path[0])
        provenance.update(path[1])
        fitted += " and request_admit_s and token_deliver_s"
    standalone = run.get("prefill_vs_standalone") or {}
    if standalone.get("samples"):
        if "standalone_fresh_extra_ms_p50" in standalone:  # per shape, first run less repeats: the median
            extra = max(0.0, standalone["standalone_fresh_extra_ms_p50"]) / 1e3
            how = (f"the median over its prefills of their shape's first run less its repeats, "
                   f"{standalone['standalone_fresh_extra_ms_p50']} ms")
        else:  # a run that predates the per-shape figure: the difference of the medians
            extra = max(0.0, standalone["standalone_fresh_ms_p50"] - standalone["standalone_best_ms_p50"]) / 1e3
            how = (f"the median first run of a shape, {standalone['standalone_fresh_ms_p50']} ms, over the median "
                   f"of its repeats, {standalone['standalone_best_ms_p50']} ms")
        terms["prefill_fresh_s"] = sig(extra)
        provenance["prefill_fresh_s"] = Provenance(
            status="measured", gpus=(gpu,), source=f"the engine alone after the live run, at the {standalone['samples']} "
            f"prefill shapes the live pool ran ({backend} backend, {run.get('rate_rps', '?')} req/s): {how} ({where})")
        fitted += " and prefill_fresh_s"
    prefill = _prefill_scale(profile, run, archs or {}, gpu)
    if prefill is not None:
        scale, shown = prefill
        terms["prefill_live_scale"] = sig(scale)
        provenance["prefill_live_scale"] = Provenance(status="measured", gpus=(gpu,), source=(
            f"the live pool itself ({backend} backend, {layout} layout, {run.get('rate_rps', '?')} req/s): {shown} "
            f"({where})"))
        fitted += " and prefill_live_scale"
    return _refitted(profile, terms, provenance, fitted, where, gpu, name)
