"""`modelpool serve`: the live pool behind one OpenAI-compatible endpoint.

With no arguments it serves the demo fleet (SmolLM2-135M-Instruct and three
tiny random models, built offline once) on two CPU slots of an embedded
local Ray cluster (GPUs when present), under the token-level policy: every
model is served at once and the slots swap between them at token
boundaries, instead of a third model waiting for a slot to drain as under
request-level. On CPU the weights run in float32 (bf16 matmuls are ~4x
slower there). With `--fleet` it serves the fleet file's models from their
`weights:` folders on every GPU of the cluster (CPU slots when there are
none). `--engine sim` times tokens by the cost model and writes placeholder
text - for load tests and dry runs; it is never picked on its own.

Here: the command and its phases (check the options, start Ray, build the
deployment, start the pool, serve the gateway). What it deploys is decided in
modelpool.deploy (GPU memory: modelpool.gpu_memory; this machine's GPUs:
modelpool.gpus; MPS: modelpool.gpu_sharing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from modelpool.deploy import Deployment, demo_deployment, fleet_deployment
from modelpool.extras import SERVE_EXTRA, installed, missing_serve_extra
from modelpool.gpu_sharing import check_mps, share_gpus, start_mps
from modelpool.gpus import count_gpus, gpu_key
from pool.actor import EngineSpec
from pool.engines.base import SamplingParams
from pool.placement import PlacementTimeout

if TYPE_CHECKING:  # pool.service needs torch: imported where serve starts (`modelpool simulate` runs without it)
    from pool.service import LivePool


def serve_command(
    fleet_path: Path | None = typer.Option(None, "--fleet", "-f", help="Fleet file whose models (their `weights:` "
                                           "folders) to serve; default: the demo fleet, built offline once."),
    engine: str = typer.Option("torch", "--engine", "-e", help="torch | vllm | sim (sim: cost-model timing, "
                               "placeholder text, for load tests and dry runs)."),
    address: str | None = typer.Option(None, "--address", help="Join this Ray cluster (`ray start --head`); "
                                       "default: start an embedded local one."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (0.0.0.0 exposes the pool)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    policy: str = typer.Option("token-level", "--policy", "-p", help="dedicated | request-level | spatial | token-level"),
    instances: int | None = typer.Option(None, "--instances", help="Instances: default 2 CPU slots, or every GPU."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU type the demo fleet's cost model counts with (a catalogue "
                                   "key: h20, h200, ...); default: this machine's GPU, by its name. A fleet file "
                                   "names its own (pool.gpu)."),
    backend: str | None = typer.Option(None, "--backend", help="ray | processes | threads | inprocess (default: "
                                       "ray, or processes where Ray is not installed; threads for --engine sim). "
                                       "processes: one OS process per instance on this machine."),
    api_key: list[str] = typer.Option([], "--api-key", help="Require this Bearer key on /v1/* (repeatable; also "
                                      "env MODELPOOL_API_KEY)."),
    api_key_file: Path | None = typer.Option(None, "--api-key-file", help="File with one API key per line."),
    admin_key: list[str] = typer.Option([], "--admin-key", help="Key for /pool/* (also env MODELPOOL_ADMIN_KEY)."),
    admin_key_file: Path | None = typer.Option(None, "--admin-key-file", help="File with one admin key per line."),
    max_queued_per_model: int = typer.Option(256, "--max-queued-per-model", help="Waiting requests per model "
                                             "before 429."),
    max_requests: int = typer.Option(4096, "--max-requests", help="Requests in the pool before 503."),
    max_requests_per_model: int = typer.Option(0, "--max-requests-per-model", help="Requests of one model in the "
                                               "pool before 429, so one model's flood leaves room for the others "
                                               "(0 = no cap)."),
    max_buffered_tokens: int = typer.Option(1024, "--max-buffered-tokens", help="Unread tokens a stream may hold "
                                            "before its request is cancelled (slow_client)."),
    default_max_tokens: int = typer.Option(1024, "--default-max-tokens", help="max_tokens of a chat that sets none."),
    trust_request_chat_template: bool = typer.Option(False, "--trust-request-chat-template", help="Render chat "
                                                     "templates sent with requests (a template is a program: "
                                                     "refused by default, as vLLM does)."),
    max_connections: int = typer.Option(2048, "--max-connections", min=1, help="Open connections before new ones "
                                        "get 503."),
    body_timeout_s: float = typer.Option(10.0, "--body-timeout-s", min=0.1, help="A request body not received "
                                         "whole within this many seconds gets 408."),
    max_restarts: int = typer.Option(3, "--max-restarts", min=0, help="Restarts of a lost instance (its actor "
                                     "died or an engine call failed) before it is written off (0 = never)."),
    call_timeout_s: float = typer.Option(300.0, "--call-timeout-s", min=0, help="An engine call unanswered this "
                                         "long marks its instance hung: written off and restarted (0 = wait for "
                                         "ever)."),
    placement_timeout_s: float = typer.Option(120.0, "--placement-timeout-s", min=0.1, help="A tensor-parallel "
                                              "instance whose Ray placement group (one GPU per rank on one node) is "
                                              "not placed by then fails to start, saying what the cluster has."),
    layout: str | None = typer.Option(None, "--layout", help="token-level instance roles: a capacity report's "
                                      "report.json (its TP1 answer) or e.g. 1P+2D / 3M (P prefill, D decode, M mixed)."),
    kv_mib: int | None = typer.Option(None, "--kv-mib", help="Device KV per instance in MiB (default: 128 on a "
                                      "CPU slot, what fits on a GPU)."),
    sim_time_scale: float = typer.Option(1.0, "--sim-time-scale", help="sim engine: multiply predicted times "
                                         "(0 = as fast as possible)."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Run one short request per model first."),
    plan_log: Path | None = typer.Option(None, "--plan-log", help="Write every Plan as JSONL here."),
    profile: Path | None = typer.Option(None, "--profile", help="Calibration profile (`modelpool calibrate`) the "
                                        "scheduler predicts GPU step and switch times with (fleet files on GPUs)."),
    async_decode: bool | None = typer.Option(None, "--async-decode/--no-async-decode", help="torch engine: queue "
                                             "a greedy batch's next decode step before this one's tokens are sent, "
                                             "so the GPU works while the host streams them (default: on CUDA)."),
    mps: bool | None = typer.Option(None, "--mps/--no-mps", help="Run the engine processes (--backend processes) "
                                    "as clients of a private CUDA MPS daemon, so instances on one GPU run side by "
                                    "side instead of in time slices (pool.mps). Default: on where instances share "
                                    "a GPU and a daemon can be started (else time-sliced, as the banner says)."),
) -> None:
    """Serve the pool behind one OpenAI-compatible endpoint (default: the demo fleet on this machine)."""
    try:  # the serve extra: a package missing ends the command, naming every one missing
        import pool.gateway.server  # noqa: F401 - fastapi, uvicorn (the phases below import from it)
        from pool.config import BACKENDS
        from pool.service import LivePool
    except ModuleNotFoundError as exc:
        missing_serve_extra(exc)
    check_choices(engine, gpu, fleet_path, layout)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    backend = pick_backend(backend, engine, BACKENDS)
    daemon = start_mps(backend, engine) if mps else None  # before anything here or in an engine touches CUDA
    if backend == "ray":
        ray_init(address, instances or 2)
    num_gpus = count_gpus(backend, address) if engine != "sim" else 0
    if daemon is not None:
        check_mps(daemon, num_gpus)
    dep = deployment(fleet_path, engine, num_gpus, instances, policy, kv_mib, profile, gpu, layout)
    set_engine_options(dep, backend, sim_time_scale, async_decode)
    daemon = share_gpus(dep, daemon, mps, engine)
    settings = gateway_settings(dep, api_key=api_key, api_key_file=api_key_file, admin_key=admin_key,
                                admin_key_file=admin_key_file, default_max_tokens=default_max_tokens,
                                max_requests_per_model=max_requests_per_model,
                                max_buffered_tokens=max_buffered_tokens,
                                trust_request_chat_template=trust_request_chat_template,
                                max_connections=max_connections, body_timeout_s=body_timeout_s)
    config = pool_config(dep, address=address, max_queued_per_model=max_queued_per_model, max_requests=max_requests,
                         max_restarts=max_restarts, call_timeout_s=call_timeout_s,
                         placement_timeout_s=placement_timeout_s)
    log_file = plan_log.open("w") if plan_log else None
    live = LivePool(dep.models, dep.instances, policy, dep.costs, config, plan_log=log_file)
    try:
        run_pool(live, dep, settings, host, port, policy, warmup)
    finally:
        live.stop()
        if daemon is not None:
            daemon.stop()
        if log_file:
            log_file.close()
        if backend == "ray" and address is None:
            import ray

            ray.shutdown()


# ---- serve_command's phases ---------------------------------------------------------------------------------------
def check_choices(engine: str, gpu: str | None, fleet_path: Path | None, layout: str | None) -> None:
    """Refuse an unknown engine or GPU name, and --gpu or --layout with the wrong fleet, before anything starts."""
    if engine not in ("torch", "vllm", "sim"):
        raise typer.BadParameter(f"unknown engine {engine!r}; choose torch, vllm or sim", param_hint="--engine")
    if gpu is not None:
        if fleet_path is not None:
            raise typer.BadParameter("--gpu is for the demo fleet; a fleet file names its GPU (pool.gpu)",
                                     param_hint="--gpu")
        gpu_key(gpu)  # a bad name fails now, not after the cluster starts
    if layout is not None and fleet_path is None:
        raise typer.BadParameter("--layout is for a fleet file's pool (--fleet)", param_hint="--layout")


def default_backend(engine: str) -> str:
    """Where serve runs `engine`'s calls unless told: Ray actors, OS processes where Ray is not installed, threads
    for the sim engine. `modelpool calibrate` measures the pool's host costs on this backend too."""
    return "threads" if engine == "sim" else "ray" if installed("ray") else "processes"


