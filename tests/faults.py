"""Fault injection for the cluster tests: what a crash or a lost node does to a replica, done
from outside the production classes."""

from __future__ import annotations


def kill_replica(model, index: int, *, restart: bool = True) -> None:
    """Kill replica ``index`` of a cluster model. Its work moves to the others; with ``restart``
    (a crash) Ray starts it again and it gets work again, without it is gone for good."""
    import ray

    ray.kill(model._replicas[index], no_restart=not restart)
