"""Instance loss: a failing engine call or a killed Ray actor writes its instance off; its requests resume
elsewhere (or on the restarted instance) with the same greedy tokens, or end with a clean error - never hang."""

from __future__ import annotations

import pytest

from pool.actor import make_engine
from pool.backends import InProcessBackend
from pool.controller import Controller
from pool.errors import RequestFailed
from pool.engines.base import SamplingParams
from pool.runner import LiveRequest
from pool.config import PoolConfig
from pool.service import LivePool, served_model, slot_instances
from scheduler import ManualClock, RequestStatus, make_scheduler
from tests.factories import LinearCosts
from tests.pool.fault_tools import (NOTHING, Sink, allocated, greedy_reference, homes, outcomes, run_streams,
                                    stream_completion, wait_until)
from tests.pool.test_live_pool import ENGINE, KV_BYTES, MODELS, NEW_TOKENS, PROMPTS, Collector, reference, tiny  # noqa: F401


class Flaky:
    """An engine whose `fail_at`-th call of `method` raises `error` (by default as a crashed device would)."""

    def __init__(self, engine, fail_at: int, method: str = "decode_step",
                 error: Exception | None = None) -> None:
        self.engine, self.fail_at, self.method, self.calls = engine, fail_at, method, 0
        self.error = error or RuntimeError("device fell off the bus")

    def __getattr__(self, name):
        attr = getattr(self.engine, name)
        if name != self.method:
            return attr

        def call(*args):
            self.calls += 1
            if self.calls == self.fail_at:
                raise self.error
            return attr(*args)
        return call


def drive(controller: Controller, backend: InProcessBackend, clock: ManualClock, sinks, limit: int = 20000,
          restart=None) -> None:
    """The live pool's loop on a manual clock; `restart(instance_id)`, when given, brings a lost instance back
    at once with a fresh engine."""
    for _ in range(limit):
        if all(s.done.is_set() for s in sinks.values()):
            return
        clock.advance(0.001)
        for handle, result in backend.poll(0.0):
            controller.complete(handle, result)
        for instance_id in sorted(controller.lost) if restart else ():
            backend.replace(instance_id, restart(instance_id))
            controller.restore(instance_id)
        controller.fail_stranded()
        controller.tick()
    raise AssertionError(f"requests did not finish: {[k for k, s in sinks.items() if not s.done.is_set()]}")


def in_process(tiny, flaky: dict | None, policy: str, roles=None, num_instances: int = 2, engine=ENGINE,  # noqa: F811
               max_tokens: int = NEW_TOKENS, flaky_slot: str = "slot0", **options):
    """A controller over `num_instances` in-process engines of `engine` (`flaky_slot` wrapped in
    `Flaky(**flaky)` unless None) with every request queued."""
    models = [served_model(name, path, dtype="float32") for name, path in tiny.items()]
    ids = [f"slot{k}" for k in range(num_instances)]
    engines = {}
    for iid in ids:
        engines[iid] = make_engine(engine)
        for m in models:
            engines[iid].load(m.name, m.path)
    if flaky is not None:
        engines[flaky_slot] = Flaky(engines[flaky_slot], **flaky)
    backend = InProcessBackend(engines)
    clock = ManualClock()
    scheduler = make_scheduler(policy, {m.name: m.profile for m in models},
                               slot_instances(num_instances, models, KV_BYTES, roles=roles), LinearCosts(), **options)
    controller = Controller(scheduler, backend, clock, ids)
    sinks = queue_all(controller, clock, max_tokens)
    controller.tick()
    return controller, backend, clock, scheduler, sinks


def queue_all(controller: Controller, clock: ManualClock, max_tokens: int = NEW_TOKENS) -> dict:
    """Every model's every prompt submitted to the controller; the sinks by (model, prompt index)."""
    sinks = {}
    for name in MODELS:
        for k, prompt in enumerate(PROMPTS):
            sinks[(name, k)] = Collector()
            controller.submit(LiveRequest(f"{name}-{k}", name, list(prompt),
                                          SamplingParams(max_tokens=max_tokens, ignore_eos=True), clock.now(),
                                          sink=sinks[(name, k)]))
    return sinks


