"""The Ray cluster the scale-out actors run on: Ray itself (or how to install it), a local Ray or
a joined cluster, and where each actor is placed (`dist.ray.spread`)."""

from __future__ import annotations

import logging
from typing import Any

from rlvr.log.tracking import import_extra

INSTALL_HINT = "pip install 'rlvr[ray]'"


def require_ray() -> Any:
    return import_extra("ray", f"dist.rollout_workers / dist.learners need Ray: {INSTALL_HINT}")


def start_ray(address: str | None, num_cpus: int | None = None) -> Any:
    """Ray, started locally (address None) or joined (an address, or "auto" for `ray start`'s)."""
    ray = require_ray()
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"address": address} if address else {"num_cpus": num_cpus}
        ray.init(include_dashboard=False, log_to_driver=False, **kwargs)
    elif address is not None:  # a notebook's or a test's Ray: it cannot be joined to another cluster now
        logging.getLogger("rlvr.scaleout").warning(
            "Ray is already running in this process: dist.ray.address = %r is not used", address)
    return ray


def placement(ray: Any, spread: bool, index: int, reserves: dict[str, float]) -> dict[str, Any]:
    """Actor options placing actor ``index`` (a rollout worker's number, a learner's rank) on node
    ``index`` of the alive nodes that have what it ``reserves`` (Ray's resource names), the driver's
    first and the rest by id: a soft node affinity, so a node that is gone is replaced by another.
    Nothing without ``spread``, or where no node has that much."""
    if not spread:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def fits(node: dict[str, Any]) -> bool:
        return bool(node["Alive"]) and all(node["Resources"].get(k, 0.0) >= v for k, v in reserves.items())

    here = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeID"] for n in ray.nodes() if fits(n)), key=lambda n: (n != here, n))
    if not nodes:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[index % len(nodes)], soft=True)}
