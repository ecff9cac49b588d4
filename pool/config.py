"""How a live pool runs: its engine, where engine calls go, admission limits, restarts and timeouts.

`PoolConfig` is everything `pool.service.LivePool` takes besides what it
serves (models, instances, policy, cost model). `modelpool serve` builds one
from its options (`modelpool.serve.pool_config`); tests and benchmarks build
theirs directly. Frozen: a running pool's settings do not change under it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pool.actor import EngineSpec
from pool.placement import DEFAULT_TIMEOUT_S as DEFAULT_PLACEMENT_TIMEOUT_S

Backend = Literal["ray", "processes", "threads", "inprocess"]
BACKENDS: tuple[str, ...] = get_args(Backend)


class PoolConfig(BaseModel):
    """The settings of one `LivePool` (every field has a default that suits tests on CPU)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    engine: EngineSpec = Field(default_factory=EngineSpec,
                               description="The engine each instance runs (torch | vllm | sim) and its options.")
    backend: Backend = Field("ray", description="Where engine calls run: ray (an actor per instance), processes "
                             "(an OS process per instance, no Ray), threads (a thread per instance in this process) "
                             "or inprocess (each call as it is issued: tests).")
    address: str | None = Field(None, description="Ray cluster to join (ray backend); None: an embedded one.")
    policy_options: Mapping[str, Any] = Field(default_factory=dict,
                                              description="Keyword options of the scheduling policy.")
    poll_s: float = Field(0.002, gt=0, description="Seconds the loop waits for engine results when nothing changed.")
    max_queued_per_model: int | None = Field(None, ge=1, description="Requests of one model that may wait for "
                                             "their first token (QueueFull beyond: HTTP 429); None: no limit.")
    max_requests: int | None = Field(None, ge=1, description="Requests in the pool at once (PoolBusy beyond: "
                                     "HTTP 503); None: no limit.")
    retry_after_s: float = Field(1.0, ge=0, description="What a refusal (PoolBusy, QueueFull) tells the client to "
                                 "wait before trying again.")
    stats_interval_s: float = Field(2.0, gt=0, description="Seconds between two stats() calls to each engine "
                                    "(/pool/status, /metrics).")
    num_recent_switches: int = Field(32, ge=0, description="Model switches /pool/status lists.")
    max_restarts: int = Field(3, ge=0, description="Fresh engines per lost instance within restart_window_s, "
                              "each after a growing back-off (0: a lost instance is written off).")
    restart_window_s: float = Field(600.0, gt=0, description="The window max_restarts counts in: the budget "
                                    "refills as restarts leave it.")
    heartbeat_timeout_s: float | None = Field(5.0, gt=0, description="An instance silent this long is hung: "
                                              "written off, killed and replaced. Silent: idle with its stats() "
                                              "call unanswered, or its engine process alive but "
                                              "not beating, busy or idle (processes and Ray backends) - a stopped "
                                              "or stuck process is found mid-call, while a slow call in a live "
                                              "process is not written off (a call stuck while the process's "
                                              "threads run is call_timeout_s's). None: no heartbeat deadline.")
    heartbeat_interval_s: float = Field(0.5, gt=0, description="How often each engine process beats (processes "
                                        "and Ray backends: a thread beside the engine's, so a long call does "
                                        "not stop it); below heartbeat_timeout_s.")
    restart_timeout_s: float = Field(300.0, gt=0, description="A restart slower than this gives the instance up.")
    call_timeout_s: float | None = Field(300.0, gt=0, description="An engine call unanswered this long means its "
                                         "instance is hung: written off and restarted; None: wait for ever.")
    devices: Mapping[str, str] = Field(default_factory=dict, description="Instance id -> torch device of its engine "
                                       "(default: the engine options' device).")
    gpu_share: float = Field(1.0, gt=0, le=1, description="Of a GPU each Ray actor asks for (0.5: two instances on "
                             "one GPU).")
    placement_timeout_s: float = Field(DEFAULT_PLACEMENT_TIMEOUT_S, gt=0, description="A tensor-parallel "
                                       "instance's Ray placement group not placed by then fails its start.")

    @model_validator(mode="after")
    def _beats_within_the_deadline(self) -> PoolConfig:
        timeout = self.heartbeat_timeout_s
        if timeout is not None and not self.heartbeat_interval_s < timeout:
            raise ValueError(f"heartbeat_interval_s ({self.heartbeat_interval_s:g}) must be below "
                             f"heartbeat_timeout_s ({timeout:g}): a live process would miss its deadline")
        return self
