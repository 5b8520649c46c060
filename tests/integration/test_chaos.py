"""Chaos on real Ray Serve (loopback, bounded): 16 sessions x 6 chat turns through the
official `openai` client while the test kills, in turn, a model replica, the session
directory's two shards (one restarted by Ray, one for good: each comes back from its own
store prefix) and an ingress replica. A client
retries a turn that failed with a retryable status. Afterwards every session's transcript on
the server equals what its client received, no committed turn is lost, every failure was
retryable, and the strict memory invariant holds on every replica. What each kill cost is
printed (and recorded in docs/benchmarks.md). A turn whose ingress is killed under it is
aborted on its replica, so that the client's retry finds its session free."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import app_args, extra_app, replica_memory, serve_actor_names
from tests.models import word_tokenizer

pytestmark = pytest.mark.ray
CHAOS_APP = "chaos"
SHARDS = 2  # the directory's actors
SESSIONS, TURNS = 16, 6
# 500 only as Ray Serve's proxy answers (plain text) when the ingress replica it called died
RETRYABLE = {500, 502, 503, 504}


@pytest.fixture(scope="module")
def chaos(served):

    args = app_args(served["model_dir"])
    # the main app holds 1.5 of the cluster's 2 CPUs: this one must fit in the rest
    args["replica"].update(num_replicas=2, num_cpus=0.15)
    args["ingress"].update(num_replicas=2, num_cpus=0.05)
    args["engine"]["sessions"]["implicit_open"] = True
    args["directory"] = {"shards": SHARDS}  # each shard is killed once below
    with extra_app(served, CHAOS_APP, args) as base:
        yield base


def directory_shard(shard: int):
    import ray

    from sessionserve.directory.client import directory_name

    return ray.get_actor(directory_name(CHAOS_APP, shard, SHARDS), namespace="sessionserve")


def serve_actors(deployment: str) -> list:
    import ray

    names = serve_actor_names(f"SERVE_REPLICA::{CHAOS_APP}#{deployment}#")
    return [ray.get_actor(n, namespace="serve") for n in names]


class Conversation:
    """One session's client: sends each turn until it succeeds (retrying retryable failures)
    and keeps what it received."""

    def __init__(self, base: str, index: int) -> None:
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        self.sid = f"chaos-{index}"
        self.index = index
        self.messages: list[dict] = []
        self.failures: list[int | str] = []
        self.failed_at: list[float] = []
        self.turns: list[tuple[float, float, int, int, int]] = []  # start, end, t, prompt, cached

    def turn(self, t: int) -> None:
        self.messages.append({"role": "user", "content": f"w{10 + self.index} w{60 + t}"})
        start = time.monotonic()
        for _ in range(60):
            try:
                out = self.client.chat.completions.create(
                    model=None,
                    messages=self.messages,
                    max_tokens=4,
                    temperature=0,
                    extra_headers={"x-session-id": self.sid},
                )
            except openai.APIStatusError as e:
                self.failures.append(e.status_code)
                self.failed_at.append(time.monotonic())
                assert e.status_code in RETRYABLE, (e.status_code, e.body)
                if e.status_code == 500:  # only Serve's proxy (plain text), never one of ours
                    assert not isinstance(e.body, dict), e.body
                time.sleep(0.5)
                continue
            except openai.APIConnectionError:
                self.failures.append("connection")
                self.failed_at.append(time.monotonic())
                time.sleep(0.5)
                continue
            self.messages.append({"role": "assistant", "content": out.choices[0].message.content})
            usage = out.usage
            cached = usage.prompt_tokens_details.cached_tokens
            self.turns.append((start, time.monotonic(), t, usage.prompt_tokens, cached))
            return
        raise AssertionError(f"{self.sid}: turn {t} never succeeded: {self.failures}")


def test_kills_lose_no_committed_turn(chaos) -> None:
    import ray

    conversations = [Conversation(chaos, i) for i in range(SESSIONS)]
    kills: list[tuple[str, float]] = []
    done = threading.Event()

    def killer() -> None:
        plan = [
            ("model replica", lambda: ray.kill(serve_actors("SessionReplica")[0])),
            (
                "directory shard 0 (restarted)",
                lambda: ray.kill(directory_shard(0), no_restart=False),
            ),
            ("directory shard 1 (for good)", lambda: ray.kill(directory_shard(1))),
            ("ingress replica", lambda: ray.kill(serve_actors("Ingress")[0])),
        ]
        for i, (what, kill) in enumerate(plan):
            # spread the kills over the workload: at 15%, 35%, 55% and 75% of the turns
            threshold = int(SESSIONS * TURNS * (0.15 + 0.2 * i))
            while completed[0] < threshold and not done.is_set():
                time.sleep(0.05)
            if done.is_set():
                return
            kill()
            kills.append((what, time.monotonic()))

    completed, lock = [0], threading.Lock()

    def converse(c: Conversation) -> None:
        for t in range(TURNS):
            c.turn(t)
            with lock:
                completed[0] += 1
            time.sleep(0.3)

    started = time.monotonic()
    chaos_thread = threading.Thread(target=killer)
    chaos_thread.start()
    with ThreadPoolExecutor(SESSIONS) as pool:
        list(pool.map(converse, conversations))
    done.set()
    chaos_thread.join()
    elapsed = time.monotonic() - started
    assert len(kills) == 4, f"the workload ended before every kill: {kills}"

    # every transcript on the server equals what its client received
    tok = word_tokenizer()
    with httpx.Client(base_url=chaos, timeout=60) as http:
        for c in conversations:
            view = http.get(f"/v1/sessions/{c.sid}", params={"include_history": "true"}).json()
            prompt = tok.apply_chat_template(
                c.messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            assert view["history"][: len(prompt)] == list(prompt), c.sid
            answer = tok.decode(view["history"][len(prompt) :], skip_special_tokens=True)
            assert answer == c.messages[-1]["content"], c.sid
            # no committed turn lost or counted twice (a turn retried after its answer was
            # lost commits the same log again, which counts once)
            assert view["turns"] == TURNS, (c.sid, view["turns"], c.failures)
    assert_the_invariant_on_every_replica()
    print("CHAOS " + json.dumps(kill_costs(conversations, kills, started, elapsed)))


def assert_the_invariant_on_every_replica() -> dict[str, dict]:
    """The strict memory invariant on both model replicas of the app; their terms."""
    seen = replica_memory(CHAOS_APP, replicas=2)
    for replica, t in seen.items():
        assert t["total"] == t["free"] + t["evictable"] + t["protected"] + (
            t["held"] + t["in_flight"]
        ), replica
    return seen


def test_a_retry_after_its_ingress_died_finds_the_session_free(chaos) -> None:
    """Ray lets a model replica's turn run on when the ingress that called it is killed.
    The replica aborts it (replicas/caller_watch.py), so the client's retry through a new
    ingress takes the session, where it met a 409 "turn in flight" for as long as the orphan
    ran: here a 1,800-token turn (~19 s), longer than Serve takes to replace the ingresses."""
    import ray

    chat = OrphanChat(chaos, "orphaned-turn")
    chat.first_turn()
    stream = chat.long_turn()
    for ingress in serve_actors("Ingress"):  # whichever one relays it
        ray.kill(ingress)
    with contextlib.suppress(Exception):  # its relay breaks off
        for _ in stream:
            pass
    stream.close()

    failures: list[int | str] = []
    for _ in range(240):
        try:
            again = chat.ask(3)
            break
        except openai.APIStatusError as e:  # while Serve replaces the ingresses; never a 409
            assert e.status_code in RETRYABLE, (e.status_code, e.body, failures)
            failures.append(e.status_code)
        except openai.APIConnectionError:
            failures.append("connection")
        time.sleep(0.25)
    else:
        raise AssertionError(f"the retry never succeeded: {failures}")
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the session's KV was kept
    plain = chat.ask(3, session=False)  # the same conversation without a session
    assert again.choices[0].message.content == plain.choices[0].message.content
    terms = assert_the_invariant_on_every_replica()
    assert all(t["in_flight"] == 0 for t in terms.values()), terms


def kill_costs(conversations, kills, started: float, elapsed: float) -> dict:
    """Per kill, over the turns that started between it and the next kill: failed attempts,
    re-prefilled tokens (later turns that found no KV: their whole history), slowest turn."""
    edges = [t for _, t in kills] + [float("inf")]
    per_kill = []
    for i, (what, at) in enumerate(kills):
        window = [turn for c in conversations for turn in c.turns if at <= turn[0] < edges[i + 1]]
        failed = sum(at <= f < edges[i + 1] for c in conversations for f in c.failed_at)
        per_kill.append(
            {
                "kill": what,
                "at_s": round(at - started, 2),
                "turns": len(window),
                "failed_attempts": failed,
                "reprefilled_tokens": sum(p for _, _, t, p, cached in window if t and not cached),
                "slowest_turn_s": round(max((e - s for s, e, *_ in window), default=0.0), 2),
            }
        )
    statuses = sorted({str(f) for c in conversations for f in c.failures})
    return {
        "turns": SESSIONS * TURNS,
        "elapsed_s": round(elapsed, 1),
        "failure_statuses": statuses,
        "per_kill": per_kill,
    }


def test_a_directory_that_cannot_answer_is_a_503_not_a_hang(served, monkeypatch) -> None:
    """A directory call is bounded: past CALL_TIMEOUT_S the caller gets a typed 503."""
    import asyncio

    import ray

    import sessionserve.directory.client as directory
    from sessionserve.errors import DirectoryUnavailableError

    @ray.remote(num_cpus=0)
    class Stuck:
        def touch(self, *args):
            time.sleep(5)
            return True

    monkeypatch.setattr(directory, "CALL_TIMEOUT_S", 0.5)
    # as a directory that is restarting for ever would behave
    client = directory.DirectoryClient("stuck-probe", 60.0, actors=[Stuck.remote()])
    with pytest.raises(DirectoryUnavailableError) as err:
        asyncio.run(client.touch("any"))
    assert err.value.status_code == 503


def test_a_turn_whose_proxy_died_is_aborted(chaos) -> None:
    """Serve's proxy dies mid-turn (its ingress lives): the ingress's ASGI receive, which
    Serve fetches from that proxy, fails, Starlette ends the response, and the relay aborts
    the turn on the model replica (api/turns.py `relay`). The session keeps its last committed
    turn: had the turn run on to its 1,800 tokens, the replica would hold them, or the ingress
    would have committed them. Serve restarts the proxy; the retry then answers as a
    sessionless request."""
    import ray

    session_id = "proxy-died"
    chat = OrphanChat(chaos, session_id)
    chat.first_turn()
    before = session_view(chaos, session_id)
    stream = chat.long_turn()
    proxies = serve_actor_names("SERVE_PROXY_ACTOR")
    assert proxies
    for name in proxies:
        ray.kill(ray.get_actor(name, namespace="serve"))
    with contextlib.suppress(Exception):  # the client's connection breaks off
        for _ in stream:
            pass
    stream.close()

    after = None
    for _ in range(480):  # until Serve has a proxy again (~30 s here) and the turn is over
        with contextlib.suppress(httpx.HTTPError):
            view = session_view(chaos, session_id)
            terms = assert_the_invariant_on_every_replica()
            if all(t["in_flight"] == 0 for t in terms.values()):
                after = view
                break
        time.sleep(0.25)
    assert after is not None, "the proxy never came back, or the turn never ended"
    assert after["turns"] == before["turns"], (before, after)
    assert after["history_tokens"] == before["history_tokens"], (before, after)
    assert after["held_tokens"] < 1800, (before, after)  # not the orphan's tokens
    again = chat.ask(3)  # no 409: nothing holds the session
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    plain = chat.ask(3, session=False)
    assert again.choices[0].message.content == plain.choices[0].message.content


class OrphanChat:
    """A greedy chat session for the orphaned-turn tests: a short first turn, then a streamed
    1,800-token one (~19 s here) that a kill leaves without a reader."""

    def __init__(self, base: str, session_id: str) -> None:
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        self.session_id = session_id
        self.messages = [{"role": "user", "content": "w1 w2"}]

    def ask(self, max_tokens: int, session: bool = True, **extra):
        """The conversation so far, in the session or (session=False) without one."""
        return self.client.chat.completions.create(
            model=None,
            messages=self.messages,
            max_tokens=max_tokens,
            temperature=0,
            extra_headers={"x-session-id": self.session_id} if session else None,
            **extra,
        )

    def first_turn(self) -> None:
        self.messages += [{"role": "assistant", "content": self.ask(3).choices[0].message.content}]
        self.messages += [{"role": "user", "content": "w3 w4"}]

    def long_turn(self):
        """The long turn's stream, once its first piece arrived (it runs on its replica)."""
        stream = self.ask(1800, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        return stream


def session_view(base: str, session_id: str) -> dict:
    response = httpx.get(f"{base}/v1/sessions/{session_id}", timeout=10)
    response.raise_for_status()
    return response.json()
