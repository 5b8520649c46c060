"""A model-free driver for the cache: plays the scheduler's part and fakes the KV content.

`FakeKV` writes, for every computed position, a rolling hash of the tokens up to it into the
slot. Reused KV is then verified: the slots a match returns must hold exactly the hashes of the
new request's own tokens. A stale, freed-and-reused, or mis-pointed slot fails this check.
The hashes live in a real (one-layer, int64) `KVPool`, attached to the cache, so KV the host
tier parks and restores, or a migration moves, is verified the same way. A cache that keeps
sliding-window KV apart gets a second, sliding layer: its hashes are verified over the window
a reused prefix goes on from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sessionserve.cache import KVPool, KVShape, RequestKV, SessionCache
from sessionserve.cache.host_tier import HostTier

_MOD = (1 << 61) - 1


def prefix_hashes(tokens: list[int]) -> list[int]:
    out, h = [], 7
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % _MOD
        out.append(h)
    return out


class FakeKV:
    def __init__(self, cache: SessionCache, host_tier_bytes: int | None = None) -> None:
        self.cache = cache
        self.sliding = cache.allocator.sliding
        if self.sliding is None:
            self.pool = KVPool(KVShape(1, 1, 1), cache.allocator.pool_slots, dtype=torch.int64)
        else:  # layer 0 full attention, layer 1 sliding
            self.pool = KVPool(
                KVShape(2, 1, 1),
                cache.allocator.pool_slots,
                dtype=torch.int64,
                sliding_layers=(1,),
                sliding_slots=self.sliding.pool_slots,
            )
            self.pool.sliding_k.fill_(-1)
            self.sliding_content = self.pool.sliding_k[0, :, 0, 0]
        self.pool.k.fill_(-1)
        self.content = self.pool.k[0, :, 0, 0]  # a view: writes land in the pool
        tier = HostTier(host_tier_bytes, [self.pool]) if host_tier_bytes else None
        cache.attach_kv([self.pool], tier)

    def compute(self, req: RequestKV, tokens: list[int], start: int, end: int) -> None:
        """'Run the model' on positions [start, end) of `tokens`: write their KV."""
        slots = self.cache.slots(req, start, end)
        assert not bool((slots < self.cache.page_size).any()), "a real token landed in page 0"
        self.verify_window(req, tokens, start)  # what the new tokens' sliding layers read
        hashes = torch.tensor(prefix_hashes(tokens[:end])[start:end])
        self.content[slots] = hashes
        if self.sliding is not None:
            where = self.sliding.lookup(slots)
            assert bool((where > 0).all()), "a computed token has no sliding slot"
            self.sliding_content[where] = hashes

    def verify(self, req: RequestKV, tokens: list[int], length: int) -> None:
        """Positions [0, length) of `req` must hold the KV of `tokens[:length]`."""
        if length == 0:
            return
        slots = self.cache.slots(req, 0, length)
        want = torch.tensor(prefix_hashes(tokens[:length]))
        bad = (self.content[slots] != want).nonzero().flatten().tolist()
        assert not bad, f"{req.rid}: stale or foreign KV at positions {bad[:8]}"
        self.verify_window(req, tokens, length)

    def verify_window(self, req: RequestKV, tokens: list[int], length: int) -> None:
        """The sliding KV the token at `length` sees (the window - 1 before it) is resident
        and holds the KV of `tokens`."""
        if self.sliding is None or length == 0:
            return
        lo = max(0, length - self.sliding.window + 1)
        where = self.sliding.lookup(self.cache.slots(req, lo, length))
        assert bool((where > 0).all()), f"{req.rid}: the window at {length} is not resident"
        want = torch.tensor(prefix_hashes(tokens[:length])[lo:])
        bad = (self.sliding_content[where] != want).nonzero().flatten().tolist()
        assert not bad, f"{req.rid}: stale sliding KV at positions {[lo + b for b in bad[:8]]}"


@dataclass
class Turn:
    """One request as the scheduler sees it: its tokens and where it is."""

    req: RequestKV
    tokens: list[int]  # prompt + output so far
    prompt_len: int
    mode: str = "append"
    sampled: bool = False  # the input is computed and the next token sampled: decode may run


class Driver:
    def __init__(
        self, cache: SessionCache, seed: int = 0, host_tier_bytes: int | None = None
    ) -> None:
        self.cache = cache
        self.kv = FakeKV(cache, host_tier_bytes)
        self.rng = torch.Generator().manual_seed(seed)

    def admit(self, turn: Turn) -> int:
        cached = self.cache.match(turn.req, turn.tokens, turn.mode)
        self.kv.verify(turn.req, turn.tokens, cached)
        return cached

    def prefill(self, turn: Turn, chunk: int | None = None) -> None:
        """Compute the uncomputed input (one chunk of at most `chunk` tokens)."""
        start = turn.req.committed_len
        end = len(turn.tokens) if chunk is None else min(len(turn.tokens), start + chunk)
        self.cache.allocate(turn.req, end)
        self.kv.compute(turn.req, turn.tokens, start, end)
        self.cache.commit(turn.req, end)

    def sample(self, turn: Turn, token: int | None = None) -> int:
        t = int(torch.randint(3, 50, (1,), generator=self.rng)) if token is None else token
        turn.tokens.append(t)
        turn.sampled = True
        return t

    def decode(self, turn: Turn) -> None:
        """Feed the last sampled token (compute its KV) and sample the next."""
        pos = len(turn.tokens) - 1
        assert turn.req.committed_len == pos, (turn.req.committed_len, pos)
        self.cache.allocate(turn.req, pos + 1)
        self.kv.compute(turn.req, turn.tokens, pos, pos + 1)
        self.cache.commit(turn.req, pos + 1)
        self.sample(turn)

    def spec_step(self, turn: Turn, k: int, accept: int) -> None:
        """Verify k drafts after the last sampled token; accept `accept` of them plus a bonus."""
        pos = len(turn.tokens) - 1
        drafts = [int(x) for x in torch.randint(3, 50, (k,), generator=self.rng)]
        self.cache.allocate(turn.req, pos + 1 + k)  # bonus slot claimed before the step
        self.kv.compute(turn.req, turn.tokens + drafts, pos, pos + 1 + k)
        turn.tokens.extend(drafts[:accept])
        self.cache.commit(turn.req, pos + 1 + accept)
        self.cache.free_overallocation(turn.req)  # rejected drafts freed the same step
        self.sample(turn, token=(drafts[accept] + 1) % 50 + 3 if accept < k else None)

    def complete(self, turn: Turn) -> None:
        """Compute what is left of the input, sample one token, finish."""
        self.prefill(turn)
        self.sample(turn)
        self.cache.finish(turn.req, turn.tokens)

    def run_turn(self, turn: Turn, new_tokens: int) -> None:
        """Admit, prefill, decode `new_tokens` tokens, finish."""
        self.admit(turn)
        self.prefill(turn)
        self.sample(turn)
        for _ in range(new_tokens - 1):
            self.decode(turn)
        self.cache.finish(turn.req, turn.tokens)
