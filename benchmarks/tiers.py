"""Sessions beyond the device pool: the host tier and live migration, vs re-prefill.

1. Next-turn TTFT at --histories tokens of history (default 2k and ~8k), three ways:
     resident:   the session's KV stayed in the pool
     host:       parked in the host tier, copied back, then only the new tokens prefilled
     re-prefill: evicted with no copy: the whole history is prefilled again
   restore_speedup_<n> = re-prefill / host.
2. Migration of the session with the first history length: export from one engine, through
   Ray's object store (ray.put, ray.get: one copy in, mapped out, as a handle call between two
   replicas on one node), import into a second engine; vs re-prefilling the history there.
   migrate_speedup_<n> = re-prefill / (export + transfer + import).
3. Hot/cold sessions in the shape of SGLang's session benchmark: --hot sessions take a turn
   every round, --cold ones every 4th, in a pool holding 60% of their KV; session-cache hit
   rate (cached / prompt tokens), mean TTFT and re-prefilled tokens with the host tier on and
   off. ttft_gain_hotcold = mean TTFT off / on.
All figures are medians of --repeats (part 1, 2) on the default model (SmolLM2-135M, fp32),
radix cache off (so "re-prefill" is really the whole history). Last line: JSON.

    .venv/bin/python -m benchmarks.tiers [--histories 2048 7936] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import emit, engine, load, machine, median, setup_threads
from sessionserve.wire import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
ANSWER = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
HOST_TIER = 4 << 30


def ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def next_turn_ttft(loaded, history: int, repeats: int) -> dict[str, float]:
    eng = engine(loaded, radix=False, num_slots=history + 512, host_tier_bytes=HOST_TIER)
    sid = eng.open_session()
    t0 = time.monotonic()
    eng.generate([ids(1, history)], ONE_TOKEN, session_id=sid)
    print(f"[history {history}] built in {time.monotonic() - t0:.1f} s", flush=True)
    out: dict[str, list[float]] = {"resident": [], "host": [], "reprefill": []}
    for rep in range(repeats):
        for mode in out:
            if mode != "resident":
                eng.park_session(sid)
            if mode == "reprefill":  # as if the host tier had dropped it too
                eng.cache.host_tier.drop(sid)
            (r,) = eng.generate([ids(100 + rep, 16)], ONE_TOKEN, session_id=sid)
            want = {"resident": "session", "host": "host", "reprefill": "none"}[mode]
            assert r.cached_source == want, (mode, r.cached_source)
            out[mode].append(r.ttft_s)
            print(f"  {mode:>9}: {1000 * r.ttft_s:8.1f} ms (cached {r.cached_tokens})", flush=True)
    bytes_ = eng.export_session(sid).kv_bytes
    return {m: median(v) for m, v in out.items()} | {"kv_bytes": bytes_}


def migration(loaded, history: int, repeats: int) -> dict[str, float]:
    """A replica's handle call puts the export in the object store (one copy) and the target
    maps it from there (zero-copy on one node), so: export, ray.put, ray.get, import."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        source = engine(loaded, radix=False, num_slots=history + 512)
        target = engine(loaded, radix=False, num_slots=2 * (history + 512))
        sid = source.open_session()
        source.generate([ids(2, history)], ONE_TOKEN, session_id=sid)
        moves, reprefills, nbytes = [], [], 0
        for rep in range(repeats):
            t0 = time.perf_counter()
            export = source.export_session(sid)
            target.import_session(ray.get(ray.put(export)))
            moves.append(time.perf_counter() - t0)
            nbytes = export.kv_bytes
            (r,) = target.generate([ids(200 + rep, 16)], ONE_TOKEN, session_id=sid)
            assert r.cached_source == "session" and r.cached_tokens >= history - 1
            target.close_session(sid)
            # the alternative: the target re-prefills the history from the token log
            fresh = target.open_session()
            again = export.history + ids(300 + rep, 16)
            (r,) = target.generate([again], ONE_TOKEN, session_id=fresh)
            reprefills.append(r.ttft_s)
            target.close_session(fresh)
            print(
                f"  move {1000 * moves[-1]:.1f} ms ({nbytes / 2**20:.1f} MiB) vs re-prefill "
                f"{1000 * reprefills[-1]:.1f} ms",
                flush=True,
            )
        return {"move_s": median(moves), "reprefill_s": median(reprefills), "kv_bytes": nbytes}
    finally:
        ray.shutdown()


