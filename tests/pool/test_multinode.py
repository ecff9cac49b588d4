"""A real multi-node Ray cluster on this machine, loopback only: `modelpool serve --address` puts an instance on
every node, `modelpool capacity --address` spreads its simulations over the nodes, and a node removed in the
middle of decoding (its raylet and workers killed) loses its instance: its requests resume on the other nodes
with the tokens of an undisturbed run, the gateway keeps answering, and the instance comes back on a node that
joins later.

The nodes are `ray.cluster_utils.Cluster` nodes (one CPU each, a custom resource naming each) whose every port
listens on 127.0.0.1 only. Ray turns a loopback `--address` into the machine's routable address before it
connects, where this cluster does not listen; `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` in the drivers' environment
makes it keep 127.0.0.1 (on Linux that is all it changes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pool.gateway.server import free_port
from tests.pool.fault_tools import Stream, homes, outcomes, run_streams, stop_serve, wait_until
from tests.pool.test_faults import LONG_TOKENS, long_reference, submit_all  # noqa: F401
from tests.pool.test_live_pool import tiny  # noqa: F401
from tests.pool.test_tp import tp2_pool

REPO = Path(__file__).resolve().parents[2]
NUM_NODES = 3
MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
PROMPTS = ("Once upon a time", "The pool swaps models", "A B C D E F")
NUM_TOKENS = 160
TIMEOUT_S = 120
LOOPBACK_DRIVER = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head node with no CPU (the drivers attach there) and NUM_NODES one-CPU worker nodes, all on loopback.

    The cluster's address is not written to Ray's per-machine address file, so a `ray.init()` elsewhere on
    this machine (another test, another session) starts its own cluster instead of joining this one.
    """
    import ray._common.utils
    import ray._private.utils
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray._private.utils, "write_ray_address", lambda *args, **kwargs: None)
        patch.setattr(ray._common.utils, "reset_ray_address", lambda *args, **kwargs: None)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
                                                                "include_dashboard": False})
        for k in range(NUM_NODES):
            add_node(cluster, k)
        yield cluster
        cluster.shutdown()


def add_node(cluster: Any, k: int) -> Any:
    return cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={f"node-{k}": 1})


def driver_env(demo_models: dict[str, Path]) -> dict[str, str]:
    return {**os.environ, **LOOPBACK_DRIVER, "OMP_NUM_THREADS": "1",
            "MODELPOOL_CACHE": str(next(iter(demo_models.values())).parent)}


def worker_ids(cluster: Any) -> set[str]:
    return {node.node_id for node in cluster.worker_nodes}


LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def listening(cluster: Any, *pids: int) -> dict[str, set[str]]:
    """What every process of the cluster (its services, agents and workers) and of `pids` listens on."""
    import psutil

    session, procs = cluster.head_node.session_name, [psutil.Process(pid) for pid in pids]
    for proc in psutil.Process().children(recursive=True):
        try:
            if session in " ".join(proc.cmdline()):
                procs += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
    out: dict[str, set[str]] = {}
    for proc in set(procs):
        try:
            name = proc.name()
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    out.setdefault(f"{name} ({proc.pid})", set()).add(f"{conn.laddr.ip}:{conn.laddr.port}")
        except psutil.Error:
            continue
    return out


