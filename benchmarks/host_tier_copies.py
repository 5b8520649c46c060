"""What a spill to the host tier and a restore from it cost, copies alone (no model).

Three arms, each in a process of its own, alternating over --rounds:
  pages  the host tier (`cache/host_tier.py`): pages allocated and written at startup, a spill
         copies pool pages into free tier pages, a restore copies them back
  reused the tier before it (a fresh tensor a parked session: `kv_snapshot.gather` /
         `scatter`), each copy dropped before the next: the allocator hands back memory the
         process wrote before
  grown  the same, each copy kept, as a tier that is filling keeps them: every spill writes
         memory the process has not written before (its page faults)
A spill is --tokens positions at page-aligned slots of a SmolLM2-135M-shaped pool (30 layers, 3
KV heads of 64), a restore every third spill into other slots. Printed: median ms a spill and
a restore per arm and round; last line JSON with `spill_ms_<arm>`, `restore_ms_<arm>` (medians
over rounds) and `spill_speedup_vs_reused`, `spill_speedup_vs_grown` (that arm's ms / pages').

    .venv/bin/python -m benchmarks.host_tier_copies [--tokens 512] [--spills 90] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from benchmarks.common import emit, machine, median

ARMS = ("pages", "reused", "grown")
PAGE = 16


def run_arm(arm: str, tokens: int, spills: int, dtype: torch.dtype) -> dict[str, float]:
    from sessionserve.cache import KVPool, KVShape
    from sessionserve.cache.host_tier import HostTier
    from sessionserve.cache.kv_snapshot import gather, scatter

    torch.set_num_threads(2)
    pool = KVPool(KVShape(30, 3, 64), 16 * 1024, dtype=dtype)
    pool.k.copy_(torch.randn(pool.k.shape).to(dtype))
    pool.v.copy_(torch.randn(pool.v.shape).to(dtype))
    slots = torch.arange(PAGE * 100, PAGE * 100 + tokens)
    into = torch.arange(PAGE * 500, PAGE * 500 + tokens)
    ids = list(range(tokens))
    tier = HostTier(1 << 30, [pool]) if arm == "pages" else None
    kept, spill, restore = [], [], []
    for i in range(spills):
        started = time.perf_counter()
        if tier is not None:
            tier.park(f"s{i}", slots, ids, PAGE)
        else:
            snap = gather([pool], slots, ids, PAGE)
        spill.append((time.perf_counter() - started) * 1000)
        if arm == "grown":
            kept.append(snap)
        if i % 3:
            continue
        started = time.perf_counter()
        if tier is not None:
            parked = tier.take(f"s{i}")
            tier.restore(parked, 0, tokens, into, PAGE)
            tier.release(parked)
        else:
            scatter([pool], snap, 0, tokens, into, PAGE)
        restore.append((time.perf_counter() - started) * 1000)
    if not torch.equal(pool.k[:, into], pool.k[:, slots]):
        raise SystemExit(f"{arm}: the restored KV differs from what was spilled")
    return {"spill_ms": median(spill), "restore_ms": median(restore)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--spills", type=int, default=90)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a child
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.tokens, args.spills, dtype)))
        return
    mb = args.tokens * 2 * 30 * 3 * 64 * dtype.itemsize / 1e6
    print(f"{machine()}; {args.tokens} tokens a spill ({mb:.1f} MB), {args.spills} spills")
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            cmd = [sys.executable, "-m", "benchmarks.host_tier_copies", "--arm", arm]
            cmd += ["--tokens", str(args.tokens), "--spills", str(args.spills)]
            cmd += ["--dtype", args.dtype]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            results[arm].append(got)
            print(
                f"  round {r} {arm:6s}: spill {got['spill_ms']:.2f} ms, "
                f"restore {got['restore_ms']:.2f} ms",
                flush=True,
            )
    summary: dict[str, float | int | str] = {"tokens": args.tokens, "dtype": args.dtype}
    for arm in ARMS:
        for key in ("spill_ms", "restore_ms"):
            summary[f"{key.split('_')[0]}_ms_{arm}"] = round(
                median([g[key] for g in results[arm]]), 3
            )
    for arm in ("reused", "grown"):
        summary[f"spill_speedup_vs_{arm}"] = round(
            summary[f"spill_ms_{arm}"] / summary["spill_ms_pages"], 3
        )
    emit(summary)


if __name__ == "__main__":
    main()