def hot_cold(loaded, hot: int, cold: int, rounds: int, tier: bool) -> dict[str, float]:
    prompt, per_turn, answer = 400, 24, ANSWER.max_tokens  # tokens
    cold_turns = -(-rounds // 4)
    need = hot * (prompt + rounds * (per_turn + answer)) + cold * (
        prompt + cold_turns * (per_turn + answer)
    )
    slots = int(0.6 * need) // 16 * 16  # the pool holds 60% of the sessions' KV
    eng = engine(loaded, radix=False, num_slots=slots, host_tier_bytes=HOST_TIER if tier else None)
    sids = [eng.open_session() for _ in range(hot + cold)]
    started: set[str] = set()
    ttfts, prompt_tokens, cached, sources = [], 0, 0, {"session": 0, "host": 0, "none": 0}
    for rnd in range(rounds):
        for i, sid in enumerate(sids):
            if i >= hot and rnd % 4 != i % 4:  # cold: every 4th round, staggered
                continue
            new = ids(1000 * i + rnd, per_turn if sid in started else prompt)
            (r,) = eng.generate([new], ANSWER, session_id=sid)
            if sid in started:  # first turns prefill in both modes alike
                ttfts.append(r.ttft_s)
                prompt_tokens += r.prompt_tokens
                cached += r.cached_tokens
                sources[r.cached_source] += 1
            started.add(sid)
    return {
        "hit_rate": cached / prompt_tokens,
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "reprefilled_tokens": prompt_tokens - cached,
        "turns": len(ttfts),
        "from_host": sources["host"],
        "evictions": eng.cache.evicted_sessions_total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--histories", type=int, nargs="+", default=[2048, 7936])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hot", type=int, default=16)
    ap.add_argument("--cold", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    setup_threads(args.threads)
    loaded = load()
    summary: dict = {"benchmark": "tiers", "machine": machine()}

    print("== 1. next-turn TTFT: resident / host tier / re-prefill ==")
    for n in args.histories:
        t = next_turn_ttft(loaded, n, args.repeats)
        k = f"{round(n / 1024)}k"
        summary |= {
            f"ttft_ms_resident_{k}": round(1000 * t["resident"], 1),
            f"ttft_ms_host_{k}": round(1000 * t["host"], 1),
            f"ttft_ms_reprefill_{k}": round(1000 * t["reprefill"], 1),
            f"restore_speedup_{k}": round(t["reprefill"] / t["host"], 1),
            f"kv_mib_{k}": round(t["kv_bytes"] / 2**20, 1),
        }

    print("== 2. migration: export + object store + import vs re-prefill on the target ==")
    n = args.histories[0]
    m = migration(loaded, n, args.repeats)
    k = f"{round(n / 1024)}k"
    summary |= {
        f"migrate_ms_{k}": round(1000 * m["move_s"], 1),
        f"migrate_reprefill_ms_{k}": round(1000 * m["reprefill_s"], 1),
        f"migrate_mib_{k}": round(m["kv_bytes"] / 2**20, 1),
        f"migrate_speedup_{k}": round(m["reprefill_s"] / m["move_s"], 1),
    }

    print(f"== 3. hot/cold: {args.hot} hot + {args.cold} cold sessions, {args.rounds} rounds ==")
    runs = {}
    for tier in (False, True):
        runs[tier] = hot_cold(loaded, args.hot, args.cold, args.rounds, tier)
        print(f"  host tier {'on ' if tier else 'off'}: {runs[tier]}", flush=True)
    off, on = runs[False], runs[True]
    summary |= {
        "hotcold_hit_rate_off": round(off["hit_rate"], 3),
        "hotcold_hit_rate_on": round(on["hit_rate"], 3),
        "hotcold_mean_ttft_ms_off": round(1000 * off["mean_ttft_s"], 1),
        "hotcold_mean_ttft_ms_on": round(1000 * on["mean_ttft_s"], 1),
        "hotcold_reprefilled_tokens_off": off["reprefilled_tokens"],
        "hotcold_reprefilled_tokens_on": on["reprefilled_tokens"],
        "ttft_gain_hotcold": round(off["mean_ttft_s"] / on["mean_ttft_s"], 2),
    }
    print(f"\nmachine: {machine()}")
    emit(summary)


if __name__ == "__main__":
    main()
