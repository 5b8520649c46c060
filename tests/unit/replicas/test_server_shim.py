"""The replica shim without Ray: streaming, tokenization, disconnect abort, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from sessionserve.replicas.server import ReplicaServer
from sessionserve.wire import GenerateCall, SamplingParams, TurnResult
from tests.models import save_tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model(d)
    srv = ReplicaServer(
        {
            "model": {"path": str(d)},
            "memory_check": "every_step",
            "cache": {"page_size": 4, "num_slots": 2048, "max_rows": 16, "max_context_len": 1024},
        }
    )
    yield srv
    srv.shutdown()


async def _collect(gen):
    return [piece async for piece in gen]


def test_stream_deltas_add_up_to_the_answer(server) -> None:
    call = GenerateCall(
        {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True}, prompt="w5 w6 w7"
    )
    pieces = asyncio.run(_collect(server.generate(call)))
    final = pieces[-1]
    assert "".join(p.text for p in pieces[:-1]) == final.text
    assert sum(len(p.token_ids) for p in pieces[:-1]) == final.completion_tokens == 6
    assert sum(len(p.logprobs) for p in pieces[:-1]) == 6
    assert final.log_base == 0 and final.log_tail == [5, 6, 7] + final.output_ids


def test_a_batched_stream_sends_the_first_token_at_once_and_the_same_answer(server) -> None:
    """With `stream_interval_ms`, the tokens after the first go merged, at most that often:
    the first delta is one token (time to first token unchanged), a long interval leaves one
    more delta before the final record, and tokens, text and logprobs equal the unbatched
    stream's."""
    call = GenerateCall(
        {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True},
        prompt="w5 w6 w7",
    )
    plain = asyncio.run(_collect(server.generate(call)))
    server.stream_interval_s = 60.0  # longer than the turn: only its end flushes
    try:
        batched = asyncio.run(_collect(server.generate(call)))
    finally:
        server.stream_interval_s = 0.0
    assert len(batched) == 3
    first, rest, final = batched
    assert len(first.token_ids) == 1 and len(rest.token_ids) == 11
    assert first.token_ids + rest.token_ids == [t for p in plain[:-1] for t in p.token_ids]
    assert first.text + rest.text == "".join(p.text for p in plain[:-1]) == final.text
    assert first.logprobs + rest.logprobs == [lp for p in plain[:-1] for lp in p.logprobs]
    assert final.output_ids == plain[-1].output_ids


def test_a_turns_time_to_first_token_counts_its_wait_for_the_engine_thread(server) -> None:
    """A served request reaches the engine as a command that waits for the step in flight;
    its time to first token (and queue time) count from its arrival at the replica, so they
    include that wait. Here the engine thread is kept busy for 0.3 s by a command queued
    first: the turn's TTFT is at least that, where counted from `Engine.submit` it was not.
    The busy command starts its 0.3 s once the turn has arrived (before, it could start
    first, and the turn then waited a little less than 0.3 s)."""
    import threading
    import time

    arrived = threading.Event()
    busy = server.loop.call(lambda: (arrived.wait(10), time.sleep(0.3)))
    call = GenerateCall({"max_tokens": 2, "temperature": 0, "ignore_eos": True}, prompt="w5")

    async def turn():
        task = asyncio.ensure_future(_collect(server.generate(call)))
        await asyncio.sleep(0)  # the turn's first step ran: its arrival is stamped
        arrived.set()
        return await task

    final = asyncio.run(turn())[-1]
    busy.result()
    assert final.ttft_s is not None and final.ttft_s >= 0.3


def test_the_message_budget_stretches_the_interval_with_the_live_streams() -> None:
    from sessionserve.replicas.server import stream_interval

    assert stream_interval(0.05, 1, 50.0) == 0.05  # few streams: the configured interval
    assert stream_interval(0.05, 2, 50.0) == 0.05
    assert stream_interval(0.05, 8, 50.0) == pytest.approx(0.16)  # 8 x 6.25 a second
    assert stream_interval(0.05, 32, 50.0) == pytest.approx(0.64)
    assert stream_interval(0.05, 32, 0.0) == 0.05  # no budget
    assert stream_interval(0.0, 1, 50.0) == pytest.approx(0.02)


