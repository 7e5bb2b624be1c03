"""rlvr.scaleout on a Ray cluster of two nodes: a head raylet and a worker raylet, each started by
`ray start` in processes of its own on this machine (docs/distributed.md, "A multi-node Ray
cluster"). The driver joins the cluster through dist.ray.address, dist.ray.spread places rollout
workers and learner ranks on both nodes, and the run gives the losses of the one-process run; a
node that dies takes its rollout worker, restarted on the node left, and its learner rank, named
in the error that stops the update."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="rlvr.scaleout needs Ray (pip install 'rlvr[ray]')")
psutil = pytest.importorskip("psutil", reason="killing one node's raylet needs psutil (a dependency of Ray)")

from rlvr.config import load_config  # noqa: E402
from rlvr.train.loop import train  # noqa: E402
from tests.test_scaleout import comparable  # noqa: E402
from tests.test_train import FP32, overrides, read_metrics  # noqa: E402

pytestmark = pytest.mark.dtype_independent  # pinned to fp32 (FP32), as test_scaleout's comparisons


@dataclass
class TwoNodes:
    address: str
    """The head's GCS, "127.0.0.1:PORT": what dist.ray.address is set to."""
    nodes: dict[str, subprocess.Popen[bytes]]
    """Each node's `ray start --block` ("a" the head, "b" the other): it owns the node's raylet and
    stops the node's processes when it is terminated, or when its raylet dies."""

    def node_ids(self) -> dict[str, str]:
        """"a" and "b" → their Ray node ids (each node advertises a resource of its name)."""
        return {name: n["NodeID"] for n in ray.nodes() for name in ("a", "b") if f"node_{name}" in n["Resources"]}

    @staticmethod
    def alive(node_id: str) -> bool:
        return any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node_id)

    def kill_raylet(self, name: str) -> None:
        """SIGKILL to the node's raylet, as when its machine is lost (its `ray start` then stops the
        node's other processes, the actors among them)."""
        raylets = [p for p in psutil.Process(self.nodes[name].pid).children(recursive=True) if p.name() == "raylet"]
        assert len(raylets) == 1, raylets
        raylets[0].kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`ray start ... --block`, returned once the node is up (its log says so)."""
    with log.open("wb") as out:
        node = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", *args, "--block",
                                 "--disable-usage-stats"], stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if node.poll() is not None or time.monotonic() > deadline:
            node.kill()
            raise RuntimeError(f"ray start {' '.join(args)} did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    return node


def _stop(node: subprocess.Popen[bytes]) -> None:
    """SIGTERM: `ray start --block` stops the node's processes, then exits; SIGKILL to what is left."""
    if node.poll() is None:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(timeout=40)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    """A head (2 CPUs, resource node_a) and a second node (2 CPUs, node_b), then this process
    connected to neither: the run under test joins through dist.ray.address. Ray in this process
    is shut down before and after, so the other modules' local Rays (test_scaleout's `local_ray`)
    start as they would alone."""
    ray.shutdown()
    logs = tmp_path_factory.mktemp("ray-nodes")
    # Ray's socket paths live under the temp dir and must fit in 107 bytes: a short folder in /tmp,
    # shared by both nodes (one host keeps one session folder per cluster)
    temp = tempfile.mkdtemp(prefix="rlvr-", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled",  # no token to hand round (Ray turns it on when ~/.ray has one)
           "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",  # a lost node: ~2 s
           "OMP_NUM_THREADS": "1"}
    port = _free_port()
    common = ["--num-cpus=2", f"--temp-dir={temp}"]
    nodes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        nodes["a"] = _ray_start(["--head", f"--port={port}", "--include-dashboard=false",
                                 '--resources={"node_a": 1}', *common], logs / "head.log", env)
        nodes["b"] = _ray_start([f"--address=127.0.0.1:{port}", '--resources={"node_b": 1}', *common],
                                logs / "b.log", env)
        yield TwoNodes(f"127.0.0.1:{port}", nodes)
    finally:
        ray.shutdown()
        for node in reversed(list(nodes.values())):
            _stop(node)
        shutil.rmtree(temp, ignore_errors=True)


def node_of(actor: Any) -> str:
    """The id of the node an actor runs on, as the actor itself sees it."""
    return str(ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=60))


def nodes_of_actors() -> dict[str, list[str]]:
    """Each actor class of this job → the nodes its actors ran on, those that have ended too (from
    Ray's actor table: the state API, ray.util.state, needs the dashboard of ray[default])."""
    from ray._private import state

    job = ray.get_runtime_context().get_job_id()
    out: dict[str, list[str]] = {}
    for actor in state.actors().values():
        if actor["JobID"] == job:
            out.setdefault(actor["ActorClassName"], []).append(actor["Address"]["NodeID"])
    return out


