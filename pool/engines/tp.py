"""Tensor parallelism for the torch engine: an instance of TP size t is t ranks, one process each.

Each rank is an ordinary `TorchEngine` over its shard of every model
(Megatron-style, `ModelSpec.shard`: column-parallel q/k/v and gate/up,
row-parallel o and down, the output head split by vocabulary, embeddings
and norms whole) and its share of the KV heads; the forward pass sums the
row-parallel outputs and gathers the logits through `TpComm` (gloo on CPU,
NCCL on CUDA). Every rank keeps its shards in its own (pinned) host memory
and copies them into its own device, so a switch moves shard bytes over
each GPU's own link, all ranks at once.

`TpEngine` is the instance as the pool sees it (the `Engine` protocol): it
runs rank 0 in its own process and hands every call to the other ranks too,
in parallel - ranks as subprocesses (the processes and thread backends)
or as Ray actors in the instance's placement group (`pool.engines.tp_ranks`).
All ranks take the same calls in the same order, so their block tables,
sampling and stopping agree without being told; the sampled
tokens are compared every step all the same. KV leaves and enters as one
`KvExport` of all heads (the ranks' shards joined on the head axis), the
same format as at tp 1.

One rank failing or dying writes the whole instance off: a dead peer breaks
the collectives at once (gloo reports the closed connection), any rank's
unexpected error ends every rank, and the call raises `RankLost` (an
`InstanceDied`), which the controller handles as any lost instance.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pool.errors import InstanceDied
from pool.engines.base import EngineError, EngineStats, GenRequest, KvCapacity, KvExport, TokenOut
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
from pool.engines.tp_files import store_stem, sweep_dead

TIMEOUT_S = 120.0  # a collective waiting this long on a live but silent peer fails (a dead one fails at once)
SUMMED_STATS = ("device_buffer_bytes", "kv_device_bytes", "kv_device_used_bytes", "kv_host_bytes", "kv_host_used_bytes",
                "host_weight_bytes", "bytes_h2d", "bytes_d2h")


class RankLost(InstanceDied):
    """A rank of a tensor-parallel instance died or failed: the whole instance is gone."""


# ---- collectives -------------------------------------------------------------------------------------
class TpComm:
    """One rank's collectives over its instance's ranks: a process group of its own (no global state, so one
    process may hold ranks of several instances), met through a file store on this host."""

    def __init__(self, store_path: str, rank: int, size: int, device: torch.device, timeout_s: float = TIMEOUT_S):
        import torch.distributed as dist

        self.rank, self.size = rank, size
        # what this rank exchanged (stats, benchmarks); seconds are the host's wait: the collective's time under
        # gloo, only its launch under NCCL
        self.num_all_reduce = self.num_gather = self.bytes = 0
        self.seconds = 0.0
        store = dist.FileStore(store_path, size)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group: Any = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # loopback only
            options._timeout = timeout
            self.group = dist.ProcessGroupGloo(store, rank, size, options)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place."""
        started = time.perf_counter()
        self.group.allreduce([tensor]).wait()
        self.seconds += time.perf_counter() - started
        self.num_all_reduce += 1
        self.bytes += tensor.numel() * tensor.element_size()

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Each rank's `[N, its vocabulary rows]` -> `[N, vocab_size]` (rank order), the same on every rank; the
        last rank's shorter part is padded for the exchange."""
        width = -(-vocab_size // self.size)
        if logits.shape[-1] < width:
            logits = torch.nn.functional.pad(logits, (0, width - logits.shape[-1]))
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        started = time.perf_counter()
        self.group.allgather([parts], [logits.contiguous()]).wait()
        self.seconds += time.perf_counter() - started
        self.num_gather += 1
        self.bytes += logits.numel() * logits.element_size()
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def figures(self) -> dict[str, float]:
        return {"all_reduces": self.num_all_reduce, "gathers": self.num_gather, "bytes": self.bytes,
                "wait_s": self.seconds}


@dataclass(frozen=True, slots=True)
class TpRank:
    """What makes a `TorchEngine` one rank of an instance."""

    rank: int
    size: int
    comm: TpComm


@dataclass(frozen=True, slots=True)
class RankSetup:
    """How to build rank `rank` (picklable: it travels to the rank's process)."""

    rank: int
    size: int
    store_path: str
    config: TorchEngineConfig
    threads: int = 1
    timeout_s: float = TIMEOUT_S


def rank_config(config: TorchEngineConfig, rank: int, device: str) -> TorchEngineConfig:
    """A rank's engine config: the instance's KV budget split evenly (a rank holds 1/tp of every token's KV).
    A rank never stages hand-offs in device memory: the instance joins its ranks' exports on the host (`join_kv`)."""
    size = config.tp
    return replace(config, tp=1, device=device, kv_bytes=config.kv_bytes // size,
                   max_host_kv_bytes=config.max_host_kv_bytes // size,
                   host_kv_prealloc_bytes=config.host_kv_prealloc_bytes // size, handoff_bytes=0)


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device when one process sees all the instance's GPUs: 'cuda:i' -> 'cuda:(i + rank)'."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device
    return f"cuda:{int(index or 0) + rank}"


def build_rank(setup: RankSetup) -> TorchEngine:
    comm = TpComm(setup.store_path, setup.rank, setup.size, torch.device(setup.config.device), setup.timeout_s)
    return TorchEngine(setup.config, rank=TpRank(setup.rank, setup.size, comm))


RankMethod = Callable[..., Any]  # a TorchEngine method, unbound (`TorchEngine.prefill`): pickled by its name


def run_call(engine: TorchEngine, method: RankMethod, args: tuple[Any, ...]) -> tuple[str, Any]:
    """One call on a remote rank, as it answers: ('ok', result) or ('err', exception). Generation calls answer
    only their token ids (rank 0 streams the text); an error that is not the engine's own ends the process
    after answering, so its peers' collectives fail at once instead of waiting out their timeout."""
    try:
        result = method(engine, *args)
    except EngineError as exc:  # raised alike on every rank before any collective (same calls, same state)
        return "err", exc
    except Exception as exc:  # noqa: BLE001 - the caller writes the instance off
        return "fatal", RuntimeError(f"rank {engine.rank.rank if engine.rank else '?'}: {method.__name__}: {exc!r}")
    if method in (TorchEngine.prefill, TorchEngine.decode_step):
        result = [out.token_id for out in result]
    return "ok", result


# ---- the instance ------------------------------------------------------------------------------------------------
class TpEngine:
    """A tensor-parallel instance behind the `Engine` protocol (see the module docstring)."""

    timings = None  # each rank's engine keeps its own

    def __init__(self, config: TorchEngineConfig, ranks: str = "processes", threads: int | None = None,
                 timeout_s: float = TIMEOUT_S) -> None:
        if config.tp < 2:
            raise ValueError(f"TpEngine needs tp >= 2, got {config.tp}")
        if ranks not in ("processes", "ray"):
            raise ValueError(f"unknown rank launcher {ranks!r}; choose processes or ray")
        self.config, self.size = config, config.tp
        self._broken: str | None = None
        sweep_dead()  # what killed TP instances on this machine left (a Ray actor has no parent to do it)
        self._store = store_stem(os.getpid()) + uuid.uuid4().hex
        threads = threads or torch.get_num_threads()
        devices = [rank_device(config.device, r) if ranks == "processes" else config.device for r in range(self.size)]
        setups = [RankSetup(r, self.size, self._store, rank_config(config, r, devices[r]), threads, timeout_s)
                  for r in range(self.size)]
        from pool.engines import tp_ranks

        launch: Callable[[Sequence[RankSetup]], list[Any]] = (tp_ranks.process_ranks if ranks == "processes"
                                                              else tp_ranks.ray_ranks)
        self._remotes: list[Any] = launch(setups[1:])
        try:
            self.local = build_rank(setups[0])  # meets the remote ranks in the process group
            self.rank_pids = [os.getpid(), *(remote.ready() for remote in self._remotes)]
        except BaseException:
            self.close()
            raise

    # ---- fan-out -----------------------------------------------------------------------------------
    def _all(self, method: RankMethod, *args: Any, per_rank: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        """Run `method` (a TorchEngine method) on every rank at once; each rank's result (rank 0 first)."""
        name = method.__name__
        if self._broken is not None:
            raise RankLost(f"tp instance already lost: {self._broken}")
        try:
            for r, remote in enumerate(self._remotes, start=1):
                remote.send(method, per_rank[r] if per_rank else args)
        except RankLost as exc:
            self._lose(str(exc))
            raise
        local_error: EngineError | None = None
        try:
            local = method(self.local, *(per_rank[0] if per_rank else args))
        except EngineError as exc:
            local, local_error = None, exc
        except Exception as exc:
            self._lose(f"rank 0: {name}: {exc!r}")
            raise RankLost(f"rank 0 failed in {name}: {exc!r}") from exc
        results, errors = [local], []
        for remote in self._remotes:
            try:
                status, result = remote.recv()
            except RankLost as exc:
                self._lose(str(exc))
                raise
            if status == "fatal":
                self._lose(str(result))
                raise RankLost(str(result))
            if status == "err":
                errors.append(result)
            results.append(result)
        if (local_error is None) != (not errors):  # ranks disagree about a call: their states have parted
            self._lose(f"{name}: rank 0 raised {local_error!r}, the others {errors!r}")
            raise RankLost(f"tp ranks disagree about {name}: rank 0 {local_error!r}, others {errors!r}")
        if local_error is not None:
            raise local_error
        return results

    def _lose(self, why: str) -> None:
        """The instance is gone: end every remote rank (they may wait in a collective) and refuse later calls."""
        self._broken = why
        for remote in self._remotes:
            remote.kill()

    # ---- models ---------------------------------------------------------------------------------------
    def load(self, model: str, path: Path) -> None:
        self._all(TorchEngine.load, model, Path(path))

    def models(self) -> list[str]:
        return self.local.models()

    def tokenizer(self, model: str) -> Any:
        return self.local.tokenizer(model)

    def model_bytes(self, model: str) -> int:
        """Bytes of one rank's shard (what each GPU's link carries in a switch)."""
        return self.local.model_bytes(model)

    def activate(self, model: str, evict: bool = True, keep: tuple[str, ...] | None = None) -> float:
        return max(self._all(TorchEngine.activate, model, evict, keep))

    def prefetch(self, model: str, keep: tuple[str, ...] | None = None) -> None:
        self._all(TorchEngine.prefetch, model, keep)

    def weights_pinned(self, model: str) -> bool:
        return all(self._all(TorchEngine.weights_pinned, model))

    def weights_ready(self, model: str) -> bool:
        return all(self._all(TorchEngine.weights_ready, model))

    def deactivate(self, model: str) -> None:
        self._all(TorchEngine.deactivate, model)

    def drop_resident(self, model: str) -> None:
        self._all(TorchEngine.drop_resident, model)

    def warm_up(self, max_tokens: int | None = None) -> int:
        return sum(self._all(TorchEngine.warm_up, max_tokens))

    # ---- generation ------------------------------------------------------------------------------------
    def prefill(self, requests: Sequence[GenRequest]) -> list[TokenOut]:
        return self._agreed(TorchEngine.prefill, list(requests))

    def decode_step(self, request_ids: Sequence[str]) -> list[TokenOut]:
        return self._agreed(TorchEngine.decode_step, list(request_ids))

    def _agreed(self, method: str, arg: Any) -> list[TokenOut]:
        outs, *others = self._all(method, arg)
        tokens = [out.token_id for out in outs]
        for r, theirs in enumerate(others, start=1):
            if theirs != tokens:
                self._lose(f"{method}: rank {r} sampled {theirs}, rank 0 {tokens}")
                raise RankLost(f"tp rank {r} sampled other tokens than rank 0 in {method}")
        return outs

    # ---- KV ---------------------------------------------------------------------------------------------
    def save_kv(self, request_ids: Sequence[str]) -> None:
        self._all(TorchEngine.save_kv, list(request_ids))

    def restore_kv(self, request_ids: Sequence[str]) -> None:
        self._all(TorchEngine.restore_kv, list(request_ids))

    def release(self, request_ids: Sequence[str]) -> None:
        self._all(TorchEngine.release, list(request_ids))

    def export_kv(self, request_ids: Sequence[str]) -> list[KvExport]:
        """Every rank's KV shard of each request, joined on the head axis: one export, as at tp 1."""
        per_rank = self._all(TorchEngine.export_kv, list(request_ids))
        return [join_kv(shards) for shards in zip(*per_rank)]

    def import_kv(self, exports: Sequence[KvExport]) -> None:
        exports = list(exports)
        shards = [split_kv(e, self.size) for e in exports]
        self._all(TorchEngine.import_kv, per_rank=[([s[r] for s in shards],) for r in range(self.size)])

    def kv_capacity(self) -> KvCapacity:
        """Tokens of each model the instance's device KV holds: the least any rank holds (ranks hold one
        token's KV heads each, in equal shapes, so they agree)."""
        reports = self._all(TorchEngine.kv_capacity)
        return KvCapacity(tokens={m: min(r.tokens[m] for r in reports) for m in reports[0].tokens},
                          block_tokens=dict(reports[0].block_tokens))

    def synchronize(self) -> None:
        self._all(TorchEngine.synchronize)

    def stats(self) -> EngineStats:
        everyone = self._all(TorchEngine.stats)
        local = everyone[0]
        summed = {name: sum(getattr(s, name) for s in everyone) for name in SUMMED_STATS}
        ranks = [{"device": s.device, "bytes_h2d": s.bytes_h2d, "bytes_d2h": s.bytes_d2h, "switch_s": s.switch_s,
                  "kv_device_used_bytes": s.kv_device_used_bytes} for s in everyone]
        return replace(local, **summed, switch_s=max(s.switch_s for s in everyone),
                       extra={**local.extra, "tp": self.size, "tp_rank_pids": list(self.rank_pids), "tp_ranks": ranks,
                              "tp_collectives": self.local.rank.comm.figures()})

    def close(self) -> None:
        for remote in getattr(self, "_remotes", []):
            remote.stop()
        local = getattr(self, "local", None)
        if local is not None:
            local.close()
        try:
            os.unlink(self._store)
        except FileNotFoundError:
            pass


# ---- KV across ranks -------------------------------------------------------------------------------------------
def join_kv(shards: Sequence[KvExport]) -> KvExport:
    """The ranks' exports of one request (each its KV heads) as one export of all heads."""
    first = shards[0]
    layers, two, heads, tokens, head_dim = first.kv_shape
    itemsize = getattr(torch, first.kv_dtype).itemsize
    parts = [np.asarray(s.kv).reshape(layers, two, heads, tokens, head_dim * itemsize) for s in shards]
    joined = np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)
    return replace(first, kv=joined, kv_shape=(layers, two, heads * len(shards), tokens, head_dim))


def split_kv(export: KvExport, size: int) -> list[KvExport]:
    """One export of all heads as `size` rank shards (KV heads split evenly, in rank order)."""
    layers, two, heads, tokens, head_dim = export.kv_shape
    if heads % size:
        raise EngineError(f"import_kv: request {export.request.request_id!r}: {heads} KV heads do not split over "
                          f"tp {size}")
    itemsize = getattr(torch, export.kv_dtype).itemsize
    full = np.asarray(export.kv).reshape(layers, two, heads, tokens, head_dim * itemsize)
    per = heads // size
    return [replace(export, kv=np.ascontiguousarray(full[:, :, r * per : (r + 1) * per]).reshape(-1),
                    kv_shape=(layers, two, per, tokens, head_dim)) for r in range(size)]