def test_capacity_spreads_its_simulations_over_the_nodes(cluster, demo_models, tmp_path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("pool: {gpu: h20, num_gpus: 4}\nmodels:\n"
                     "  - {name: small-a, arch: qwen2.5-1.5b, traffic: {rate_rps: 0.4}}\n"
                     "  - {name: small-b, arch: qwen3-1.7b, traffic: {rate_rps: 0.2}}\n"
                     "  - {name: small-c, arch: qwen2.5-3b, traffic: {rate_rps: 0.1}}\n")
    done = subprocess.run([sys.executable, "-m", "modelpool.cli", "capacity", "--address", cluster.address,
                           "--fleet", str(fleet), "--duration", "30", "--policies", "dedicated,token-level",
                           "--what-if-tpot", "0", "--out", str(tmp_path / "report")], cwd=REPO,
                          env=driver_env(demo_models), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.search(r"(\d+) simulations ran as Ray tasks on (\d+) node\(s\): (.*)", done.stdout)
    assert found, done.stdout
    spread = {node: int(count) for node, count in re.findall(r"(\w{8}) (\d+)", found.group(3))}
    print(f"\ncapacity on {NUM_NODES} nodes: {found.group(0)}")
    assert int(found.group(2)) == len(spread) >= 2, found.group(0)
    assert set(spread) <= {node[:8] for node in worker_ids(cluster)}  # the head has no CPU: no task ran there
    assert sum(spread.values()) == int(found.group(1)) > 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert set(report["policies"]) == {"dedicated", "token-level"}


def test_serve_says_which_tp_instance_no_node_can_hold_and_exits(cluster, demo_models, tmp_path) -> None:
    """Only one-CPU nodes: a TP2 instance (two CPU ranks on one node) cannot be placed; serve ends within its
    --placement-timeout-s with one line saying what was asked and what each node has, not a traceback."""
    path = demo_models["tiny-llama"]
    fleet = tmp_path / "tp2.yaml"
    fleet.write_text(f"pool: {{gpu: h100, num_gpus: 2}}\nmodels:\n  - {{name: two, arch: {path}, weights: {path}, "
                     "tp: 2}\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "modelpool.cli", "serve", "--address", cluster.address, "--fleet",
                           str(fleet), "--instances", "1", "--kv-mib", "16", "--placement-timeout-s", "2",
                           "--no-warmup", "--port", str(free_port())], cwd=REPO, env=driver_env(demo_models),
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    line = next((x for x in done.stderr.splitlines() if x.startswith("error: instance tp2-0")), None)
    assert line and "2 bundles {'CPU': 1.0} packed on one node (STRICT_PACK) within 2 s" in line, done.stderr
    for node_id in worker_ids(cluster):
        assert f"node {node_id[:8]} (127.0.0.1): CPU 1 free of 1" in line, (node_id, line)
    assert "Traceback" not in done.stdout + done.stderr and took < 60, (took, done.stderr[-2000:])
    print(f"\nserve with a TP2 instance and one-CPU nodes: exit 1 after {took:.1f} s: {line[:120]}...")


# ---- `modelpool serve --address`: an instance per node, one node lost mid-decode ------------------------------
def bodies(tag: str, num_tokens: int = NUM_TOKENS) -> dict[tuple[str, int], dict[str, Any]]:
    return {(model, k): {"model": model, "prompt": prompt, "max_tokens": num_tokens, "temperature": 0,
                         "ignore_eos": True, "user": tag}
            for model in MODELS for k, prompt in enumerate(PROMPTS)}


def tally(streams: dict[Any, Stream], reference: dict[Any, str], prefix: bool = False) -> Counter[str]:
    """finished with the undisturbed run's text (identical; with `prefix`, the start of it: a shorter request)
    or other text (wrong), clean_error, hung, cut."""
    def same(key: Any, text: str) -> bool:
        return reference[key].startswith(text) if prefix else text == reference[key]

    return Counter(("identical" if same(key, s.text) and s.text else "wrong") if s.kind == "finished" else s.kind
                   for key, s in streams.items())


def status(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/pool/status", timeout=10).json())


def serve(cluster: Any, demo_models: dict[str, Path], tmp_path: Path, port: int) -> subprocess.Popen[str]:
    fleet = tmp_path / "tiny.yaml"
    fleet.write_text("pool: {gpu: h100, num_gpus: 1}\nmodels:\n" + "".join(
        f"  - {{name: {name}, arch: {demo_models[name]}, weights: {demo_models[name]}}}\n" for name in MODELS))
    log = (tmp_path / "serve.log").open("w")
    return subprocess.Popen([sys.executable, "-m", "modelpool.cli", "serve", "--address", cluster.address,
                             "--fleet", str(fleet), "--instances", str(NUM_NODES), "--kv-mib", "32",
                             "--port", str(port)], cwd=REPO, env=driver_env(demo_models), stdout=log,
                            stderr=subprocess.STDOUT, text=True)


def test_serve_on_every_node_and_a_node_lost_mid_decode(cluster, demo_models, tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(cluster, demo_models, tmp_path, port)
    log = tmp_path / "serve.log"
    try:
        wait_until(lambda: "OpenAI-compatible endpoint" in log.read_text() or proc.poll() is not None, 240,
                   "serve to come up")
        assert proc.poll() is None, log.read_text()[-4000:]
        # an instance on every worker node
        nodes = {iid: inst["node"] for iid, inst in status(url)["instances"].items()}
        assert len(nodes) == NUM_NODES and set(nodes.values()) == worker_ids(cluster), nodes

        _, join = run_streams(url, bodies("undisturbed"), TIMEOUT_S)
        reference = {key: s.text for key, s in join().items() if s.kind == "finished"}
        assert len(reference) == len(MODELS) * len(PROMPTS) and all(reference.values()), reference
        # loopback only: every socket of every node's services, agents and workers, and the gateway's
        sockets = listening(cluster, proc.pid)
        exposed = {name: addrs for name, addrs in sockets.items() if any(a.rsplit(":", 1)[0] not in LOOPBACK
                                                                         for a in addrs)}
        assert not exposed and sum(map(len, sockets.values())) >= 20, sockets
        assert f"127.0.0.1:{port}" in set.union(*sockets.values())
        print(f"\n{sum(map(len, sockets.values()))} listening sockets in {len(sockets)} processes, all on loopback")

        started, join = run_streams(url, bodies("node-lost"), TIMEOUT_S)
        assert all(event.wait(60) for event in started.values()), "streams did not start"
        state = status(url)
        victim, held = max(((iid, inst["requests_on_device"]) for iid, inst in state["instances"].items()),
                           key=lambda pair: pair[1])
        node = next(n for n in cluster.worker_nodes if n.node_id == nodes[victim])
        removed_at = time.monotonic()
        cluster.remove_node(node, allow_graceful=False)  # its raylet, object store and workers killed
        answers = [httpx.get(f"{url}/health", timeout=10).status_code]
        streams = join()
        answers.append(httpx.get(f"{url}/v1/models", timeout=10).status_code)
        counts = tally(streams, reference)
        after = status(url)
        print(f"\nnode lost mid-decode: {victim} on node {nodes[victim][:8]} held {held} requests on its device "
              f"({state['requests_in_pool']} in the pool); outcomes {dict(counts)} in "
              f"{time.monotonic() - removed_at:.1f} s; lost {after['lost_instances']}")
        assert held >= 1, state  # every stream has begun: the ones on its device are part-decoded
        assert counts["identical"] == len(streams), (counts, {k: s for k, s in streams.items()
                                                                if s.text != reference.get(k)})
        assert answers == [200, 200]
        assert victim in after["lost_instances"] and after["tick_errors"] == 0

        # the gateway keeps serving on the nodes that are left
        _, join = run_streams(url, bodies("after", 24), TIMEOUT_S)
        after_loss = tally(join(), reference, prefix=True)
        assert after_loss["identical"] == len(MODELS) * len(PROMPTS), after_loss

        # a node joins: the lost instance comes back on it (its restart waited for room)
        fresh = add_node(cluster, NUM_NODES)
        wait_until(lambda: not status(url)["lost_instances"], 120, "the lost instance back on the new node")
        final = status(url)
        back = final["instances"][victim]["node"]
        assert back == fresh.node_id, (back, fresh.node_id)
        print(f"instance {victim} back on the new node {back[:8]} after {final['restarts']} restart(s); "
              f"after the loss {dict(after_loss)}")
    finally:
        stop_serve(proc, timeout_s=60)
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]


# ---- TP placement across nodes ------------------------------------------------------------------------------
def test_a_tp_group_packs_on_one_node_or_says_which_nodes_fall_short(cluster, monkeypatch) -> None:
    """Three CPUs free in the cluster but at most one per node: a TP2 group of CPU bundles cannot be packed,
    and the error lists every node's free CPUs; a node with two CPUs joins and the group lands on it whole."""
    import ray
    import ray._private.ray_constants

    from pool.placement import Placements, PlacementTimeout

    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)  # what LOOPBACK_DRIVER does
    ray.init(address=cluster.address, log_to_driver=False)
    placements = Placements()
    try:
        free = {node.node_id: 1 for node in cluster.worker_nodes}
        with pytest.raises(PlacementTimeout) as caught:
            placements.reserve("tp0", 2, use_gpus=False, timeout_s=2)
        text = str(caught.value)
        assert "instance tp0" in text and "2 bundles" in text and "STRICT_PACK" in text, text
        for node_id in free:  # every worker node is named with what it has
            assert f"node {node_id[:8]} (127.0.0.1): CPU " in text, (node_id, text)
        wide = cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        group = placements.reserve("tp0", 2, use_gpus=False, timeout_s=30)
        from ray.util.placement_group import placement_group_table

        placed = set(placement_group_table(group)["bundles_to_node_id"].values())
        assert placed == {wide.node_id}, placed
    finally:
        placements.close()
        ray.shutdown()


def test_a_tp2_instance_lost_with_its_node_resumes_on_the_other_and_gives_its_group_back(
        cluster, monkeypatch, tiny, long_reference) -> None:  # noqa: F811
    """Two TP2 torch instances (rank 1 a Ray actor in the instance's group), each packed on its own two-CPU
    node; that node removed mid-decode: the requests finish on the other instance with transformers' greedy
    tokens, and the lost instance's placement group is removed (not left pending for a node that is gone)."""
    import ray
    import ray._private.ray_constants
    from ray.util.placement_group import placement_group_table

    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    for _ in range(2):
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        wide = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU") == 2}
        with tp2_pool(tiny, "ray") as pool:
            groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
            packed = [set(g["bundles_to_node_id"].values()) for g in groups]
            assert len(packed) == 2 and all(len(p) == 1 for p in packed) and set.union(*packed) <= wide, packed
            assert len(set(pool.nodes.values())) == 2 and set(pool.nodes.values()) == set.union(*packed), pool.nodes
            sinks = submit_all(pool, models=("tiny-qwen3",))
            wait_until(lambda: any(1 <= produced < LONG_TOKENS - 8 for _, _, produced in homes(pool).values()), 60,
                       "a TP2 instance decoding")
            victim = max((h[0] for h in homes(pool).values()), key=[h[0] for h in homes(pool).values()].count)
            held = [rid for rid, h in homes(pool).items() if h[0] == victim]
            cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == pool.nodes[victim]),
                                allow_graceful=False)
            result = outcomes(sinks, long_reference, lambda key: pool.holds(f"{key[0]}-{key[1]}"), 120)
            counts = result.counts()
            print(f"\nTP2 instance {victim} lost with its node holding {len(held)} requests; outcomes {counts}")
            assert counts == {"identical": len(sinks), "clean_errors": 0, "wrong": 0, "hung": 0, "lost": 0}, result
            assert held
            # the loss is noticed by a failed call or the heartbeat, whichever comes first: where the held requests'
            # last tokens beat the node's removal (a loaded CI machine), only the heartbeat tells (once in CI)
            wait_until(lambda: pool.status()["lost_instances"] == [victim], 30, f"{victim}'s loss noticed")
            wait_until(lambda: sum(g["state"] == "CREATED" for g in placement_group_table().values()) == 1, 30,
                       "the lost instance's group removed")
            assert not [g for g in placement_group_table().values() if g["state"] == "PENDING"]
        assert not [g for g in placement_group_table().values() if g["state"] in ("CREATED", "PENDING")]
    finally:
        ray.shutdown()
