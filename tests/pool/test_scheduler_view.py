"""The live pool needs nothing of its scheduler beyond the `Scheduler` Protocol.

`ProtocolOnly` wraps a real policy and offers exactly the Protocol's members (read from the Protocol
class itself, so a member added there is offered here): any other attribute the pool reached for would
raise. The pool is then driven through the paths that read scheduler state - `/pool/status`'s
snapshot, an instance lost mid-decode and restarted, lost for good with requests stranded, a prefill
instance lost while its KV is handed over - and must behave as with the bare policy.
"""

from __future__ import annotations

from typing import Any

import pytest

import pool.service
import tests.pool.test_faults as faults
from pool.controller import Controller
from scheduler import Scheduler, make_scheduler
from tests.pool.test_live_pool import reference, tiny  # noqa: F401  (fixtures)

PROTOCOL = frozenset(name for name in vars(Scheduler) if not name.startswith("_"))


class ProtocolOnly:
    """A scheduler that is the Protocol and nothing more: every other attribute is an AttributeError."""

    __slots__ = ("_scheduler", "reached")

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        self.reached: set[str] = set()  # the members the caller used

    def __getattr__(self, name: str) -> Any:
        if name not in PROTOCOL:
            raise AttributeError(f"{name!r} is not in the Scheduler Protocol ({', '.join(sorted(PROTOCOL))})")
        self.reached.add(name)
        return getattr(self._scheduler, name)


def test_the_wrapper_offers_the_protocol_and_nothing_else() -> None:
    assert PROTOCOL == {"name", "submit", "on_event", "schedule", "view", "request_view", "kv_room"}
    from tests.factories import LinearCosts
    from tests.pool.sim_gateway import sim_models

    models = sim_models()
    inner = make_scheduler("request-level", {m.name: m.profile for m in models},
                           pool.service.slot_instances(1, models, 1 << 20), LinearCosts())
    wrapped = ProtocolOnly(inner)
    assert wrapped.name == "request-level" and wrapped.view().policy == "request-level"
    for internal in ("instances", "queues", "requests", "models"):
        assert hasattr(inner, internal)
        with pytest.raises(AttributeError, match="not in the Scheduler Protocol"):
            getattr(wrapped, internal)


def test_a_sim_pool_serves_restarts_and_writes_off_through_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sim pool's fault test (restart, then written off for good, status read all along) on a scheduler
    that offers only the Protocol."""
    made: list[ProtocolOnly] = []

    def protocol_only(*args: Any, **kwargs: Any) -> ProtocolOnly:
        made.append(ProtocolOnly(make_scheduler(*args, **kwargs)))
        return made[-1]

    monkeypatch.setattr(pool.service, "make_scheduler", protocol_only)
    faults.test_sim_pool_killed_engine_restarts_then_is_written_off()
    assert made, "the pool did not build its scheduler through pool.service.make_scheduler"
    assert {"submit", "on_event", "schedule", "view", "request_view", "kv_room"} <= made[0].reached


@pytest.mark.parametrize("case", ["mid_decode", "hand_off"])
def test_the_controller_loses_instances_through_the_protocol(monkeypatch: pytest.MonkeyPatch, case: str,
                                                             tiny, reference) -> None:  # noqa: F811
    """An instance lost mid-decode (request-level) and a prefill instance lost during the KV hand-off
    (token-level, stranding the queued prompts): `lose` and `fail_stranded` read the scheduler through the
    Protocol; the tests' own checks still read the bare policy."""
    controllers: list[Controller] = []

    def controller(scheduler: Any, *args: Any, **kwargs: Any) -> Controller:
        controllers.append(Controller(ProtocolOnly(scheduler), *args, **kwargs))
        return controllers[-1]

    monkeypatch.setattr(faults, "Controller", controller)
    if case == "mid_decode":
        faults.test_instance_lost_mid_decode_requests_resume_elsewhere(tiny, reference)
    else:
        faults.test_prefill_instance_lost_during_kv_hand_off_spares_the_decoder(tiny, reference)
    assert controllers and controllers[0].lost == {"slot0"}
    assert {"request_view", "view"} <= controllers[0].scheduler.reached  # type: ignore[attr-defined]


def test_the_pool_imports_no_scheduler_internals() -> None:
    """pool/ imports the scheduler package's public names and the fleet's config types (scheduler.fleet),
    never a policy module or another internal one."""
    import ast
    from pathlib import Path

    root = Path(pool.service.__file__).resolve().parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad += [f"{path.relative_to(root.parent)}:{node.lineno} {name}" for name in names
                    if name.startswith("scheduler.") and name != "scheduler.fleet"]
    assert bad == []
