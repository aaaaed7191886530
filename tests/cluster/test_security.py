"""What the Rays this project starts expose, and what ``cluster/local_cluster.py stop`` may touch.

- The library's own local Ray (``python jobs/build_dataset.py cfg`` with no cluster connected,
  which is ``load_model(..., replicas=N)`` underneath), in a subprocess of its own: every socket of
  its process tree listens on loopback, token auth is on (a protected agent path answers 401
  without the token and passes with it), and what answers without the token is exactly the
  list in docs/CLUSTER.md.
- The ``local_cluster.py`` cluster: the same list, measured on a running cluster.
- ``stop`` against forged or foreign records: an unrelated process and a user folder survive; a
  copy of a real record in another state folder does not stop the real cluster.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from interp_engine.loopback import start_local_ray
from interp_engine.errors import LoopbackError

from .. import ray_exposure as rx

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

#: runs in a fresh process: the job (with no RAY_ADDRESS it starts the library's own Ray), then a
#: survey of that Ray while it is still up (its processes are this process's children) and a
#: replica is loaded into it again (the job closed its own), so that a worker is listening too
SURVEY = """
import json, os, sys
from pathlib import Path
from interp_engine.jobs.build_dataset import main
rc = main([sys.argv[1]])
from interp_engine import load_model
from tests import ray_exposure as rx
model = load_model(sys.argv[2], replicas=1, cpus_per_replica=1, torch_threads=1)
rows = rx.listening(rx.tree([os.getpid()]))
token = (Path.home() / ".ray" / "auth_token").read_text().strip()
guarded = [(r, rx.get(p, "/api/job_agent/jobs/")[0], rx.get(p, "/api/job_agent/jobs/", token)[0])
           for _, p, r in rows if r in ("DashboardAgent", "RuntimeEnvAgent") and rx.kind(p) == "HTTP"]