def test_instance_lost_mid_decode_requests_resume_elsewhere(tiny, reference) -> None:  # noqa: F811
    controller, backend, clock, scheduler, sinks = in_process(tiny, {"fail_at": 4}, "request-level")
    drive(controller, backend, clock, sinks)
    assert controller.lost == {"slot0"}
    assert all(r.status is RequestStatus.FINISHED for r in scheduler.requests.values())
    for key, sink in sinks.items():  # every token exactly once, equal to an uninterrupted run
        assert sink.error is None and sink.tokens == reference[key] and not sink.after_end, key
    resumed = [r for r in scheduler.requests.values() if r.reason == "engine call failed: RuntimeError('device fell off the bus')"]
    assert resumed, "the lost instance held requests that had to resume elsewhere"


def test_prefill_instance_lost_during_kv_hand_off_spares_the_decoder(tiny, reference) -> None:  # noqa: F811
    """The prefill instance hands requests over by `export_kv` (the controller carries their KV to the decoder);
    its second export fails: the prefill instance is written off (not the decoder), the requests it had handed
    over before finish on the decoder with their uninterrupted tokens (their KV was no longer on it), and the
    ones in the failed export and the queued ones (no prefill instance left) fail at once, cleanly, instead of
    waiting for ever."""
    controller, backend, clock, scheduler, sinks = in_process(
        tiny, {"fail_at": 2, "method": "export_kv"}, "token-level", roles=["prefill", "decode"], fixed_turn_steps=3)
    drive(controller, backend, clock, sinks)
    assert controller.lost == {"slot0"}
    errors = {key: str(sink.error) for key, sink in sinks.items() if sink.error is not None}
    assert errors and all(isinstance(sinks[key].error, RequestFailed) for key in errors)
    assert all("was lost" in why for why in errors.values()), errors
    finished = [key for key, sink in sinks.items() if sink.error is None]
    assert finished, "the export that worked (the first) handed requests over that then finished"
    for key in finished:
        assert sinks[key].tokens == reference[key], key
    assert all(r.done for r in scheduler.requests.values()) and not controller.requests
    print(f"\nhand-off fault: {len(finished)} identical, {len(errors)} failed cleanly; 0 hung")


# ---- real Ray: an instance's actor killed in the middle of decoding ----------------------------------------
LONG_TOKENS = 64


@pytest.fixture(scope="module")
def long_reference(tiny) -> dict[tuple[str, int], list[int]]:  # noqa: F811
    return greedy_reference(tiny, PROMPTS, LONG_TOKENS)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield ray
    ray.shutdown()


def ray_pool(tiny, num_instances: int, **options) -> LivePool:  # noqa: F811
    models = [served_model(name, path, dtype="float32") for name, path in tiny.items()]
    # short fixed turns: the models take turns every few tokens, so an instance holds part-decoded requests of
    # several models at any moment
    return LivePool(models, slot_instances(num_instances, models, KV_BYTES), "token-level", LinearCosts(),
                    PoolConfig(engine=ENGINE, backend="ray", stats_interval_s=0.1,
                               policy_options={"fixed_turn_steps": 4}, **options))


def submit_all(pool: LivePool, tag: str = "", models=MODELS) -> dict[tuple[str, int], Sink]:
    sinks = {}
    for name in models:
        for k, prompt in enumerate(PROMPTS):
            sinks[(name, k)] = Sink()
            pool.submit(f"{tag}{name}-{k}", name, prompt, SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True),
                        sinks[(name, k)])
    return sinks


def kill_mid_decode(pool: LivePool, instance_id: str | None = None) -> tuple[str, dict[str, tuple[str, str, int]]]:
    """Kill the actor of an instance that holds part-decoded requests of two models or more; returns it and
    what it held."""
    def victim() -> str | None:
        by_instance: dict[str, set[str]] = {}
        for home, model, produced in homes(pool).values():
            if 1 <= produced < LONG_TOKENS - 4 and instance_id in (None, home):
                by_instance.setdefault(home, set()).add(model)
        return next((iid for iid, models in sorted(by_instance.items()) if len(models) >= 2), None)

    wait_until(lambda: victim() is not None, 60, "an instance decoding requests of two models")
    chosen = victim()
    assert chosen is not None
    held = {rid: h for rid, h in homes(pool).items() if h[0] == chosen}
    pool.kill_instance(chosen)
    return chosen, held