def test_the_app_hands_the_replica_its_stream_budget() -> None:
    from sessionserve.app import build_app

    def replica_kwargs(args: dict) -> dict:
        app = build_app(args)
        return app._bound_deployment.init_args[0]._bound_deployment.init_kwargs  # Ingress(r, c)

    kwargs = replica_kwargs({"replica": {"stream_interval_ms": 30, "stream_messages_per_s": 20}})
    assert kwargs["stream_interval_ms"] == 30
    assert kwargs["stream_messages_per_s"] == 20
    # auto: a budget where the forward shares the host's cores, none beside a GPU (where 50
    # messages a second for 256 streams would send each one every 5 s)
    assert replica_kwargs({})["stream_messages_per_s"] == 50
    gpu = {"engine": {"model": {"device": "cuda"}}}
    assert replica_kwargs(gpu)["stream_messages_per_s"] == 0
    assert (
        replica_kwargs(gpu | {"replica": {"stream_messages_per_s": 400}})["stream_messages_per_s"]
        == 400
    )


def test_a_request_that_fails_alone_raises_a_typed_500_for_its_caller(server, monkeypatch):
    from sessionserve.errors import RequestFailedError
    from sessionserve.replicas.stopping import StopChecker

    def broken(self, req):
        raise RuntimeError("a stop-check bug")

    monkeypatch.setattr(StopChecker, "check", broken)
    call = GenerateCall({"max_tokens": 4, "temperature": 0}, prompt=[5, 6])
    with pytest.raises(RequestFailedError, match="stopped alone") as err:
        asyncio.run(_collect(server.generate(call)))
    assert err.value.status_code == 500 and "Traceback" not in str(err.value)
    monkeypatch.undo()
    ok = asyncio.run(_collect(server.generate(call)))[-1]  # the replica serves on
    assert ok.completion_tokens > 0
    assert server.loop.error is None


def test_append_mode_builds_on_the_history_it_is_given(server) -> None:
    call = GenerateCall(
        {"max_tokens": 2, "temperature": 0}, session_id="s", prompt=[9], history_ids=[5, 6, 7, 8]
    )
    final = asyncio.run(_collect(server.generate(call)))[-1]
    assert final.prompt_tokens == 5  # the log it was given is kept: the directory appends
    assert final.log_base == 4 and final.log_tail == [9] + final.output_ids


def test_a_cancelled_stream_aborts_its_request(server) -> None:
    async def read_two_then_cancel():
        gen = server.generate(
            GenerateCall({"max_tokens": 900, "ignore_eos": True}, session_id="c", prompt=[5, 6])
        )
        await gen.__anext__()
        await gen.__anext__()
        await gen.aclose()  # what Serve does when the client goes away

    asyncio.run(read_two_then_cancel())
    outputs = server.engine.outputs
    assert not outputs.requests and not outputs.results  # nothing kept behind
    terms = asyncio.run(server.memory_check())
    assert terms["live_requests"] == 0
    server.check_health()


def test_a_stream_cancelled_again_at_every_await_still_aborts_its_request(server) -> None:
    """In an ASGI app (the colocated ingress) a client that goes away cancels an anyio cancel
    scope, which cancels the task again at each await, the stream's cleanup included: its
    abort must still reach the engine thread (a cancelled command is skipped there)."""
    import anyio

    async def read_two_then_leave():
        gen = server.generate(GenerateCall({"max_tokens": 900, "ignore_eos": True}, prompt=[5, 6]))
        with anyio.CancelScope() as scope:
            await gen.__anext__()
            await gen.__anext__()
            scope.cancel()
            await gen.__anext__()  # cancelled here, and at the abort's await after it
        await gen.aclose()

    asyncio.run(read_two_then_leave())
    terms = asyncio.run(server.memory_check())  # queued after the abort: it has run
    assert terms["live_requests"] == 0 and not server.engine.outputs.requests
    server.check_health()


