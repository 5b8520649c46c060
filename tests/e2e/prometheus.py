"""A real Prometheus server (Debian's `prometheus` package) for tests, on loopback."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"


def ensure_prometheus() -> str | None:
    """The prometheus binary, installing Debian's package if needed; None with a reason
    printed when that is impossible here (not root, no apt, no network)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if shutil.which("apt-get") is None:
        print("prometheus: not installed and no apt-get on this machine")
        return None
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            print(f"prometheus: `{' '.join(cmd)}` failed: {done.stderr[-500:]}")
            return None
    return shutil.which("prometheus")


class Prometheus:
    def __init__(self, binary: str, scrape_target: str, port: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ss-prom-"))
        config = {
            # Ray's metrics agent can take over a second to answer on 2 busy cores (a scrape
            # timeout is at most its interval: at 1 s every scrape of a CI run timed out for a
            # minute); the tests' waits allow several 5 s scrapes
            "global": {
                "scrape_interval": "5s",
                "scrape_timeout": "5s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "ray", "static_configs": [{"targets": [scrape_target]}]}
            ],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(self.dir / "log").open("w"),
        )

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError((self.dir / "log").read_text()[-2000:])

    def query(self, promql: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{promql!r}: {body}")
        return body["data"]["result"]

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, promql: str, predicate, timeout_s: float = 30) -> float:
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            last = self.value(promql)
            if last is not None and predicate(last):
                return last
            time.sleep(0.5)
        raise AssertionError(
            f"{promql!r} never satisfied the check; last value {last}; {self.targets()}"
        )

    def targets(self) -> str:
        """Each scrape target's health and last error: whether a missing series is the
        exporter's absence or the series' (for a failure's message)."""
        try:
            r = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()
            active = r["data"]["activeTargets"]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            return f"targets unknown ({e!r})"
        return "targets: " + "; ".join(
            f"{t['scrapeUrl']} {t['health']} (last scrape {t['lastScrape']}, error "
            f"{t['lastError']!r}, {t['lastScrapeDuration']:.3f} s)"
            for t in active
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
