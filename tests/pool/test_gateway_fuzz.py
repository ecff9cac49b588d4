"""Fuzzing the gateway over HTTP: schemathesis from its own OpenAPI document, against uvicorn on 127.0.0.1.

Every operation in /openapi.json gets generated requests that fit the
schema (positive) and, where the schema constrains anything, requests that
break it (negative). Half of the generated generation bodies name a served
model, so the fuzzer reaches the pool and not only the 404. Raw bodies
(random bytes, JSON of the wrong shape, odd content types) go to both
generation endpoints too. Pass: no 5xx, no error event in a stream, the
server alive and the pool drained with no tick errors afterwards.

`MODELPOOL_FUZZ_EXAMPLES=N` (default 120) sets the examples per operation
and mode; a larger N is the long run BENCHMARKS.md records.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from pool.actor import EngineSpec
from pool.gateway import GatewaySettings, create_app
from pool.gateway.server import BackgroundServer
from pool.config import PoolConfig
from pool.service import LivePool, ServedModel, slot_instances
from scheduler import ModelProfile
from tests.factories import LinearCosts

EXAMPLES = int(os.environ.get("MODELPOOL_FUZZ_EXAMPLES", "120"))
MODELS = ("alpha", "org/beta-1.5b")  # one id with a slash: /v1/models/{model_id:path}
CONTEXT = 256  # short contexts keep every accepted request short on the zero-time sim engine
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def served():
    costs = LinearCosts()
    models = [ServedModel(n, Path("<sim>") / n, ModelProfile(n, 1, 1e9, 1000, CONTEXT, 10.0, 0.1)) for n in MODELS]
    instances = slot_instances(2, models, 1 << 30, roles=["prefill", "decode"])
    spec = EngineSpec("sim", {"costs": costs, "time_scale": 0, "kv_bytes": 1 << 30,
                              "kv_bytes_per_token": {n: 1000 for n in MODELS}})
    pool = LivePool(models, instances, "token-level", costs, PoolConfig(engine=spec, backend="threads")).start()
    settings_ = GatewaySettings(owned_by="modelpool-sim", fingerprint="modelpool-sim", max_body_bytes=1 << 16)
    with BackgroundServer(create_app(pool, settings_)) as server:
        yield pool, server
    pool.stop()


def problem(status: int, content: bytes) -> str | None:
    if status >= 500:
        return f"status {status}"
    if status == 200 and b'data: {"error"' in content:  # a stream that failed after it started
        return "error event in a stream"
    return None


def with_served_model(case, model: str | None, model_id: str | None) -> None:
    """Point a generated case at a served model (so it reaches the pool, not only the 404)."""
    if model is not None and isinstance(case.body, dict):
        case.body["model"] = model
    if model_id is not None and case.path_parameters and "model_id" in case.path_parameters:
        case.path_parameters["model_id"] = model_id


def fuzz_operation(operation, mode: GenerationMode, url: str, tally: Counter, failures: list[str]) -> None:
    names = st.sampled_from((*MODELS, None))  # mostly served ids; None keeps the generated one

    @FUZZ
    @given(case=operation.as_strategy(generation_mode=mode), model=names, model_id=names)
    def run(case, model, model_id) -> None:
        with_served_model(case, model, model_id)
        response = case.call(base_url=url, timeout=60)
        tally[(operation.label, mode.value, response.status_code)] += 1
        found = problem(response.status_code, response.content)
        if found:
            failures.append(f"{found}: {case.as_curl_command()} -> {response.content[:300]!r}")

    try:
        run()
    except Unsatisfiable:  # no parameters or body to break: nothing to do in negative mode
        assert mode is GenerationMode.NEGATIVE, operation.label


def test_every_ref_in_the_openapi_document_resolves(served):
    _, server = served
    document = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    refs: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref")
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    assert "#/components/schemas/ChatMessage" in refs
    for ref in refs:
        target = document
        for part in ref.removeprefix("#/").split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        assert isinstance(target, dict), f"{ref} does not resolve"


def test_schemathesis_finds_no_server_error(served):
    pool, server = served
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    tally: Counter = Counter()
    failures: list[str] = []
    started = time.monotonic()
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz_operation(operation, mode, server.url, tally, failures)
    elapsed = time.monotonic() - started
    by_operation: Counter = Counter()
    for (label, mode, status), count in sorted(tally.items()):
        by_operation[label] += count
        print(f"{label:28} {mode:9} {status}: {count}")
    print(f"schemathesis: {sum(tally.values())} cases in {elapsed:.0f} s, {len(failures)} failures")
    assert not failures, "\n".join(failures[:10])
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                                "GET /v1/models/{model_id}", "GET /v1/models"}
    served_ok = 0
    for label in ("POST /v1/completions", "POST /v1/chat/completions"):  # generated bodies were refused, and served
        statuses = {status for (op, _, status) in tally if op == label}
        assert {400, 404} <= statuses, (label, statuses)
        assert by_operation[label] >= EXAMPLES
        served_ok += sum(count for (op, _, status), count in tally.items() if op == label and status == 200)
    assert served_ok >= EXAMPLES // 10, tally  # ~1 in 4 generated bodies is served (the rest is refused)
    assert tally[("GET /v1/models/{model_id}", "positive", 200)] > 0
    assert_pool_healthy(pool, server)


@FUZZ
@given(body=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                      st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                                   lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                                                 inner, max_size=4),
                                   max_leaves=12).map(lambda v: json.dumps(v).encode())),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", "",
                                     "application/json; charset=latin-1"]))
def test_raw_bodies_get_a_4xx(served, body, path, content_type):
    _, server = served
    response = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": content_type}, timeout=30)
    assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def assert_pool_healthy(pool: LivePool, server: BackgroundServer) -> None:
    """Alive, answering, nothing left allocated, no tick errors."""
    assert server.thread.is_alive() and httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30
    while pool.status().get("requests_in_pool") and time.monotonic() < deadline:
        time.sleep(0.1)
    status = pool.status()
    assert status["requests_in_pool"] == 0 and status["tick_errors"] == 0
    assert all(i["kv_used_bytes"] == 0 for i in status["instances"].values())
