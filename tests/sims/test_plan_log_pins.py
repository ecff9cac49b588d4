"""Plan logs pinned by hash: a refactor that means to keep behaviour keeps every byte of them.

Each case replays a short workload through the simulator under one policy and configuration and hashes its
Plan log (the audit trail, `sims.simulator`'s JSONL). The cases reach the decode-turn paths of token-level
(quota turns, open-ended turns, newcomers cutting in, prompts preempting a mixed instance's turn, the
hand-off after the first tokens) and the continuous batching of the others, chunked prefill included.

A change that *means* to change plans (a new rule, a different cost) updates the pins on purpose, and says
so in its commit:

    PYTHONPATH=. python tests/sims/test_plan_log_pins.py --update
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PINS = Path(__file__).with_name("plan_log_pins.json")


@dataclass(frozen=True)
class Case:
    name: str
    fleet: str  # relative to the repository root
    policy: str
    duration_s: float
    num_gpus: int | None = None
    mixed: int = 0  # token-level: this many mixed instances of the fleet's first TP class instead of the P/D cut
    models: int | None = None  # only the fleet's first N models (of the first TP class when `mixed`)
    rate_scale: float = 1.0  # every model's traffic hint times this
    options: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("fleet-token-level", "models.yaml", "token-level", 120.0, num_gpus=24),
    Case("fleet-token-level-tight", "models.yaml", "token-level", 120.0, num_gpus=14),
    Case("fleet-token-level-artifact", "models.yaml", "token-level", 120.0, num_gpus=16,
         options={"first_tokens": 1, "min_turn_tpot": 0.0}),
    Case("fleet-token-level-fixed", "models.yaml", "token-level", 60.0, num_gpus=16,
         options={"fixed_turn_steps": 5}),
    Case("fleet-dedicated", "models.yaml", "dedicated", 120.0, num_gpus=64),
    Case("fleet-dedicated-chunked", "models.yaml", "dedicated", 120.0, num_gpus=64,
         options={"chunked_prefill_tokens": 512}),
    Case("fleet-request-level", "models.yaml", "request-level", 120.0, num_gpus=24),
    Case("fleet-spatial", "models.yaml", "spatial", 120.0, num_gpus=24),
    Case("aegaeon-token-level", "examples/aegaeon/models.yaml", "token-level", 600.0),
    Case("aegaeon-request-level", "examples/aegaeon/models.yaml", "request-level", 600.0),
    Case("aegaeon-mixed", "examples/aegaeon/models.yaml", "token-level", 900.0, mixed=2, models=6),
    Case("fleet-mixed", "models.yaml", "token-level", 600.0, mixed=3, models=12, rate_scale=8.0),
    Case("aegaeon-mixed-crowded", "examples/aegaeon/models.yaml", "token-level", 300.0, mixed=2, models=20,
         rate_scale=2.0),
    Case("fleet-mixed-crowded", "models.yaml", "token-level", 200.0, mixed=2, models=41),
    Case("aegaeon-mixed-one", "examples/aegaeon/models.yaml", "token-level", 900.0, mixed=1, models=3),
]


def plan_log(case: Case) -> str:
    from modelpool.config import load_fleet
    from sims.capacity_eval import Layout, build_instances
    from sims.run import fleet_workload_spec, simulate
    from sims.traces import load_workload

    fleet = load_fleet(ROOT / case.fleet)
    if case.models is not None:
        tp = fleet.models[0].tp
        keep = [m for m in fleet.models if m.tp == tp or not case.mixed][:case.models]
        fleet = fleet.model_copy(update={"models": keep})
    if case.rate_scale != 1.0:
        fleet = fleet.model_copy(update={"models": [
            m.model_copy(update={"traffic": m.traffic.model_copy(update={"rate_rps": m.traffic.rate_rps * case.rate_scale})})
            if m.traffic else m for m in fleet.models]})
    workload = load_workload(fleet_workload_spec(fleet, case.duration_s), [m.name for m in fleet.models], seed=0)
    instances = build_instances(fleet, Layout(fleet.models[0].tp, mixed=case.mixed)) if case.mixed else None
    log = io.StringIO()
    simulate(fleet, workload, case.policy, num_gpus=case.num_gpus, plan_log=log, instances=instances,
             **case.options)
    return log.getvalue()


def digest(case: Case) -> dict[str, Any]:
    text = plan_log(case)
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "plans": text.count("\n")}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_plan_log_is_unchanged(case: Case) -> None:
    pins = json.loads(PINS.read_text())
    assert case.name in pins, f"no pin for {case.name}: run this file with --update"
    assert digest(case) == pins[case.name], (
        f"{case.name}: the Plan log changed; if the change is meant, update the pins (see the module docstring)")


if __name__ == "__main__":
    import time
    if "--update" not in sys.argv:
        sys.exit("usage: PYTHONPATH=. python tests/sims/test_plan_log_pins.py --update")
    out = {}
    for case in CASES:
        started = time.perf_counter()
        out[case.name] = digest(case)
        print(f"{case.name}: {out[case.name]} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    PINS.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