def test_decoder_lost_while_importing_staged_kv_frees_it_at_the_prefill_instance(tiny, long_reference) -> None:  # noqa: F811
    """Hand-offs staged in the prefill engine's device memory (pool.engines.handoff); one of two decode instances
    fails its second import: it alone is written off, every request ends with its uninterrupted tokens (those
    in the failed import resume from their prompt and are handed over again), and the prefill engine's staged
    regions are all released."""
    from pool.actor import EngineSpec

    controller, backend, clock, _, sinks = in_process(
        tiny, {"fail_at": 2, "method": "import_kv"}, "token-level", roles=["decode", "decode", "prefill"],
        num_instances=3, engine=EngineSpec("torch", {**ENGINE.options, "handoff_bytes": 8 << 20}),
        max_tokens=LONG_TOKENS, fixed_turn_steps=3)
    engines = backend.engines
    prefill = engines["slot2"]
    drive(controller, backend, clock, sinks)
    assert controller.lost == {"slot0"} and engines["slot0"].calls >= 2
    for key, sink in sinks.items():
        assert sink.error is None and sink.tokens == long_reference[key], key
    stats = prefill.stats()
    assert stats.extra["timings"]["kv"]["export_kv(device)"]["requests"] >= len(sinks)
    for _ in range(50):  # the releases are fire-and-forget calls
        for handle, result in backend.poll(0.0):
            controller.complete(handle, result)
    assert prefill.stats().extra["handoff_staged_bytes"] == 0


def test_decoder_lost_before_it_imports_a_staged_hand_off_frees_it_at_the_prefill_instance(tiny) -> None:  # noqa: F811
    """A request handed over to a decode instance, its KV staged and carried, when that instance is lost before
    its SwapIn: the scheduler re-queues it from prompt, so the carried export is dropped and the prefill engine
    frees the region at once (else it stays taken unless that same engine exports the request again)."""
    from pool.actor import EngineSpec

    models = [served_model(name, path, dtype="float32") for name, path in tiny.items()]
    ids = ["slot0", "slot1", "slot2"]  # decode, decode, prefill
    engines = {iid: make_engine(EngineSpec("torch", {**ENGINE.options, "handoff_bytes": 8 << 20})) for iid in ids}
    for engine in engines.values():
        for m in models:
            engine.load(m.name, m.path)
    backend, clock = InProcessBackend(engines), ManualClock()
    scheduler = make_scheduler("token-level", {m.name: m.profile for m in models},
                               slot_instances(3, models, KV_BYTES, roles=["decode", "decode", "prefill"]),
                               LinearCosts(), fixed_turn_steps=3)
    controller = Controller(scheduler, backend, clock, ids)
    for name in MODELS:
        for k, prompt in enumerate(PROMPTS):
            controller.submit(LiveRequest(f"{name}-{k}", name, list(prompt),
                                          SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True), clock.now(),
                                          sink=Collector()))

    def carried_to(instance_id: str) -> list[str]:
        return [rid for rid, live in controller.requests.items() if live.kv_staged
                and getattr(scheduler.request_view(rid), "instance_id", None) == instance_id]

    for _ in range(2000):
        controller.tick()
        if carried_to("slot0") or carried_to("slot1"):
            break
        clock.advance(0.001)
        for handle, result in backend.poll(0.0):
            controller.complete(handle, result)
    lost = "slot0" if carried_to("slot0") else "slot1"
    waiting = carried_to(lost)
    assert waiting and all(rid in engines["slot2"].kv_calls._staged for rid in waiting)
    controller.lose(lost, "test")
    assert all(controller.requests[rid].kv_export is None for rid in waiting)
    assert not any(rid in engines["slot2"].kv_calls._staged for rid in waiting)  # released at the prefill engine


