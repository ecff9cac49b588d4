"""Carrying out one instance's Plan actions through engine calls, one call at a time.

An `InstanceRunner` is a small state machine: `start(actions)` issues the first
engine call, every `on_result()` turns a finished call into the scheduler's
events (and streamed tokens) and issues the next. It never waits and never
reads a clock, so the live controller (Ray calls) and the parity harness (a
manual clock) drive the same code. Semantics match the simulator's executor:

Each engine call is a typed value of `pool.calls` (`calls.Activate`, `calls.Prefill`, ...), which a backend
runs on the instance's engine with `call.run(engine)`:

- Switch -> `activate(model, evict)` -> SwitchDone; Prefetch -> `prefetch`, not waited for.
- Prefill -> `prefill` (+ `save_kv` when `kv_to_host`) -> StepDone(prefill).
- Decode -> `decode_step` per step; the turn ends after `max_steps`, at the
  first finished request, or at the step boundary after a Stop -> StepDone.
  A Decode with `prefill_chunks` (one mixed iteration): the engines have no
  chunked prefill, so a prompt is computed whole with its last chunk
  (`prefill` of the prompts it completes, then the decode step) and earlier
  chunks call nothing; the StepDone lists the completed prompts, 1 step, as
  the simulator's does (their times differ: the simulator charges each chunk).
- SwapOut -> `save_kv` -> KvMoved(host); on an instance that hands its
  requests over (a prefill instance), `export_kv` instead: the KV leaves the
  engine then and the controller carries it (`LiveRequest.kv_export`), so
  the instance that takes the request over never waits for this one.
- SwapIn -> (`import_kv` of KV the controller carries; `export_kv` from the
  instance whose host memory holds the KV, `import_kv` here) `restore_kv`
  -> KvMoved(device). KV an exporting engine staged in its device memory (a
  hand-off on one GPU, `KvExport.staged`) is freed there with a `release` once
  the import has copied it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pool import calls
from pool.calls import EngineCall
from pool.engines.base import GenRequest, SamplingParams, TokenOut
from scheduler import Action, Decode, Event, KvMoved, Prefetch, Prefill, StepDone, SwapIn, SwapOut, Switch, SwitchDone


@dataclass(slots=True, eq=False)
class LiveRequest:
    """A request as the live pool holds it: token ids in, streamed tokens out."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_at: float
    output_token_ids: list[int] = field(default_factory=list)
    sink: Callable[[TokenOut | BaseException], None] | None = None
    kv_home: str | None = None  # the instance whose engine holds its KV (device or host), as the scheduler has it
    kv_export: Any = None  # its KV out of every engine (a KvExport), from a hand-off; kv_home is where it left
    cancelled: bool = False
    finished: bool = False

    @property
    def kv_staged(self) -> bool:
        """The KV it carries waits in the exporting engine's device memory (`KvExport.staged`), which frees it
        when it releases the request (kv_home)."""
        return is_staged(self.kv_export)

    def gen_request(self) -> GenRequest:
        return GenRequest(self.request_id, self.model, tuple(self.prompt_token_ids), self.sampling,
                          tuple(self.output_token_ids))


def is_staged(export: Any) -> bool:
    """A hand-off's KV that waits in its exporting engine's device memory (`KvExport.staged`; engines whose
    exports are something else never stage)."""
    return bool(getattr(export, "staged", False))


# issue(instance_id, call, waits) -> handle; waits=False: nobody waits for its result (a prefetch, a release)
Issue = Callable[[str, EngineCall, bool], int]


