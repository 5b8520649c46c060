"""How much a bare Ray Serve ingress grows under the soak's request mix: the baseline for the
ingress figure of `benchmarks/soak.py`.

A FastAPI ingress streams from a trivial deployment through a handle (no model, no sessions,
no directory), under the same shape of load as the soak: 8 clients, JSON answers, streamed
answers, and streams the client walks away from. It prints the ingress process's RSS growth
every --report-every requests; whatever sessionserve's ingress grows beyond this is ours.

    .venv/bin/python -m benchmarks.ingress_rss_baseline [--requests 8000]

Last line: JSON with the growth (MiB) at each report.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import httpx  # noqa: E402
import psutil  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from ray import serve  # noqa: E402

from benchmarks.common import emit, local_serve  # noqa: E402

app = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0.5})
class Words:
    async def generate(self, n: int):
        for i in range(n):
            yield {"text": f"w{i} "}


@serve.deployment(ray_actor_options={"num_cpus": 0.25})
@serve.ingress(app)
class BareIngress:
    def __init__(self, words) -> None:
        self.words = words

    @app.post("/v1/chat/completions")
    async def chat(self, body: dict):
        stream = self.words.options(stream=True).generate.remote(body.get("max_tokens", 4))
        if body.get("stream"):

            async def sse():
                async for piece in stream:
                    yield "data: " + json.dumps(piece) + "\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        text = "".join([p["text"] async for p in stream])
        return JSONResponse({"choices": [{"message": {"content": text}}]})


def client_loop(base: str, seed: int, budget: list[int], lock, on_step) -> None:
    rng, http = random.Random(seed), httpx.Client(base_url=base, timeout=60)
    while True:
        with lock:
            if budget[0] <= 0:
                return
            budget[0] -= 1
        roll, body = rng.random(), {"max_tokens": rng.randrange(1, 12)}
        if roll < 0.06:  # walked away from
            with http.stream(
                "POST", "/v1/chat/completions", json={"max_tokens": 200, "stream": True}
            ) as r:
                next(r.iter_lines(), None)
        elif roll > 0.85:
            with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
                for _ in r.iter_lines():
                    pass
        else:
            http.post("/v1/chat/completions", json=body)
        on_step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--report-every", type=int, default=1000)
    ap.add_argument("--port", type=int, default=8125)
    args = ap.parse_args()
    growth: dict[int, float] = {}
    with local_serve(args.port):
        serve.run(BareIngress.bind(Words.bind()), name="bare", route_prefix="/")
        (ingress,) = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "ray::" in " ".join(p.info["cmdline"] or [])
            and "BareIngress" in " ".join(p.info["cmdline"] or [])
        ]
        rss0, done, lock = ingress.memory_info().rss, [0], threading.Lock()

        def on_step() -> None:
            with lock:
                done[0] += 1
                n = done[0]
            if n % args.report_every == 0:
                growth[n] = round((ingress.memory_info().rss - rss0) / 2**20, 1)
                print(f"{n:>6} requests  ingress RSS growth {growth[n]:6.1f} MiB", flush=True)

        budget = [args.requests]
        base = f"http://127.0.0.1:{args.port}"
        threads = [
            threading.Thread(target=client_loop, args=(base, i, budget, lock, on_step))
            for i in range(args.workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    emit({"benchmark": "ingress_rss_baseline", "requests": args.requests, "growth_mib": growth})


if __name__ == "__main__":
    main()