def pick_backend(backend: str | None, engine: str, choices: Sequence[str]) -> str:
    """The backend asked for, else serve's default for `engine` (`default_backend`)."""
    backend = backend or default_backend(engine)
    if backend not in choices:
        raise typer.BadParameter(f"unknown backend {backend!r}; choose {', '.join(choices)}", param_hint="--backend")
    if backend == "ray" and not installed("ray"):
        raise typer.BadParameter(f"Ray is not installed: {SERVE_EXTRA}, or serve without it: --backend processes",
                                 param_hint="--backend")
    return backend


def deployment(fleet_path: Path | None, engine: str, num_gpus: int, instances: int | None, policy: str,
               kv_mib: int | None, profile: Path | None, gpu: str | None, layout: str | None) -> Deployment:
    """The fleet file's deployment (in `layout`), or the demo fleet's; a bad fleet file or layout ends the
    command saying what is wrong."""
    from modelpool.config import FleetFileError
    from modelpool.layout import LayoutError, layout_roles

    try:
        roles = layout_roles(layout, policy) if layout else None
        return (fleet_deployment(fleet_path, engine, num_gpus, instances, policy, kv_mib, profile, roles)
                if fleet_path else demo_deployment(engine, num_gpus, instances, kv_mib, gpu))
    except LayoutError as exc:
        raise typer.BadParameter(str(exc), param_hint="--layout") from None
    except FleetFileError as exc:
        for problem in exc.problems:
            typer.echo(str(problem), err=True)
        raise typer.Exit(1) from None


