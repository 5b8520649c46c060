"""The Serve replica deployment: a thin shim around `Engine`.

The engine runs in a background thread (`EngineLoop`); requests come in on the replica's
asyncio loop, are submitted under the engine lock, and stream back through an asyncio queue fed
by the engine's listener. A cancelled stream (client disconnect) aborts its request, which keeps
what the session has committed. Tokenization happens here, next to the model's tokenizer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from sessionserve.config import EngineConfig
from sessionserve.errors import MemoryInvariantError
from sessionserve.metrics import RayEngineMetrics
from sessionserve.replicas.engine import Engine, StepEvent
from sessionserve.replicas.request import InvalidRequestError, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)
IDLE_TICK_S = 0.5  # while idle: check the idle invariant and refresh the gauges this often


@dataclass
class GenerateCall:
    """What the ingress sends a replica for one request."""

    sampling: dict[str, Any]
    session_id: str | None = None
    mode: Literal["append", "chat"] = "append"
    messages: list[dict[str, str]] | None = None  # chat: the whole conversation
    prompt: str | list[int] | None = None  # completions: text or ids (appended in a session)
    history_ids: list[int] | None = None  # append mode: the session's token log (directory)
    rid: str | None = None


class EngineLoop(threading.Thread):
    """Steps the engine while it has work; checks the idle invariant while it has none."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(name="sessionserve-engine", daemon=True)
        self.engine = engine
        self.wake = threading.Event()
        self.stopping = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopping:
                if self.engine.has_work():
                    self.engine.step()
                    continue
                if not self.wake.wait(IDLE_TICK_S):
                    self.engine.report_gauges()  # checks the invariant (idle form if idle)
                self.wake.clear()
        except BaseException as e:  # the replica reports it through check_health
            self.error = e
            log.exception("engine loop died")


