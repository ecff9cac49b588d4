"""How the capacity answer moves if the least certain terms are worse than measured.

A capacity answer rests on the profile's terms on the target GPU, and there most are carried from another
GPU by datasheet ratio or assumed (the report's assumptions say which). The three that move a pooled answer
most and are known least well off the GPU they were measured on: the memory-bandwidth efficiency (every
decode step streams the weights), the host link (every switch and KV move) and the per-step overhead (every
decode step, the pool's host time included). `worse_profile` makes each `WORSE` worse (the efficiencies that
much lower, the overheads that much higher); the capacity command searches again with it, and
`sensitivity_entry` puts the two answers side by side for the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sims.profiles import CalibrationProfile, Provenance

WORSE = 0.2
RATES = ("eff_mem", "eff_kv", "eff_pcie", "eff_kv_move")  # the memory bandwidth and the host link
OVERHEADS = ("decode_fixed_s", "host_call_s")  # the per-step overhead
TERMS_TEXT = "memory-bandwidth efficiency, host link and per-step overhead"


def worse_profile(profile: CalibrationProfile, gpu: str, worse: float = WORSE) -> CalibrationProfile:
    """`profile`'s terms on GPU type `gpu` with the rates `worse` lower and the per-step overheads `worse`
    higher (every other term as it is; the provenance says what was changed)."""
    terms = profile.terms_for(gpu)
    update: dict[str, Any] = {}
    for term in RATES:
        value = getattr(terms, term)
        if value is not None:
            update[term] = value * (1 - worse)
    for term in OVERHEADS:
        update[term] = getattr(terms, term) * (1 + worse)
    note = f"{worse:.0%} worse than the profile's (capacity sensitivity)"
    provenance = {term: profile.entry(term, gpu) for term in type(terms).model_fields}
    provenance |= {term: Provenance(status="estimated", source=note) for term in update}
    return profile.model_copy(update={"name": f"{profile.name} ({note})", "terms": terms.model_copy(update=update),
                                      "gpu_overrides": {}, "provenance": provenance})


def sensitivity_entry(base: Mapping[str, tuple[int, bool]], worse: Mapping[str, tuple[int, bool]], gpu: str,
                      amount: float = WORSE) -> dict[str, Any]:
    """The report's sensitivity section: per policy (GPUs, met) as searched and with the terms `amount` worse."""
    policies: dict[str, dict[str, Any]] = {policy: {"gpus": base[policy][0], "met": base[policy][1], "worse_gpus": worse[policy][0],
                         "worse_met": worse[policy][1]} for policy in base if policy in worse}

    def cell(gpus: int, met: bool) -> str:
        return f"{gpus}{'' if met else ' (unmet)'}"

    parts = [f"{policy} {cell(e['gpus'], e['met'])} -> {cell(e['worse_gpus'], e['worse_met'])}"
             for policy, e in policies.items()]
    return {"gpu": gpu, "worse_by": amount, "terms": [*RATES, *OVERHEADS], "policies": policies,
            "line": f"If the {TERMS_TEXT} are {amount:.0%} worse on {gpu.upper()}, GPUs needed: " + "; ".join(parts)}
