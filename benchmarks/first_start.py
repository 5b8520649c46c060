"""A first start on a fresh machine, timed: `serve run` with an empty cache root (no converted
model, no kernels, no packages) and an empty inductor cache, until the replica answers and
until each compiled package serves its first step (the replica's `compile: steps of ... of
the <package> now run compiled` lines). Optionally a baseline checkout first, in the same
run (`--baseline-tree`, e.g. `git worktree add /tmp/old <rev>`), so the two starts are
compared on the same machine minutes apart.

    .venv/bin/python -m benchmarks.first_start                       # deploy/serve-cpu.yaml
    .venv/bin/python -m benchmarks.first_start --baseline-tree /tmp/old --until prefill

Run it alone on the machine, with no Ray running: each start brings up its own cluster, and
its builds are what is timed. Prints, per start, seconds from `serve run` to the first
answer and to each package; the last line is JSON (`<start>_answer_s`,
`<start>_<package>_s`, and `ratio_<package>` baseline / this tree where both reached it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import emit, machine

HERE = Path(__file__).resolve().parents[1]
# compiled_forward.INSTALLED_LOG, the package's role captured
INSTALLED = re.compile(r"compile: steps of \d+-\d+ tokens of the (.+?) now run compiled")
# --until: the packages to wait for (the forward's and the dense decode step's come last)
UNTIL = {
    "answer": (),
    "int4": ("4-bit decode step package",),
    "prefill": ("4-bit decode step package", "prefill package"),
    "all": ("4-bit decode step package", "prefill package", "decode step package", "forward"),
}


def first_answer(base: str) -> bool:
    """Whether the server answers a one-token completion now (its model's name from
    /v1/models)."""
    try:
        models = httpx.get(f"{base}/v1/models", timeout=5).json()["data"]
        body = {"model": models[0]["id"], "prompt": "Hello", "max_tokens": 1}
        return httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return False


def one_start(
    tree: Path, config: str, wanted: tuple[str, ...], timeout_s: float, keep_log: Path | None
) -> dict:
    """`serve run config` from `tree` (its code first on PYTHONPATH) with fresh caches;
    seconds from the start to the first answer and to each package's first step. Its log is
    copied to `keep_log` when given (the scratch directory it is written in goes)."""
    serve = Path(sys.executable).with_name("serve")
    ray = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray), "stop", "--force"], capture_output=True, check=False)
    scratch = Path(tempfile.mkdtemp(prefix="first-start-"))
    env = os.environ | {
        "PYTHONPATH": str(tree),
        "SESSIONSERVE_CACHE": str(scratch / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    log_path = scratch / "serve.log"
    times: dict[str, float] = {}
    started = time.monotonic()
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [str(serve), "run", config], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        while time.monotonic() - started < timeout_s and server.poll() is None:
            now = round(time.monotonic() - started, 1)
            for role in INSTALLED.findall(log_path.read_text(errors="replace")):
                times.setdefault(role, now)
            if "answer" not in times and first_answer("http://127.0.0.1:8000"):
                times["answer"] = round(time.monotonic() - started, 1)
                print(f"  answered after {times['answer']:.0f} s", flush=True)
            if "answer" in times and all(role in times for role in wanted):
                break
            time.sleep(1)
        else:
            print(f"  stopped waiting after {time.monotonic() - started:.0f} s", flush=True)
            if server.poll() is not None:  # it exited: why, before its log goes
                tail = log_path.read_text(errors="replace").splitlines()[-20:]
                print("  serve run exited; its log ends:\n    " + "\n    ".join(tail))
    finally:
        subprocess.run([str(serve), "shutdown", "-y"], cwd=tree, env=env, capture_output=True)
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        subprocess.run([str(ray), "stop", "--force"], capture_output=True, check=False)
        if keep_log is not None:
            keep_log.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log_path, keep_log)
        shutil.rmtree(scratch, ignore_errors=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="deploy/serve-cpu.yaml")
    ap.add_argument("--baseline-tree", type=Path, help="a checkout started first, as baseline")
    ap.add_argument("--until", choices=sorted(UNTIL), default="prefill")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per start at most")
    ap.add_argument("--logs", type=Path, help="a folder to keep each start's log in (<start>.log)")
    args = ap.parse_args()
    starts = {"this": HERE}
    if args.baseline_tree is not None:
        starts = {"baseline": args.baseline_tree.resolve(), **starts}
    summary: dict = {"machine": machine(), "config": args.config, "until": args.until}
    results = {}
    for name, tree in starts.items():
        print(f"{name}: serve run {args.config} from {tree}, caches empty", flush=True)
        keep = args.logs / f"{name}.log" if args.logs is not None else None
        results[name] = one_start(tree, args.config, UNTIL[args.until], args.timeout, keep)
        for what, seconds in sorted(results[name].items(), key=lambda kv: kv[1]):
            print(f"  {what}: {seconds:.0f} s ({seconds / 60:.1f} min)")
            summary[f"{name}_{what.replace(' ', '_')}_s"] = seconds
    if "baseline" in results:
        for what, seconds in results["this"].items():
            if what in results["baseline"] and seconds > 0:
                ratio = round(results["baseline"][what] / seconds, 2)
                summary[f"ratio_{what.replace(' ', '_')}"] = ratio
                print(f"{what}: {ratio:.2f}x sooner than the baseline")
    emit(summary)


if __name__ == "__main__":
    main()
