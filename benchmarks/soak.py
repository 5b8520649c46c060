"""Soak: thousands of turns over many sessions with churn, the strict memory check on.

Not part of CI. Serves a tiny random-weight model (2 replicas, strict mode: the invariant is
checked after every step) and runs --workers concurrent clients for --turns turns in all.
Each client keeps a few sessions and, at random (seeded), opens new ones, closes old ones,
runs turns (chat and append mode, some streamed), aborts turns by disconnecting mid-stream
and sends bad requests. Every --report-every turns, and at the end, it samples:
- held-token drift: each replica's `held` term against the sum its sessions report, and the
  invariant's terms (`free + evictable + protected + held + in_flight == total`) once idle;
- memory (RSS) of every Ray worker process of the app, against the first sample;
- errors: any 5xx, or any 4xx the workload did not ask for.

    .venv/bin/python -m benchmarks.soak [--turns 3000] [--workers 8]

The last line is JSON: held_drift_tokens (must be 0), rss growth per process, error counts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from collections import Counter

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import httpx  # noqa: E402
import psutil  # noqa: E402

from benchmarks.common import emit, local_serve  # noqa: E402
from sessionserve.api.memory_trace import ENV as MEMORY_TRACE_ENV  # noqa: E402

APP = "soak"


def app_args(model_dir: str) -> dict:
    return {
        "engine": {
            "model": {"path": model_dir, "torch_threads": 1},
            "cache": {"page_size": 4, "num_slots": 8192, "max_rows": 64, "max_context_len": 1024},
            "sessions": {"implicit_open": True, "max_sessions": 64, "default_ttl_s": 600},
            "scheduler": {"max_prefill_tokens": 128},
            "memory_check": "every_step",
        },
        "replica": {"num_replicas": 2, "num_cpus": 0.5, "routing_stats_period_s": 0.5},
        "ingress": {"num_replicas": 1, "num_cpus": 0.25},
    }


class Client:
    """One simulated user: a handful of sessions, random actions, counted outcomes."""

    def __init__(self, base: str, seed: int, counts: Counter, lock: threading.Lock) -> None:
        self.http = httpx.Client(base_url=base, timeout=120)
        self.rng = random.Random(seed)
        self.seed = seed
        self.sessions: dict[str, list[dict]] = {}  # id -> chat messages so far
        self.counts, self.lock = counts, lock
        self.serial = 0

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def new_session(self) -> str:
        self.serial += 1
        sid = f"soak-{self.seed}-{self.serial}"
        r = self.http.post("/v1/sessions", json={"session_id": sid})
        self.expect(r, 200, "open")
        self.sessions[sid] = []
        return sid

    def expect(self, r: httpx.Response, status: int, what: str) -> bool:
        if r.status_code == status:
            self.count(what)
            return True
        if r.status_code == 409 and what == "turn":  # the turn just walked away from is
            self.count("busy_409")  # still being aborted (reported, not an error)
            return False
        kind = "5xx" if r.status_code >= 500 else f"unexpected_{r.status_code}"
        self.count(kind)
        self.count(f"{kind}:{what}")
        return False

    def step(self) -> None:
        roll = self.rng.random()
        if not self.sessions or (roll < 0.08 and len(self.sessions) < 6):
            self.new_session()
        elif roll < 0.14:
            sid = self.rng.choice(list(self.sessions))
            self.expect(self.http.delete(f"/v1/sessions/{sid}"), 200, "close")
            del self.sessions[sid]
        elif roll < 0.20:
            self.abort_turn(self.rng.choice(list(self.sessions)))
        elif roll < 0.24:
            body = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": -1}
            self.expect(self.http.post("/v1/chat/completions", json=body), 400, "bad_request")
        else:
            self.chat_turn(self.rng.choice(list(self.sessions)), stream=roll > 0.85)

    def chat_turn(self, sid: str, stream: bool) -> None:
        messages = self.sessions[sid] + [
            {
                "role": "user",
                "content": f"w{self.rng.randrange(5, 250)} w{self.rng.randrange(5, 250)}",
            }
        ]
        body = {"messages": messages, "max_tokens": self.rng.randrange(1, 12), "temperature": 0}
        if len(messages) > 24:  # keep within the context: start the conversation over
            self.expect(self.http.delete(f"/v1/sessions/{sid}"), 200, "close")
            del self.sessions[sid]
            return
        headers = {"x-session-id": sid}
        if stream:
            text = []
            with self.http.stream(
                "POST", "/v1/chat/completions", json=body | {"stream": True}, headers=headers
            ) as r:
                if not self.expect(r, 200, "turn"):
                    return
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.count("5xx")
                            return
                        if chunk["choices"]:
                            text.append(chunk["choices"][0]["delta"].get("content") or "")
            answer = "".join(text)
        else:
            r = self.http.post("/v1/chat/completions", json=body, headers=headers)
            if not self.expect(r, 200, "turn"):
                return
            answer = r.json()["choices"][0]["message"]["content"]
        self.sessions[sid] = messages + [{"role": "assistant", "content": answer}]

    def abort_turn(self, sid: str) -> None:
        """A streamed turn the client walks away from: the server aborts it."""
        body = {
            "messages": self.sessions[sid] + [{"role": "user", "content": "w7 w8"}],
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
        }
        with self.http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"x-session-id": sid}
        ) as r:
            if self.expect(r, 200, "abort"):
                lines = r.iter_lines()
                next(lines, None)
        # the session stays at its last completed turn; a 409 may follow briefly
        time.sleep(0.05)


def replica_processes() -> dict[str, psutil.Process]:
    """The app's Ray worker processes (replicas, ingress, directory), by their title."""
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        for tag in ("SessionReplica", "Ingress", "SessionDirectoryActor"):
            if tag in cmd and "ray::" in cmd:
                found[f"{tag}-{p.pid}"] = p
    return found


