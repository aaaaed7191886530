"""The errors of the Ray service, in a module of their own: the scheduler (actors/) raises them
and the cluster model (cluster.py) uses the scheduler, so neither may hold them."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """The cluster cannot serve the request (too few resources, replicas that failed to start)."""


class ShardFailed(ClusterError):
    """One shard of the work failed ``max_attempts`` times (its replicas died under it, or it
    raised something other than an input error); the message names the shard and replicas."""


def user_error(err: BaseException) -> BaseException:
    """The exception a remote call raised, out of Ray's ``RayTaskError`` wrapper (its message
    already names the replica and shard); ``err`` itself when it carries none."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err
