"""``interp-engine``: the service from a shell.

    interp-engine serve MODEL --name NAME [--backend vllm] [--replicas 2] [--option max_model_len=512 ...] [--replace]
    interp-engine status [NAME]
    interp-engine shutdown NAME

Each joins the cluster in ``RAY_ADDRESS``. Without one, ``serve`` starts the library's own loopback
Ray in its process and keeps running (Ctrl-C shuts the service and that Ray down), printing the
environment other shells need to reach it; ``status`` and ``shutdown`` need a cluster to talk to.
The token is never printed: ``serve`` prints the file that holds it (readable by you only), and
removes it when it ends the service (Ctrl-C, SIGTERM, SIGHUP).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option takes KEY=VALUE (e.g. max_model_len=512), got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="interp-engine", description="Deploy and inspect capture services.")
    commands = top.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="deploy a model as a service")
    serve.add_argument("model", help="a local folder, the embedded default, or a hub id in the local cache")
    serve.add_argument("--name", required=True, help="the service's name (its URL path /NAME)")
    serve.add_argument("--backend", default="eager", help="eager or vllm")
    serve.add_argument("--replicas", type=int, default=1)
    serve.add_argument("--min-replicas", type=int)
    serve.add_argument("--max-replicas", type=int)
    serve.add_argument("--host", default="127.0.0.1", help="where Serve's HTTP proxy listens (when this starts Serve)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--cpus-per-replica", type=float, default=1)
    serve.add_argument("--gpus-per-replica", type=float)
    serve.add_argument("--torch-threads", type=int)
    serve.add_argument("--replace", action="store_true",
                       help="replace a running service of this name (its connected clients then fail with ServiceChanged)")
    serve.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                       help="a backend option, as load_model(..., KEY=VALUE) (VALUE read as JSON where it parses)")
    status = commands.add_parser("status", help="services, replicas, health and queues")
    status.add_argument("name", nargs="?")
    status.add_argument("--json", action="store_true", help="print JSON")
    down = commands.add_parser("shutdown", help="end a service")
    down.add_argument("name")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from ..errors import ClusterError, InputError

    try:
        return {"serve": _serve, "status": _status, "shutdown": _shutdown}[args.command](args)
    except (ClusterError, InputError) as err:
        print(f"interp-engine {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


def _serve(args) -> int:
    import ray

    from .deploy import serve

    started_here = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    info = serve(args.model, args.name, backend=args.backend, replicas=args.replicas, min_replicas=args.min_replicas,
                 max_replicas=args.max_replicas, host=args.host, port=args.port,
                 cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
                 torch_threads=args.torch_threads, replace=args.replace, **dict(args.option))
    print(f"service {info.name}: {info.replicas} replica(s) of {info.model} ({info.backend})")
    print(f"  url:   {info.url}")
    print(f"  token: in {info.token_path} (readable by you only)")
    if not started_here:
        return 0
    from ..loopback import LOOPBACK_ENV

    print("  this process runs the Ray that holds it; other shells reach it with:")
    env = {"RAY_ADDRESS": ray.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "token", **LOOPBACK_ENV}
    for key, value in env.items():
        print(f"    export {key}={value}")
    print("  Ctrl-C ends the service and this Ray.", flush=True)
    _hold(info.name)
    return 0


def _hold(name: str) -> None:
    """Keep this process (and the Ray it runs) until Ctrl-C, SIGTERM or SIGHUP; then end Serve and
    Ray and remove the service's token files, however the wait ends."""
    import signal
    import time

    from .auth import forget_token

    def stop(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        forget_token(name)  # first: a second Ctrl-C during the shutdown below leaves no token behind
        import ray
        from ray import serve as ray_serve

        if ray.is_initialized():
            ray_serve.shutdown()
            ray.shutdown()


def _status(args) -> int:
    from .client import _join_cluster
    from .status import all_status, service_status

    _join_cluster()
    rows = [service_status(args.name)] if args.name else all_status()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no services on this cluster")
    for row in rows:
        replicas = ", ".join(f"{n} {state.lower()}" for state, n in sorted(row["replicas"].items())) or "none"
        queue = " ".join(f"{n if n is not None else '?'}" for _, n in sorted(row["queue"].items()))
        served = f"{row['url']}, model {row['model']} ({row['backend']}), " if row.get("url") else ""
        print(f"{row['name']}: {row['status']} ({row['health']}), {served}replicas: {replicas}; queued per replica: "
              f"{queue or '-'}{'; ' + row['message'] if row['message'] else ''}")
    return 0


def _shutdown(args) -> int:
    from .client import _join_cluster
    from .deploy import shutdown

    _join_cluster()
    shutdown(args.name)
    print(f"service {args.name} shut down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
