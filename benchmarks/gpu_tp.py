"""Benchmark tensor parallelism in the torch engine: TP1 against TP2, and against the cost model's TP terms.

    python benchmarks/gpu_tp.py --out benchmarks/out/h200x2-tp.json      # two GPUs, NCCL: Qwen2.5-14B/32B/72B shapes, bf16
    python benchmarks/gpu_tp.py --tiny --out /tmp/tp.json          # CPU, gloo: tiny and small shapes, float32

Models are random-weight folders of Qwen2.5 shapes (config, a word tokenizer,
`random_weights.json`: each rank generates its shard; nothing is downloaded).
For each shape and tp (a TP1 run is skipped where the weights do not fit one
device, as the 72B's 145 GB do not fit one H200):
- whole-model switch (`activate` of a model not on the device; each rank copies its shard over its own
  link, all at once) against the pinned floor: shard bytes / this host's measured host-to-device rate;
- prefill of one prompt at each --prefill length;
- decode step (the engine's whole call: inputs, forward with its all-reduces, sampling) at each --batches
  size at --context tokens, with the collectives one step runs (count, bytes, host wait) from rank 0;
- KV swap: `save_kv` / `restore_kv` of a batch of 8 at the context, and the bytes each rank moved;
- the cost model's terms for the same shape and tp (`sims.costmodel`, --gpu): decode step, prefill, switch,
  and its all-reduce terms (2 per layer; per step and per token);
- one all-reduce alone (`TpComm` between two processes) at each payload a decode step sends (hidden x batch).
TP ranks are processes (rank 0 here); on CUDA they take cuda:0 and cuda:1 and decode eagerly (CUDA graphs are
not captured at tp > 1 yet), so compare TP2 with TP1 run eagerly as well (--no-graphs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import copy_bandwidth  # noqa: E402
from gpu_pool import word_tokenizer  # noqa: E402

from pool.engines.base import GenRequest, SamplingParams  # noqa: E402
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from pool.engines.tp import TpEngine  # noqa: E402
from pool.engines.weights import RANDOM_WEIGHTS_FILE  # noqa: E402
from scheduler.fleet import catalogue_arch, hf_shape  # noqa: E402

GiB = 1 << 30
# Qwen2.5 shapes from the arch catalogue (scheduler/catalog.py), as Qwen2Config keys
SHAPES = {f"{key}-shape": hf_shape(catalogue_arch(key)) for key in ("qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b")}
CPU_SHAPES = {
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=1024, tie_word_embeddings=False),
    "small": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                  intermediate_size=2816, vocab_size=8192, tie_word_embeddings=False),
}


def build_folder(root: Path, name: str, shape: dict[str, int], dtype: str, seed: int) -> Path:
    from transformers import Qwen2Config

    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1e6, torch_dtype=dtype).save_pretrained(folder)
    word_tokenizer(shape["vocab_size"]).save_pretrained(folder)
    (folder / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}))
    return folder


def make(tp: int, args: argparse.Namespace, model_bytes: int) -> Any:
    config = TorchEngineConfig(device=args.device, dtype=args.dtype, kv_bytes=args.kv_gib * GiB * tp,
                               max_host_kv_bytes=4 * args.kv_gib * GiB * tp, max_model_bytes=model_bytes or None,
                               cuda_graphs=args.graphs, tp=tp)
    return TorchEngine(config) if tp == 1 else TpEngine(config, threads=torch.get_num_threads())


def sync(engine: Any) -> None:
    engine.synchronize()


def wall(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ids(vocab: int, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=gen).tolist()


def collectives(engine: Any) -> dict[str, float]:
    return dict(engine.stats().extra.get("tp_collectives", {})) if isinstance(engine, TpEngine) else {}


def moved_d2h(engine: Any) -> list[int]:
    """Device-to-host bytes each rank has moved so far."""
    stats = engine.stats()
    return [r["bytes_d2h"] for r in stats.extra["tp_ranks"]] if "tp_ranks" in stats.extra else [stats.bytes_d2h]


def measure(engine: Any, names: list[str], shape: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    a, b = names
    out: dict[str, Any] = {"shard_bytes": engine.model_bytes(a)}
    engine.activate(a)
    engine.activate(b)
    switch, switch_wall = [], []
    for rep in range(args.reps):  # each activation copies the whole model (its shard on every rank)
        cold, warm = (a, b) if rep % 2 == 0 else (b, a)
        engine.drop_resident(cold)
        seconds = [0.0]
        switch_wall.append(wall(lambda: seconds.__setitem__(0, engine.activate(cold))))
        switch.append(seconds[0])
    out["switch_s"], out["switch_wall_s"] = statistics.median(switch), statistics.median(switch_wall)
    model = engine.stats().active_model
    greedy = SamplingParams(max_tokens=1, ignore_eos=True)
    out["prefill_s"] = {}
    for n, length in enumerate(args.prefill):
        times = []
        for rep in range(args.reps + 1):  # the first warms this length
            req = GenRequest(f"p{length}-{rep}", model, ids(shape["vocab_size"], length, rep), greedy)
            seconds = wall(lambda: (engine.prefill([req]), sync(engine)))
            if rep:
                times.append(seconds)
        out["prefill_s"][str(length)] = statistics.median(times)
    out["decode"] = {}
    for batch in args.batches:
        params = SamplingParams(max_tokens=args.steps + 4, ignore_eos=True)
        reqs = [GenRequest(f"d{batch}-{i}", model, ids(shape["vocab_size"], args.context, 100 + i), params)
                for i in range(batch)]
        for chunk in range(0, batch, 8):
            engine.prefill(reqs[chunk : chunk + 8])
        rids = [r.request_id for r in reqs]
        engine.decode_step(rids)  # warm
        before = collectives(engine)
        times = []
        for _ in range(args.steps):
            times.append(wall(lambda: (engine.decode_step(rids), sync(engine))))
        after = collectives(engine)
        row: dict[str, Any] = {"step_s": statistics.median(times), "min_s": min(times)}
        if after:
            row["per_step"] = {k: (after[k] - before[k]) / args.steps for k in after}
        if batch == args.kv_batch:
            before_kv = moved_d2h(engine)
            row["save_kv_s"] = wall(lambda: (engine.save_kv(rids), sync(engine)))
            row["restore_kv_s"] = wall(lambda: (engine.restore_kv(rids), sync(engine)))
            row["kv_bytes_per_rank"] = [now - was for now, was in zip(moved_d2h(engine), before_kv)]
        engine.release(rids)
        out["decode"][str(batch)] = row
    return out


def layout_bytes(folder: Path, tp: int, dtype: str) -> int:
    """Bytes of one rank's image (rank 0: the largest), from the engine's own layout; nothing is allocated."""
    import math

    from transformers import AutoConfig

    from pool.engines.device import align_up
    from pool.engines.weights import ModelSpec

    spec = ModelSpec.from_config(AutoConfig.from_pretrained(folder))
    spec = spec if tp == 1 else spec.shard(0, tp)
    return sum(align_up(math.prod(shape) * getattr(torch, dtype).itemsize) for _, shape in spec.layout())


def cost_terms(name: str, folder: Path, tp: int, gpu: str, args: argparse.Namespace) -> dict[str, Any]:
    from scheduler.fleet import Arch, arch_from_hf_config
    from sims.costmodel import RooflineCostModel

    arch = Arch.model_validate(arch_from_hf_config(json.loads((folder / "config.json").read_text())))
    cost = RooflineCostModel.for_models({name: (arch, tp)}, gpu)
    c = cost.constants(name)
    return {"gpu": gpu, "weight_bytes_per_gpu": arch.weight_bytes / tp,
            "switch_s": cost.switch_s(name),
            "prefill_s": {str(n): cost.prefill_s(name, n) for n in args.prefill},
            "decode_step_s": {str(b): cost.decode_step_s(name, b, b * args.context) for b in args.batches},
            "allreduces_per_step": 2 * arch.num_layers if tp > 1 else 0,
            "allreduce_fixed_s": c.allreduce_fixed_s, "allreduce_s_per_token": c.allreduce_s_per_token}


def _all_reduce_rank(rank: int, size: int, store: str, device: str, sizes: list[int], reps: int, out: Any) -> None:
    from pool.engines.tp import TpComm

    torch.set_num_threads(1)
    comm = TpComm(store, rank, size, torch.device(device))
    rows = {}
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        times = []
        for rep in range(reps + 10):  # the first ten warm up
            if device != "cpu":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            comm.all_reduce(tensor)
            if device != "cpu":
                torch.cuda.synchronize(device)
            if rep >= 10:
                times.append(time.perf_counter() - start)
        rows[str(nbytes)] = {"median_s": statistics.median(times), "p10_s": sorted(times)[len(times) // 10]}
    if rank == 0:
        out.put(rows)


def all_reduce_latency(size: int, cuda: bool, sizes: list[int], reps: int = 200) -> dict[str, Any]:
    """One all-reduce through `TpComm` (gloo or NCCL) between `size` processes, alone, by message size."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = str(Path(tempfile.mkdtemp()) / "store")
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, size, store, f"cuda:{r}" if cuda else "cpu", sizes, reps,
                                                        out)) for r in range(size)]
    for proc in procs:
        proc.start()
    rows = out.get(timeout=300)
    for proc in procs:
        proc.join(60)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU, gloo, tiny and small shapes (seconds)")
    parser.add_argument("--shapes", nargs="*", help="shape names to run (default: all of the mode)")
    parser.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--prefill", type=int, nargs="*", default=[512, 4096])
    parser.add_argument("--context", type=int, default=None, help="decode context tokens (default 1024; tiny 128)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 20; tiny 10)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kv-batch", type=int, default=8)
    parser.add_argument("--kv-gib", type=int, default=None, help="device KV per rank, GiB (default 8; tiny 1)")
    parser.add_argument("--gpu", default="h200", help="the cost model's GPU (catalogue key)")
    parser.add_argument("--no-graphs", dest="graphs", action="store_false", help="TP1 decodes eagerly too")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    args.device, args.dtype = ("cuda:0", "bfloat16") if cuda else ("cpu", "float32")
    args.context = args.context or (1024 if cuda else 128)
    args.steps = args.steps or (20 if cuda else 10)
    args.kv_gib = args.kv_gib or (8 if cuda else 1)
    if not cuda:
        torch.set_num_threads(1)
        args.prefill = [n for n in args.prefill if n <= 512] or [512]  # CPU: a 4096-token prefill takes minutes
    shapes = CPU_SHAPES if not cuda else SHAPES
    shapes = {k: v for k, v in shapes.items() if not args.shapes or k in args.shapes}
    device_bytes = torch.cuda.get_device_properties(0).total_memory if cuda else None
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "dtype": args.dtype,
                              "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
                              "bandwidth": copy_bandwidth(torch.device(args.device), 1 * GiB if cuda else 64 << 20, 3),
                              "shapes": {}}
    h2d = result["bandwidth"]["h2d_GBps"] * 1e9
    if max(args.tp) > 1:
        hidden = [shape["hidden_size"] * (2 if cuda else 4) for shape in shapes.values()]
        sizes = sorted({h * b for h in hidden for b in args.batches})  # one decode step's all-reduce payloads
        result["all_reduce"] = all_reduce_latency(max(args.tp), cuda, sizes)
        print("all-reduce:", json.dumps(result["all_reduce"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for shape_name, shape in shapes.items():
            names = [f"{shape_name}-a", f"{shape_name}-b"]
            folders = [build_folder(Path(tmp), n, shape, args.dtype, seed) for seed, n in enumerate(names)]
            runs: dict[str, Any] = {}
            for tp in args.tp:
                terms = cost_terms(names[0], folders[0], tp, args.gpu, args)
                per_gpu = layout_bytes(folders[0], tp, args.dtype)
                if device_bytes is not None and 2 * per_gpu + args.kv_gib * GiB > 0.95 * device_bytes:
                    # the engine's model region holds two models' worth (the switch target beside the active one)
                    runs[f"tp{tp}"] = {"skipped": f"two model slots of {per_gpu / 1e9:.1f} GB and {args.kv_gib} GiB "
                                                  f"of KV do not fit one device", "cost_model": terms}
                    print(f"{shape_name} tp{tp}: {runs[f'tp{tp}']['skipped']}", flush=True)
                    continue
                engine = None
                try:
                    engine = make(tp, args, 0)
                    for name, folder in zip(names, folders):
                        engine.load(name, folder)
                    shard = engine.model_bytes(names[0])
                    print(f"{shape_name} tp{tp}: shard {shard / 1e9:.3f} GB", flush=True)
                    row = measure(engine, names, shape, args)
                    row["switch_floor_s"] = row["shard_bytes"] / h2d
                    row["cost_model"] = terms
                    runs[f"tp{tp}"] = row
                    print(json.dumps({k: v for k, v in row.items() if k != "cost_model"}), flush=True)
                finally:
                    if engine is not None:
                        engine.close()
            result["shapes"][shape_name] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
