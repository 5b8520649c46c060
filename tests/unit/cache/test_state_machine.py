"""Random interleavings of everything the scheduler can do to the cache, for page sizes 1, 16 and
256, with and without the sliding-window layers' KV kept apart (a window of 24 tokens over a
sliding space small enough to run out). After every rule the busy invariant holds and every
reused KV slot holds exactly the KV of the tokens it is reused for (FakeKV); at teardown every
slot and row is free. With a host tier (a budget smaller than the sessions' KV, so it evicts
too), idle sessions are also parked explicitly and by pressure and restored by their next turn;
restored KV is verified the same way, and the invariant covers the tier's bytes."""

from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from sessionserve.cache import KVState, RequestKV, SessionLimits, build_session_cache
from sessionserve.cache.allocator import floor_align
from sessionserve.cache.checker import MemoryChecker
from sessionserve.cache.session_cache import common_prefix_len
from sessionserve.errors import (
    KVCacheFullError,
    SessionBusyError,
    SessionClosingError,
    SessionExistsError,
    TooManySessionsError,
    UnknownSessionError,
)
from tests.unit.cache.kvdriver import Driver, Turn

pytestmark = pytest.mark.slow  # 7 machines x EXAMPLES runs: ~2 min in all
EXAMPLES = int(os.environ.get("SESSIONSERVE_STATE_MACHINE_EXAMPLES", "300"))
SESSION_IDS = st.sampled_from(["s0", "s1", "s2", "s3", "s4"])
PICK = st.integers(0, 1000)
SHARED_PREFIXES = [[5 + (i * 3 + j) % 37 for j in range(n)] for i, n in enumerate((3, 20, 40))]