class InstanceRunner:
    def __init__(self, instance_id: str, issue: Issue, requests: dict[str, LiveRequest],
                 deliver: Callable[[LiveRequest, TokenOut], None], hands_off: bool = False) -> None:
        self.instance_id = instance_id
        self.hands_off = hands_off  # SwapOut exports (see the module docstring)
        self._issue = issue
        self._requests = requests
        self._deliver = deliver
        self._actions: deque[Action] = deque()
        self._current: Action | None = None
        self._stage: type[EngineCall] | None = None  # the kind of the current action's latest call: its stage
        self._pending: int | None = None
        self._stop = False
        self._steps = 0
        self._finished: list[str] = []
        self._imports: list[tuple[str, list[str]]] = []
        self._importing: list[str] = []  # request ids of the import_kv in flight
        self._carried: list[str] = []  # request ids whose KV the controller carries, to import first
        self._exporting: list[str] = []  # request ids of the hand-off export_kv in flight
        self._release_after: list[tuple[str | None, str]] = []  # (exporter, request id) of staged KV importing
        self._chunked: dict[str, int] = {}  # request -> prompt tokens its chunks planned so far (mixed iterations)
        self._chunk_done: list[str] = []  # prompts the current mixed iteration completes
        self._chunk_finished: list[str] = []  # of those, the ones that ended at their first token

    @property
    def busy(self) -> bool:
        return self._current is not None or bool(self._actions)

    def start(self, actions: Sequence[Action]) -> list[Event]:
        if self.busy:
            raise RuntimeError(f"{self.instance_id}: new actions while busy with {self._current!r}")
        self._actions.extend(actions)
        self._stop = False
        return self._next()

    def stop(self) -> None:
        """End the current Decode at the next step boundary (a no-op when none runs)."""
        self._stop = True

    def staged_in_flight(self) -> list[tuple[str | None, str]]:
        """(exporting instance, request id) of KV staged in device memory that the import in flight copies."""
        return list(self._release_after)

    def reset(self) -> None:
        """Forget everything in flight (the instance was lost)."""
        self._actions.clear()
        self._current, self._pending, self._stage = None, None, None
        self._chunked, self._chunk_done, self._chunk_finished = {}, [], []
        self._release_after = []  # the controller frees what a lost or refused call left behind

    def on_result(self, handle: int, result: Any) -> list[Event]:
        if handle != self._pending:
            raise RuntimeError(f"{self.instance_id}: result for call {handle}, expected {self._pending}")
        self._pending = None
        action = self._current
        events: list[Event] = []
        if isinstance(action, Switch):
            events.append(SwitchDone(self.instance_id, action.model))
        elif isinstance(action, Prefill):
            events += self._prefill_result(action, result)
        elif isinstance(action, Decode):
            events += self._decode_result(action, result)
        elif isinstance(action, SwapOut):
            self._carry(result)
            events.append(KvMoved(self.instance_id, action.request_ids, "host"))
        elif isinstance(action, SwapIn):
            events += self._swap_in_result(action, result)
        if self._pending is None:  # the action is complete
            self._current = None
            events += self._next()
        return events

    # ---- issuing --------------------------------------------------------------------
    def _call(self, call: EngineCall, instance_id: str | None = None) -> None:
        """Issue the current action's next call (on this instance, or `instance_id`) and wait for it."""
        self._stage = type(call)
        self._pending = self._issue(instance_id or self.instance_id, call, True)

    def _send(self, instance_id: str, call: EngineCall) -> None:
        """Issue a call nobody waits for."""
        self._issue(instance_id, call, False)

    def _next(self) -> list[Event]:
        while self._actions:
            action = self._current = self._actions.popleft()
            if isinstance(action, Switch):  # keep: a planned resident set, which the engine keeps
                self._call(calls.Activate(action.model, action.evict, action.keep))
            elif isinstance(action, Prefetch):
                self._send(self.instance_id, calls.Prefetch(action.model, action.keep))
                self._current = None
                continue
            elif isinstance(action, Prefill):
                ids = self._live(action.request_ids)
                if not ids:  # all cancelled while queued for this instance
                    self._current = None
                    return [StepDone(self.instance_id, "prefill", action.request_ids, 1)] + self._next()
                for rid in ids:
                    self._requests[rid].kv_home = self.instance_id
                self._call(calls.Prefill(tuple(self._requests[rid].gen_request() for rid in ids)))
            elif isinstance(action, Decode):
                self._steps, self._finished = 0, []
                self._chunk_done = self._chunks_done(action) if action.prefill_chunks else []
                self._chunk_finished = []
                if self._chunk_done:  # the prompts this iteration completes, computed whole
                    for rid in self._chunk_done:
                        self._requests[rid].kv_home = self.instance_id
                    self._call(calls.Prefill(tuple(self._requests[rid].gen_request() for rid in self._chunk_done)))
                    return []
                event = self._decode_continue(action)
                if event is None:
                    return []
                self._current = None
                return [event] + self._next()
            elif isinstance(action, SwapOut):
                if not self.hands_off:
                    self._call(calls.SaveKv(tuple(action.request_ids)))
                    return []
                self._exporting = [rid for rid in self._live(action.request_ids)
                                   if self._requests[rid].kv_home == self.instance_id]
                if not self._exporting:  # all cancelled (or finished) meanwhile
                    self._current = None
                    return [KvMoved(self.instance_id, action.request_ids, "host")] + self._next()
                self._call(calls.ExportKv(tuple(self._exporting)))
            elif isinstance(action, SwapIn):
                live = self._live(action.request_ids)
                self._carried = [rid for rid in live if self._requests[rid].kv_export is not None]
                self._imports = self._foreign([rid for rid in live if rid not in self._carried])
                self._swap_in_next(action)
            else:
                raise RuntimeError(f"{self.instance_id}: cannot run {action!r}")
            return []
        return []

    def _live(self, ids: Sequence[str]) -> list[str]:
        out = []
        for rid in ids:
            live = self._requests.get(rid)
            if live is not None and not live.cancelled and not live.finished:
                out.append(rid)
        return out

    # ---- prefill -------------------------------------------------------------------------
    def _prefill_result(self, action: Prefill, result: Any) -> list[Event]:
        if self._stage is calls.Prefill:
            finished = self._tokens(result)
            keep = [rid for rid in self._live(action.request_ids) if rid not in finished]
            if action.kv_to_host and keep:
                self._call(calls.SaveKv(tuple(keep)))
                self._finished = finished
                return []
            return [StepDone(self.instance_id, "prefill", action.request_ids, 1, tuple(finished))]
        return [StepDone(self.instance_id, "prefill", action.request_ids, 1, tuple(self._finished))]

    def _tokens(self, outs: Sequence[TokenOut]) -> list[str]:
        finished, deliveries = self._record(outs)
        self._deliver_all(deliveries)
        return finished

    def _record(self, outs: Sequence[TokenOut]) -> tuple[list[str], list[tuple[LiveRequest, TokenOut]]]:
        """Book the tokens on their requests; returns the finished ids and the (request, token) to deliver."""
        finished, deliveries = [], []
        for out in outs:
            live = self._requests.get(out.request_id)
            if live is None or live.cancelled:
                continue
            live.output_token_ids.append(out.token_id)
            if out.finished:
                live.finished = True
                live.kv_home = None
                finished.append(out.request_id)
            deliveries.append((live, out))
        return finished, deliveries

    def _deliver_all(self, deliveries: list[tuple[LiveRequest, TokenOut]]) -> None:
        for live, out in deliveries:
            self._deliver(live, out)

    # ---- decode ----------------------------------------------------------------------------
    def _chunks_done(self, action: Decode) -> list[str]:
        """Count the iteration's chunks on their prompts; the live requests whose prompt they complete."""
        done = []
        for rid, tokens in action.prefill_chunks:
            live = self._requests.get(rid)
            if live is None or live.cancelled or live.finished:
                self._chunked.pop(rid, None)
                continue
            seen = self._chunked.get(rid, 0) + tokens
            if seen >= len(live.prompt_token_ids) + len(live.output_token_ids):
                self._chunked.pop(rid, None)
                done.append(rid)
            else:
                self._chunked[rid] = seen
        return done

    def _decode_continue(self, action: Decode) -> StepDone | None:
        """Issue the next step of the turn, or return the turn's StepDone when it is over."""
        ids = self._live(action.request_ids)
        if not ids or self._finished or self._steps >= action.max_steps or (self._stop and self._steps > 0):
            if action.prefill_chunks:  # one iteration: its decode step and the prompts it completed
                return StepDone(self.instance_id, "decode", action.request_ids + tuple(self._chunk_done), 1,
                                tuple(self._finished + self._chunk_finished))
            return StepDone(self.instance_id, "decode", action.request_ids, self._steps, tuple(self._finished))
        self._call(calls.DecodeStep(tuple(ids), turn_step=self._steps + 1, max_steps=action.max_steps))
        return None

    def _decode_result(self, action: Decode, result: Any) -> list[Event]:
        if self._stage is calls.Prefill:  # a mixed iteration's completed prompts: their first tokens
            self._chunk_finished = self._tokens(result)
            event = self._decode_continue(action)
            return [] if event is None else [event]
        self._steps += 1
        finished, deliveries = self._record(result)
        self._finished += finished
        event = self._decode_continue(action)  # the next step goes out before the tokens are streamed:
        self._deliver_all(deliveries)  # the engine computes it while the clients get theirs
        return [] if event is None else [event]

    # ---- KV moves ------------------------------------------------------------------------
    def _foreign(self, ids: Sequence[str]) -> list[tuple[str, list[str]]]:
        """Group the requests whose KV sits in another instance's host memory by that instance."""
        out: dict[str, list[str]] = {}
        for rid in self._live(ids):
            home = self._requests[rid].kv_home
            if home is not None and home != self.instance_id:
                out.setdefault(home, []).append(rid)
        return sorted(out.items())

    def _carry(self, exports: Any) -> None:
        """A hand-off's export_kv ended: the controller carries each request's KV until it is imported."""
        if self._stage is not calls.ExportKv:
            return
        for rid, export in zip(self._exporting, exports):
            live = self._requests.get(rid)
            if live is not None and not live.cancelled and not live.finished:
                live.kv_export = export
        self._exporting = []

    def _swap_in_next(self, action: SwapIn) -> None:
        if self._carried:
            ids, self._carried = self._live(self._carried), []
            self._release_after = [(self._requests[rid].kv_home, rid) for rid in ids if self._requests[rid].kv_staged]
            exports = [self._requests[rid].kv_export for rid in ids]
            for rid in ids:
                self._requests[rid].kv_export = None
            self._importing = ids
            self._call(calls.ImportKv(tuple(exports)))
            return
        if self._imports:
            home, ids = self._imports[0]
            self._call(calls.ExportKv(tuple(ids)), home)  # runs on the home instance, after whatever it is doing
            return
        ids = self._live(action.request_ids)
        for rid in ids:
            self._requests[rid].kv_home = self.instance_id
        self._call(calls.RestoreKv(tuple(ids)))

    def _release_staged(self) -> None:
        """The import copied the KV the exporting instances staged in device memory: they may free it now."""
        homes: dict[str, list[str]] = {}
        for home, rid in self._release_after:
            if home is not None and home != self.instance_id:
                homes.setdefault(home, []).append(rid)
        self._release_after = []
        for home, ids in sorted(homes.items()):
            self._send(home, calls.Release(tuple(ids)))

    def _swap_in_result(self, action: SwapIn, result: Any) -> list[Event]:
        if self._stage is calls.ExportKv:
            home, ids = self._imports.pop(0)
            # one export per id, in order (none when the home instance was lost); a request cancelled while
            # its KV was on the way is not imported: nobody would release it here
            kept = [(rid, export) for rid, export in zip(ids, result) if self._live([rid])]
            self._release_after = [(home, rid) for rid, export in zip(ids, result) if is_staged(export)]
            self._importing = [rid for rid, _ in kept]
            self._call(calls.ImportKv(tuple(export for _, export in kept)))
            return []
        if self._stage is calls.ImportKv:
            self._release_staged()
            gone = [rid for rid in self._importing if not self._live([rid])]  # cancelled during the import
            if gone:
                self._send(self.instance_id, calls.Release(tuple(gone)))
            self._swap_in_next(action)
            return []
        return [KvMoved(self.instance_id, action.request_ids, "device")]
