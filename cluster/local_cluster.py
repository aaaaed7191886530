#!/usr/bin/env python
"""Start and stop a local multi-node Ray cluster on loopback, with token authentication.

    python cluster/local_cluster.py start --workers 2 [--gpus-per-worker 1] [--state DIR]
    eval "$(python cluster/local_cluster.py env)"     # RAY_ADDRESS, RAY_API_SERVER_ADDRESS, auth
    ray job submit --working-dir . -- python jobs/build_dataset.py config.yaml
    python cluster/local_cluster.py stop

Every port the cluster opens listens on 127.0.0.1 only (docs/CLUSTER.md lists them). Ray binds a
node's servers to loopback exactly when the node's address is loopback, but ``ray start`` turns
``--node-ip-address 127.0.0.1`` into the machine's IP unless Ray's local-only switch
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set (``interp_engine/loopback.py``, which the library's
own local Ray shares); so every node and every client of the cluster (``env``) runs with it. With that switch ``ray start`` refuses to add worker nodes, so worker
nodes are started by :func:`run_node` (``ray start`` with that one refusal lifted). A fresh random
token is written to ``STATE/auth_token`` (mode 0600) and every node runs with
``RAY_AUTH_MODE=token`` reading it, so a request without the token gets 401. Each node is one
``ray start --block`` process in its own process group; ``stop`` ends exactly those groups (never
``ray stop``, which would end every Ray on the machine), and only those it can prove it started
(see :func:`stop`). ``--gpus-per-worker`` declares (fake, on a
CPU machine) GPUs, which is how the tests place GPU replicas without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from interp_engine.loopback import HOST, LOOPBACK_ENV, free_port

DEFAULT_STATE = Path(os.environ.get("INTERP_ENGINE_CLUSTER_STATE", Path.home() / ".cache" / "interp_engine" / "cluster"))
#: the file that marks a folder as this script's: in the state folder, and in each cluster's temp dir
MARKER = ".interp_engine_local_cluster"


def env(state: Path) -> dict[str, str]:
    """What a client needs to reach this cluster: the cluster address (``ray.init``, and so
    ``load_model(..., replicas=N)``), the job server address (``ray job submit``), auth mode and
    token file."""
    info = json.loads((state / "cluster.json").read_text())
    return {"RAY_ADDRESS": f"{HOST}:{info['port']}",
            "RAY_API_SERVER_ADDRESS": f"http://{HOST}:{info['dashboard_port']}",
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(state / "auth_token"), **LOOPBACK_ENV}


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _ray() -> str:
    return shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


def _spawn(args: list[str], log: Path, environ: dict, *, worker: bool = False) -> int:
    command = [sys.executable, str(Path(__file__).resolve()), "node"] if worker else [_ray()]
    with open(log, "ab") as out:
        proc = subprocess.Popen([*command, "start", *args, "--block", "--disable-usage-stats"], stdout=out,
                                stderr=subprocess.STDOUT, env=environ, start_new_session=True)
    return proc.pid


def run_node(argv: list[str]) -> int:
    """``ray ARGV`` (``start --address ...``) for a worker node of a loopback cluster.

    Written against ray 2.60. This process runs with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` like
    every node, which keeps 127.0.0.1 as the node address; but ``ray start`` reads that switch a
    second time to refuse worker nodes ("not supported on Windows and OSX"). Here, and only in this
    process, the switch is turned back on and the address lookup it guards answers loopback, which
    is what the switch would have answered. The node's own processes keep the switch off.
    """
    from ray._private import ray_constants, services
    from ray.scripts.scripts import main as ray_main

    ray_constants.ENABLE_RAY_CLUSTER = True
    services.node_ip_address_from_perspective = lambda address=None: HOST
    sys.argv = ["ray", *argv]
    return ray_main()


def start(state: Path = DEFAULT_STATE, *, workers: int = 2, head_cpus: float = 1, cpus_per_worker: float = 1,
          gpus_per_worker: float = 0, timeout: float = 90, dashboard_port: int | None = None,
          client_server_port: int | None = None) -> dict[str, str]:
    """Start a head and ``workers`` worker nodes; return the client environment (see :func:`env`).

    ``client_server_port`` places the Ray client server (``ray://``) there; by default it gets a
    free port (``ray start`` cannot leave it out). Like every port here it listens on 127.0.0.1.
    """
    state = Path(state)
    if (state / "cluster.json").exists():
        raise SystemExit(f"a cluster is already recorded in {state}; run `stop` first (or pass another --state)")
    _claim_state(state)
    token = state / "auth_token"
    for old in [state / "head.log", *state.glob("worker-*.log")]:  # this script's own logs (a claimed folder)
        old.unlink(missing_ok=True)
    token.unlink(missing_ok=True)
    with os.fdopen(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:  # never readable by others
        out.write(secrets.token_hex(32))
    # Jobs run `python ...` with the nodes' PATH: put this interpreter's environment first.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    environ = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "PATH": path,
               **LOOPBACK_ENV}
    environ.pop("RAY_ADDRESS", None)
    taken = {p for p in (dashboard_port, client_server_port) if p}

    def fresh() -> str:  # a free port not handed out yet (the OS may offer a just-closed one again)
        while (free := free_port()) in taken:
            pass
        taken.add(free)
        return str(free)

    # The head's two metrics servers have fixed default ports; free ones let clusters coexist.
    head_environ = {**environ, "AUTOSCALER_METRIC_PORT": fresh(), "DASHBOARD_METRIC_PORT": fresh()}
    port, dash = int(fresh()), dashboard_port or int(fresh())
    common = ["--node-ip-address", HOST, "--min-worker-port", "0", "--max-worker-port", "0"]

    def node_ports() -> list[str]:
        return ["--dashboard-agent-listen-port", fresh(), "--dashboard-agent-grpc-port", fresh(),
                "--metrics-export-port", fresh(), "--runtime-env-agent-port", fresh()]

    # Each node gets its own temp dir: nodes sharing one would share runtime_resources/, and a
    # worker unpacking a job's working_dir there would pull it from under the running driver.
    # Short (Ray's unix socket paths must stay under 108 bytes), new (mkdtemp: 0700, never an
    # existing folder), and marked as this cluster's, so that `stop` removes it and nothing else.
    cluster_id = secrets.token_hex(8)
    temp = Path(tempfile.mkdtemp(prefix="ray-ie-", dir="/tmp"))
    (temp / MARKER).write_text(json.dumps({"id": cluster_id, "state": str(state.resolve())}))

    try:
        pids = [_spawn(["--head", "--port", str(port), "--temp-dir", str(temp / "head"),
                        "--dashboard-host", HOST, "--dashboard-port", str(dash),
                        "--ray-client-server-port", str(client_server_port or fresh()),
                        "--num-cpus", _num(head_cpus), "--num-gpus", "0",
                        *common, *node_ports()], state / "head.log", head_environ)]
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)  # nothing recorded yet: `stop` would not find it
        raise
    info = {"id": cluster_id, "port": port, "dashboard_port": dash, "pids": pids, "started": [_started(pids[0])],
            "workers": workers, "temp": str(temp)}
    (state / "cluster.json").write_text(json.dumps(info))
    _wait_for_port(port, timeout, state / "head.log")
    _wait_for_log(state / "head.log", timeout)
    for i in range(workers):  # one at a time: raylets starting together on one host race for names
        pids.append(_spawn(["--address", f"{HOST}:{port}", "--num-cpus", _num(cpus_per_worker),
                            "--num-gpus", _num(gpus_per_worker), "--resources", json.dumps({f"worker_{i}": 1}),
                            "--temp-dir", str(temp / f"w{i}"),
                            *common, *node_ports()], state / f"worker-{i}.log", environ, worker=True))
        info["started"].append(_started(pids[-1]))
        (state / "cluster.json").write_text(json.dumps(info))
        _wait_for_log(state / f"worker-{i}.log", timeout)
    _wait_for_nodes(state, 1 + workers, timeout)
    _wait_for_port(dash, timeout, state / "head.log")
    return env(state)


def _wait_for_port(port: int, timeout: float, log: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.2)
    raise SystemExit(f"nothing listens on {HOST}:{port} after {timeout:g}s; see {log}")


def _wait_for_log(log: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if "Ray runtime started" in text:
            return
        if "Error" in text or "Traceback" in text:
            break
        time.sleep(0.2)
    raise SystemExit(f"a Ray node did not start; see {log}")


def _wait_for_nodes(state: Path, n: int, timeout: float) -> None:
    code = ("import ray,sys,time\nray.init(address=sys.argv[1], log_to_driver=False)\n"
            "d=time.time()+float(sys.argv[3])\n"
            "while sum(x['Alive'] for x in ray.nodes())<int(sys.argv[2]) and time.time()<d: time.sleep(0.3)\n"
            "sys.exit(0 if sum(x['Alive'] for x in ray.nodes())>=int(sys.argv[2]) else 1)\n")
    environ = {**os.environ, **env(state)}
    done = subprocess.run([sys.executable, "-c", code, environ["RAY_ADDRESS"], str(n), str(timeout)],
                          env=environ, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the cluster did not reach {n} nodes in {timeout:g}s; logs in {state}\n{done.stderr[-2000:]}")


def _claim_state(state: Path) -> None:
    """Make ``state`` this script's state folder: a new or empty folder gets the marker; one that
    holds other files and no marker is refused (``start`` writes and replaces files there)."""
    state.mkdir(parents=True, exist_ok=True)
    if not (state / MARKER).is_file():
        if any(state.iterdir()):
            raise SystemExit(f"{state} is not empty and is not a state folder of local_cluster.py (it has no "
                             f"{MARKER}); nothing was started. Pass --state with a new or empty folder.")
        (state / MARKER).write_text("state folder of cluster/local_cluster.py\n")


def _started(pid: int) -> float | None:
    """The start time of process ``pid`` (what tells it from a later process given the same id)."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _own_node(pid: int, started, temp: str) -> str | None:
    """None when ``pid`` is a node this script started for the cluster whose temp dir is
    ``temp`` (the same start time as recorded, a ``start`` command line with ``--temp-dir`` under
    ``temp``, the leader of its own process group); otherwise why not. ``"gone"`` when it ended."""
    import psutil

    try:
        process = psutil.Process(pid)
        created, command = process.create_time(), process.cmdline()
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.Error as err:
        return f"cannot inspect it ({err})"
    shown = " ".join(command)[:120] or process.name()
    if not isinstance(started, (int, float)) or abs(created - started) > 1e-3:
        return f"`{shown}` started at another time than the node recorded (a later process with the same id)"
    dirs = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == "--temp-dir"]
    if "start" not in command or len(dirs) != 1 or Path(dirs[0]).parent != Path(temp):
        return f"`{shown}` is not a `ray start` with --temp-dir under {temp}"
    try:
        leader = os.getpgid(pid) == pid
    except ProcessLookupError:
        return "gone"
    if not leader:
        return f"`{shown}` does not lead its own process group"
    return None


def _own_temp(temp: str, cluster_id, state: Path) -> str | None:
    """None when ``temp`` is the temp dir ``start`` made for this cluster (its marker names the
    cluster's id and this state folder); otherwise why not. ``"gone"`` when it does not exist."""
    path = Path(temp)
    if not path.exists() and not path.is_symlink():
        return "gone"
    if path.is_symlink() or not path.is_dir() or not path.name.startswith("ray-ie-"):
        return "it is not a ray-ie-* folder that start made"
    try:
        mark = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return f"it has no {MARKER} marker"
    if not isinstance(mark, dict) or mark.get("id") != cluster_id or mark.get("state") != str(state.resolve()):
        return f"its {MARKER} names another cluster"
    return None


def _record(state: Path) -> dict:
    info = json.loads((state / "cluster.json").read_text())
    if not isinstance(info, dict) or not isinstance(info.get("pids"), list) or not (state / MARKER).is_file():
        raise ValueError("not a record this script wrote")
    return info


def stop(state: Path = DEFAULT_STATE, timeout: float = 10) -> bool:
    """End the nodes this script started (by their process groups) and remove their temp dir.
    False if no cluster was recorded.

    The record (``STATE/cluster.json``) is not trusted on its own: a process is ended only if it
    is provably one of this cluster's nodes (the start time recorded when it was spawned, a ``ray
    start`` command line whose ``--temp-dir`` lies in the cluster's temp dir, its own process
    group), and the temp dir is removed only if it carries the marker ``start`` wrote for this
    cluster and this state folder (without that marker no process is ended either: the record is
    then not this folder's). Anything else is left alone, and once the cluster's own parts are
    gone ``stop`` raises SystemExit naming each thing it left and why."""
    state = Path(state)
    if not (state / "cluster.json").exists():
        return False
    try:
        info = _record(state)
    except (OSError, ValueError) as err:
        raise SystemExit(f"{state / 'cluster.json'} is not a cluster record of local_cluster.py ({err}); "
                         f"nothing was stopped or removed. End its processes and remove it yourself.") from None
    temp, pids = str(info.get("temp", "")), info["pids"]
    started = list(info.get("started") or [])
    started += [None] * (len(pids) - len(started))
    refused = []
    own = []
    temp_why = _own_temp(temp, info.get("id"), state)  # proves the record is this state folder's cluster
    for pid, when in zip(pids, started):
        why = _own_node(pid, when, temp) if isinstance(pid, int) and pid > 1 else "not a process id"
        if why is None and temp_why is not None:
            why = f"the record's temp dir {temp} does not prove it is this state folder's cluster ({temp_why})"
        if why is None:
            own.append(pid)
        elif why != "gone":
            refused.append(f"not ending process {pid}: {why}")
    # The workers first, the head after them: a node that gets SIGTERM drains through the head's
    # GCS, so workers ended together with their head wait on it until SIGKILL. The head, alone by
    # then, still waits out a 30 s drain of nothing; its group is killed after a short grace.
    head = {pids[0]} if pids else set()
    _end([p for p in own if p not in head], timeout)
    _end([p for p in own if p in head], min(timeout, 2.0))
    if temp_why is None:
        shutil.rmtree(temp, ignore_errors=True)
    elif temp_why != "gone":
        refused.append(f"not removing {temp}: {temp_why}")
    (state / "cluster.json").unlink()
    if refused:
        raise SystemExit("\n".join([f"{state / 'cluster.json'} named things this script did not start; "
                                     f"they were left alone (the record is removed):", *refused]))
    return True


def _end(groups: list[int], timeout: float) -> None:
    """SIGTERM each process group, then SIGKILL those still alive after ``timeout`` seconds."""
    ended = []
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGTERM)
            ended.append(pgid)
        except ProcessLookupError:
            pass
    deadline = time.time() + timeout
    while time.time() < deadline and any(_group_alive(g) for g in ended):
        time.sleep(0.1)
    for pgid in ended:
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):  # it may end between the check and the kill
                os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["node"]:  # internal: how start() runs a worker node
        return run_node(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["start", "stop", "env"])
    parser.add_argument("--state", type=Path, default=DEFAULT_STATE, help="where the token, pids and logs live")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--head-cpus", type=float, default=1)
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument("--gpus-per-worker", type=float, default=0)
    parser.add_argument("--dashboard-port", type=int, default=None)
    parser.add_argument("--client-server-port", type=int, default=None,
                        help="port of the Ray client server (ray://), on 127.0.0.1; default: a free one")
    args = parser.parse_args(argv)
    if args.command == "start":
        variables = start(args.state, workers=args.workers, head_cpus=args.head_cpus,
                          cpus_per_worker=args.cpus_per_worker, gpus_per_worker=args.gpus_per_worker,
                          dashboard_port=args.dashboard_port, client_server_port=args.client_server_port)
        print(f"cluster up: head + {args.workers} workers on {HOST}; token in {args.state / 'auth_token'}")
    elif args.command == "stop":
        print("stopped" if stop(args.state) else f"no cluster recorded in {args.state}")
        return 0
    else:
        variables = env(args.state)
    for key, value in variables.items():
        print(f"export {key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
