"""Every Ray Serve internal the service touches, in one place. Written against ray 2.60.

- :func:`bind_node_address`: Serve 2.60 starts, in every replica, a gRPC server for calls between
  deployments (``Replica._on_initialized``: ``add_port_to_grpc_server(server, "[::]:0")``), on
  every interface of the machine, while every other server of a Ray node listens on the node's
  address only (127.0.0.1 for the library's loopback Ray). Called in the replica's constructor,
  before Serve starts that server, it makes the replica bind it to the node's address instead:
  loopback on a loopback cluster, the node's IP on a real one (where other nodes can still reach
  it). Nothing of ours uses that server (handles call replicas as Ray actors), so nothing else
  changes.
- :func:`ongoing_requests`: the queue length of each replica of an application, read from Serve's
  replica actors (``ReplicaActor.get_num_ongoing_requests``, what Serve's router asks them).
- :func:`replica_stats`: what each replica reports of itself (the dictionaries it holds), through
  Serve's ``ReplicaActor.record_routing_stats``, which calls the deployment's own
  ``record_routing_stats`` (Serve also polls it for custom request routers; ours ignore it).
"""

from __future__ import annotations

#: the Serve replica actor names of an application: ``SERVE_REPLICA::<app>#<deployment>#<id>``
REPLICA_PREFIX = "SERVE_REPLICA::"


def bind_node_address() -> None:
    """Make this Serve replica bind its inter-deployment gRPC server to the node's address."""
    import ray
    from ray.serve._private import replica as serve_replica

    original = serve_replica.add_port_to_grpc_server
    if getattr(original, "_interp_engine", False):
        return
    host = ray.util.get_node_ip_address()
    host = f"[{host}]" if ":" in host else host

    def add_port(server, address: str):
        if address.startswith("[::]:"):
            address = f"{host}:{address.rsplit(':', 1)[1]}"
        return original(server, address)

    add_port._interp_engine = True
    serve_replica.add_port_to_grpc_server = add_port


def replica_actors(app: str) -> list[str]:
    """The names of the running Serve replica actors of application ``app`` (namespace ``serve``)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(f"{REPLICA_PREFIX}{app}#"))


def ongoing_requests(app: str, timeout: float = 5.0) -> dict[str, int | None]:
    """Replica id -> requests it holds now (running and queued at it); None where it did not answer."""
    import ray

    out: dict[str, int | None] = {}
    for name in replica_actors(app):
        replica_id = name.rsplit("#", 1)[-1]
        try:
            actor = ray.get_actor(name, namespace="serve")
            out[replica_id] = int(ray.get(actor.get_num_ongoing_requests.remote(), timeout=timeout))
        except Exception:
            out[replica_id] = None
    return out


def replica_stats(app: str, timeout: float = 5.0) -> dict[str, dict | None]:
    """Replica id -> its ``record_routing_stats()``; None where it did not answer."""
    import ray

    out: dict[str, dict | None] = {}
    for name in replica_actors(app):
        try:
            actor = ray.get_actor(name, namespace="serve")
            out[name.rsplit("#", 1)[-1]] = dict(ray.get(actor.record_routing_stats.remote(), timeout=timeout))
        except Exception:
            out[name.rsplit("#", 1)[-1]] = None
    return out