found = {"|".join(k): sorted(v) for k, v in rx.without_token(rows).items() if v}
print("SURVEY " + json.dumps({"rc": rc, "rows": rows, "found": found, "guarded": guarded}))
model.close()
"""


def _isolated_env(home: Path) -> dict[str, str]:
    """No cluster to join, a home of its own (Ray's token file lands there), and a fresh short
    Ray temp dir (its socket paths must fit in 108 bytes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_TMPDIR=tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    return env


def _found(mapping) -> dict[tuple[str, str], set[str]]:
    return {tuple(k.split("|")): set(v) for k, v in mapping.items()}


def test_the_librarys_own_ray_binds_loopback_only_with_token_auth(tiny_path, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"prompt {i} lorem ipsum"}) + "\n" for i in range(3)))
    config = tmp_path / "build.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(tiny_path("llama")), "replicas": 1, "cpus_per_replica": 1, "torch_threads": 1,
        "prompts": str(prompts), "points": ["resid_post.1"], "output": str(tmp_path / "out"), "progress": False}))
    home = tmp_path / "home"
    home.mkdir()
    env = _isolated_env(home)
    try:
        done = subprocess.run([PY, "-c", SURVEY, str(config), str(tiny_path("llama"))], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=400)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SURVEY ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    survey = json.loads(lines[-1][len("SURVEY "):])
    assert survey["rc"] == 0
    rows = [tuple(row) for row in survey["rows"]]
    exposed = [row for row in rows if not rx.is_loopback(row[0])]
    assert not exposed, f"the library's own Ray listens beyond loopback: {exposed}"
    # the survey saw the whole Ray: GCS, raylet, both agents, a worker (the replica), the driver
    assert {"gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "worker", "python"} <= {r for *_, r in rows}
    # token auth is on: a protected path of the agents is refused without the token, passes with it
    assert "RuntimeEnvAgent" in {r for r, *_ in survey["guarded"]}, survey["guarded"]
    assert all(bare == 401 and with_token != 401 for _, bare, with_token in survey["guarded"]), survey["guarded"]
    # what answers without the token is the documented list, less the dashboard (none here); the
    # servers on Ray's fixed default ports (head metrics, agent HTTP) are absent when another Ray
    # on this machine holds those ports, so a row may be missing, but none differs or is extra
    expected = {k: v for k, v in rx.documented().items() if k != ("dashboard.py", "HTTP")}
    found = _found(survey["found"])
    assert ("DashboardAgent", "Prometheus") in found
    assert {k: v for k, v in expected.items() if k in found} == found
    token = home / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700


def test_the_library_refuses_to_start_a_ray_without_token_auth(monkeypatch):
    import ray

    before = ray.is_initialized()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(LoopbackError, match="RAY_AUTH_MODE='disabled'.*Unset RAY_AUTH_MODE"):
        start_local_ray()
    assert ray.is_initialized() == before


def test_a_token_file_readable_by_others_is_made_private(monkeypatch, tmp_path):
    from interp_engine.loopback import _private_default_token

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("a" * 64)
    token.chmod(0o644)
    _private_default_token()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.read_text() == "a" * 64


def _local_cluster():
    spec = importlib.util.spec_from_file_location("local_cluster", ROOT / "cluster" / "local_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _marked_state(path: Path) -> Path:
    lc = _local_cluster()
    path.mkdir(parents=True, exist_ok=True)
    (path / lc.MARKER).write_text("state folder of cluster/local_cluster.py\n")
    return path


def _stop_cli(state: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "cluster/local_cluster.py", "stop", "--state", str(state)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def bystander():
    """An unrelated process in a process group of its own (what `killpg` on its id would end)."""
    process = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


def _user_folder(parent: Path, name: str) -> Path:
    folder = parent / name
    (folder / "sub").mkdir(parents=True)
    (folder / "results.csv").write_text("a,b\n1,2\n")
    (folder / "sub" / "notes.md").write_text("mine")
    return folder


def _intact(folder: Path) -> bool:
    return (folder / "results.csv").read_text() == "a,b\n1,2\n" and (folder / "sub" / "notes.md").read_text() == "mine"


def test_stop_leaves_an_unrelated_process_and_a_user_folder_alone(tmp_path, bystander):
    import psutil

    state = _marked_state(tmp_path / "state")
    folder = _user_folder(tmp_path, "ray-ie-results")  # even named like the temp dirs start makes
    # the forger even records the process's true start time
    record = {"id": "0" * 16, "port": 1, "dashboard_port": 2, "pids": [bystander.pid],
              "started": [psutil.Process(bystander.pid).create_time()], "workers": 0, "temp": str(folder)}
    (state / "cluster.json").write_text(json.dumps(record))
    done = _stop_cli(state)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"not ending process {bystander.pid}" in done.stderr and f"not removing {folder}" in done.stderr
    assert "is not a `ray start` with --temp-dir" in done.stderr and "no .interp_engine_local_cluster marker" in done.stderr
    assert bystander.poll() is None and _intact(folder)


def test_stop_refuses_a_record_in_a_folder_the_script_does_not_own(tmp_path, bystander):
    state = tmp_path / "someone-elses"
    state.mkdir()
    folder = _user_folder(tmp_path, "ray-ie-data")
    record = {"pids": [bystander.pid], "temp": str(folder)}
    (state / "cluster.json").write_text(json.dumps(record))
    done = _stop_cli(state)
    assert done.returncode == 1 and "not a cluster record of local_cluster.py" in done.stderr, done.stderr
    assert bystander.poll() is None and _intact(folder) and json.loads((state / "cluster.json").read_text()) == record
    (state / "cluster.json").write_text("{not json")  # a broken record: the same refusal, no traceback
    done = _stop_cli(state)
    assert done.returncode == 1 and "not a cluster record" in done.stderr and "Traceback" not in done.stderr


def test_start_refuses_a_user_folder_as_its_state(tmp_path):
    folder = _user_folder(tmp_path, "project")
    (folder / "run.log").write_text("keep me")
    done = subprocess.run([PY, "cluster/local_cluster.py", "start", "--workers", "0", "--state", str(folder)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "is not empty and is not a state folder" in done.stderr, done.stderr
    assert _intact(folder) and (folder / "run.log").read_text() == "keep me"
    assert sorted(p.name for p in folder.iterdir()) == ["results.csv", "run.log", "sub"]


def test_local_cluster_exposes_only_the_documented_list_and_stops_only_itself(tmp_path):
    lc = _local_cluster()
    state = tmp_path / "state"
    try:
        lc.start(state, workers=1, head_cpus=1, cpus_per_worker=1)
    except BaseException:
        lc.stop(state)
        raise
    info = json.loads((state / "cluster.json").read_text())
    try:
        pids = rx.tree(info["pids"])
        rows = rx.listening(pids)
        assert rows and all(rx.is_loopback(ip) for ip, *_ in rows), rows
        found = {k: v for k, v in rx.without_token(rows).items() if v}
        assert found == rx.documented()
        # a copy of this cluster's record in another state folder is not that folder's cluster
        other = _marked_state(tmp_path / "other")
        (other / "cluster.json").write_text((state / "cluster.json").read_text())
        with pytest.raises(SystemExit, match="does not prove it is this state folder's cluster"):
            lc.stop(other)
        assert all(lc._group_alive(pid) for pid in info["pids"]) and Path(info["temp"]).is_dir()
    finally:
        assert lc.stop(state) is True
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not [pid for pid in pids if _alive(pid)]
    assert not Path(info["temp"]).exists() and not (state / "cluster.json").exists()
    assert (state / "head.log").exists()  # the state folder (logs, token) stays


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
