"""Two Ray nodes on this machine (`ray.cluster_utils.Cluster`): one model replica per node,
the session directory on the head. Sessions pin across both nodes; when the worker node is
removed, its sessions are re-pinned to the head's replica and their next turn succeeds with
the full history (the same tokens as a stateless request carrying it).

The scenario runs in a subprocess: a driver process can join one Ray cluster only, and the
rest of the suite shares another (tests/conftest.py `served`). Its `RAY_TMPDIR` is a fresh
directory of this test's: `Cluster` writes the cluster's address under Ray's default temp root
whatever temp dir its head is given, and on a machine where no Ray ever ran (`/tmp/ray` absent)
that write failed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.process_group import stop_group
from tests.ray_start import once_more_on_startup_timeout

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
SESSIONS = 8


def test_sessions_pin_across_nodes_and_survive_losing_one(tmp_path) -> None:
    out = tmp_path / "result.json"

    def start() -> tuple[subprocess.CompletedProcess, str | None]:
        proc = run_scenario(out, tmp_path / "model")
        return proc, None if proc.returncode == 0 else proc.stderr

    proc, _ = once_more_on_startup_timeout(start, "the two-node scenario")
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    moved = [s for s in result["sessions"] if s["was_on_removed_node"]]
    stayed = [s for s in result["sessions"] if not s["was_on_removed_node"]]
    summary = {"moved": len(moved), "stayed": len(stayed), "recovery_s": result["recovery_s"]}
    print("MULTINODE " + json.dumps(summary))
    assert len(result["nodes_with_sessions"]) == 2  # pinned across both nodes
    assert moved and stayed
    for s in moved:  # re-pinned, re-prefilled from the directory's log, the same answer
        assert s["after"]["replica"] != s["before"]["replica"]
        assert s["after"]["cached_tokens"] == 0
        assert s["after"]["prompt_tokens"] == s["history_len"]
        assert s["after"]["text"] == s["reference_text"]
    for s in stayed:  # untouched: still on their replica, their KV reused
        assert s["after"]["replica"] == s["before"]["replica"]
        assert s["after"]["cached_tokens"] > 0
        assert s["after"]["text"] == s["reference_text"]


def run_scenario(out: Path, model_dir: Path) -> subprocess.CompletedProcess:
    """`scenario` in a fresh process whose `RAY_TMPDIR` is a new short dir, removed after."""
    ray_tmp = tempfile.mkdtemp(prefix="ss-mn-", dir="/tmp")  # Ray's socket paths must be short
    env = os.environ | {
        "PYTHONPATH": str(ROOT),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_TMPDIR": ray_tmp,
    }
    code = (
        "import sys; from tests.integration.test_multinode import scenario; scenario(*sys.argv[1:])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(out), str(model_dir)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its Ray processes in its group, stopped with it below
    )
    try:
        stdout, stderr = proc.communicate(timeout=400)
    finally:  # whatever the scenario left running (a failed start's GCS and raylet) goes too
        stop_group(proc, grace_s=10)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def scenario(out_path: str, model_dir: str) -> None:
    """Run in a fresh process (with `RAY_TMPDIR` set): build the two-node cluster, serve,
    converse, remove the worker, converse again, and write what happened to `out_path`."""
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from sessionserve.app import build_app
    from tests.conftest import app_args, free_port
    from tests.http_wait import wait_healthy
    from tests.models import save_tiny_model

    save_tiny_model(model_dir, num_hidden_layers=2)
    # the head's temp dir is Ray's default root under RAY_TMPDIR, where Cluster writes its address
    temp = os.path.join(os.environ["RAY_TMPDIR"], "ray")
    os.makedirs(temp, exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "temp_dir": temp},
    )
    worker = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="WARNING")
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
        args = app_args(model_dir)
        args["replica"].update(num_replicas=2, num_cpus=0.5, max_replicas_per_node=1)
        args["ingress"].update(num_replicas=1, num_cpus=0.2)
        serve.run(build_app(args), name="mn", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        assert wait_healthy(base, 120), "the two-node app never answered /health"
        result = converse(base, httpx, cluster, worker, serve)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    Path(out_path).write_text(json.dumps(result))


def converse(base, httpx, cluster, worker, serve) -> dict:
    handle = serve.get_deployment_handle("SessionReplica", app_name="mn")
    replica_node = {}
    for _ in range(40):
        terms = handle.memory_check.remote().result(timeout_s=30)
        replica_node[terms["replica"]] = terms["node"]
        if len(replica_node) == 2:
            break
    worker_node = worker.node_id
    sessions = []
    with httpx.Client(base_url=base, timeout=60) as http:
        for i in range(SESSIONS):
            sid = http.post("/v1/sessions", json={}).json()["id"]
            prompt = [10 + i, 20 + i, 30 + i]
            turn = post(http, sid, prompt)
            view = http.get(f"/v1/sessions/{sid}", params={"include_history": "true"}).json()
            sessions.append(
                {
                    "sid": sid,
                    "history": view["history"],
                    "before": turn,
                    "was_on_removed_node": replica_node.get(turn["replica"]) == worker_node,
                }
            )
        on_nodes = {replica_node.get(s["before"]["replica"]) for s in sessions}
        cluster.remove_node(worker)  # the worker node and its replica go away
        started = time.monotonic()
        for s in sessions:
            nxt = [40, 41]
            deadline = time.monotonic() + 120
            while True:
                try:
                    after = post(http, s["sid"], nxt)
                    break
                except RuntimeError as e:  # 5xx while Serve notices the loss: retry
                    if time.monotonic() > deadline:
                        raise
                    s.setdefault("retries", []).append(str(e)[:80])
                    time.sleep(1.0)
            full = s["history"] + nxt
            reference = http.post(
                "/v1/completions",
                json={"prompt": full, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
            ).json()
            s.update(
                after=after,
                history_len=len(full),
                reference_text=reference["choices"][0]["text"],
            )
        recovery_s = time.monotonic() - started
    return {
        "nodes_with_sessions": sorted(n for n in on_nodes if n),
        "sessions": sessions,
        "recovery_s": round(recovery_s, 1),
    }


def post(http, sid: str, prompt: list[int]) -> dict:
    r = http.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        headers={"x-session-id": sid},
    )
    if r.status_code >= 500:
        raise RuntimeError(f"{r.status_code} {r.text}")
    assert r.status_code == 200, r.text
    body = r.json()
    return {
        "replica": body["session"]["replica"],
        "text": body["choices"][0]["text"],
        "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"],
        "prompt_tokens": body["usage"]["prompt_tokens"],
    }