def test_shutdown_aborts_what_is_still_running(tmp_path) -> None:
    save_tiny_model(tmp_path)
    srv = ReplicaServer({"model": {"path": str(tmp_path)}})
    rid = srv.engine.submit([5, 6], SamplingParams(max_tokens=3000, ignore_eos=True))
    srv.shutdown()
    srv.loop.join(10)
    assert not srv.loop.is_alive()
    assert srv.engine.take_result(rid).finish_reason.value == "abort"


def test_the_event_loop_never_waits_for_a_forward(tmp_path) -> None:
    """With a forward stuck on the engine thread, the replica's asyncio loop still runs: it
    answers routing stats, queues a second request, and both finish once the forward does."""
    import threading

    save_tiny_model(tmp_path)
    srv = ReplicaServer({"model": {"path": str(tmp_path)}, "memory_check": "every_step"})
    runner, entered, release = srv.engine.runner, threading.Event(), threading.Event()
    real_forward = runner.forward

    def stuck_forward(batch):
        entered.set()
        release.wait()
        return real_forward(batch)

    runner.forward = stuck_forward
    call = lambda p: GenerateCall({"max_tokens": 3, "temperature": 0}, prompt=p)  # noqa: E731

    async def scenario():
        first = asyncio.create_task(_collect(srv.generate(call("w5 w6"))))
        await asyncio.to_thread(entered.wait)  # the engine thread is inside the forward
        stats = srv.record_routing_stats()  # answered without the engine thread
        second = asyncio.create_task(_collect(srv.generate(call("w7 w8 w9"))))
        for _ in range(5):
            await asyncio.sleep(0)  # the loop keeps turning
        assert not first.done() and not second.done() and not release.is_set()
        release.set()
        return stats, await first, await second

    try:
        stats, a, b = asyncio.run(scenario())
        assert stats["queue_len"] == 1 and stats["free_kv_tokens"] > 0
        assert a[-1].completion_tokens == b[-1].completion_tokens == 3
    finally:
        release.set()
        srv.shutdown()


def test_a_dead_engine_thread_fails_calls_instead_of_hanging(tmp_path) -> None:
    from sessionserve.errors import EngineUnavailableError

    save_tiny_model(tmp_path)
    srv = ReplicaServer({"model": {"path": str(tmp_path)}})

    def crash(batch):
        raise RuntimeError("boom")

    srv.engine.runner.forward = crash
    with pytest.raises(EngineUnavailableError, match="boom"):  # a 503 at once, never a hang
        asyncio.run(_collect(srv.generate(GenerateCall({"max_tokens": 2}, prompt="w5"))))
    srv.loop.join(10)
    assert isinstance(srv.loop.error, RuntimeError)
    with pytest.raises(EngineUnavailableError):
        srv.loop.call(srv.engine.has_work)
    with pytest.raises(RuntimeError, match="engine loop died"):
        srv.check_health()


def _final(server, call: GenerateCall) -> TurnResult:
    return asyncio.run(_collect(server.generate(call)))[-1]


def test_append_turns_extend_the_replicas_history_never_the_directorys_log(server, caplog):
    """Append mode end to end through the shim: only the new prompt goes in (with the length
    of the directory's log, not the log), the replica's history of the session is extended
    (its KV reused), the session opens with the TTL the call names, and a failover log that
    disagrees is reported and not used to rewrite it. What the directory is sent is what the
    turn adds to its log, or the whole log when the directory's disagreed."""
    greedy = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    sid = "append-shim"
    t1 = _final(server, GenerateCall(greedy, sid, "append", prompt=[5, 6, 7], ttl_s=42.0))
    assert t1.log_base == 0 and t1.log_tail == [5, 6, 7] + t1.output_ids
    assert server.engine.session_info(sid).ttl_s == 42.0  # not the configured default
    caplog.set_level("WARNING", logger="sessionserve.replicas.sessions")
    call = GenerateCall(greedy, sid, "append", prompt=[8, 9], log_tokens=t1.log_len)
    t2 = _final(server, call)
    assert t2.log_base == t1.log_len and t2.log_tail == [8, 9] + t2.output_ids
    assert t2.cached_source == "session" and t2.cached_tokens >= t1.log_len - 1
    log2 = t1.log_tail + t2.log_tail
    assert "differs" not in caplog.text  # the log agrees: nothing to report
    short = GenerateCall(greedy, sid, "append", prompt=[10], log_tokens=3)  # a lost commit
    t3 = _final(server, short)
    assert t3.log_base == 0 and t3.log_tail[: len(log2)] == log2  # the whole log: it differed
    assert "(3 tokens) differs from this replica's history" in caplog.text
    stale = GenerateCall(greedy, sid, "append", prompt=[11], history_ids=[1, 2, 3])
    t4 = _final(server, stale)
    assert t4.log_base == 0 and t4.log_tail[: t3.log_len] == t3.log_tail  # not [1, 2, 3]
    server.engine.close_session(sid)