class ReplicaServer:
    def __init__(self, engine_config: dict[str, Any]) -> None:
        cfg = EngineConfig.model_validate(engine_config)
        self.engine = Engine(cfg)
        self.loop = EngineLoop(self.engine)
        self.loop.start()
        try:
            from ray import serve

            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (tests, scripts): no metrics export
            self.replica_id = "local"
        else:
            self.engine.metrics = RayEngineMetrics(self.replica_id, self.engine.model_name)

    # ---- generation ----
    async def generate(self, call: GenerateCall) -> AsyncIterator[dict[str, Any]]:
        """Stream {"token_ids", "text"} deltas, then one {"final": ...} with the usage."""
        ids = self._input_ids(call)
        sampling = SamplingParams.build(**call.sampling)
        queue: asyncio.Queue[StepEvent] = asyncio.Queue()
        aio = asyncio.get_running_loop()
        rid = call.rid or uuid.uuid4().hex
        # The input is always complete (the ingress passes the session's token log for
        # append mode), so the cache reuses the longest prefix it holds and rewinds if the log
        # and the held KV ever disagree: the directory's log is the source of truth.
        self.engine.submit(
            ids,
            sampling,
            session_id=call.session_id,
            mode="chat",
            rid=rid,
            listener=lambda e: aio.call_soon_threadsafe(queue.put_nowait, e),
            open_missing=True,
        )
        self.loop.wake.set()
        done, out_ids, text_sent = False, [], ""
        try:
            while not done:
                event = await queue.get()
                done = event.result is not None
                out_ids += event.new_token_ids
                text = (event.result.text or "") if done else self._visible_text(out_ids, sampling)
                if event.new_token_ids or len(text) > len(text_sent):
                    yield {
                        "token_ids": event.new_token_ids,
                        "text": text[len(text_sent) :],
                        "logprobs": self._logprob_entries(event.new_logprobs),
                    }
                    text_sent = text
                if done:
                    yield {"final": _final(event, ids) | {"replica": self.replica_id}}
        finally:
            if not done:  # the caller went away: abort, keeping what the session committed
                self.engine.abort(rid, "client disconnected")

    def _visible_text(self, out_ids: list[int], sampling: SamplingParams) -> str:
        """The answer so far, minus a tail that might still become a stop string (so what is
        sent is always a prefix of the final answer)."""
        text = self.engine.tokenizer.decode(out_ids, skip_special_tokens=True)
        hold = max((len(s) - 1 for s in sampling.stop), default=0)
        return text[: max(0, len(text) - hold)]

    def _logprob_entries(self, lps: list[TokenLogprob]) -> list[tuple[str, float, list]]:
        tok = self.engine.tokenizer
        return [
            (tok.decode([lp.token_id]), lp.logprob, [(tok.decode([t]), v) for t, v in lp.top])
            for lp in lps
        ]

    def _input_ids(self, call: GenerateCall) -> list[int]:
        tok = self.engine.tokenizer
        if call.messages is not None:
            try:
                return list(
                    tok.apply_chat_template(
                        call.messages, add_generation_prompt=True, tokenize=True, return_dict=False
                    )
                )
            except Exception as e:  # a template that rejects the roles or order
                raise InvalidRequestError(f"messages: {e}", param="messages") from None
        prompt = call.prompt
        new = (
            list(prompt)
            if isinstance(prompt, list)
            else tok(prompt or "", add_special_tokens=False).input_ids
        )
        return (call.history_ids or []) + new

    # ---- sessions ----
    async def close_session(self, session_id: str) -> bool:
        try:
            return self.engine.close_session(session_id)
        except KeyError:
            return True  # never reached this replica (or expired here): nothing held

    async def session_held_tokens(self, session_id: str) -> int | None:
        try:
            return self.engine.session_info(session_id).held_tokens
        except KeyError:
            return None

    async def memory_check(self) -> dict[str, Any]:
        """Run the memory invariant now (idle or busy form) and return its terms."""
        return {"replica": self.replica_id, **self.engine.check_memory()._asdict()}

    # ---- Serve hooks ----
    def check_health(self) -> None:
        if self.loop.error is not None:
            raise RuntimeError(f"engine loop died: {self.loop.error!r}")
        if not self.loop.is_alive():
            raise RuntimeError("engine loop is not running")
        if self.engine.checker.failures:
            raise MemoryInvariantError("the memory invariant failed on this replica")

    def record_routing_stats(self) -> dict[str, Any]:
        e = self.engine
        with e.lock:
            return {
                "ts": time.time(),  # lets the router tell a fresh report from a repeated one
                "free_kv_tokens": e.cache.reclaimable_size(),
                "held_tokens": sum(e.cache.slot_held_tokens(s) for s in e.cache.idle_slots()),
                "open_sessions": len(e.cache.session_slots),
                "queue_len": len(e.scheduler.waiting) + len(e.scheduler.running),
            }

    def __del__(self) -> None:
        """Serve calls this after its graceful drain (in-flight requests get
        `graceful_shutdown_timeout_s` to finish); whatever is still running is aborted, so
        streams end with finish_reason "abort" and sessions keep their committed turns."""
        loop = getattr(self, "loop", None)
        if loop is None:
            return
        with self.engine.lock:
            leftovers = list(self.engine.requests)
        for rid in leftovers:
            try:
                self.engine.abort(rid, "replica shutting down")
            except RuntimeError:  # the replica's event loop is already closed
                pass
        loop.stopping = True
        loop.wake.set()


def _final(event: StepEvent, input_ids: list[int]) -> dict[str, Any]:
    r = event.result
    return {
        "finish_reason": r.finish_reason.value,
        "finish_message": r.finish_message,
        "text": r.text,
        "output_ids": r.output_ids,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "cached_source": r.cached_source,
        "spec_drafted": r.spec_drafted,
        "spec_accepted": r.spec_accepted,
        "ttft_s": r.ttft_s,
        "full_ids": input_ids + r.output_ids,
    }