def two_node_run(two_nodes: TwoNodes) -> list[str]:
    return ["dist.rollout_workers=2", "dist.learners=2", f'dist.ray={{address = "{two_nodes.address}", spread = true, '
            'timeout_s = 30}']


MICRO = "train.micro_batch_size=4"
"""Four micro-batches of the 16 samples: two on each learner rank."""


def test_a_run_spread_over_two_nodes_gives_the_one_process_losses(two_nodes: TwoNodes, tiny_dir: Path,
                                                                   tmp_path: Path) -> None:
    """The whole loop (rlvr.train) over both nodes, placed as dist.ray.spread says: the metrics of
    the run in one process, to fp32's rounding of the gradient summed over two ranks (test_scaleout)."""
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "local"), MICRO, *FP32]), quiet=True)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "nodes"), MICRO, *FP32, *two_node_run(two_nodes)]),
          quiet=True)
    ids, placed = two_nodes.node_ids(), nodes_of_actors()  # the run joined the cluster: its actors are in it
    assert sorted(placed["RolloutWorker"]) == sorted([ids["a"], ids["b"]])  # worker 0 on a, worker 1 on b
    assert placed["LearnerWorker"] == [ids["b"]]  # rank 1; rank 0 is this process, on a
    local, spread = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "nodes")
    assert [r["step"] for r in spread] == [1, 2]
    for a, b in zip(local, spread, strict=True):
        a, b = comparable(a), comparable(b)
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert spread[-1]["grad_norm"] > 0 and spread[-1]["dist/policy_version"] == 2


def test_an_address_given_while_connected_is_said_to_be_unused(two_nodes: TwoNodes,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """start_ray keeps the connection it has (here the cluster's) and says the address is not used."""
    from rlvr.scaleout import start_ray

    if not ray.is_initialized():
        ray.init(address=two_nodes.address, include_dashboard=False, log_to_driver=False)
    with caplog.at_level("WARNING", logger="rlvr.scaleout"):
        assert start_ray("127.0.0.1:1") is ray
    assert "dist.ray.address = '127.0.0.1:1' is not used" in caplog.text
    assert len(two_nodes.node_ids()) == 2


def test_a_lost_node_restarts_its_rollout_worker_elsewhere_and_names_its_learner_rank(
        two_nodes: TwoNodes, tiny_dir: Path, tmp_path: Path) -> None:
    """Rollout worker 1 and learner rank 1 on node b, worker 0 and the driver (rank 0) on the head;
    node b's raylet killed. The collection restarts worker 1 on the head and samples what one
    process samples; the update stops with an error naming learner rank 1. (This kills node b: it
    runs last in this module.)"""
    from rlvr import scaleout
    from rlvr.train.loop import setup, train_step

    runs = {}
    for name, extra in (("local", []), ("nodes", two_node_run(two_nodes))):
        (tmp_path / name).mkdir()
        runs[name] = setup(load_config(None, [*overrides(tiny_dir, tmp_path, name), MICRO, *FP32, *extra]),
                           tmp_path / name)
    local, run = runs["local"], runs["nodes"]
    scaleout.attach(run)
    try:
        ids = two_nodes.node_ids()
        assert [node_of(w) for w in run.engine.workers] == [ids["a"], ids["b"]]
        assert [node_of(a) for a in run.updater.actors] == [ids["b"]]  # rank 1; rank 0 is this process, on a
        assert ray.get_runtime_context().get_node_id() == ids["a"]
        two_nodes.kill_raylet("b")
        deadline = time.monotonic() + 60
        while two_nodes.alive(ids["b"]):  # the head marks it dead after missed health checks (~2 s here)
            assert time.monotonic() < deadline, "node b was never marked dead"
            time.sleep(0.2)
        # the step's collection: worker 1 is found dead, restarted on the head, and re-runs its prompts
        from rlvr.train.run import collect

        collected, expected = collect(run, 1), collect(local, 1)
        assert run.engine.restarts == 1
        assert [node_of(w) for w in run.engine.workers] == [ids["a"], ids["a"]]
        assert [[x.completion.token_ids for x in g.samples] for g in collected.groups] == \
            [[x.completion.token_ids for x in g.samples] for g in expected.groups]
        # the next step's update: rank 1 went with its node
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="learner rank 1 failed during the update(.|\n)*its node has died"):
            train_step(run, 2)
        assert time.monotonic() - t < 30  # at once: rank 0's collective found its peer gone (timeout_s is 30)
    finally:
        scaleout.detach(run)
        scaleout.detach(local)