def test_an_append_turn_on_a_replica_without_the_session_starts_from_its_log(server) -> None:
    """Failover: the replica opens the session from the directory's token log; the turn
    answers as a sessionless request over log + prompt does."""
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    log = [5, 9, 14, 3, 22, 7]
    call = GenerateCall(greedy, "moved-here", "append", prompt=[11, 12], history_ids=log)
    got = _final(server, call)
    ref = _final(server, GenerateCall(greedy, prompt=log + [11, 12]))
    assert got.log_base == len(log) and got.log_tail == [11, 12] + got.output_ids
    assert got.output_ids == ref.output_ids
    assert server.engine.session_info("moved-here").history_tokens == got.log_len
    server.engine.close_session("moved-here")


def test_a_replica_without_the_session_asks_for_its_log_and_changes_nothing(server) -> None:
    """An append turn carries only the log's length: a replica that lacks the session (failover,
    a reclaimed slot) refuses it before any work, so the ingress resends it with the log."""
    from sessionserve.errors import SessionLogNeededError

    greedy = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    call = GenerateCall(greedy, "elsewhere", "append", prompt=[11, 12], log_tokens=6)
    with pytest.raises(SessionLogNeededError, match="elsewhere"):
        _final(server, call)
    assert "elsewhere" not in server.engine.cache.session_slots  # not opened
    assert asyncio.run(server.memory_check())["live_requests"] == 0  # no KV taken
    new = GenerateCall(greedy, "brand-new", "append", prompt=[11, 12], log_tokens=0)
    assert _final(server, new).prompt_tokens == 2  # an empty log: opened here, no round trip
    server.engine.close_session("brand-new")


def test_a_quiet_replica_still_closes_sessions_past_their_ttl(server) -> None:
    """The engine thread reaps on its idle ticks too (it reaped only inside steps, so on a
    replica with no traffic an idle session held its KV past its TTL until the next request)."""
    import time

    greedy = {"max_tokens": 2, "temperature": 0}
    _final(server, GenerateCall(greedy, "short-lived", "append", prompt=[5, 6], ttl_s=0.2))
    assert server.engine.session_info("short-lived").held_tokens > 0
    deadline = time.monotonic() + 15
    while "short-lived" in server.engine.cache.session_slots and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "short-lived" not in server.engine.cache.session_slots
    assert not server.engine.has_work()


def test_chat_on_a_base_model_is_a_400_that_says_why(server, monkeypatch) -> None:
    """A base model (Gemma 3 270M's GGUF has no chat template) serves completions only."""
    from sessionserve.errors import InvalidRequestError

    monkeypatch.setattr(server.engine.tokenizer, "chat_template", None)
    call = GenerateCall(
        {"max_tokens": 2}, mode="chat", messages=[{"role": "user", "content": "w5"}]
    )
    with pytest.raises(InvalidRequestError, match="no chat template") as err:
        asyncio.run(_collect(server.generate(call)))
    assert err.value.param == "messages" and "/v1/completions" in str(err.value)
    assert server.engine.check_memory().in_flight == 0  # refused before any KV was taken
    prompt = GenerateCall({"max_tokens": 2, "temperature": 0}, prompt="w5 w6")
    assert asyncio.run(_collect(server.generate(prompt)))[-1].completion_tokens == 2


def _long_turn(session_id: str, caller: str, max_tokens: int = 900) -> GenerateCall:
    sampling = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return GenerateCall(sampling, session_id=session_id, prompt=[5, 6], caller=caller)