def test_ray_actor_killed_mid_decode_requests_resume_on_the_other_instance(tiny, long_reference, ray_cluster) -> None:  # noqa: F811
    with ray_pool(tiny, 2, max_restarts=0) as pool:
        sinks = submit_all(pool)
        killed, held = kill_mid_decode(pool)
        result = outcomes(sinks, long_reference, lambda key: pool.holds(f"{key[0]}-{key[1]}"), 120)
        counts = result.counts()
        print(f"\nfault: killed {killed} holding {len(held)} requests of {len({h[1] for h in held.values()})} "
              f"models; outcomes {counts}")
        assert counts["hung"] == counts["lost"] == counts["wrong"] == 0, result
        assert counts["identical"] + counts["clean_errors"] == len(sinks)
        resumed = [rid for rid in held if rid in {f"{m}-{k}" for m, k in result.identical}]
        assert resumed, f"no request that was on {killed} resumed elsewhere: {held}, {result}"
        status = pool.status()
        assert status["lost_instances"] == [killed] and status["restarts"] == 0
        wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")
        # the pool goes on serving on the instance that is left
        again = submit_all(pool, "again-")
        assert outcomes(again, long_reference, lambda key: True, 120).counts()["identical"] == len(again)


def test_the_only_instance_killed_comes_back_and_its_requests_resume(tiny, long_reference, ray_cluster) -> None:  # noqa: F811
    with ray_pool(tiny, 1) as pool:
        sinks = submit_all(pool)
        killed, held = kill_mid_decode(pool)
        result = outcomes(sinks, long_reference, lambda key: pool.holds(f"{key[0]}-{key[1]}"), 120)
        counts = result.counts()
        print(f"\nfault: killed the only instance {killed} holding {len(held)} requests; outcomes {counts}")
        assert counts == {"identical": len(sinks), "clean_errors": 0, "wrong": 0, "hung": 0, "lost": 0}, result
        status = pool.status()
        assert status["restarts"] == 1 and status["lost_instances"] == [] and status["tick_errors"] == 0
        wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")


def test_the_only_instance_killed_without_restarts_fails_every_request_cleanly(tiny, long_reference,  # noqa: F811
                                                                               ray_cluster) -> None:
    with ray_pool(tiny, 1, max_restarts=0) as pool:
        sinks = submit_all(pool)
        killed, held = kill_mid_decode(pool)
        result = outcomes(sinks, long_reference, lambda key: pool.holds(f"{key[0]}-{key[1]}"), 60)
        counts = result.counts()
        print(f"\nfault: killed the only instance {killed} (no restarts) holding {len(held)} requests; outcomes {counts}")
        assert counts["hung"] == counts["lost"] == counts["wrong"] == 0, result
        assert counts["clean_errors"] >= len(held) and counts["identical"] + counts["clean_errors"] == len(sinks)
        assert all("was lost" in str(sinks[key].error) for key in result.clean_errors)
        # a request that comes later is not left waiting for an instance that will never come back
        late = Sink()
        pool.submit("late", MODELS[0], PROMPTS[0], SamplingParams(max_tokens=4), late)
        assert late.done.wait(10) and isinstance(late.error, RequestFailed), late.error
        wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")


# ---- the same through the gateway: streaming clients over 127.0.0.1 ---------------------------------------
STREAM_TIMEOUT_S = 90.0  # longest silence a client accepts before it calls its stream hung


def stream_bodies() -> dict[tuple[str, int], dict]:
    texts = ["Once upon a time", "The sea was calm and", "In a small village"]
    return {(name, k): {"model": name, "prompt": text, "max_tokens": LONG_TOKENS, "temperature": 0,
                        "ignore_eos": True} for name in MODELS for k, text in enumerate(texts[:2])}


def tally(streams: dict, reference: dict) -> dict[str, int]:
    counts = {"identical": 0, "clean_errors": 0, "wrong": 0, "hung": 0, "cut": 0}
    for key, stream in streams.items():
        kind = stream.kind
        if kind == "finished":
            counts["identical" if stream.text == reference[key].text else "wrong"] += 1
        elif kind == "clean_error":
            counts["clean_errors"] += 1
        else:
            counts[kind] += 1
    return counts