def set_engine_options(dep: Deployment, backend: str, sim_time_scale: float, async_decode: bool | None) -> None:
    """The command line's engine options (the sim engine's pace, async decode) and backend, onto `dep`."""
    if dep.engine.kind == "sim":
        dep.engine = dataclasses.replace(dep.engine, options={**dep.engine.options, "time_scale": sim_time_scale})
    dep.engine = with_async_decode(dep.engine, async_decode)
    dep.backend = backend
    note = host_backend_note(dep.costs, backend)
    if note:
        dep.notes.append(note)


def host_backend_note(costs: Any, backend: str) -> str | None:
    """A note where the cost model's profile (--profile) measured the pool's host terms on another backend than
    `backend`: the plans then count that backend's hop per engine call, not this one's."""
    run = getattr(getattr(costs, "profile", None), "calibration", None)
    if run is None or run.backend in (None, backend):
        return None
    return (f"the profile's host terms (host_call_s, request_admit_s, token_deliver_s, kv_call_host_s) were "
            f"measured on the {run.backend} backend, but serve runs {backend}: the plans count {run.backend}'s "
            f"time per engine call (`modelpool calibrate --backend {backend}` measures this one's)")


def gateway_settings(dep: Deployment, *, api_key: list[str], api_key_file: Path | None, admin_key: list[str],
                     admin_key_file: Path | None, default_max_tokens: int, max_requests_per_model: int,
                     max_buffered_tokens: int, trust_request_chat_template: bool, max_connections: int,
                     body_timeout_s: float) -> Any:
    """The gateway's keys, connection bounds and per-request limits (`pool.gateway.GatewaySettings`)."""
    from pool.gateway import GatewaySettings
    from pool.gateway.auth import ADMIN_KEY_ENV, API_KEY_ENV, read_keys
    from pool.gateway.prompts import RequestLimits

    sim = dep.engine.kind == "sim"
    return GatewaySettings(
        api_keys=tuple(read_keys(api_key, api_key_file, API_KEY_ENV)),
        admin_keys=tuple(read_keys(admin_key, admin_key_file, ADMIN_KEY_ENV)),
        default_chat_max_tokens=default_max_tokens,
        max_requests_per_model=max_requests_per_model or None,
        max_buffered_tokens=max_buffered_tokens,
        limits=RequestLimits(trust_request_chat_template=trust_request_chat_template),
        max_connections=max_connections, body_timeout_s=body_timeout_s,
        owned_by="modelpool-sim" if sim else "modelpool",
        fingerprint="modelpool-sim" if sim else None)