def test_a_turn_whose_caller_died_is_aborted(server, monkeypatch) -> None:
    """Ray lets a turn run on after its ingress's process died (no one reads it); the
    replica's caller watch aborts it, and its session keeps only what was committed."""
    from sessionserve.replicas.caller_watch import CallerWatch

    alive = {"ingress-a": True}
    monkeypatch.setattr(server, "callers", CallerWatch(alive.__getitem__, period_s=0.02))

    async def run() -> list:
        turn = server.generate(_long_turn("orphan", "ingress-a"))
        pieces = [await turn.__anext__()]
        alive["ingress-a"] = False  # its ingress was killed
        pieces += [piece async for piece in turn]  # what Ray would deliver to no one
        server.callers.stop()
        return pieces

    final = asyncio.run(run())[-1]
    assert final.finish_reason == "abort" and "ingress-a died" in final.finish_message
    assert final.completion_tokens < 900
    info = server.engine.session_info("orphan")
    assert info.history_tokens == 0 and not info.turn_in_flight  # nothing was committed
    assert not server.callers.callers
    assert asyncio.run(server.memory_check())["live_requests"] == 0
    server.engine.close_session("orphan")


def test_a_retry_takes_the_session_of_a_turn_whose_caller_died(server, monkeypatch) -> None:
    """A second turn while one runs is a 409, unless the running turn's caller died (the
    client retried through another ingress): that turn is aborted at once and the retry runs
    on the session as if it had never started."""
    from sessionserve.errors import SessionBusyError
    from sessionserve.replicas.caller_watch import CallerWatch

    alive = {"ingress-a": True, "ingress-b": True}
    # no periodic sweep: only the retry's arrival finds the dead caller
    monkeypatch.setattr(server, "callers", CallerWatch(alive.__getitem__, period_s=3600))

    async def run() -> tuple[list, list]:
        first = server.generate(_long_turn("retried", "ingress-a"))
        await first.__anext__()
        with pytest.raises(SessionBusyError):  # its caller lives: the second turn must wait
            await server.generate(_long_turn("retried", "ingress-b", 3)).__anext__()
        alive["ingress-a"] = False
        retry = [piece async for piece in server.generate(_long_turn("retried", "ingress-b", 3))]
        rest = [piece async for piece in first]
        server.callers.stop()
        return retry, rest

    retry, rest = asyncio.run(run())
    assert rest[-1].finish_reason == "abort"
    alone = asyncio.run(_collect(server.generate(_long_turn(None, None, 3))))  # sessionless
    assert retry[-1].finish_reason == "length"
    assert retry[-1].output_ids == alone[-1].output_ids  # nothing of the orphan remained
    assert server.engine.session_info("retried").history_tokens == 2 + 3
    assert asyncio.run(server.memory_check())["live_requests"] == 0
    server.engine.close_session("retried")


def test_the_caller_watch_asks_once_per_caller_and_names_the_dead_ones() -> None:
    from sessionserve.replicas.caller_watch import CallerWatch

    asked = []
    watch = CallerWatch(lambda caller: asked.append(caller) or caller != "gone")
    for rid, caller in [("r1", "gone"), ("r2", "live"), ("r3", "gone"), ("r4", None)]:
        watch.watch(rid, caller)
    assert asyncio.run(watch.orphans()) == {"gone": ["r1", "r3"]}
    assert sorted(asked) == ["gone", "live"]
    assert asyncio.run(watch.orphaned("r2")) is None and asyncio.run(watch.orphaned("r4")) is None
    watch.forget("r1")
    assert asyncio.run(watch.orphans()) == {"gone": ["r3"]}


def test_a_caller_whose_liveness_ray_does_not_answer_counts_as_alive(monkeypatch) -> None:
    """A GCS that is down must not hold a turn's answer, nor abort a live caller's turn."""
    import time

    from sessionserve.replicas import caller_watch

    monkeypatch.setattr(caller_watch, "ANSWER_WAIT_S", 0.05)
    watch = caller_watch.CallerWatch(lambda caller: time.sleep(0.5) or False)
    watch.watch("r1", "slow")
    assert asyncio.run(watch.orphaned("r1")) is None
    assert asyncio.run(watch.orphans()) == {}