class SessionCacheMachine(RuleBasedStateMachine):
    page_size = 16
    host_tier_bytes: int | None = None  # FakeKV's pool: 16 bytes a token
    sliding_window: int | None = None

    def __init__(self) -> None:
        super().__init__()
        p = self.page_size
        self.cache = build_session_cache(
            num_slots=max(p * 10, 192),
            page_size=p,
            max_rows=6,
            max_context_len=4096,
            limits=SessionLimits(max_sessions=4, max_session_tokens=max(p, 96)),
            sliding_window=self.sliding_window,
            sliding_slots=150,
        )
        self.checker = MemoryChecker(self.cache)
        self.drive = Driver(self.cache, seed=1, host_tier_bytes=self.host_tier_bytes)
        self.turns: list[Turn] = []
        self.history: dict[str, list[int]] = {}  # the model of each session's checkpoint
        self.closing: set[str] = set()
        self.next_rid = 0

    # ---- helpers ----
    def _rid(self) -> str:
        self.next_rid += 1
        return f"r{self.next_rid}"

    def _pick(self, i: int, pred=lambda t: True) -> Turn | None:
        cands = [t for t in self.turns if pred(t)]
        return cands[i % len(cands)] if cands else None

    def _end(self, turn: Turn) -> None:
        self.turns.remove(turn)
        sid = turn.req.session_id
        if sid in self.closing:  # a deferred close completes when the turn ends
            self.closing.discard(sid)
            del self.history[sid]

    def _turn_of(self, sid: str) -> Turn | None:
        return next((t for t in self.turns if t.req.session_id == sid), None)

    # ---- sessions ----
    @initialize(new=st.lists(st.integers(3, 40), min_size=1, max_size=60), n=st.integers(1, 20))
    def sessions_with_history(self, new: list[int], n: int) -> None:
        for sid in ("s0", "s1"):
            self.open_session(sid)
        self.whole_turn("s0", new, n)

    @rule(
        sid=SESSION_IDS,
        new=st.lists(st.integers(3, 40), min_size=1, max_size=40),
        n=st.integers(1, 20),
    )
    def whole_turn(self, sid: str, new: list[int], n: int) -> None:
        """A complete append turn (admit, prefill, decode, finish) to build up held KV."""
        if sid not in self.history or self._turn_of(sid) or sid in self.closing:
            return
        tokens = self.history[sid] + new
        turn = Turn(self.cache.start_turn(sid, self._rid()), tokens, len(tokens))
        self.turns.append(turn)
        try:
            self.drive.run_turn(turn, n)
        except KVCacheFullError:
            self.cache.abort(turn.req, turn.tokens)
            self._end(turn)
            return
        self.history[sid] = turn.tokens
        event("completed a whole session turn")
        self._end(turn)

    @rule(sid=SESSION_IDS)
    def open_session(self, sid: str) -> None:
        try:
            self.cache.open_session(sid)
        except SessionExistsError:
            assert sid in self.history
            return
        except TooManySessionsError:
            assert len(self.history) >= 4
            return
        self.history[sid] = []

    @rule(
        sid=SESSION_IDS,
        mode=st.sampled_from(["append", "chat"]),
        cut=PICK,
        new=st.lists(st.integers(3, 40), min_size=1, max_size=40),
    )
    def start_turn(self, sid: str, mode: str, cut: int, new: list[int]) -> None:
        if sid not in self.history:
            try:
                self.cache.start_turn(sid, self._rid())
                raise AssertionError("a turn started on an unknown session")
            except UnknownSessionError:
                return
        hist = self.history[sid]
        running = self._turn_of(sid)
        before = dict(vars(self.cache.session(sid)))
        try:
            req = self.cache.start_turn(sid, self._rid())
        except (SessionBusyError, SessionClosingError):
            assert running is not None or sid in self.closing
            assert dict(vars(self.cache.session(sid))) == before  # a refusal changes nothing
            return
        assert running is None and sid not in self.closing
        prefix = hist if mode == "append" else hist[: cut % (len(hist) + 1)]
        tokens = prefix + new
        self.turns.append(Turn(req=req, tokens=tokens, prompt_len=len(tokens), mode=mode))

    @rule(sid=SESSION_IDS)
    def close_session(self, sid: str) -> None:
        if sid not in self.history:
            try:
                self.cache.close_session(sid)
                raise AssertionError("closed an unknown session")
            except UnknownSessionError:
                return
        closed = self.cache.close_session(sid)
        assert closed == (self._turn_of(sid) is None)
        if closed:
            del self.history[sid]
        else:
            self.closing.add(sid)

    @rule(sid=SESSION_IDS)
    def forged_abort_is_refused(self, sid: str) -> None:
        if sid not in self.history or self._turn_of(sid) is None:
            return
        before = dict(vars(self.cache.session(sid)))
        try:
            self.cache.abort(RequestKV(rid="forged", session_id=sid))
            raise AssertionError("a request that does not own the turn ended it")
        except SessionBusyError:
            pass
        assert dict(vars(self.cache.session(sid))) == before

    # ---- ordinary requests ----
    @rule(which=st.integers(0, 2), suffix=st.lists(st.integers(3, 40), min_size=1, max_size=30))
    def start_ordinary(self, which: int, suffix: list[int]) -> None:
        tokens = SHARED_PREFIXES[which] + suffix
        turn = Turn(req=RequestKV(rid=self._rid()), tokens=tokens, prompt_len=len(tokens))
        self.turns.append(turn)

    # ---- scheduling ----
    @precondition(lambda self: any(t.req.state is KVState.WAITING for t in self.turns))
    @rule(i=PICK)
    def admit(self, i: int) -> None:
        turn = self._pick(i, lambda t: t.req.state is KVState.WAITING)
        sid = turn.req.session_id
        slot = self.cache.session(sid) if sid else None
        expect = None
        tier = self.cache.host_tier
        parked = tier.get(sid) if tier is not None and sid else None
        branch = False  # a chat rewind of a page or more: the branch left goes to the tree
        if slot is not None and slot.holds_kv:
            lcp = common_prefix_len(slot.kv_tokens, turn.tokens[:-1])
            expect = lcp if lcp >= slot.protected_len else None
            branch = turn.mode == "chat" and self.cache._leaves_a_branch(slot, lcp)
            if self.sliding_window and not (
                self.cache._window_resident(slot.row, lcp) and not branch
            ):  # the sliding window at lcp is gone: what the tree can give (verified below)
                expect, branch = None, False
                event("a session turn went back past its sliding window")
        try:
            cached = self.drive.admit(turn)  # verifies the reused KV content
        except KVCacheFullError:  # no free row: stays queued, holding nothing
            assert turn.req.state is KVState.WAITING and turn.req.row is None
            return
        if branch:  # reused from the tree: at least the whole pages before the divergence
            assert cached >= floor_align(lcp, self.cache.page_size)
            assert turn.req.cached_source == ("radix" if cached else "none")
        elif expect is not None:
            assert (cached, turn.req.cached_source) == (expect, "session" if expect else "none")
        if parked is not None:  # taken out whether or not it could be restored
            assert sid not in tier
            if turn.req.cached_source == "host":
                assert cached == common_prefix_len(parked.tokens, turn.tokens[:-1]) > 0
        else:
            assert turn.req.cached_source != "host"
        event(f"admitted with cached source {turn.req.cached_source}")
        turn.sampled = False

    @precondition(lambda self: any(t.req.is_live and not t.sampled for t in self.turns))
    @rule(i=PICK, chunk=st.integers(1, 64))
    def prefill(self, i: int, chunk: int) -> None:
        turn = self._pick(i, lambda t: t.req.is_live and not t.sampled)
        try:
            self.drive.prefill(turn, chunk)
        except KVCacheFullError:
            return
        if turn.req.committed_len == len(turn.tokens):
            self.drive.sample(turn)

    @precondition(lambda self: any(t.req.is_live and t.sampled for t in self.turns))
    @rule(i=PICK, steps=st.integers(1, 6))
    def decode(self, i: int, steps: int) -> None:
        turn = self._pick(i, lambda t: t.req.is_live and t.sampled)
        for _ in range(steps):
            try:
                self.drive.decode(turn)
            except KVCacheFullError:
                return

    @precondition(lambda self: any(t.req.is_live and t.sampled for t in self.turns))
    @rule(i=PICK, k=st.integers(1, 5), accept=st.integers(0, 5))
    def speculate(self, i: int, k: int, accept: int) -> None:
        turn = self._pick(i, lambda t: t.req.is_live and t.sampled)
        try:
            self.drive.spec_step(turn, k, min(k, accept))
        except KVCacheFullError:
            return

    @precondition(lambda self: any(t.req.is_live and t.sampled for t in self.turns))
    @rule(i=PICK, k=st.integers(1, 5))
    def over_allocate(self, i: int, k: int) -> None:
        """Drafts allocated for a verify that has not run yet (abort/finish may come next)."""
        turn = self._pick(i, lambda t: t.req.is_live and t.sampled)
        try:
            self.cache.allocate(turn.req, turn.req.committed_len + 1 + k)
        except KVCacheFullError:
            return

    @precondition(lambda self: any(t.req.is_live and t.sampled for t in self.turns))
    @rule(i=PICK, overshoot=st.integers(0, 6))
    def finish(self, i: int, overshoot: int) -> None:
        turn = self._pick(i, lambda t: t.req.is_live and t.sampled)
        # overshoot is what the last verify accepted past a stop: never below what a
        # re-admission (after a retract) matched, which the engine's last verify came after
        keep = max(turn.prompt_len + 1, turn.req.protected_len, len(turn.tokens) - overshoot)
        final = turn.tokens[:keep]
        self.cache.finish(turn.req, final)
        event("finished a session turn" if turn.req.session_id else "finished a plain request")
        if turn.req.session_id:
            self.history[turn.req.session_id] = final
        self._end(turn)

    @precondition(lambda self: self.turns)
    @rule(i=PICK)
    def abort(self, i: int) -> None:
        """Covers pre-abort (never matched), abort while queued or retracted, and mid-abort."""
        turn = self._pick(i)
        self.cache.abort(turn.req, turn.tokens)
        self._end(turn)

    @precondition(lambda self: any(t.req.is_live for t in self.turns))
    @rule(i=PICK)
    def retract(self, i: int) -> None:
        turn = self._pick(i, lambda t: t.req.is_live)
        self.cache.retract(turn.req, turn.tokens)
        turn.sampled = False

    @rule(sid=SESSION_IDS)
    def park(self, sid: str) -> None:
        if sid not in self.history:
            return
        slot = self.cache.session(sid)
        if self._turn_of(sid) is not None:
            before = dict(vars(slot))
            try:
                self.cache.park(sid)
                raise AssertionError("parked a session with a turn in flight")
            except SessionBusyError:
                assert dict(vars(slot)) == before
            return
        was_resident, held = slot.holds_kv, slot.committed_len
        parked = self.cache.park(sid)
        assert not slot.holds_kv
        assert parked == (self.cache.host_tier is not None and sid in self.cache.host_tier)
        if parked and was_resident:
            event("parked a session in the host tier")
            assert len(self.cache.host_tier.get(sid)) == held

    @rule(n=st.integers(1, 400))
    def memory_pressure(self, n: int) -> None:
        try:
            self.cache.make_room(n)
        except KVCacheFullError:
            pass

    # ---- checks ----
    @invariant()
    def memory_is_accounted(self) -> None:
        self.checker.check_busy([t.req for t in self.turns if t.req.is_live])

    @invariant()
    def checkpoints_match_the_model(self) -> None:
        assert set(self.cache.session_slots) == set(self.history)
        for sid, hist in self.history.items():
            slot = self.cache.session(sid)
            assert slot.history == hist
            running = self._turn_of(sid)
            assert slot.turn_rid == (running.req.rid if running else None)

    def teardown(self) -> None:
        if self.cache.evicted_sessions_total:
            event("evicted an idle session")
        tier = self.cache.host_tier
        if tier is not None and tier.restored_total:
            event("restored a session from the host tier")
        if tier is not None and tier.evicted_total:
            event("the host tier evicted a session")
        for turn in list(self.turns):
            self.cache.abort(turn.req, turn.tokens)
            self._end(turn)
        for sid in list(self.history):
            assert self.cache.close_session(sid)
        self.cache.flush()
        t = self.checker.check_idle()
        assert t.free == t.total and t.rows_free == t.rows_total, t
        assert t.sliding_free == t.sliding_total, t
        assert t.host_bytes == t.host_sessions == 0, t


def _machine_for(page: int, host_tier_bytes: int | None = None, sliding_window: int | None = None):
    name = f"SessionCacheMachinePage{page}" + ("HostTier" if host_tier_bytes else "")
    name += "Sliding" if sliding_window else ""
    attrs = {"page_size": page, "host_tier_bytes": host_tier_bytes}
    attrs["sliding_window"] = sliding_window
    machine = type(name, (SessionCacheMachine,), attrs)
    test = machine.TestCase
    test.settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    return test


TestSessionCachePage1 = _machine_for(1, host_tier_bytes=16 * 120)
TestSessionCachePage16 = _machine_for(16)
TestSessionCachePage16HostTier = _machine_for(16, host_tier_bytes=16 * 120)
TestSessionCachePage256 = _machine_for(256, host_tier_bytes=16 * 120)
TestSessionCachePage1Sliding = _machine_for(1, host_tier_bytes=32 * 120, sliding_window=24)
TestSessionCachePage16Sliding = _machine_for(16, host_tier_bytes=32 * 120, sliding_window=24)
TestSessionCachePage256Sliding = _machine_for(256, sliding_window=24)