def test_gateway_streams_survive_a_killed_actor_or_end_with_an_error_event(tiny, ray_cluster) -> None:  # noqa: F811
    """One instance, one restart allowed: the first kill resumes every stream on the restarted actor with the
    text of an uninterrupted run; the second kill (no restart left) ends every stream with an SSE error event."""
    from pool.gateway import create_app
    from pool.gateway.server import BackgroundServer

    pool = ray_pool(tiny, 1, max_restarts=1).start()
    try:
        with BackgroundServer(create_app(pool)) as server:
            bodies = stream_bodies()
            _, join = run_streams(server.url, bodies, STREAM_TIMEOUT_S)
            reference = join()  # the uninterrupted run
            assert all(s.kind == "finished" for s in reference.values()), reference
            counts = {}
            for fault in ("restarted", "written off"):
                started, join = run_streams(server.url, bodies, STREAM_TIMEOUT_S)
                assert all(event.wait(60) for event in started.values()), "streams did not start"
                killed, held = kill_mid_decode(pool)
                counts[fault] = tally(join(), reference)
                print(f"\ngateway fault ({fault}): killed {killed} holding {len(held)} streams; outcomes {counts[fault]}")
                assert counts[fault]["hung"] == counts[fault]["cut"] == counts[fault]["wrong"] == 0, counts
            assert counts["restarted"]["identical"] == len(bodies)
            assert counts["written off"]["clean_errors"] >= len(held)
            late = stream_completion(server.url, bodies[(MODELS[0], 0)], STREAM_TIMEOUT_S)
            assert late.kind == "clean_error" and late.error["code"] == "request_failed", late
            wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")
    finally:
        pool.stop()


def test_resumed_text_streams_exactly_the_uninterrupted_text(tiny, long_reference) -> None:  # noqa: F811
    """A request resumed at any token (its instance lost) streams the rest of the uninterrupted run's text:
    no text held back for an unfinished character before the fault is dropped or sent twice."""
    from transformers import AutoTokenizer

    from pool.engines.sampling import OutputText

    def streamed(text: OutputText, ids: list[int], ends: bool) -> str:
        out = ""
        for n, token_id in enumerate(ids):
            text.push(token_id)
            out += text.take_delta(ends and n == len(ids) - 1)
        return out

    num_cuts = 0
    for (name, _), tokens in long_reference.items():
        tokenizer = AutoTokenizer.from_pretrained(tiny[name])
        whole = streamed(OutputText(tokenizer, ()), tokens, True)
        for cut in range(1, len(tokens), 3):
            sent = streamed(OutputText(tokenizer, ()), tokens[:cut], False)  # what the client had before the fault
            rest = streamed(OutputText(tokenizer, (), tokens[:cut]), tokens[cut:], True)  # from the resumed engine
            assert sent + rest == whole, (name, cut)
            num_cuts += 1
    assert num_cuts > 100



def test_sim_pool_killed_engine_restarts_then_is_written_off() -> None:
    """The same faults on the in-process `threads` backend (sim engine: three models, one instance, one restart):
    `kill_instance` there makes every call on the engine end with InstanceDied, as a dead actor's would."""
    from tests.pool.sim_gateway import MODELS as SIM_MODELS
    from tests.pool.sim_gateway import sim_pool

    with sim_pool(num_instances=1, max_restarts=1) as pool:
        reference = submit_all(pool, "ref-", SIM_MODELS)
        assert all(sink.done.wait(60) and sink.error is None for sink in reference.values())  # uninterrupted
        expected = {key: sink.tokens for key, sink in reference.items()}
        counts = {}
        for fault in ("restarted", "written off"):
            sinks = submit_all(pool, f"{fault}-", SIM_MODELS)
            killed, held = kill_mid_decode(pool)
            counts[fault] = outcomes(sinks, expected, lambda key: pool.holds(f"{fault}-{key[0]}-{key[1]}"), 60).counts()
            print(f"\nsim fault ({fault}): killed {killed} holding {len(held)} requests; outcomes {counts[fault]}")
            assert counts[fault]["hung"] == counts[fault]["lost"] == counts[fault]["wrong"] == 0, counts
        assert counts["restarted"]["identical"] == len(reference)
        assert counts["written off"]["clean_errors"] >= len(held)
        # status is a snapshot the loop refreshes: the write-off shows in it soon after the errors reach clients
        wait_until(lambda: pool.status()["lost_instances"] == ["slot0"], 10, f"slot0 written off: {pool.status()}")
        assert pool.status()["restarts"] == 1
        wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")



class Poisoned:
    """An engine that fails every call that carries request `poison`: a request that crashes any engine."""

    def __init__(self, engine, poison: str) -> None:
        self.engine, self.poison = engine, poison

    def __getattr__(self, name):
        attr = getattr(self.engine, name)

        def call(*args):
            ids = [getattr(item, "request_id", item) for arg in args if isinstance(arg, list | tuple) for item in arg]
            if self.poison in ids:
                raise RuntimeError(f"engine crashed on {self.poison}")
            return attr(*args)
        return call


