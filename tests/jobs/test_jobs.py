"""The dataset-build job: config validation, and end to end on a cluster started by
``cluster/local_cluster.py`` (head + 2 workers, token auth): ``ray job submit`` with the token
works, without it is refused (401), and a driver killed mid-build resumes to the same dataset."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import yaml

from interp_engine.jobs.config import load_config
from interp_engine.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def test_config_errors_are_listed_field_by_field():
    with pytest.raises(ConfigError) as info:
        load_config({"replicas": 0, "points": ["resid_post.1", "resid_psot.1"], "layout": "rows", "prompts": [],
                     "extra": 1})
    text = str(info.value)
    for field in ("replicas:", "points[1]:", "layout:", "output:", "prompts:", "extra:"):
        assert f"  {field}" in text, (field, text)
    assert "greater than or equal to 1" in text and "unknown site 'resid_psot'" in text


def test_config_reads_yaml_and_json(tmp_path):
    data = {"prompts": "p.jsonl", "points": ["resid_post.3"], "output": "out", "replicas": 2}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "c.json").write_text(json.dumps(data))
    assert load_config(tmp_path / "c.yaml") == load_config(tmp_path / "c.json")
    assert load_config(tmp_path / "c.yaml").load_options()["replicas"] == 2
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def _local_cluster():
    spec = importlib.util.spec_from_file_location("local_cluster", ROOT / "cluster" / "local_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script_cluster(tmp_path_factory):
    lc = _local_cluster()
    state = tmp_path_factory.mktemp("cluster_state")
    try:
        variables = lc.start(state, workers=2, head_cpus=1, cpus_per_worker=1, gpus_per_worker=1)
    except BaseException:
        lc.stop(state)
        raise
    yield state, variables
    lc.stop(state)


def _config(tmp_path, model_path, output, n=40) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"Prompt {i}: " + "lorem ipsum dolor " * (2 + i % 5)}) + "\n"
                               for i in range(n)))
    config = {"model": str(model_path), "replicas": 2, "gpus_per_replica": 1, "device": "cpu", "cpus_per_replica": 0.5,
              "torch_threads": 1, "prompts": str(prompts),
              "points": ["resid_post.2", "logits"], "output": str(output), "layout": "token", "shard_size": 1,
              "progress": False}
    path = tmp_path / "build.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _env(variables, **extra):
    return {**os.environ, **variables, **extra}


def test_dashboard_is_on_loopback_and_needs_the_token(script_cluster):
    state, variables = script_cluster
    url = variables["RAY_API_SERVER_ADDRESS"] + "/api/jobs/"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url, timeout=10)
    assert info.value.code == 401
    token = Path(variables["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    assert urllib.request.urlopen(request, timeout=10).status == 200
    port = int(variables["RAY_API_SERVER_ADDRESS"].rsplit(":", 1)[1])
    bound = {c.laddr.ip for c in psutil.net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert bound and all(ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback for ip in bound), bound
    # the listening socket's own address is the proof: no test sends traffic beyond loopback


#: non-loopback listeners docs/CLUSTER.md documents as unavoidable (process name -> why): none
BEYOND_LOOPBACK: dict[str, str] = {}


def _cluster_pids(state: Path) -> set[int]:
    pids = set()
    for pid in json.loads((state / "cluster.json").read_text())["pids"]:
        node = psutil.Process(pid)
        pids |= {node.pid, *(child.pid for child in node.children(recursive=True))}
    return pids


def test_every_port_the_cluster_opens_is_on_loopback(script_cluster):
    state, variables = script_cluster
    pids = _cluster_pids(state)
    listening = [(c.laddr.ip, c.laddr.port, psutil.Process(c.pid).name())
                 for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]
    exposed = [(ip, port, name) for ip, port, name in listening
               if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback and name not in BEYOND_LOOPBACK]
    assert not exposed, f"listening beyond loopback: {exposed}"
    # the listing saw the cluster: GCS, dashboard/job server, and a raylet on each of the 3 nodes
    info = json.loads((state / "cluster.json").read_text())
    ports = {port for _, port, _ in listening}
    assert {info["port"], info["dashboard_port"]} <= ports
    assert sum(name == "raylet" for _, _, name in listening) >= 2 * 3  # node manager + object manager
    assert len(listening) >= 20, listening


def test_job_submit_with_token_builds_the_dataset(script_cluster, tiny_path, tmp_path):
    state, variables = script_cluster
    output = tmp_path / "out"
    config = _config(tmp_path, tiny_path("llama"), output, n=6)
    done = subprocess.run([str(Path(PY).parent / "ray"), "job", "submit", "--working-dir", ".", "--", "python",
                           "jobs/build_dataset.py", str(config)], cwd=ROOT, env=_env(variables),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads([line for line in done.stdout.splitlines() if line.startswith('{"rows"')][-1])
    assert summary["shards"] == 6 and summary["rows"] == pq.read_table(output).num_rows
    # without the token the job server refuses a submission (the same REST call `ray job submit` makes)
    body = json.dumps({"entrypoint": "python jobs/build_dataset.py " + str(config)}).encode()
    request = urllib.request.Request(variables["RAY_API_SERVER_ADDRESS"] + "/api/jobs/", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 401


def test_job_submit_builds_a_feature_dashboard(script_cluster, tiny_path, eager_models, tmp_path):
    """jobs/feature_dashboard.py through `ray job submit`, with a SAELens folder: the dashboard it
    writes equals the one feature_dashboard() builds here."""
    import torch

    from interp_engine import feature_dashboard, load_dictionary, save_dictionary

    from .. import sparse_dicts as sd
    from ..oracles import REL_SAME, assert_near

    _, variables = script_cluster
    folder = save_dictionary(sd.sae(k=12), tmp_path / "sae")
    prompts = ["The quick brown fox", "jumps over", "the lazy dog", "and runs", "far away from here"]
    config = tmp_path / "dashboard.yaml"
    config.write_text(yaml.safe_dump({"model": str(tiny_path("llama")), "prompts": prompts,
                                      "saes": [{"path": str(folder), "name": "l1"}], "output": str(tmp_path / "job"),
                                      "top_k": 3, "shard_size": 2, "progress": False}))
    done = subprocess.run([str(Path(PY).parent / "ray"), "job", "submit", "--working-dir", ".", "--", "python",
                           "jobs/feature_dashboard.py", str(config)], cwd=ROOT, env=_env(variables),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    job = pq.read_table(tmp_path / "job" / "features.parquet").to_pandas()
    here = feature_dashboard(eager_models("llama"), prompts, [load_dictionary(folder, name="l1")], tmp_path / "here",
                             top_k=3, shard_size=2).features().to_pandas()
    assert len(job) == len(here) == sd.D_SAE and (job["n_fired"] == here["n_fired"]).all()
    assert job["n_fired"].sum() > 0
    assert_near(torch.tensor(job["max_activation"].to_numpy()), torch.tensor(here["max_activation"].to_numpy()),
                "maxima", REL_SAME)


def test_driver_killed_mid_build_resumes_to_the_same_dataset(script_cluster, tiny_path, eager_models, tmp_path):
    from interp_engine.dataset.build import build_dataset

    state, variables = script_cluster
    output = tmp_path / "resumed"
    total = 120  # enough shards that the kill lands mid-build even when this process is descheduled
    config = _config(tmp_path, tiny_path("llama"), output, n=total)
    env = _env(variables)  # RAY_ADDRESS is the cluster's GCS: the driver joins it
    command = [PY, "jobs/build_dataset.py", str(config)]
    driver = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while len(list(output.glob("part-*.parquet"))) < 3 and time.time() < deadline and driver.poll() is None:
        time.sleep(0.02)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    partial = len(list(output.glob("part-*.parquet")))
    assert 3 <= partial < total, f"the kill should land mid-build ({partial} of {total} shards written)"
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["resumed_shards"] >= partial and summary["shards"] == total
    settings = yaml.safe_load(config.read_text())
    clean = build_dataset(eager_models("llama"), settings["prompts"], settings["points"], tmp_path / "clean",
                          layout="token", shard_size=1, progress=False)
    resumed = pq.read_table(output)
    assert resumed.num_rows == clean.rows
    assert resumed.equals(clean.to_arrow())
    assert not list(output.glob(".*tmp*"))
