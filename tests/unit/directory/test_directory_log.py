"""The directory's token log costs a turn what the turn adds: commits are deltas (cut at
`base`, then `tail`), idempotent, refused when they follow more log than the directory has;
the store keeps each log as append-only chunks, compacted every MAX_LOG_CHUNKS turns, and a
restarted directory rebuilds every log exactly from them."""

from __future__ import annotations

import pickle

from sessionserve.directory.state import MAX_LOG_CHUNKS, SessionDirectoryState
from sessionserve.directory.store import MemoryStore


class CountingStore(MemoryStore):
    """A MemoryStore that records the bytes of every write."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[int] = []

    def put(self, key: str, value: object) -> None:
        super().put(key, value)
        self.written.append(len(pickle.dumps(value)))


def test_commits_append_rewind_and_count_a_resent_turn_once() -> None:
    state = SessionDirectoryState()
    sid = state.open("s", None)
    assert state.commit_turn(sid, 0, [1, 2, 3])
    assert state.commit_turn(sid, 3, [4, 5])  # an append turn
    assert state.commit_turn(sid, 3, [4, 5])  # Ray re-sent it: nothing changes
    assert state.log(sid) == [1, 2, 3, 4, 5] and state.info(sid)["turns"] == 2
    assert state.commit_turn(sid, 2, [9, 9, 9])  # a chat turn that went back to token 2
    assert state.log(sid) == [1, 2, 9, 9, 9] and state.info(sid)["turns"] == 3


def test_a_commit_that_follows_a_longer_log_is_refused_and_reported(caplog) -> None:
    state = SessionDirectoryState()
    sid = state.open("s", None)
    state.commit_turn(sid, 0, [1, 2, 3])
    assert state.commit_turn(sid, 7, [8])  # the session exists: not "gone"
    assert state.log(sid) == [1, 2, 3] and state.info(sid)["turns"] == 1
    assert state.counts()["log_mismatches"] == 1
    assert "followed 7 tokens of log, the directory holds 3" in caplog.text
    assert state.commit_turn(sid, 0, [4, 5, 6, 7, 8])  # the replica's whole log: taken
    assert state.log(sid) == [4, 5, 6, 7, 8]


def test_a_turn_writes_what_it_adds_not_the_whole_log() -> None:
    store = CountingStore()
    state = SessionDirectoryState(store=store)
    sid = state.open("s", None)
    state.commit_turn(sid, 0, list(range(100_000)))
    first = sum(store.written)
    store.written.clear()
    state.commit_turn(sid, 100_000, [7] * 50)
    assert sum(store.written) < 2_000 < first // 100  # one small chunk and the record


def test_a_restarted_directory_rebuilds_chunked_logs_exactly_through_compaction() -> None:
    store = CountingStore()
    state = SessionDirectoryState(store=store)
    sid, other = state.open("s", None), state.open("t", None)
    log: list[int] = []
    for turn in range(2 * MAX_LOG_CHUNKS + 5):
        base = max(0, len(log) - 2) if turn % 7 == 3 else len(log)  # some turns rewind
        tail = [turn % 50, turn % 13 + 1, 3]
        state.commit_turn(sid, base, tail)
        log = log[:base] + tail
        again = SessionDirectoryState(store=store)  # the actor restarted after this turn
        assert again.log(sid) == log, turn
    state.commit_turn(other, 0, [1, 2])
    chunks = [k for k in store.data if k.startswith("l/s/")]
    assert 1 <= len(chunks) < MAX_LOG_CHUNKS  # compacted: old chunks deleted
    again = SessionDirectoryState(store=store)
    assert again.log(sid) == log and again.log(other) == [1, 2]
    assert again.info(sid)["turns"] == 2 * MAX_LOG_CHUNKS + 5
    state.close(sid)
    assert not [k for k in store.data if k.startswith("l/s/") or k == "s/s"]