def test_a_request_that_crashes_every_engine_ends_instead_of_taking_the_pool_down(tiny, reference) -> None:  # noqa: F811
    """With restarts, a request that kills whatever engine runs it would be resumed for ever and bring every
    instance down in turn; after two lost instances it ends with a clean error, and the pool serves on."""
    poison = "tiny-qwen2-1"
    controller, backend, clock, scheduler, sinks = in_process(tiny, None, "token-level", fixed_turn_steps=4)
    models = [served_model(name, path, dtype="float32") for name, path in tiny.items()]

    def fresh(instance_id: str) -> Poisoned:
        engine = make_engine(ENGINE)
        for m in models:
            engine.load(m.name, m.path)
        restarts.append(instance_id)
        return Poisoned(engine, poison)

    restarts: list[str] = []
    for iid in ("slot0", "slot1"):
        backend.replace(iid, Poisoned(backend.engines[iid], poison))
    drive(controller, backend, clock, sinks, restart=fresh)
    assert isinstance(sinks[("tiny-qwen2", 1)].error, RequestFailed)
    assert "failing call of 2 instances that were lost" in str(sinks[("tiny-qwen2", 1)].error)
    errors = [key for key, sink in sinks.items() if sink.error is not None]
    finished = [key for key, sink in sinks.items() if sink.error is None]
    assert all(sinks[key].tokens == reference[key] for key in finished), finished
    assert len(restarts) == 2 and not controller.lost and not controller.requests
    print(f"\npoison request: {len(restarts)} instances lost and restarted, {len(finished)} identical, "
          f"{len(errors)} clean errors (the poison and requests batched with it twice): {errors}")
    assert len(finished) >= len(sinks) - 3


def test_a_request_in_two_crashes_at_different_steps_is_a_victim_not_the_cause(tiny, reference) -> None:  # noqa: F811
    """Two instances lost, each in a call that carried the same request: failed as the cause only when it stood
    at the same output step both times (a request that moved on in between was only batched with the cause)."""
    controller, backend, clock, scheduler, sinks = in_process(tiny, None, "request-level")
    victim, cause = "tiny-llama-0", "tiny-llama-1"
    controller.lose("slot0", "a test's crash", [victim, cause])
    controller.requests[victim].output_token_ids.append(7)  # the victim produced a token in between
    controller.lose("slot1", "a test's second crash", [victim, cause])
    assert isinstance(sinks[("tiny-llama", 1)].error, RequestFailed)
    assert "at the same step" in str(sinks[("tiny-llama", 1)].error)
    assert sinks[("tiny-llama", 0)].error is None and victim in controller.requests


@pytest.mark.slow
def test_a_live_actor_whose_engine_fails_is_replaced_and_a_poison_request_ends(tiny, long_reference,  # noqa: F811
                                                                               ray_cluster) -> None:
    """Real Ray, an engine error (not a death): a prompt with a token id past the vocabulary (the pool API does
    not check ids; the gateway does) makes the engine raise. Its instance is written off, the old actor (still
    alive) killed and a fresh one started; the bad request, lost twice, ends with a clean error; the requests
    batched with it resume on the new actor and finish with the uninterrupted tokens."""
    with ray_pool(tiny, 1) as pool:
        sinks = submit_all(pool)
        bad = Sink()
        pool.submit("bad", MODELS[1], [5, 10**6, 7], SamplingParams(max_tokens=8), bad)
        result = outcomes(sinks, long_reference, lambda key: pool.holds(f"{key[0]}-{key[1]}"), 180)
        assert bad.done.wait(60) and isinstance(bad.error, RequestFailed), bad.error
        counts = result.counts()
        print(f"\npoison prompt on a live actor: restarts {pool.status()['restarts']}, outcomes {counts}")
        assert counts["hung"] == counts["lost"] == counts["wrong"] == 0, result
        assert counts["identical"] >= len(sinks) - 3 and "failing call of 2 instances" in str(bad.error)
        assert pool.status()["restarts"] == 2 and pool.status()["lost_instances"] == []
        wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")
