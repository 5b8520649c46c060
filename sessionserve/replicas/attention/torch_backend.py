"""Paged attention in plain torch (CPU and any device), vectorised over the batch.

Sequences with the same number of new tokens form one group and run as one padded
`scaled_dot_product_attention` call per layer: all decodes together (q_len 1), all speculative
verifies together (q_len k+1), each distinct prefill length on its own. So a decode step costs
one gather and one SDPA per layer whatever the batch size, not a Python loop per sequence.
A prefill with no cached prefix attends to its new K/V directly (causal), skipping the gather.
Sliding-window layers (Gemma 3, Mistral) read only the last `window - 1 + q` context positions
of each sequence (a token sees itself and the `window - 1` positions before it), through
their own slots and mask per group, built with the others once per forward: from the sliding
slots when the cache keeps their KV apart (`SeqSpec.sliding_slots`), else from the context's.

Metadata is built on the host with whole-tensor ops and copied to the device once per group
(no per-sequence device writes, no device-to-host reads inside the layers).

Where the compiled forward runs (CPU), decode groups (one new token per row) instead call a
kernel that reads the pool in place (`decode_kernel`, attention/inplace_decode.py): no
gathered copy of their K/V; the CPU kernel (cpu_decode_kernel.py) takes chain verifies' rows
(k + 1 tokens each) too. Groups of 2+ new tokens a row that no decode kernel takes (prompts,
session turns) call the CPU prefill kernel (`extend_kernel`, cpu_extend_kernel.py) over the
pool in place where it is usable, sliding layers included (over their window's columns, or
banded by the kernel).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from sessionserve.replicas.attention import cpu_extend_kernel
from sessionserve.replicas.attention.base import AttentionBackend, ForwardMeta, SeqSpec, to_device
from sessionserve.replicas.attention.inplace_decode import DecodeKernel, part_padded

MIN_STATIC_CTX = 64  # smallest context bucket of a static decode plan


@dataclass
class _Group:
    token_idx: torch.Tensor  # [B, q] positions of the group's query tokens in the flat batch
    ctx_slots: torch.Tensor | None  # [B, Lmax] KV slots, padded with slot 0; None when fresh
    mask: torch.Tensor | None  # [B, 1, q, Lmax] True = may attend; None = no masking needed
    fresh: tuple[int, int] | None = None  # one sequence, no cached prefix, causal: its flat
    # token range [start, end) (host ints), using the new K/V directly
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # fresh groups, per
    # sliding window: its layers' causal mask, where causal alone is not enough
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # per sliding window: its layers' context slots [B, Wmax] and mask [B, 1, q, Wmax] (absent:
    # they read `ctx_slots` with `mask`, the window covering every context)
    decode: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # groups of up to `decode_kernel.max_query_tokens` tokens a row, no tree, where the kernel
    # is installed: for the full layers (key None) and, for decode rows (q 1), each window in
    # `windowed`, the slots [B, W] (W a multiple of the kernel's chunks) and per row how many
    # of them it reads [B]
    rows: tuple[int, int] | None = None  # a decode (or prefill kernel) group's rows when they
    # are one range of the flat batch [start, end) (decodes are: the scheduler puts them
    # first): sliced, not indexed
    extend: tuple[torch.Tensor, torch.Tensor] | None = None  # where the CPU prefill kernel
    # takes the group (`extend_kernel`: rows of 2+ tokens, no tree): its slots [B, W] and
    # context lengths [B], read by full layers, and by sliding layers whose window is not in
    # `extend_windowed` (the kernel bands them itself)
    extend_windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # per window in `windowed`, where the kernel takes the group: its layers' columns
    # (`windowed`'s slots [B, Wmax], a fresh prompt's sliding slots where kept apart) and how
    # many of them each row reads [B]
    stacked_masks: dict | None = field(default_factory=dict)  # `grouped_attention`'s masks,
    # built at the forward's first layer and reused by the others (per window key); None for
    # the static groups of CUDA graphs, whose masks are refilled in place between replays


def window_columns(seqs: list[SeqSpec], q: int, window: int) -> list[torch.Tensor]:
    """Per sequence, the slots a sliding layer reads: its last `window - 1 + q` context
    positions, sliding slots where the cache keeps those apart."""
    return [
        (s.sliding_slots if s.sliding_slots is not None else s.ctx_slots)[-(window - 1 + q) :]
        for s in seqs
    ]


def context_mask(
    ctx_lens: torch.Tensor, q: int, width: int, window: int | None = None
) -> torch.Tensor:
    """[B, q, width] bool: new token i of row b (its last q context positions) sees positions
    0..ctx_len - q + i: the cached prefix, then causally among the new tokens; with a
    `window`, only the last `window` of those (itself included)."""
    last_seen = (ctx_lens - q)[:, None, None] + torch.arange(q)[None, :, None]
    cols = torch.arange(width)[None, None, :]
    mask = cols <= last_seen
    if window is not None:
        mask &= cols > last_seen - window
    return mask


class TorchPagedBackend(AttentionBackend):
    name = "torch"

    def __init__(self, max_context_len: int | None = None, windows: tuple[int, ...] = ()) -> None:
        self.max_context_len = max_context_len  # the largest static context bucket
        self.windows = windows  # the model's sliding windows (attention.sliding_windows)
        # set where the compiled forward is installed (assembly.compile_forwards): decode
        # groups attend over the pool in place (`inplace_decode.decode_attention`'s signature)
        self.decode_kernel: DecodeKernel | None = None
        # set where the CPU prefill attention kernel is usable for the model and pool
        # (assembly.pool_and_backend, cpu_extend_kernel.py): groups of 2+ new tokens a row
        # that no decode kernel takes attend over the pool in place
        self.extend_kernel = False

    def prepare(self, seqs: list[SeqSpec], device: torch.device) -> list[_Group]:
        starts, pos = [], 0
        for s in seqs:
            starts.append(pos)
            pos += s.q_len
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, s in enumerate(seqs):
            by_len[s.q_len].append(i)
        return [
            self._group([seqs[i] for i in idx], [starts[i] for i in idx], device)
            for idx in by_len.values()
        ]

    def _group(self, seqs: list[SeqSpec], starts: list[int], device: torch.device) -> _Group:
        q, only = seqs[0].q_len, seqs[0]
        lens = torch.tensor([s.ctx_len for s in seqs])
        apart = seqs[0].sliding_slots is not None
        # the windows whose layers read something else than the context: a cut, or apart
        windows = [w for w in self.windows if apart or int(lens.max()) > w]
        if windows and any(s.tree_mask is not None for s in seqs):
            raise NotImplementedError("tree verification over sliding-window layers; use chain")
        extends = self.extend_kernel and q > 1 and all(s.tree_mask is None for s in seqs)
        if len(seqs) == 1 and only.ctx_len == q and only.tree_mask is None:
            fresh = _Group(torch.empty(0), None, None, fresh=(starts[0], starts[0] + q))
            if extends:  # every layer takes the kernel, which bands sliding ones itself
                fresh.extend = (to_device(only.ctx_slots[None], device), to_device(lens, device))
                if apart:  # its sliding slots cover all of it (fewer than `window - 1 + q`)
                    sliding = to_device(only.sliding_slots[None], device)
                    fresh.extend_windowed = dict.fromkeys(windows, (sliding, fresh.extend[1]))
                return fresh
            for w in (w for w in windows if only.ctx_len > w):  # causal is not enough
                fresh.window_masks[w] = to_device(context_mask(lens, q, q, w)[:, None], device)
            return fresh
        token_idx = torch.tensor(starts)[:, None] + torch.arange(q)
        ctx_slots = pad_sequence([s.ctx_slots for s in seqs], batch_first=True)
        width = ctx_slots.shape[1]
        mask = None
        if q > 1 or int(lens.min()) < width:
            mask = context_mask(lens, q, width)
            for b, s in enumerate(seqs):
                if s.tree_mask is not None:
                    mask[b, :, s.ctx_len - q : s.ctx_len] = s.tree_mask
            mask = to_device(mask[:, None], device)
        group = _Group(to_device(token_idx, device), to_device(ctx_slots, device), mask)
        kernel = self.decode_kernel
        if (
            kernel is not None
            and q <= kernel.max_query_tokens
            and all(s.tree_mask is None for s in seqs)
        ):
            group.decode[None] = _kernel_slots(ctx_slots, lens, kernel.chunks, device)
        elif extends:  # rows a decode kernel takes stay with it
            group.extend = (group.ctx_slots, to_device(lens, device))
        consecutive = starts == list(range(starts[0], starts[0] + q * len(starts), q))
        if (group.decode or group.extend is not None) and consecutive:
            group.rows = (starts[0], starts[0] + q * len(starts))
        for w in windows:
            cols = window_columns(seqs, q, w)
            narrow = pad_sequence(cols, batch_first=True)
            lens_w = torch.tensor([c.numel() for c in cols])
            mask_w = context_mask(lens_w, q, narrow.shape[1], w)[:, None]
            group.windowed[w] = (to_device(narrow, device), to_device(mask_w, device))
            if group.extend is not None:
                group.extend_windowed[w] = (group.windowed[w][0], to_device(lens_w, device))
            if group.decode and q == 1:  # a decode row sees all of its last `window`
                # positions (a verify's tokens each see other ones: they keep the mask)
                group.decode[w] = _kernel_slots(narrow, lens_w, kernel.chunks, device)
        return group

    # ---- static decode (CUDA graphs) ----
    def graph_key(self, seqs: list[SeqSpec]) -> int | None:
        """The context bucket: a power of two >= the longest context (at least 64)."""
        longest = max(s.ctx_len for s in seqs)
        width = max(MIN_STATIC_CTX, 1 << (longest - 1).bit_length())
        if self.max_context_len is not None and width > self.max_context_len:
            width = self.max_context_len if longest <= self.max_context_len else 0
        return width or None

    def static_decode(self, batch_size: int, key: int, device: torch.device) -> list[_Group]:
        """One decode group of fixed shape [batch_size, key] (a plan `forward` runs as is)."""
        group = _Group(
            token_idx=torch.arange(batch_size, device=device)[:, None],
            ctx_slots=torch.zeros(batch_size, key, dtype=torch.int64, device=device),
            mask=torch.zeros(batch_size, 1, 1, key, dtype=torch.bool, device=device),
            stacked_masks=None,
        )
        group.windowed = {
            w: _static_window(batch_size, 1, min(key, w), device) for w in self.windows
        }
        return [group]

    def fill_decode(self, static: list[_Group], seqs: list[SeqSpec]) -> None:
        (static,) = static
        batch_size, width = static.ctx_slots.shape
        ctx = torch.zeros(batch_size, width, dtype=torch.int64)
        lens = torch.ones(batch_size, dtype=torch.int64)  # padding rows see slot 0 only
        if seqs:
            packed = pad_sequence([s.ctx_slots for s in seqs], batch_first=True)
            ctx[: len(seqs), : packed.shape[1]] = packed
            lens[: len(seqs)] = torch.tensor([s.ctx_len for s in seqs])
        static.ctx_slots.copy_(to_device(ctx, static.ctx_slots.device), non_blocking=True)
        mask = context_mask(lens, 1, width)  # [B, 1, width]
        static.mask.copy_(to_device(mask[:, None], static.mask.device), non_blocking=True)
        for w, (slots, mask) in static.windowed.items():
            _fill_window(slots, mask, window_columns(seqs, 1, w), [1] * len(seqs), w)

    def static_extend(
        self, q_len: int, width: int, device: torch.device, rows: int = 1
    ) -> list[_Group]:
        """One group of fixed shape: `rows` sequences of `q_len` query tokens each (padded) over
        contexts of `width` columns (CUDA graphs for short extends and for verifies, see
        cuda_graphs.ExtendGraphs and VerifyGraphs). Row b's queries are flat tokens
        b * q_len .. (b + 1) * q_len - 1."""
        group = _Group(
            token_idx=torch.arange(rows * q_len, device=device).view(rows, q_len),
            ctx_slots=torch.zeros(rows, width, dtype=torch.int64, device=device),
            mask=torch.zeros(rows, 1, q_len, width, dtype=torch.bool, device=device),
            stacked_masks=None,
        )
        group.windowed = {
            w: _static_window(rows, q_len, min(width, w - 1 + q_len), device) for w in self.windows
        }
        return [group]

    def fill_rows(self, static: list[_Group], seqs: list[SeqSpec]) -> None:
        """Write `seqs` (each at most q_len new tokens) into `static`'s first rows; query rows
        past a sequence's tokens, and rows past the sequences, are padding that sees only
        column 0 (slot 0, never read by a real row)."""
        (static,) = static
        rows, _, q_len, width = static.mask.shape
        ctx = torch.zeros(rows, width, dtype=torch.int64)
        mask = torch.zeros(rows, q_len, width, dtype=torch.bool)
        mask[:, :, 0] = True
        for b, seq in enumerate(seqs):
            ctx[b, : seq.ctx_len] = seq.ctx_slots
            mask[b, : seq.q_len] = context_mask(torch.tensor([seq.ctx_len]), seq.q_len, width)[0]
        static.ctx_slots.copy_(to_device(ctx, static.ctx_slots.device), non_blocking=True)
        static.mask.copy_(to_device(mask[:, None], static.mask.device), non_blocking=True)
        for w, (slots, wmask) in static.windowed.items():
            cols = [window_columns([s], s.q_len, w)[0] for s in seqs]
            _fill_window(slots, wmask, cols, [s.q_len for s in seqs], w)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: ForwardMeta,
        scaling: float,
        window: int | None = None,
    ) -> torch.Tensor:
        if window is not None and window not in self.windows:
            raise RuntimeError(f"layer {layer}'s sliding window {window} was not planned for")
        k_pool, v_pool, apart = meta.kv_pool.layer_kv(layer)  # [slots, KVH, D]
        n_tokens, n_heads, head_dim = q.shape[2], q.shape[1], q.shape[3]
        out = q.new_empty(n_tokens, n_heads, head_dim)
        q_tokens = q[0].transpose(0, 1)  # [T, H, D]
        for g in meta.plan:
            banded = g.window_masks.get(window) if window is not None else None
            context = _extend_context(g, window, apart)
            if context is not None:  # the prefill kernel over the pool in place
                s, e = g.fresh or g.rows or (0, 0)
                if e:
                    out[s:e] = cpu_extend_kernel.extend_attend(
                        q_tokens[s:e], k_pool, v_pool, *context, scaling, window
                    )
                else:
                    rows = g.token_idx.reshape(-1)
                    out[rows] = cpu_extend_kernel.extend_attend(
                        q_tokens[rows], k_pool, v_pool, *context, scaling, window
                    )
                continue
            if g.fresh is not None:
                s, e = g.fresh
                o = F.scaled_dot_product_attention(
                    q[:, :, s:e],
                    k[:, :, s:e],
                    v[:, :, s:e],
                    attn_mask=banded,
                    is_causal=banded is None and e - s > 1,
                    scale=scaling,
                    enable_gqa=True,
                )  # [1, H, q, D]
                out[s:e] = o[0].transpose(0, 1)
                continue
            slots, mask, key = g.ctx_slots, g.mask, None
            if window is not None and window in g.windowed:
                (slots, mask), key = g.windowed[window], window
            elif apart:
                raise RuntimeError(f"layer {layer} reads sliding slots this plan did not map")
            kernel = self.decode_kernel
            if kernel is not None and key in g.decode and kernel.scale == scaling:
                if g.rows == (0, n_tokens):  # a step of decodes only: the kernel's output is
                    # the layer's (no copy into `out`; this runs 30 times a step, on cold caches)
                    return kernel(q_tokens.contiguous(), k_pool, v_pool, *g.decode[key])[None]
                if g.rows is not None:
                    s, e = g.rows
                    out[s:e] = kernel(q_tokens[s:e].contiguous(), k_pool, v_pool, *g.decode[key])
                else:  # a row's tokens consecutive, as the kernel takes them
                    rows = g.token_idx.reshape(-1)
                    out[rows] = kernel(q_tokens[rows], k_pool, v_pool, *g.decode[key])
                continue
            qg = q_tokens[g.token_idx].transpose(1, 2)  # [B, H, q, D]
            kg = gather_rows(k_pool, slots).transpose(1, 2).to(q.dtype)  # [B, KVH, Lmax, D]
            vg = gather_rows(v_pool, slots).transpose(1, 2).to(q.dtype)
            masks = g.stacked_masks.setdefault(key, {}) if g.stacked_masks is not None else None
            o = grouped_attention(qg, kg, vg, mask, scaling, masks)  # [B, H, q, D]
            out[g.token_idx.reshape(-1)] = o.transpose(1, 2).reshape(-1, n_heads, head_dim)
        return out.unsqueeze(0)


def _extend_context(
    g: _Group, window: int | None, apart: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The slots and lengths the prefill kernel reads for a layer (of `window`, None: full
    attention) of group `g`, or None where the kernel does not take it: the window's columns
    where the plan narrowed them (a window that cuts a context, or sliding KV kept apart),
    else the whole contexts, which the kernel bands to the window itself."""
    if g.extend is None:
        return None
    if window is not None and window in g.extend_windowed:
        return g.extend_windowed[window]
    return None if apart else g.extend


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    masks: dict | None = None,
) -> torch.Tensor:
    """`scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)` for q [B, H, q, D]
    over k, v [B, KVH, L, D], `mask` boolean [B, 1, q, L] or None. On a CPU the query heads
    that share a K/V head are stacked as the rows of one query ([B, KVH, G * q, D], the mask
    repeated for each): every row's sums are the same (rows are independent: bit-identical in
    bf16; a single fp32 row's GEMM sums in another order, within 1e-6), but torch's CPU kernel
    then runs fewer, larger blocks, and its cost at these sizes is the per-block GEMM calls.
    The stacked mask is additive (0 / -inf in the query's dtype, what SDPA turns a boolean
    mask into on every call) and built once into `masks` when given: a forward's layers share
    it. docs/benchmarks.md has the speedups (SmolLM2's 3 heads a group, bf16, 2 cores)."""
    b, heads, q_len, d = q.shape
    group = heads // k.shape[1]
    if group == 1 or q.device.type != "cpu":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1
        )
    stacked = q.reshape(b, k.shape[1], group * q_len, d)
    if mask is not None:
        built = masks.get(q.dtype) if masks is not None else None
        if built is None:
            rows = mask.expand(b, 1, q_len, mask.shape[-1]).repeat(1, 1, group, 1)
            built = torch.zeros(rows.shape, dtype=q.dtype).masked_fill_(~rows, float("-inf"))
            if masks is not None:
                masks[q.dtype] = built
        mask = built
    o = F.scaled_dot_product_attention(stacked, k, v, attn_mask=mask, scale=scale)
    return o.view(b, heads, q_len, d)