def pool_config(dep: Deployment, *, address: str | None, max_queued_per_model: int, max_requests: int,
                max_restarts: int, call_timeout_s: float, placement_timeout_s: float) -> Any:
    """The live pool's settings (`pool.config.PoolConfig`): the deployment's engine, backend and GPU layout, the
    command line's limits (`call_timeout_s` 0: wait for ever)."""
    from pool.config import PoolConfig

    return PoolConfig(engine=dep.engine, backend=dep.backend, address=address, devices=dep.devices,
                      gpu_share=dep.gpu_share, policy_options=dep.policy_options,
                      max_queued_per_model=max_queued_per_model, max_requests=max_requests,
                      max_restarts=max_restarts, call_timeout_s=call_timeout_s or None,
                      placement_timeout_s=placement_timeout_s)


def run_pool(pool: LivePool, dep: Deployment, settings: Any, host: str, port: int, policy: str,
             warmup: bool) -> None:
    """Start the pool (and warm it up), then serve the gateway until Ctrl-C or SIGTERM; the caller stops the pool."""
    from pool.gateway import create_app
    from pool.gateway.server import GatewayServer, uvicorn_config
    from pool.heap import freeze_heap

    typer.echo(f"Starting {len(dep.instances)} instance(s) with {len(dep.models)} model(s)...")
    # Ctrl-C and SIGTERM stop start-up and warm-up at once (the caller's finally stops the pool), also in a process
    # started with SIGINT ignored (a background job of a script): uvicorn installs its own handlers only later
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        pool.start()
        if warmup:
            typer.echo(f"Warmed up in {warm_up(pool):.1f} s.")
        freeze_heap()  # start-up's objects (imports, the threads backend's engines) out of full collections
    except KeyboardInterrupt:
        typer.echo("Interrupted before serving: stopping the pool.", err=True)
        raise typer.Exit(130) from None
    except PlacementTimeout as exc:  # the cluster has no node for a TP instance: say so, no traceback
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    server = GatewayServer(uvicorn_config(create_app(pool, settings), host, port, log_level="info"))
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    text = banner(dep, pool, url, policy, bool(settings.api_keys))

    served = threading.Event()  # set when server.run returns, however: a server that never started ends it too

    def announce() -> None:
        while not server.started and not server.should_exit and not served.wait(0.05):
            pass
        if server.started:
            typer.echo(text)

    threading.Thread(target=announce, daemon=True).start()
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal (our handlers above): end as
    # a clean exit, so the pool, its actors and the embedded Ray cluster are stopped by the caller
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        served.set()


def warm_up(pool: LivePool, timeout_s: float = 600.0) -> float:
    """One short request per model, so the first client does not pay for first-touching memory."""
    started = time.perf_counter()
    done = threading.Semaphore(0)
    for name in pool.models:
        ids = list(pool.tokenizer(name)("Hello", add_special_tokens=False)["input_ids"]) or [1]
        pool.submit(f"warmup-{name}", name, ids, SamplingParams(max_tokens=2, ignore_eos=True),
                    lambda item: done.release() if isinstance(item, BaseException) or item.finished else None)
    for _ in pool.models:
        if not done.acquire(timeout=timeout_s):
            raise RuntimeError("the warm-up requests did not finish")
    return time.perf_counter() - started


def banner(dep: Deployment, pool: LivePool, url: str, policy: str, keyed: bool) -> str:
    place = {"cpu": "CPU slots", "cuda": "GPUs", "sim": "simulated instances"}[dep.device]
    lines = [f"modelpool: {len(dep.models)} models on {len(dep.instances)} {place} "
             f"({dep.engine.kind} engine, {policy} policy, {dep.backend} backend)"]
    lines += [f"  {info.name:24s} max_model_len {info.max_model_len}" for info in pool.model_infos()]
    lines += [f"  note: {note}" for note in dep.notes]
    model = "smollm2-135m" if "smollm2-135m" in pool.models else next(iter(pool.models))
    auth = ' -H "Authorization: Bearer $MODELPOOL_API_KEY"' if keyed else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    lines += [f"OpenAI-compatible endpoint: {url}/v1   (status: {url}/pool/status, metrics: {url}/metrics)",
              "Try:", f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"]
    return "\n".join(lines)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def with_async_decode(spec: EngineSpec, async_decode: bool | None) -> EngineSpec:
    """The torch engine's `async_decode` switch set from --async-decode/--no-async-decode (None: its default)."""
    if spec.kind != "torch" or async_decode is None:
        return spec
    return EngineSpec(spec.kind, {**spec.options, "async_decode": async_decode})


def ray_init(address: str | None, num_instances: int) -> None:
    import ray

    if ray.is_initialized():
        return
    if address is None:  # the embedded cluster, room for every CPU slot
        # Ray turns a loopback node address into the routable one and listens on every interface whatever it is
        # told; its token auth (its default for a new local cluster, so RAY_AUTH_MODE is left alone) is what keeps
        # its job agent, which runs any command it is sent, closed to the network.
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(os.cpu_count() or 1, num_instances),
                 _node_ip_address="127.0.0.1")
    else:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
