"""The forward context the paged attention op reads is the calling thread's."""

from __future__ import annotations

import threading

from sessionserve.replicas.attention.paged_op import current_meta, forward_context


def test_two_threads_in_forwards_at_once_each_read_their_own_metadata() -> None:
    """A first start's background thread times two packages over a scratch pool while the
    engine thread runs a step (prefill_choice.split_point): each forward's attention must
    read its own pool and slots. Both threads enter a context, wait for each other inside
    it, then read; a context shared by the process gave one of them the other's."""
    inside = threading.Barrier(2)
    seen: dict[str, object] = {}

    def forward(name: str, meta: object) -> None:
        with forward_context(meta):  # type: ignore[arg-type]  (any object stands for a meta)
            inside.wait(10)
            seen[name] = current_meta()
            inside.wait(10)
        seen[name + " after"] = current_meta()

    metas = {"engine": object(), "timing": object()}
    threads = [threading.Thread(target=forward, args=item) for item in metas.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen["engine"] is metas["engine"] and seen["timing"] is metas["timing"]
    assert seen["engine after"] is None and seen["timing after"] is None
    assert current_meta() is None  # this thread was in no forward


def test_a_nested_context_restores_the_outer_one() -> None:
    outer, inner = object(), object()
    with forward_context(outer):  # type: ignore[arg-type]
        with forward_context(inner):  # type: ignore[arg-type]
            assert current_meta() is inner
        assert current_meta() is outer
    assert current_meta() is None
