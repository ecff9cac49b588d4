"""/metrics: vLLM's metric names with a `model_name` label, plus the pool's own.

Latencies (TTFT, inter-token, end to end) and token counters are observed by
the gateway as tokens leave for the client, with vLLM's buckets, so
dashboards built for vLLM work unchanged. Gauges (running/waiting requests,
KV usage) and the pool metrics (model switches, switch seconds, KV bytes
swapped, what each instance holds) are read from the pool at scrape time.
Each app has its own registry, so several gateways can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pool.gateway.drain import DrainRate

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class GatewayMetrics:
    def __init__(self, pool: Any, model_names: Iterable[str]) -> None:
        self.registry = CollectorRegistry()
        reg, label = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (gateway arrival to "
                              "first token sent).", label, buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens sent.", label,
                             buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.", label,
                             buckets=E2E_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens admitted.", label, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", label, registry=reg)
        self.success = Counter("vllm:request_success", "Requests finished.", ["model_name", "finished_reason"],
                               registry=reg)
        self.errors = Counter("modelpool_request_errors", "Requests answered with an error, by HTTP status.",
                              ["model_name", "status"], registry=reg)
        self.drain = DrainRate()  # for Retry-After
        self._children: dict[str, tuple[Any, ...]] = {}
        for name in model_names:
            self._labels(name)
        reg.register(PoolCollector(pool))

    def _labels(self, model: str) -> tuple[Any, ...]:
        children = self._children.get(model)
        if children is None:
            children = self._children[model] = tuple(
                metric.labels(model_name=model)
                for metric in (self.ttft, self.itl, self.e2e, self.prompt_tokens, self.generation_tokens))
        return children

    def timer(self, model: str, prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, model, prompt_tokens)

    def error(self, model: str, status: int) -> None:
        self.errors.labels(model_name=model, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies, observed as its tokens go out."""

    __slots__ = ("metrics", "model", "prompt_tokens", "arrived_at", "last_at", "num_tokens", "children")

    def __init__(self, metrics: GatewayMetrics, model: str, prompt_tokens: int) -> None:
        self.metrics, self.model, self.prompt_tokens = metrics, model, prompt_tokens
        self.arrived_at = self.last_at = time.perf_counter()
        self.num_tokens = 0
        self.children = metrics._labels(model)

    def token(self) -> None:
        now = time.perf_counter()
        ttft, itl = self.children[0], self.children[1]
        (ttft if self.num_tokens == 0 else itl).observe(now - self.last_at)
        if self.num_tokens == 0:
            self.metrics.drain.started(self.model)
        self.last_at = now
        self.num_tokens += 1

    def finished(self, reason: str | None) -> None:
        self.children[2].observe(time.perf_counter() - self.arrived_at)
        self.children[3].inc(self.prompt_tokens)
        self.children[4].inc(self.num_tokens)
        self.metrics.success.labels(model_name=self.model, finished_reason=reason or "abort").inc()
        self.metrics.drain.ended(self.model)


class PoolCollector:
    """Gauges and pool counters read from the LivePool at scrape time."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: nothing fixed to describe

    def collect(self) -> Iterable[Metric]:
        pool = self.pool
        status = pool.status()
        yield from self._requests(pool, status)
        yield from self._instances(pool, status)

    def _requests(self, pool: Any, status: dict[str, Any]) -> Iterable[Metric]:
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests generating tokens.", labels=["model_name"])
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting for their first token.",
                                    labels=["model_name"])
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Share (0-1) of the pool's device KV the model's "
                               "requests hold (scheduler reservations).", labels=["model_name"])
        capacity = sum(i.get("kv_capacity_bytes", 0.0) for i in status.get("instances", {}).values()) or 1.0
        per_model = status.get("models", {})
        for model, (queued, generating) in pool.load().items():
            running.add_metric([model], generating)
            waiting.add_metric([model], queued)
            kv.add_metric([model], per_model.get(model, {}).get("kv_reserved_bytes", 0.0) / capacity)
        rejected = CounterMetricFamily("modelpool_requests_rejected", "Requests refused at admission.",
                                       labels=["model_name", "reason"])
        for (model, reason), count in sorted(pool.num_rejected.items()):
            rejected.add_metric([model, reason], count)
        ready = GaugeMetricFamily("modelpool_ready", "1 while the pool takes requests.")
        ready.add_metric([], 1.0 if pool.ready else 0.0)
        yield from (running, waiting, kv, rejected, ready)

    def _instances(self, pool: Any, status: dict[str, Any]) -> Iterable[Metric]:
        switches = CounterMetricFamily("modelpool_model_switches", "Model switches planned, by instance and the "
                                       "model switched in.", labels=["instance", "model_name"])
        for (instance, model), count in sorted(pool.num_switches.items()):
            switches.add_metric([instance, model], count)
        moves = CounterMetricFamily("modelpool_kv_swaps", "Requests whose KV was swapped, by direction.",
                                    labels=["direction"])
        for direction, count in sorted(pool.num_kv_moves.items()):
            moves.add_metric([direction], count)
        switch_s = CounterMetricFamily("modelpool_switch_seconds", "Seconds engines spent switching models.",
                                       labels=["instance"])
        kv_bytes = CounterMetricFamily("modelpool_kv_swapped_bytes", "KV bytes moved between device and host.",
                                       labels=["instance", "direction"])
        active = GaugeMetricFamily("modelpool_instance_loaded_model", "1 for the model an instance has loaded "
                                   "(active) or prefetched.", labels=["instance", "model_name", "slot"])
        kv_used = GaugeMetricFamily("modelpool_instance_kv_used_bytes", "Device KV reserved on the instance.",
                                    labels=["instance"])
        kv_cap = GaugeMetricFamily("modelpool_instance_kv_capacity_bytes", "Device KV the instance has.",
                                   labels=["instance"])
        up = GaugeMetricFamily("modelpool_instance_up", "0 once the instance was lost.", labels=["instance"])
        captures = CounterMetricFamily("modelpool_graph_captures", "CUDA graphs captured by the instance's engine "
                                       "(all at warm-up: none on the request path).", labels=["instance"])
        misses = CounterMetricFamily("modelpool_graph_misses", "Decode steps that found no captured graph and ran "
                                     "eagerly.", labels=["instance"])
        for instance, info in sorted(status.get("instances", {}).items()):
            stats = pool.engine_stats.get(instance, {})
            extra = stats.get("extra", {})
            captures.add_metric([instance], float(extra.get("graph_captures", 0)))
            misses.add_metric([instance], float(extra.get("graph_misses", 0)))
            switch_s.add_metric([instance], float(stats.get("switch_s", 0.0)))
            weights_h2d = float(stats.get("extra", {}).get("weight_bytes_h2d", 0))
            kv_bytes.add_metric([instance, "device_to_host"], float(stats.get("bytes_d2h", 0)))
            kv_bytes.add_metric([instance, "host_to_device"], max(0.0, float(stats.get("bytes_h2d", 0)) - weights_h2d))
            for slot in ("active", "prefetched"):
                if info.get(f"{slot}_model"):
                    active.add_metric([instance, info[f"{slot}_model"], slot], 1.0)
            kv_used.add_metric([instance], float(info.get("kv_used_bytes", 0.0)))
            kv_cap.add_metric([instance], float(info.get("kv_capacity_bytes", 0.0)))
            up.add_metric([instance], 0.0 if info.get("lost") else 1.0)
        yield from (switches, moves, switch_s, kv_bytes, active, kv_used, kv_cap, up, captures, misses)