def gather_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`pool[index]` for a 2-D index ([B, L] slots -> [B, L, KVH, D]) through `index_select`,
    which copies whole rows at a time; advanced indexing (`aten::index`) copied the same values
    slowly enough on CPU to cost decode steps 5-19% (benchmarks/paged_gather.py)."""
    rows = pool.index_select(0, index.reshape(-1))
    return rows.view(*index.shape, *pool.shape[1:])


def _kernel_slots(
    slots: torch.Tensor, lens: torch.Tensor, chunks: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`slots` part-padded for `chunks` (`part_padded`), and `lens`, on the device."""
    return to_device(part_padded(slots, chunks), device), to_device(lens, device)


def _static_window(
    batch_size: int, q_len: int, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.zeros(batch_size, width, dtype=torch.int64, device=device)
    return slots, torch.zeros(batch_size, 1, q_len, width, dtype=torch.bool, device=device)


def _fill_window(
    slots: torch.Tensor,
    mask: torch.Tensor,
    cols: list[torch.Tensor],
    qs: list[int],
    window: int,
) -> None:
    """Write a sliding layer's columns into static buffers (`qs`: each row's new tokens);
    rows (and query rows) past the real ones are padding that sees column 0 (slot 0) only."""
    batch_size, _, q_len, width = mask.shape
    host_slots = torch.zeros(batch_size, width, dtype=torch.int64)
    host_mask = torch.zeros(batch_size, q_len, width, dtype=torch.bool)
    host_mask[:, :, 0] = True
    for b, (c, n) in enumerate(zip(cols, qs, strict=True)):
        host_slots[b, : c.numel()] = c
        host_mask[b, :n] = context_mask(torch.tensor([c.numel()]), n, width, window)[0]
    slots.copy_(to_device(host_slots, slots.device), non_blocking=True)
    mask.copy_(to_device(host_mask[:, None], mask.device), non_blocking=True)
