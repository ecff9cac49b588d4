"""Least-squares fits of profile terms to measured times: the ANCHORS.md figures and `modelpool calibrate`'s.

Each family of measurements is linear in the inverse efficiencies and the
overheads, so each fit is one weighted least-squares solve (weights
1/measured: relative errors count alike), over the columns the measurements
can tell apart:

- decode (CUDA graphs; without them when no graph step was measured):
      t = W / (hbm * eff_mem) + KV / (hbm * eff_kv) + decode_fixed_s
          + layers * decode_layer_s + batch * decode_request_s
  W = weight bytes a step streams (+ KV written), KV = KV bytes read; the layer column only
  where three shapes or more put layers off the weight bytes' line, the request column only
  where a shape was timed at two batches and two contexts (else they cannot be told from the
  intercept and the KV read).
- eager decode, beside graph steps: the host launch floor,
      launch_s_per_layer = (t - the fitted overheads of its step) / layers (averaged over anchors)
- prefill (eager): t = FLOPs / (peak * eff_compute) + prefill_fixed_s + layers * prefill_layer_s
      + prompts * prefill_request_s   (the layer column only when layer counts differ, the prompt
      column only when prompt counts differ: else they cannot be told from the intercept)
- swap: t = bytes / (h2d * eff_pcie) + switch_fixed_s
- KV move: t = bytes / (h2d * eff_kv_move) + kv_move_fixed_s (per move, whatever its requests)

An overhead the fit wants negative is held at 0 and the rest refitted (a free
parameter spent on noise). An efficiency the times give above 1 (or none: the
times do not grow with the work) is held at 1. `Fit.held` names both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from scheduler.fleet import Arch, GpuSpec
from sims.costmodel import RooflineCostModel, model_constants
from sims.profiles import CalibrationProfile, ProfileTerms

Kind = Literal["decode", "prefill", "swap", "kv_move"]


@dataclass(frozen=True, slots=True)
class Anchor:
    """One measured time. `batch`: requests (decode batch, prompts of a prefill, requests moved);
    `tokens`: context per request (decode), prompt length per prompt (prefill), unused otherwise;
    `swap_bytes`: bytes copied (swap, kv_move)."""

    kind: Kind
    arch: str
    measured_s: float
    batch: int = 1
    tokens: int = 0
    swap_bytes: float = 0.0
    cuda_graphs: bool = True

    def label(self) -> str:
        if self.kind == "decode":
            return f"decode {self.arch} batch {self.batch} ctx {self.tokens}{'' if self.cuda_graphs else ' eager'}"
        if self.kind == "prefill":
            return f"prefill {self.arch} {self.tokens} tokens" + (f" x {self.batch}" if self.batch > 1 else "")
        if self.kind == "swap":
            return f"swap {self.arch} {self.swap_bytes / 1e9:.1f} GB"
        return f"KV move {self.arch} {self.batch} req {self.swap_bytes / 1e6:.1f} MB"


@dataclass(frozen=True)
class Fit:
    """Fitted terms (4 significant digits), the terms held at a bound, the points behind each family."""

    terms: dict[str, float | bool]
    held: frozenset[str] = frozenset()
    points: dict[str, int] = field(default_factory=dict)


UNIT = ProfileTerms(eff_compute=1, eff_mem=1, eff_kv=1, eff_pcie=1, eff_nvlink=1, prefill_fixed_s=0, prefill_layer_s=0,
                    decode_fixed_s=0, launch_s_per_layer=0, decode_cuda_graphs=True, prefill_cuda_graphs=False,
                    switch_fixed_s=0, allreduce_latency_s=0)


def solve(rows: list[list[float]], measured: list[float], nonnegative: tuple[int, ...] = ()) -> list[float]:
    """Least squares in relative error (each row and its target divided by the target). A column in
    `nonnegative` whose coefficient comes out negative is dropped (held at 0) and the rest refitted."""
    a = np.array(rows) / np.array(measured)[:, None]
    keep = list(range(a.shape[1]))
    while True:
        solution, *_ = np.linalg.lstsq(a[:, keep], np.ones(len(measured)), rcond=None)
        negative = [column for column, x in zip(keep, solution) if column in nonnegative and x < 0]
        if not negative:
            out = [0.0] * a.shape[1]
            for column, x in zip(keep, solution):
                out[column] = float(x)
            return out
        keep.remove(min(negative, key=lambda column: solution[keep.index(column)]))


def sig(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def fit(anchors: Sequence[Anchor], gpu: GpuSpec, arch_of: Callable[[str], Arch]) -> Fit:
    """Every term the anchors determine, fitted (see the module docstring)."""
    unit = {a.arch: model_constants(arch_of(a.arch), 1, gpu, UNIT) for a in anchors}
    terms: dict[str, float | bool] = {}
    held: set[str] = set()
    points: dict[str, int] = {}

    def efficiency(name: str, inverse: float) -> None:
        terms[name] = 1.0 if inverse <= 1.0 else sig(1 / inverse)
        if inverse <= 1.0:
            held.add(name)

    def overhead(name: str, value: float) -> None:
        terms[name] = sig(value)
        if value <= 0:
            held.add(name)

    graphs = [a for a in anchors if a.kind == "decode" and a.cuda_graphs]
    eager = [a for a in anchors if a.kind == "decode" and not a.cuda_graphs]
    decode = graphs or eager
    if decode:
        extra = _decode_columns(decode, unit)
        rows = [[unit[a.arch].stream_static_s + a.batch * unit[a.arch].kv_write_s_per_token,
                 a.batch * a.tokens * unit[a.arch].kv_read_s_per_token, 1.0]
                + [float(unit[a.arch].num_layers if term == "decode_layer_s" else a.batch) for term in extra]
                for a in decode]
        inv_mem, inv_kv, fixed, *rest = solve(rows, [a.measured_s for a in decode],
                                              nonnegative=tuple(range(len(rows[0]))))
        efficiency("eff_mem", inv_mem)
        efficiency("eff_kv", inv_kv)
        overhead("decode_fixed_s", fixed)
        for term, value in zip(extra, rest):
            overhead(term, value)
        terms["decode_cuda_graphs"] = bool(graphs)
        points["decode"] = len(decode)
        if graphs and eager:
            def fixed_of(a: Anchor) -> float:  # the fitted overheads of a step of a's shape and batch
                return (float(terms["decode_fixed_s"]) + unit[a.arch].num_layers * float(terms.get("decode_layer_s", 0.0))
                        + a.batch * float(terms.get("decode_request_s", 0.0)))

            launch = [(a.measured_s - fixed_of(a)) / unit[a.arch].num_layers for a in eager]
            overhead("launch_s_per_layer", sum(launch) / len(launch))
            points["eager decode"] = len(eager)
        elif not graphs:  # eager steps fitted by the linear terms themselves: no separate floor
            terms["launch_s_per_layer"] = 0.0
    prefill = [a for a in anchors if a.kind == "prefill"]
    if prefill:
        _fit_prefill(prefill, unit, efficiency, overhead, terms)
        points["prefill"] = len(prefill)
    swaps = [a for a in anchors if a.kind == "swap"]
    if swaps:
        inv_pcie, fixed = solve([[a.swap_bytes / (gpu.h2d_gb_s * 1e9), 1.0] for a in swaps],
                                [a.measured_s for a in swaps], nonnegative=(0, 1))
        efficiency("eff_pcie", inv_pcie)
        overhead("switch_fixed_s", fixed)
        points["swap"] = len(swaps)
    moves = [a for a in anchors if a.kind == "kv_move"]
    if moves:
        rows = [[a.swap_bytes / (gpu.h2d_gb_s * 1e9), 1.0] for a in moves]
        solution = solve(rows, [a.measured_s for a in moves], nonnegative=(0, 1))
        efficiency("eff_kv_move", solution[0])
        overhead("kv_move_fixed_s", solution[1])
        points["kv_move"] = len(moves)
    return Fit(terms, frozenset(held), points)


def _decode_columns(decode: list[Anchor], unit: dict) -> list[str]:
    """The decode overheads beyond decode_fixed_s that these steps tell apart from the other columns:
    decode_layer_s where the shapes' (layers, weight bytes) do not lie on one line (three shapes at least,
    two layer counts), decode_request_s where one shape was timed at two batch sizes and two contexts per
    request (else a request's cost cannot be told from the KV it reads)."""
    shapes = {(unit[a.arch].num_layers, unit[a.arch].stream_static_s) for a in decode}
    columns = []
    if len(shapes) >= 3 and np.linalg.matrix_rank(np.array([[1.0, layers, weights / max(w for _, w in shapes)]
                                                             for layers, weights in shapes])) == 3:
        columns.append("decode_layer_s")
    by_arch: dict[str, list[Anchor]] = {}
    for a in decode:
        by_arch.setdefault(a.arch, []).append(a)
    if any(len({a.batch for a in mine}) > 1 and len({a.tokens for a in mine}) > 1 for mine in by_arch.values()):
        columns.append("decode_request_s")
    return columns


def _fit_prefill(prefill: list[Anchor], unit: dict, efficiency: Callable[[str, float], None],
                 overhead: Callable[[str, float], None], terms: dict[str, float | bool]) -> None:
    """The compute line through the prefills it bounds: a prefill whose weight read (at the decode fit's
    eff_mem) outlasts its FLOPs, or that the host launch floor holds up, says nothing of eff_compute, so it
    is left out and the rest refitted (a few rounds; at least two prefills stay)."""
    layered = len({unit[a.arch].num_layers for a in prefill}) > 1
    per_prompt = len({a.batch for a in prefill}) > 1
    inv_mem = 1.0 / float(terms.get("eff_mem", 1.0))
    launch = float(terms.get("launch_s_per_layer", 0.0))

    def row(a: Anchor) -> list[float]:
        c, total = unit[a.arch], a.batch * a.tokens
        flops = total * c.gemm_s_per_token + a.batch * c.lm_head_s_per_row + c.attn_s_per_pair * total * a.tokens / 2
        return [flops, 1.0] + ([float(c.num_layers)] if layered else []) + ([float(a.batch)] if per_prompt else [])

    used = list(prefill)
    for _ in range(4):
        solution = solve([row(a) for a in used], [a.measured_s for a in used], nonnegative=tuple(range(len(row(used[0])))))
        bound = [a for a in prefill if _compute_bound(a, unit[a.arch], row(a), solution, inv_mem, launch)]
        if len(bound) < 2 or bound == used:
            break
        used = bound
    efficiency("eff_compute", solution[0])
    overhead("prefill_fixed_s", solution[1])
    overhead("prefill_layer_s", solution[2] if layered else 0.0)
    if per_prompt:
        overhead("prefill_request_s", solution[-1])
    terms["prefill_cuda_graphs"] = False


def _compute_bound(a: Anchor, c: Any, row: list[float], solution: list[float], inv_mem: float, launch: float) -> bool:
    """Whether the fitted compute line, not the weight read or the launch floor, sets this prefill's time."""
    compute = row[0] * solution[0]
    memory = (c.stream_static_s + a.batch * a.tokens * c.kv_write_s_per_token) * inv_mem
    linear = sum(x * k for x, k in zip(row, solution))
    return compute >= memory and linear >= c.num_layers * launch


@dataclass(frozen=True, slots=True)
class Check:
    """One anchor against the model's prediction."""

    label: str
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


def predict(profile: CalibrationProfile, anchors: Sequence[Anchor], gpu: str | GpuSpec, gpu_name: str,
            arch_of: Callable[[str], Arch]) -> list[Check]:
    """Every anchor predicted by `profile` on `gpu` (a catalogue key, or a spec named `gpu_name`); a decode
    step in the other graph mode than the profile's is predicted in its own mode."""
    models = {a.arch: (arch_of(a.arch), 1) for a in anchors}
    model = RooflineCostModel.for_models(models, gpu, profile, gpu_name)
    terms = model.terms
    flipped = profile.model_copy(update={"terms": terms.model_copy(update={"decode_cuda_graphs": not terms.decode_cuda_graphs}),
                                         "gpu_overrides": {}})
    other = RooflineCostModel.for_models(models, gpu, flipped, gpu_name)
    checks = []
    for a in anchors:
        if a.kind == "decode":
            mode = model if a.cuda_graphs == terms.decode_cuda_graphs else other
            predicted = mode.decode_step_s(a.arch, a.batch, a.batch * a.tokens)
        elif a.kind == "prefill":
            predicted = model.prefill_s(a.arch, a.batch * a.tokens, a.batch)
        elif a.kind == "swap":
            predicted = model.switch_s(a.arch)
        else:
            c = model.constants(a.arch)
            predicted = a.swap_bytes * c.kv_s_per_byte + c.kv_move_fixed_s
        checks.append(Check(a.label(), a.measured_s, predicted))
    return checks