def sample(serve, processes: dict, rss0: dict) -> dict:
    handle = serve.get_deployment_handle("SessionReplica", app_name=APP)
    terms, failures = {}, 0
    for _ in range(40):
        try:
            t = handle.memory_check.remote().result(timeout_s=60)
        except Exception:  # MemoryInvariantError: the check itself found a lost slot
            failures += 1
            continue
        terms[t["replica"]] = t
        if len(terms) == 2:
            break
    drift = 0
    for t in terms.values():
        drift += abs(
            t["total"] - (t["free"] + t["evictable"] + t["protected"] + t["held"] + t["in_flight"])
        )
    rss = {}
    for name, p in processes.items():
        try:
            rss[name] = p.memory_info().rss
            rss0.setdefault(name, rss[name])
        except psutil.NoSuchProcess:
            pass
    return {"drift": drift, "rss": rss, "terms": terms, "check_failures": failures}


def print_trace(traced: dict, ingress_rss: dict[str, int]) -> None:
    """What the ingress's Python allocations grew by since the baseline, against its RSS."""
    rss = ", ".join(f"{v / 2**20:.1f} MiB" for v in ingress_rss.values())
    print(
        f"ingress since the baseline: RSS +{rss}; Python allocations (tracemalloc) "
        f"{traced['grown_bytes'] / 2**20:+.2f} MiB of {traced['traced_bytes'] / 2**20:.1f} MiB"
    )
    for entry in traced["top"]:
        print(f"{entry['size_diff'] / 2**10:+10.1f} KiB {entry['count_diff']:+7d} blocks")
        for frame in entry["traceback"][-6:]:
            print(f"{'':>24}{frame}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=3000, help="client actions in all")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--report-every", type=int, default=500)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument(
        "--trace-ingress",
        type=int,
        default=0,
        metavar="FRAMES",
        help="run tracemalloc in the ingress (FRAMES per allocation); after the first "
        "--report-every actions take a baseline, and at the end print what grew since",
    )
    args = ap.parse_args()
    if args.trace_ingress:  # Ray's workers inherit the driver's environment
        os.environ[MEMORY_TRACE_ENV] = str(args.trace_ingress)
    from ray import serve

    from sessionserve.app import build_app

    counts: Counter = Counter()
    lock = threading.Lock()
    done = [0]
    samples = []
    with local_serve(args.port) as model_dir:
        serve.run(build_app(app_args(model_dir)), name=APP, route_prefix="/")
        base = f"http://127.0.0.1:{args.port}"
        processes, rss0 = replica_processes(), {}
        ingress = serve.get_deployment_handle("Ingress", app_name=APP)
        rss_mark: dict[str, int] = {}  # RSS when the ingress's trace took its baseline
        samples.append(sample(serve, processes, rss0))
        started = time.monotonic()

        def worker(seed: int) -> None:
            client = Client(base, seed, counts, lock)
            while True:
                with lock:
                    if done[0] >= args.turns:
                        return
                    done[0] += 1
                    n = done[0]
                try:
                    client.step()
                except httpx.HTTPError as e:
                    client.count(f"transport:{type(e).__name__}")
                if n % args.report_every == 0:
                    if args.trace_ingress and n == args.report_every:
                        traced = ingress.memory_trace.remote("mark").result(timeout_s=120)
                        rss_mark.update(sample(serve, processes, {})["rss"])
                        print(f"ingress tracemalloc baseline: {traced / 2**20:.1f} MiB traced")
                    s = sample(serve, processes, rss0)
                    samples.append(s)
                    grown = {k: (v - rss0[k]) / 2**20 for k, v in s["rss"].items()}
                    print(
                        f"{n:>6} actions  {time.monotonic() - started:7.1f} s  drift "
                        f"{s['drift']}  RSS growth MiB "
                        + " ".join(f"{k} {v:.1f}" for k, v in sorted(grown.items()))
                        + f"  5xx {counts['5xx']}",
                        flush=True,
                    )

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        time.sleep(1.0)  # let aborted turns finish aborting
        final = sample(serve, processes, rss0)
        idle = all(t["in_flight"] == 0 for t in final["terms"].values())
        traced = ingress.memory_trace.remote("growth").result(timeout_s=300) if rss_mark else None
    if traced is not None:
        ingress_rss = {k: final["rss"][k] - v for k, v in rss_mark.items() if "Ingress" in k}
        print_trace(traced, ingress_rss)
    growth = {k: round((final["rss"][k] - rss0[k]) / 2**20, 1) for k in final["rss"]}
    errors = {k: v for k, v in counts.items() if k.startswith(("5xx", "unexpected", "transport"))}
    print(f"{'process':>32} {'RSS growth MiB':>15}")
    for k, v in sorted(growth.items()):
        print(f"{k:>32} {v:>15}")
    emit(
        {
            "benchmark": "soak",
            "actions": args.turns,
            "workers": args.workers,
            "elapsed_s": round(elapsed, 1),
            "turns_ok": counts["turn"],
            "opens": counts["open"],
            "closes": counts["close"],
            "aborts": counts["abort"],
            "bad_requests_answered_400": counts["bad_request"],
            "held_drift_tokens": max(s["drift"] for s in samples + [final]),
            "invariant_check_failures": sum(s["check_failures"] for s in samples + [final]),
            "busy_409_after_abort": counts["busy_409"],
            "idle_at_end": idle,
            "rss_growth_mib": growth,
            "errors": errors,
            **(
                {
                    "ingress_traced_growth_mib": round(traced["grown_bytes"] / 2**20, 2),
                    "ingress_rss_growth_since_mark_mib": {
                        k: round(v / 2**20, 1) for k, v in ingress_rss.items()
                    },
                }
                if traced is not None
                else {}
            ),
        }
    )


if __name__ == "__main__":
    main()
