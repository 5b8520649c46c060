"""Overlap scheduling (`engine.overlap_schedule`): step N+1 is scheduled before step N's tokens
are known and N's results are processed while N+1 runs on the forward thread. It must not
change a single token, and the KV accounting must stay exact: the memory check runs after
every step (`tiny_engine`'s default), and every test ends with the idle check. The reference
system's overlap bugs are the scenarios: a request that ends (stop token, abort) while its
next step is already running, retraction under KV pressure, sessions restored from the host
tier while a step writes the pool, max_tokens reached with a step in flight."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import pytest
import torch

from sessionserve.replicas.engine_loop import EngineLoop
from sessionserve.replicas.outputs import StepEvent
from sessionserve.replicas.sampling import DeviceSample
from sessionserve.replicas.speculative.policy import SpecPolicy
from sessionserve.wire import FinishReason, SamplingParams
from tests.models import engine_device, mimic_drafter, tiny_engine, tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# overlap on a forward thread, and inline (the engine thread launches the next step itself)
MODES = pytest.mark.parametrize("mode", [True, "inline"])


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


@dataclass
class Workload:
    """Conversations (session turns, each sent when the previous one has ended) beside plain
    requests, submitted at fixed step numbers; what came back, by name."""

    conversations: list[list[tuple[list[int], SamplingParams]]]
    plain: dict[int, list[tuple[list[int], SamplingParams]]]  # step -> requests sent then
    results: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, FinishReason] = field(default_factory=dict)


def _workload(seed: int, penalties: bool = False, sampled: bool = True) -> Workload:
    """`sampled`: some requests sample (seeded); else every one is greedy."""
    rng = random.Random(seed)

    def sampling() -> SamplingParams:
        kind = rng.choice(
            ["greedy", "seeded", "stop", "eos"] if sampled else ["greedy", "stop", "eos"]
        )
        extra = {"repetition_penalty": 1.3} if penalties and rng.random() < 0.3 else {}
        if kind == "seeded":
            return SamplingParams(
                max_tokens=rng.randrange(1, 20), temperature=0.9, seed=rng.randrange(99), **extra
            )
        if kind == "stop":  # stops on whichever of these comes first, or at max_tokens
            stops = rng.sample(range(3, 250), 40)
            return SamplingParams(max_tokens=20, temperature=0, stop_token_ids=stops, **extra)
        ignore = kind == "greedy"
        return SamplingParams(
            max_tokens=rng.randrange(1, 24), temperature=0, ignore_eos=ignore, **extra
        )

    conversations = [
        [(_ids(rng, rng.randrange(3, 70)), sampling()) for _ in range(rng.randrange(2, 5))]
        for _ in range(5)
    ]
    plain = {
        rng.randrange(0, 40): [(_ids(rng, rng.randrange(1, 90)), sampling())] for _ in range(8)
    }
    return Workload(conversations, plain)


def _run(engine, work: Workload) -> Workload:
    """Drive `work` through `engine` one step at a time (as the served engine thread does)."""
    sids = [engine.open_session() for _ in work.conversations]
    next_turn = [0] * len(sids)
    active: dict[str, str] = {}  # rid -> result name
    step = 0
    while True:
        for c, sid in enumerate(sids):
            busy = any(name.startswith(f"c{c}.") for name in active.values())
            if not busy and next_turn[c] < len(work.conversations[c]):
                ids, sampling = work.conversations[c][next_turn[c]]
                rid = engine.submit(ids, sampling, session_id=sid)
                active[rid] = f"c{c}.{next_turn[c]}"
                next_turn[c] += 1
        for i, (ids, sampling) in enumerate(work.plain.get(step, [])):
            active[engine.submit(ids, sampling)] = f"p{step}.{i}"
        if not engine.has_work():
            break
        engine.step()
        step += 1
        live = set(engine.in_flight())
        for rid in [r for r in active if r not in live]:
            result = engine.take_result(rid)
            work.results[active[rid]] = result.output_ids
            work.reasons[active[rid]] = result.finish_reason
            del active[rid]
    for sid in sids:
        engine.close_session(sid)
    engine.checker.check_idle()
    return work


@MODES
@pytest.mark.parametrize(
    ("arch", "seed"), [("llama", 0), ("llama", 1), ("qwen2", 2), ("gemma3", 3)]
)
def test_overlap_gives_the_tokens_it_gives_without(arch: str, seed: int, mode) -> None:
    """gemma3: sliding-window layers, whose window slots are given back as sequences grow
    (while the step in flight may still read them)."""
    model = tiny_model(arch)
    plain = _run(tiny_engine(model, prefill=24), _workload(seed))
    overlapped = tiny_engine(model, prefill=24, overlap=mode)
    got = _run(overlapped, _workload(seed))
    assert got.results == plain.results
    assert got.reasons == plain.reasons
    assert len(got.results) == sum(map(len, got.conversations)) + len(got.plain)
    assert overlapped.overlap_totals["overlapped_steps"] > 0
    overlapped.close()


def test_overlap_is_on_by_default_where_the_forward_runs_on_a_gpu() -> None:
    """`auto` (the default): inline for a CUDA device, where it measured fastest at 1, 32 and
    64 requests on an H200, off on a CPU; an explicit choice holds on either; anything else is
    refused."""
    from pydantic import ValidationError

    from sessionserve.config import EngineConfig, ModelConfig

    devices = ("cpu", "cuda", "cuda:1")
    mode = {d: EngineConfig(model=ModelConfig(device=d)).overlap_mode() for d in devices}
    assert mode == {"cpu": "off", "cuda": "inline", "cuda:1": "inline"}
    for choice, want in ((True, "thread"), (False, "off"), ("inline", "inline")):
        for d in ("cpu", "cuda"):
            cfg = EngineConfig(model=ModelConfig(device=d), overlap_schedule=choice)
            assert cfg.overlap_mode() == want
    with pytest.raises(ValidationError):
        EngineConfig(overlap_schedule="sometimes")
    engine = tiny_engine(tiny_model(), overlap="auto")  # on the test device (`--device`)
    on_gpu = engine_device().startswith("cuda")
    assert (engine.forwards is not None) is on_gpu
    if on_gpu:
        assert engine.forwards.inline
    engine.close()


@MODES
def test_overlap_under_kv_pressure_retracts_and_restores_from_the_host_tier(mode) -> None:
    """A pool too small for the load: decodes run out of KV (the overlapped schedule stalls,
    the running step is processed, then requests are retracted) and idle sessions go to the
    host tier and come back; each copy back into the pool waits for the forward in flight."""
    model = tiny_model()
    kw = {"page_size": 16, "num_slots": 384, "prefill": 32, "host_tier_bytes": 64 << 20}
    plain = _run(tiny_engine(model, **kw), _workload(7))
    engine = tiny_engine(model, overlap=mode, **kw)
    fenced = []
    wait = engine.runner.kv_pool.fence
    engine.runner.kv_pool.fence = lambda: (fenced.append(1), wait())[1]
    got = _run(engine, _workload(7))
    assert got.results == plain.results
    assert engine.scheduler.retractions_total > 0
    assert engine.overlap_totals["overlap_waits"] > 0  # each retraction waited for a step
    restores = engine.cache.host_tier.restored_total
    assert restores > 0 and len(fenced) >= restores
    engine.close()


def test_requests_with_penalties_take_turns_without_overlap() -> None:
    """Penalties read the whole history, which a pending token would leave one short: a
    running request with them makes each step wait for the one before; same tokens."""
    model = tiny_model()
    plain = _run(tiny_engine(model, prefill=24), _workload(3, penalties=True))
    engine = tiny_engine(model, prefill=24, overlap=True)
    got = _run(engine, _workload(3, penalties=True))
    assert got.results == plain.results
    assert engine.overlap_totals["overlap_waits"] > 0


def test_max_tokens_reached_in_flight_costs_no_extra_step() -> None:
    """A decode whose pending token is its last (max_tokens) is not scheduled again: the
    overlapped engine runs as many steps as the plain one, each overlapped with the one before
    it, except the first, and on CUDA (`--device cuda`) those next to a step that captures a
    graph: such a step runs alone (engine.py), landing the one in flight first (a wait), and
    the step after it has none in flight."""
    model = tiny_model()
    plain, engine = tiny_engine(model), tiny_engine(model, overlap=True)
    forwards, captures = [], []
    run, captures_first = engine.runner.run_prepared, engine.runner.captures
    engine.runner.run_prepared = lambda *a, **k: (forwards.append(1), run(*a, **k))[1]
    engine.runner.captures = lambda fb: (captures.append(captures_first(fb)), captures[-1])[1]
    for e in (plain, engine):
        e.generate([list(range(5, 25))], GREEDY)  # 1 prefill + 11 decode steps
    assert len(forwards) == plain.scheduler.steps == GREEDY.max_tokens
    assert len(captures) == GREEDY.max_tokens  # asked once a step
    # (step k - 1 captured, step k captures), k = 2..
    pairs = list(zip(captures, captures[1:], strict=False))
    assert engine.overlap_totals == {
        "overlapped_steps": sum(not before and not now for before, now in pairs),
        "overlap_waits": sum(now and not before for before, now in pairs),
    }


def test_forced_retractions_under_overlap() -> None:
    model = tiny_model()
    rng = random.Random(5)
    prompts = [_ids(rng, rng.randrange(5, 60)) for _ in range(6)]
    ref = tiny_engine(model, prefill=16).generate(prompts, GREEDY)
    engine = tiny_engine(model, prefill=16, retract_every=3, overlap=True)
    got = engine.generate(prompts, GREEDY)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert sum(r.retractions for r in got) > 0
    engine.checker.check_idle()


@MODES
@pytest.mark.parametrize("when", ["prefilling", "decoding"])
def test_an_abort_while_its_step_runs_gives_its_kv_back(when: str, mode) -> None:
    model = tiny_model()
    rng = random.Random(9)
    keep = [_ids(rng, 20), _ids(rng, 33)]
    doomed = _ids(rng, 120 if when == "prefilling" else 10)
    ref = tiny_engine(model, prefill=16).generate(keep, GREEDY)
    engine = tiny_engine(model, prefill=16, overlap=mode)
    rids = [engine.submit(ids, GREEDY) for ids in keep]
    victim = engine.submit(doomed, GREEDY)
    for _ in range(4):  # prefilling: its 120 tokens take 8 steps of 16
        engine.step()
    assert engine._in_flight is not None
    batch, _ = engine._in_flight
    assert victim in {s.req.rid for s in batch.seqs}  # a step computing for it is running
    assert engine.abort(victim)
    engine.run_until_idle()
    assert engine.take_result(victim).finish_reason is FinishReason.ABORT
    assert [engine.take_result(r).output_ids for r in rids] == [r.output_ids for r in ref]
    engine.checker.check_idle()


@MODES
def test_a_stop_token_ends_the_answer_while_the_next_step_runs(mode) -> None:
    """The step after the stop token is already running when the stop is seen: its token is
    dropped and the slot it wrote is given back (the every-step check sees the pool)."""
    model = tiny_model()
    prompt = list(range(5, 25))
    (free,) = tiny_engine(model).generate([prompt], GREEDY)
    stop = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[free.output_ids[4]])
    (ref,) = tiny_engine(model).generate([prompt], stop)
    engine = tiny_engine(model, overlap=mode)
    sid = engine.open_session()
    (got,) = engine.generate([prompt], stop, session_id=sid)
    assert got.output_ids == ref.output_ids == free.output_ids[: len(ref.output_ids)]
    assert got.finish_reason is FinishReason.STOP
    # the session holds exactly the answered history: its next turn sees nothing extra
    (turn2,) = engine.generate([[7, 8, 9]], GREEDY, session_id=sid)
    history = prompt + got.output_ids + [7, 8, 9]
    (full,) = tiny_engine(model, radix=False).generate([history], GREEDY)
    assert turn2.output_ids == full.output_ids
    engine.close_session(sid)
    engine.checker.check_idle()


@pytest.mark.parametrize(("speculate", "mode"), [(False, True), (True, True), (True, "inline")])
def test_the_served_engine_thread_runs_overlapped_steps(speculate: bool, mode) -> None:
    """Also with history and EAGLE drafts: verify steps run between the overlapped ones
    while submits arrive as commands (inline: every forward on the engine thread)."""
    model = tiny_model(num_hidden_layers=1, seed=3) if speculate else tiny_model()
    rng = random.Random(11)
    prompts = [_ids(rng, rng.randrange(5, 40)) for _ in range(5)]
    ref = tiny_engine(model).generate(prompts, GREEDY)
    spec = {"drafter": mimic_drafter, "history_drafts": True} if speculate else {}
    engine = tiny_engine(model, overlap=mode, **spec)
    if speculate:  # plain steps between the verifies, whatever the device's timings
        engine.speculative.policy = _Alternating()
    loop = EngineLoop(engine)
    loop.start()
    done, results = threading.Semaphore(0), {}

    def listener(event: StepEvent) -> None:
        if event.result is not None:
            results[event.rid] = event.result.output_ids
            done.release()

    submits = [loop.call(lambda p=p: engine.submit(p, GREEDY, listener=listener)) for p in prompts]
    rids = [f.result(timeout=30) for f in submits]
    for _ in prompts:
        assert done.acquire(timeout=60)
    loop.stopping = True
    loop.wake.set()
    loop.join(timeout=30)
    assert [results[r] for r in rids] == [r.output_ids for r in ref]
    assert not engine.has_work()
    assert engine.overlap_totals["overlapped_steps"] > 0
    assert (engine.spec_stats.steps > 0) == speculate
    engine.checker.check_idle()
    engine.close()


@pytest.mark.gpu
def test_overlap_on_cuda_with_graphs_gives_the_same_tokens() -> None:
    """On a GPU the forward thread replays the decode graphs and the extend graphs."""
    model = tiny_model()
    plain = _run(tiny_engine(model, device="cuda", prefill=24), _workload(4))
    engine = tiny_engine(model, device="cuda", prefill=24, overlap=True)
    got = _run(engine, _workload(4))
    assert got.results == plain.results
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    assert engine.overlap_totals["overlapped_steps"] > 0
    engine.close()


def test_the_forward_thread_never_reads_a_token_back(monkeypatch) -> None:
    """Under overlap the forward thread leaves each step's tokens on the device (the next step
    reads them there) and only starts their copy to the host; the engine thread waits for it
    when the step lands. On a GPU this is what lets step N+1 launch while step N runs: a read
    on the forward thread would wait for the device every step."""
    readers: list[str] = []
    to_host = DeviceSample.to_host

    def recorded(self):
        readers.append(threading.current_thread().name)
        return to_host(self)

    monkeypatch.setattr(DeviceSample, "to_host", recorded)
    model = tiny_model()
    plain = _run(tiny_engine(model, prefill=24), _workload(2))
    readers.clear()
    engine = tiny_engine(model, prefill=24, overlap=True)
    got = _run(engine, _workload(2))
    assert got.results == plain.results and got.reasons == plain.reasons
    assert engine.overlap_totals["overlapped_steps"] > 0
    assert readers and not any(name.startswith("sessionserve-forward") for name in readers)
    engine.close()


def test_waiting_for_the_launch_runs_the_next_step_before_the_last_lands() -> None:
    """`Engine.await_launch` (an experiment, off by default: engine.py): the engine thread
    waits for the step it submitted to have run on the forward thread (on a GPU: been
    launched) before it lands the one before. Forced on, every step that lands with the next
    one in flight finds it already run, and the tokens are the same (without the wait, on a
    CPU, step n lands while n + 1 computes)."""
    model = tiny_model()
    plain = _run(tiny_engine(model, prefill=24), _workload(1))
    engine = tiny_engine(model, prefill=24, overlap=True)
    engine.await_launch = True
    ran: set[int] = set()
    landings: list[bool] = []  # per landing with the next step in flight: had it run?
    run, complete = engine.forwards._run, engine._complete

    def recorded_run(batch, *a, **k):
        out = run(batch, *a, **k)
        ran.add(batch.step)
        return out

    def recorded_complete(batch, *a, **k):
        nxt = engine._in_flight
        if nxt is not None and nxt[0].step == batch.step + 1:
            landings.append(batch.step + 1 in ran)
        return complete(batch, *a, **k)

    engine.forwards._run, engine._complete = recorded_run, recorded_complete
    got = _run(engine, _workload(1))
    assert got.results == plain.results and got.reasons == plain.reasons
    assert engine.overlap_totals["overlapped_steps"] > 0
    assert landings and all(landings)
    engine.close()


@pytest.mark.gpu
@MODES
@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_the_forward_thread_never_waits_for_the_gpu(backend: str, mode) -> None:
    """With graphs captured (a first pass), a second pass of the same workload runs under
    `torch.cuda.set_sync_debug_mode("error")`: any operation that would make a thread wait for
    the device through torch (a token read back, a copy from pageable memory, FlashInfer's
    blocking copy of host page ids) raises. Event waits (the engine thread landing a step, a
    plan fence) are not such operations. Answers: fp32 (torch backend) equal the plain
    engine's; bf16 (FlashInfer) equal the pass's before it, once the graphs all replay (the
    first pass's capturing steps ran outside a graph, whose kernels round bf16 differently:
    on an H100 one answer of four differed from the second pass's). Inline, the launch is the
    engine thread's, and it must not wait either."""
    import torch

    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
        model = tiny_model(hidden_size=256, num_attention_heads=4).to(torch.bfloat16)
    else:
        model = tiny_model()
    # no radix cache: the second pass prefills, batches and replays exactly as the first
    engine = tiny_engine(
        model, device="cuda", backend=backend, prefill=24, overlap=mode, radix=False
    )
    assert engine.runner.backend.name == backend
    _run(engine, _workload(4, sampled=False))  # captures the graphs the next passes replay
    first = _run(engine, _workload(4, sampled=False))
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _run(engine, _workload(4, sampled=False))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if backend == "torch":
        plain = _run(tiny_engine(model, device="cuda", prefill=24), _workload(4, sampled=False))
        assert got.results == plain.results
    assert got.results == first.results and got.reasons == first.reasons
    assert engine.overlap_totals["overlapped_steps"] > 0 and engine.runner.graphs.replays > 0
    engine.close()


class _Alternating(SpecPolicy):
    """Drafts every other step, whatever the timings: with an EAGLE head every decode would
    verify, and verifies run eagerly, so without plain steps no decode graph would replay
    (the H100 run on 2026-11-27 saw 0 replays)."""

    calls = 0

    def choose(self, num_decodes: int, owed_positions: int = 0) -> bool:
        self.calls += 1
        return self.calls % 2 == 0


@pytest.mark.gpu
def test_speculation_under_overlap_on_cuda_with_graphs() -> None:
    """A landed step's hidden states are read after the next step's decode graph may have
    replayed into the same buffer (the forward thread hands out a copy)."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    plain = _run(tiny_engine(model, device="cuda", prefill=24), _workload(1, sampled=False))
    engine = tiny_engine(model, device="cuda", drafter=mimic_drafter, prefill=24, overlap=True)
    engine.speculative.policy = _Alternating()
    got = _run(engine, _workload(1, sampled=False))
    assert got.results == plain.results
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    assert engine.spec_stats.steps > 0 and engine.overlap_totals["overlapped_steps"] > 0
    engine.close()


def test_the_heads_catch_up_graphs_are_captured_only_with_no_step_in_flight() -> None:
    """Under overlap a step's EAGLE catch-up runs when it lands, maybe while the next step's
    forward runs on the forward thread; a graph capture then would break that forward (a
    stream capture forbids other threads' device work). So the engine tells the head when
    nothing is in flight (`may_capture`), and `CatchUpGraphs` builds a new shape only then,
    else catches up eagerly (its static path stands in for the graphs here). Answers stay
    the plain engine's either way."""
    from sessionserve.replicas.attention.torch_backend import TorchPagedBackend
    from sessionserve.replicas.speculative.catch_up_graphs import CatchUpGraphs

    model = tiny_model(num_hidden_layers=1, seed=3)
    plain = _run(tiny_engine(model, prefill=24), _workload(1, sampled=False))
    engine = tiny_engine(model, drafter=mimic_drafter, prefill=24, overlap=True)
    engine.speculative.policy = _Alternating()
    eagle = engine.speculative.eagle
    graphs = eagle.catch_up_graphs = CatchUpGraphs(
        eagle, (1, 2, 4, 8), TorchPagedBackend(), eagle.num_drafts + 1, capture=False
    )
    seen = []  # (a step in flight, the head may capture) at each catch-up
    run = graphs.run
    graphs.run = lambda e: (
        seen.append((engine._in_flight is not None, eagle.may_capture())),
        run(e),
    )[1]
    got = _run(engine, _workload(1, sampled=False))
    assert got.results == plain.results
    assert {flight for flight, _ in seen} == {True, False}  # both happened
    assert all(may != flight for flight, may in seen)
    assert graphs.replays > 0 and engine.overlap_totals["overlapped_steps"] > 0
    # with every step's catch-up told not to capture: no shape is built, all go eagerly
    graphs.graphs.clear()
    eagle.may_capture = lambda: False
    replays = graphs.replays
    again = _run(engine, _workload(1, sampled=False))
    assert again.results == plain.results
    assert not graphs.graphs and graphs.replays == replays
    engine.checker.check_idle()
    engine.close()


@pytest.mark.parametrize(("seed", "mode"), [(0, True), (5, True), (5, "inline")])
def test_speculation_under_overlap_gives_the_plain_engines_tokens(seed: int, mode) -> None:
    """EAGLE and history drafts with overlap scheduling, over sessions and plain requests
    with stops, EOS and max_tokens landing inside verified runs: greedy answers are the
    plain engine's (no speculation, no overlap), with the every-step memory check. Steps
    without drafts overlapped; each verify waited for the step before it."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    plain = _run(tiny_engine(model, prefill=24), _workload(seed, sampled=False))
    engine = tiny_engine(
        model, drafter=mimic_drafter, history_drafts=True, prefill=24, overlap=mode
    )
    # both sources' accounting under overlap is what is checked: history drafts wherever
    # they offer (its rare matches would otherwise lose to a head this good; the choice by
    # records is test_history_drafts.py's)
    engine.speculative._expected = lambda req, source, n: float(source == "history")
    got = _run(engine, _workload(seed, sampled=False))
    assert got.results == plain.results
    assert got.reasons == plain.reasons
    stats = engine.spec_stats
    assert stats.steps > 0 and stats.accepted > 0
    assert set(engine.speculative.by_source) == {"eagle", "history"}
    assert engine.overlap_totals["overlapped_steps"] > 0
    assert engine.overlap_totals["overlap_waits"] > 0
    engine.close()


def test_a_step_that_captures_a_graph_runs_with_nothing_beside_it() -> None:
    """While a CUDA graph is captured no other thread may use the device, and under overlap
    the engine thread runs the EAGLE head's catch-up for the landed step while the next step
    computes (the CUDA version of this workload failed on an H100 once its decode graphs
    replayed; its error was not kept, and this is the conflict it had). Here the decode
    graphs' static path stands in for the graphs, claiming a capture on each bucket's first
    use: every such forward starts after the catch-ups before it ended and none starts while
    it runs; answers equal the plain engine's."""
    from sessionserve.replicas.cuda_graphs import DecodeGraphs

    model = tiny_model(num_hidden_layers=1, seed=3)
    plain = _run(tiny_engine(model, prefill=24), _workload(1, sampled=False))
    engine = tiny_engine(model, drafter=mimic_drafter, prefill=24, overlap=True)
    engine.speculative.policy = _Alternating()
    runner, spec = engine.runner, engine.speculative
    graphs = runner.graphs = DecodeGraphs(runner, (1, 2, 4, 8, 16, 32), capture=False)
    seen: set[int] = set()
    log: list[tuple[str, bool]] = []  # ("forward" | "catch_up", start?) in time order

    def first_of_bucket(fb) -> bool:
        key = graphs._key(fb)
        return key is not None and key[0] not in seen

    graphs.needs_capture = first_of_bucket

    def timed(name, inner, capturing=lambda *a: True):
        def call(*args, **kwargs):
            mark = capturing(*args)
            if mark:
                log.append((name, True))
            try:
                return inner(*args, **kwargs)
            finally:
                if mark:
                    log.append((name, False))
                    if name == "forward":
                        seen.add(graphs._key(args[1])[0])

        return call

    runner.run_prepared = timed(
        "forward", runner.run_prepared, lambda b, fb, _: runner.captures(fb)
    )
    spec.catch_up = timed("catch_up", spec.catch_up)
    got = _run(engine, _workload(1, sampled=False))
    assert got.results == plain.results
    assert len(seen) >= 2  # buckets captured
    open_catch_ups, capturing = 0, False
    for name, start in log:
        if name == "catch_up":
            assert not capturing, "a catch-up ran while a graph was captured"
            open_catch_ups += 1 if start else -1
        elif start:
            assert open_catch_ups == 0, "a graph was captured while a catch-up ran"
            capturing = True
        else:
            capturing = False
    engine.close()


def test_sampled_requests_speculate_under_overlap_and_keep_their_lengths() -> None:
    """Seeded sampled requests beside greedy ones (the acceptance test is the plain
    engine's: test_speculative_sampling.py checks its distribution): every request ends as it
    should (max_tokens, or a stop or EOS it sampled) and the memory check holds."""
    model = tiny_model(num_hidden_layers=1, seed=3)
    work = _workload(2)
    engine = tiny_engine(model, drafter=mimic_drafter, prefill=24, overlap=True)
    got = _run(engine, work)
    params = {}
    for c, turns in enumerate(work.conversations):
        params.update((f"c{c}.{t}", p) for t, (_, p) in enumerate(turns))
    for step, reqs in work.plain.items():
        params.update((f"p{step}.{i}", p) for i, (_, p) in enumerate(reqs))
    assert set(got.results) == set(params)
    for name, ids in got.results.items():
        p = params[name]
        if got.reasons[name] is FinishReason.LENGTH:
            assert len(ids) == p.max_tokens
        else:
            assert got.reasons[name] is FinishReason.STOP and len(ids) <= p.max_tokens
    assert any(not p.is_greedy for p in params.values())
    assert engine.spec_stats.steps > 0
    engine.close()


@pytest.mark.parametrize(
    "pending",
    [
        [(0, "a"), (1, "b"), (2, "c")],  # a steady decode batch: views, no copies
        [(0, "b"), (1, "a"), (2, "c")],  # reordered
        [(0, "a"), (1, "b")],  # one ended: the first rows still
        [(0, "a"), (1, "c")],  # one ended in the middle
        [(0, "a"), (1, "x"), (2, "c")],  # one the last step did not sample: reads 0
        [(0, "a"), (1, "b"), (2, "c"), (3, "x")],  # the same, where its pick would be row 3
        [(3, "a"), (4, "b"), (5, "c")],  # after a prefill chunk's tokens
        [(0, "a"), (5, "b"), (9, "c")],  # between other sequences' tokens
        [(300, "a"), (301, "b"), (302, "c")],  # past the kept arange's first size
    ],
)
def test_the_pending_tokens_land_where_the_batch_reads_them(pending) -> None:
    """The tokens the step in flight samples reach this step's input ids, each at its
    request's place, whether the batch is the last one again (views) or not (copies)."""
    from sessionserve.replicas.step import ForwardBatch, LastSampled

    eng = tiny_engine(overlap=True)
    try:
        runner = eng.runner
        sampled = {"a": 11, "b": 22, "c": 33}
        tokens = torch.tensor(list(sampled.values()), device=runner.device)
        runner.last_sampled = LastSampled(tokens, {r: i for i, r in enumerate(sampled)})
        fb = ForwardBatch(*(torch.zeros(1) for _ in range(3)), [], torch.zeros(1))
        fb.pending_ids = runner._pending_ids(pending)
        ids = fb.device_ids(torch.full((400,), -1, device=runner.device)).cpu()
        expected = torch.full((400,), -1)
        for place, rid in pending:
            expected[place] = sampled.get(rid, 0)
        assert torch.equal(ids, expected)
    finally:
        eng.close()
