"""The decode step compiled whole (compiled_decode.py, `engine.compile_decode`): attention
inside the graph, the new token merged into the flash-decoding sum as one more part, every
layer's new K/V returned and written after the call.

Checked without a build: the formula with the new token equals the formula over a pool the
token was written to first (any head grouping, parts, empty contexts); `DecodeStep` run
eagerly token by token over its own pool gives transformers' logits and hidden states of the
whole sequence; and an engine whose runner runs `DecodeStep` eagerly as its decode package
answers as the plain engine and as transformers' `generate` (Llama, Qwen2's q/k/v biases),
over batches, sessions and overlap scheduling, with the strict memory check after every step.
Then one real AOTInductor build (a tiny Llama, ~30-60 s on 2 cores, by a build process as
`compile: auto` builds it): the package's steps give
the eager engine's tokens and logprobs, on pools of any size (the package's pool dimension is
dynamic: one exported for a fixed pool read the wrong rows of a larger one), its attention
the hand-written CPU kernel where this machine builds it (test_cpu_decode_kernel.py)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from sessionserve.cache import KVShape
from sessionserve.replicas import aoti_call, compiled_decode, compiled_forward, cpu_linear
from sessionserve.replicas.attention import cpu_decode_kernel, install
from sessionserve.replicas.attention.base import SeqSpec
from sessionserve.replicas.attention.inplace_decode import decode_attention
from sessionserve.replicas.compiled_attention import kernel_chunks
from sessionserve.replicas.compiled_decode import CompiledDecode, DecodeStep
from sessionserve.replicas.compiled_forward import CompilePlan
from sessionserve.replicas.hidden_states import decoder_features
from sessionserve.replicas.step import ForwardBatch
from sessionserve.wire import SamplingParams
from tests.models import hf_greedy, over_rounded_kv, session_turns, tiny_engine, tiny_model

pytestmark = pytest.mark.slow  # real package builds (25-50 s each)
CHUNKS = 4


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (9, 3)])
@pytest.mark.parametrize("chunks", [1, 4])
def test_the_new_token_as_a_part_equals_writing_it_first(heads, kv_heads, chunks) -> None:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads + chunks)
    batch, width, dim, slots_in_pool = 4, 4 * chunks, 16, 200
    k_pool = torch.randn(slots_in_pool, kv_heads, dim, generator=g)
    v_pool = torch.randn(slots_in_pool, kv_heads, dim, generator=g)
    query = torch.randn(batch, heads, dim, generator=g)
    new_k = torch.randn(batch, kv_heads, dim, generator=g)
    new_v = torch.randn(batch, kv_heads, dim, generator=g)
    slots = torch.randperm(slots_in_pool - batch, generator=g)[: batch * width].view(batch, width)
    lens = torch.tensor([0, 1, width - 1, width])  # an empty context too: the token alone
    got = decode_attention(query, k_pool, v_pool, slots, lens, chunks, 0.3, new_k, new_v)
    # the reference: write each row's token to a free slot, append it to the row's context
    own = torch.arange(slots_in_pool - batch, slots_in_pool)
    k_pool[own], v_pool[own] = new_k, new_v
    wide = torch.cat([slots, torch.zeros(batch, chunks, dtype=torch.int64)], 1)
    wide[torch.arange(batch), lens] = own
    want = decode_attention(query, k_pool, v_pool, wide, lens + 1, chunks, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a row with no context answers its own value (per KV head)
    torch.testing.assert_close(got[0], new_v[0].repeat_interleave(heads // kv_heads, 0))


def reference_model(model):
    """`model` as transformers runs it (SDPA attention), for full-sequence references."""
    plain = copy.deepcopy(model)
    plain.set_attn_implementation("sdpa")
    return plain


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_step_token_by_token_gives_the_whole_sequence_forward(arch) -> None:
    """`DecodeStep` eagerly, one token a step over its own pool (each step's K/V written to
    the token's slot, as `CompiledDecode.run` does), two rows at once: logits and the
    feature layers' hidden states equal transformers' forward over the whole sequence."""
    model = tiny_model(arch, seed=5)
    layers = (0, 1)
    plain = reference_model(model)
    ours = copy.deepcopy(model)
    install(ours)  # our attention function (the runner's model has it)
    step = DecodeStep(ours, CHUNKS, layers).eval()
    shape = KVShape.from_hf_config(model.config)
    k_pool = torch.zeros(shape.num_layers, 64, shape.num_kv_heads, shape.head_dim)
    v_pool = torch.zeros_like(k_pool)
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(3, model.config.vocab_size, (2, 9), generator=g)
    rows_slots = torch.stack([torch.arange(10, 19), torch.arange(40, 49)])  # scattered rows
    logits, features = [], []
    with torch.inference_mode():
        for t in range(seqs.shape[1]):
            old = torch.nn.functional.pad(rows_slots[:, :t], (0, CHUNKS * 3 - t))
            t2 = torch.full((2,), t)
            rows = torch.arange(2)  # the logits wanted; the tokens as they are (no padding)
            out = step(seqs[:, t], t2, k_pool, v_pool, old, t2, rows, rows, rows)
            k_pool.index_copy_(1, rows_slots[:, t], out[2])
            v_pool.index_copy_(1, rows_slots[:, t], out[3])
            logits.append(out[0])
            features.append(out[1])
        positions = torch.arange(seqs.shape[1]).expand(2, -1)
        last, want_features = decoder_features(plain.get_decoder(), seqs, positions, layers)
        want_logits = plain.get_output_embeddings()(last)
    torch.testing.assert_close(torch.stack(logits, 1), want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(features, 1), want_features, atol=1e-5, rtol=1e-5)


class EagerDecode(CompiledDecode):
    """`DecodeStep` run eagerly in a `CompiledDecode`'s place: the runner's decode path (slot
    tables, pending tokens, the one write of every layer's K/V) without a build."""

    def __init__(
        self,
        step: DecodeStep,
        max_tokens: int = 32,
        linear_kernel: bool = False,
        block_kernel: bool = False,
    ) -> None:
        self.package = None
        self.step = step
        self.max_tokens, self.min_tokens, self.chunks = max_tokens, 1, step.chunks
        self.query_tokens = step.query_tokens
        self.window, self.sliding_apart = step.window, step.sliding_apart
        # (only the runner's choice of steps reads these here)
        self.linear_kernel, self.block_kernel = linear_kernel, block_kernel
        self.block_decoder = block_kernel
        self.calls = 0

        def run(*args: torch.Tensor) -> list[torch.Tensor]:
            self.calls += 1
            return list(step(*args))

        self._fn = run


def with_eager_decode(engine, attention_kernel: bool = False) -> EagerDecode:
    runner = engine.runner
    step = DecodeStep(
        runner.model,
        CHUNKS,
        runner.feature_layers,
        attention_kernel,
        sliding_apart=runner.kv_pool.has_sliding,
    )
    decode = EagerDecode(step.eval())
    runner.compiled_decode = decode
    return decode


def inputs_for(vocab: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 30, 70)]


def assert_same_answers(got, want, inputs, model, atol: float) -> None:
    for a, b, prompt in zip(got, want, inputs, strict=True):
        assert a.output_ids == b.output_ids
        assert a.output_ids == hf_greedy(model, prompt, len(a.output_ids))[: len(a.output_ids)]
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=atol)


@pytest.mark.parametrize("attention", ["formula", "cpu_kernel"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_engine_running_the_step_answers_as_the_plain_engine(arch, overlap, attention) -> None:
    """Its layers attending through `decode_attention` (what inductor compiles) or the
    hand-written CPU kernel (cpu_decode_kernel.py, where this machine can build it)."""
    if attention == "cpu_kernel" and not cpu_decode_kernel.load():
        pytest.skip(f"the CPU decode kernel cannot be used here: {cpu_decode_kernel.why_not()}")
    model = tiny_model(arch, seed=6)
    whole = tiny_engine(model, prefill=40, overlap=overlap)
    decode = with_eager_decode(whole, attention == "cpu_kernel")
    plain = tiny_engine(model, prefill=40, overlap=overlap)
    greedy = SamplingParams(max_tokens=20, temperature=0, logprobs=True)
    inputs = inputs_for(model.config.vocab_size)
    got = whole.generate(inputs, greedy)
    assert_same_answers(got, plain.generate(inputs, greedy), inputs, model, atol=1e-5)
    assert decode.calls >= 19  # every decode step
    g = torch.Generator().manual_seed(4)
    turns = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (30, 9, 50)]
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11)
    results = [session_turns(e, turns, sampled) for e in (whole, plain)]
    assert results[0] == results[1]
    assert results[0][-1][1] > 0  # the last turn reused the session's KV
    whole.check_memory()


def recorded_shapes(decode: CompiledDecode) -> list[tuple[int, int]]:
    """From now on, the (tokens, rows) of each call of `decode`'s package."""
    shapes: list[tuple[int, int]] = []
    inner = decode._fn

    def counted(*args: torch.Tensor) -> list[torch.Tensor]:
        shapes.append((args[0].numel(), args[4].shape[0]))
        return inner(*args)

    decode._fn = counted
    return shapes


@pytest.fixture
def kernel() -> None:
    if not cpu_decode_kernel.load():
        pytest.skip(f"the CPU decode kernel cannot be used here: {cpu_decode_kernel.why_not()}")


@pytest.mark.usefixtures("kernel")
def test_rows_of_unequal_widths_answer_as_the_forward() -> None:
    """Through the CPU kernel a step's rows may add several tokens each (1, 3, 2 and 4 here,
    one row with no old context): padded to the widest for the attention alone (the
    linears see the 10 tokens, not 16), the step's logits (of the tokens asked for),
    features and every layer's written K/V equal the eager forward's."""
    model = tiny_model("llama", seed=7)
    runner = tiny_engine(model).runner
    pool = runner.kv_pool
    g = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    widths, old = [1, 3, 2, 4], [7, 20, 0, 5]
    free = torch.randperm(pool.k.shape[1] - 1, generator=g) + 1
    seqs, ids, positions, out_slots, start = [], [], [], [], 0
    for q, o in zip(widths, old, strict=True):
        ctx = free[start : start + o + q]
        start += o + q
        seqs.append(SeqSpec(q, ctx))
        ids += torch.randint(3, model.config.vocab_size, (q,), generator=g).tolist()
        positions += range(o, o + q)
        out_slots.append(ctx[o:])
    wanted = torch.tensor([0, 2, 3, 5, 6, 7, 8, 9])  # not the third row's first token
    batch = ForwardBatch(
        torch.tensor(ids), torch.tensor(positions), torch.cat(out_slots), seqs, wanted, True
    )
    runner.compiled_decode = None
    want_logits, want_hidden = runner.forward(batch)
    want_k, want_v = pool.k[:, batch.out_slots].clone(), pool.v[:, batch.out_slots].clone()
    pool.k[:, batch.out_slots] = 0
    pool.v[:, batch.out_slots] = 0
    decode = with_eager_decode(tiny_engine(model), attention_kernel=True)
    assert decode.query_tokens >= 4 and decode.takes(seqs)
    runner.compiled_decode = decode
    linear_rows: list[int] = []
    q_proj = decode.step.decoder.layers[0].self_attn.q_proj
    hook = q_proj.register_forward_hook(lambda m, args, out: linear_rows.append(args[0].numel()))
    try:
        got_logits, got_hidden = runner.forward(batch)
    finally:
        hook.remove()
    assert decode.calls == 1
    assert linear_rows == [sum(widths) * q_proj.in_features]
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_hidden, want_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.k[:, batch.out_slots], want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.v[:, batch.out_slots], want_v, atol=1e-5, rtol=1e-5)
    # a tree, a row wider than the kernel takes, sliding slots or more tokens than the
    # forward's package takes are not the package's
    tree = SeqSpec(2, seqs[0].ctx_slots, torch.ones(2, 2, dtype=torch.bool))
    assert not decode.takes([tree])
    assert not decode.takes([SeqSpec(decode.query_tokens + 1, free[:40])])
    assert not decode.takes(seqs, sliding=True)
    assert not decode.takes([seqs[1]] * (decode.max_tokens // 3 + 1))  # too many tokens
    # padded, far more than the package's tokens; their own, within them
    assert decode.takes([seqs[3]] + [SeqSpec(1, free[:9])] * (decode.max_tokens - 4))


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_verifies_and_short_turns_run_the_step(overlap) -> None:
    """History drafts' verifies (k + 1 tokens a row, rows with and without drafts padded
    alike) and short session turns run the decode step (its layers on the CPU kernel): greedy
    answers equal the plain engine's and transformers', the strict memory check after every
    step."""
    model = tiny_model("llama", seed=6)
    engine = tiny_engine(model, history_drafts=True, overlap=overlap)
    decode = with_eager_decode(engine, attention_kernel=True)
    plain = tiny_engine(model, overlap=overlap)
    shapes = recorded_shapes(decode)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [12], [30, 31, 32]]
    got = engine.generate(prompts, greedy)
    for a, b, prompt in zip(got, plain.generate(prompts, greedy), prompts, strict=True):
        assert a.output_ids == b.output_ids == hf_greedy(model, prompt, 16)[: len(a.output_ids)]
    assert engine.spec_stats.steps > 0
    assert any(tokens > rows for tokens, rows in shapes)  # verifies ran the step
    sid = engine.open_session()
    history: list[int] = []
    for turn in range(3):
        new = [20 + turn, 21, 22]  # short turns: 3 new tokens over the history
        calls = len(shapes)
        (r,) = engine.generate([new], SamplingParams(max_tokens=5, temperature=0), session_id=sid)
        # the turn's prefill ran the step (after the first turn with the last answer's
        # last token, whose K/V no step has computed yet)
        assert (3 + (turn > 0), 1) in shapes[calls:], turn
        history += new
        assert r.output_ids == hf_greedy(model, history, 5)[: len(r.output_ids)], turn
        history += r.output_ids
    engine.check_memory()


@pytest.mark.parametrize("attention", ["formula", "cpu_kernel"])
@pytest.mark.parametrize("apart", [True, False], ids=["sliding_kv_apart", "one_pool"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_sliding_window_layers_attend_over_their_windows_in_the_step(
    attention, apart, overlap
) -> None:
    """Gemma 3's layout (two of three layers see the last 8 tokens), the sliding layers' KV
    kept apart or in the one pool: decode steps run the step with contexts far past the
    window, and through the CPU kernel (rows of several tokens: verifies, short session
    turns) rows run it where no window cuts their context, and no other. Greedy
    answers and logprobs equal the plain engine's and transformers', the strict memory check
    after every step."""
    kernel = attention == "cpu_kernel"
    if kernel and not cpu_decode_kernel.load():
        pytest.skip(f"the CPU decode kernel cannot be used here: {cpu_decode_kernel.why_not()}")
    model = tiny_model("gemma3", seed=7)
    engine = tiny_engine(model, overlap=overlap, sliding_window_kv=apart)
    decode = with_eager_decode(engine, attention_kernel=kernel)
    assert (decode.window, decode.sliding_apart) == (8, apart)
    plain = tiny_engine(model, overlap=overlap, sliding_window_kv=apart)
    shapes = recorded_shapes(decode)
    greedy = SamplingParams(max_tokens=24, temperature=0, logprobs=True)
    inputs = inputs_for(model.config.vocab_size)  # 3, 30 and 70 tokens: the window is 8
    got = engine.generate(inputs, greedy)
    assert_same_answers(got, plain.generate(inputs, greedy), inputs, model, atol=1e-5)
    assert decode.calls >= 23
    if kernel:  # a row of several tokens runs the step only where no window cuts it
        short = SeqSpec(3, torch.arange(1, 8), sliding_slots=torch.arange(1, 8) if apart else None)
        long = SeqSpec(3, torch.arange(1, 12), sliding_slots=torch.arange(4, 14) if apart else None)
        assert decode.takes([short], apart) and not decode.takes([short, long], apart)
        assert not decode.takes([short], not apart)  # a package is built for its pool layout
    sid = engine.open_session()
    history: list[int] = []
    for turn in range(3):
        new = [20 + turn, 21, 22]
        calls = len(shapes)
        (r,) = engine.generate([new], SamplingParams(max_tokens=5, temperature=0), session_id=sid)
        ran_whole = (3 + (turn > 0), 1) in shapes[calls:]
        assert ran_whole == (kernel and len(history) + 4 <= 8), turn
        history += new
        assert r.output_ids == hf_greedy(model, history, 5)[: len(r.output_ids)], turn
        history += r.output_ids
    engine.check_memory()


class ForwardRange:
    """Stands in for the forward's (or the prefill) package: runs steps of
    `min_tokens..max_tokens` tokens through the runner's eager forward, counting them."""

    limited = False  # as a package that covers its range (CompiledForward.limit_to)

    def __init__(self, runner, min_tokens: int, max_tokens: int) -> None:
        self.runner, self.min_tokens, self.max_tokens = runner, min_tokens, max_tokens
        self.steps: list[int] = []

    def accepts(self, num_tokens: int) -> bool:
        return self.min_tokens <= num_tokens <= self.max_tokens

    def run(self, ids, positions, logit_idx, meta):
        self.steps.append(len(ids))
        last, hidden = self.runner.decode_hidden(ids, positions, meta)
        return self.runner.lm_head(last[logit_idx]), hidden


@pytest.mark.parametrize(
    "other",
    [
        "eager",
        "prefill_package",
        "prefill_package_linear_kernel",
        "prefill_package_block_kernel",
    ],
)
def test_the_step_runs_past_the_forwards_range_where_steps_would_run_eagerly(other) -> None:
    """A decode step package wider than the forward's (KERNEL_MAX_TOKENS, its linears the
    few-row kernel) runs decode steps of more requests than the forward's package takes,
    which would otherwise run eagerly, and rows of a few tokens however they pad (padding
    costs the attention alone), judged by their own tokens; where a prefill package was
    chosen for those lengths, it keeps them, unless the decode package's linears read each
    weight once for all rows (the few-row kernel, or the 4-bit package's block kernel: then
    it takes them as it would from the eager forward). Answers equal the plain engine's and
    transformers'."""
    model = tiny_model("llama", seed=8)
    engine = tiny_engine(model, max_rows=48)
    runner = engine.runner
    step = DecodeStep(runner.model, CHUNKS, runner.feature_layers, False)
    decode = EagerDecode(
        step.eval(),
        max_tokens=compiled_decode.KERNEL_MAX_TOKENS,
        linear_kernel=other.endswith("linear_kernel"),
        block_kernel=other.endswith("block_kernel"),
    )
    runner.compiled_decode = decode
    runner.compiled = ForwardRange(runner, 1, 8)
    if other != "eager":
        runner.compiled_prefill = ForwardRange(runner, 9, 512)
    prefill_package = other == "prefill_package"  # the prefill package keeps its steps
    shapes = recorded_shapes(decode)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in range(3, 15)]
    got = engine.generate(prompts, greedy)
    want = tiny_engine(model, max_rows=48).generate(prompts, greedy)
    for a, b, prompt in zip(got, want, prompts, strict=True):
        assert a.output_ids == b.output_ids == hf_greedy(model, prompt, 6)[: len(a.output_ids)]
    wide = [tokens for tokens, _ in shapes if tokens > 8]
    if prefill_package:
        assert not wide and any(n == len(prompts) for n in runner.compiled_prefill.steps)
    else:
        assert len(prompts) in wide  # the 12-request decode steps ran the decode package
    engine.check_memory()

    def step_of(widths: list[int]) -> ForwardBatch:
        n = sum(widths)
        zeros = torch.zeros(n, dtype=torch.int64)
        seqs = [SeqSpec(w, torch.arange(40 + w)) for w in widths]
        return ForwardBatch(zeros, zeros, zeros, seqs, torch.arange(n))

    decode.query_tokens = 4  # as through the CPU kernel (only the choice is checked below)
    takes = {
        (1,) * 12: True,  # past the forward's 8, eager otherwise
        (3,) * 4: True,  # rows of 3 tokens: no padding
        (2, 2, 2, 2, 1): True,  # 9 tokens padded to 10
        (2,) * 4 + (1,) * 6: True,  # 14 tokens padded to 20
        (4,) * 2 + (1,) * 7: True,  # 15 tokens padded to 36: the padding attends, no more
        (4,) + (1,) * 7: True,  # 11 tokens padded to 32
        (4, 1, 1, 1): True,  # 7 tokens padded to 16: the forward's range, by its tokens
        (1,) * 6: True,  # within the forward's range: the decode package, as always
        (4,) * 16 + (1,): False,  # 65 tokens: past the package's 64
        (4,) * 3 + (1,) * 40: True,  # 52 tokens padded to 172: within 64 of its own
    }
    for widths, want in takes.items():
        want = want and (sum(widths) <= 8 or not prefill_package)
        assert runner._takes_decode_package(decode, step_of(list(widths))) == want, widths


def test_plan_decode_compile_resolves_the_config(tmp_path) -> None:
    llama, mistral = tiny_model("llama"), tiny_model("mistral", sliding_window=12)
    forward = CompilePlan(True, "test", tmp_path / "forward.pt2", 32)
    engine = tiny_engine(llama)
    pool = engine.runner.kv_pool
    plan, step = compiled_decode.plan_decode_compile(True, forward, llama, pool)
    assert isinstance(step, DecodeStep)  # the step the key was taken from, compiled as is
    assert step.key_facts()["decode_step"] == compiled_decode.DECODE_FORMAT
    assert plan.enabled and plan.package is not None and plan.package != forward.package
    want = compiled_decode.KERNEL_MAX_TOKENS if step.linear_kernel else 32
    assert plan.max_tokens == want and plan.loads_as.func is CompiledDecode
    assert plan.loads_as.keywords == {
        "query_tokens": step.query_tokens,
        "linear_kernel": step.linear_kernel,
        "window": None,
        "sliding_apart": False,
    }
    for kernel, widest in ((True, compiled_decode.KERNEL_MAX_TOKENS), (False, 32)):
        wide, _ = compiled_decode.plan_decode_compile(True, forward, llama, pool, None, kernel)
        assert wide.max_tokens == widest, kernel  # the kernel's package runs past the forward's
    assert not compiled_decode.plan_decode_compile(False, forward, llama, pool)[0].enabled
    auto = compiled_decode.plan_decode_compile("auto", forward, llama, pool)[0]
    assert not auto.enabled and "not worth it" in auto.reason  # a tiny model
    apart = tiny_engine(mistral).runner.kv_pool  # its window's KV kept apart (the default)
    windowed, windowed_step = compiled_decode.plan_decode_compile(True, forward, mistral, apart)
    assert windowed.enabled and windowed_step is not None and windowed.package != plan.package
    assert (windowed_step.window, windowed_step.sliding_apart) == (12, True)
    assert windowed.loads_as.keywords["window"] == 12
    assert windowed.loads_as.keywords["sliding_apart"] is True
    # auto builds no dense package for it in bf16 (measured no faster), only the 4-bit one
    # from it; in fp32 (the few-row linear kernel) it does
    bf16_mistral = copy.deepcopy(mistral).to(torch.bfloat16)
    assert "sliding-window" in compiled_decode.dense_step_declines("auto", bf16_mistral)
    assert compiled_decode.dense_step_declines(True, bf16_mistral) is None
    assert compiled_decode.dense_step_declines("auto", mistral) is None
    bf16_llama = copy.deepcopy(llama).to(torch.bfloat16)
    assert compiled_decode.dense_step_declines("auto", bf16_llama) is None
    one_pool = compiled_decode.plan_decode_compile(True, forward, mistral, pool)[0]
    assert one_pool.loads_as.keywords["sliding_apart"] is False  # its own package
    assert one_pool.package not in (windowed.package, plan.package)
    on_cuda = CompilePlan(True, "test", None, 32)
    assert not compiled_decode.plan_decode_compile(True, on_cuda, llama, pool)[0].enabled
    eager = CompilePlan(False, "off")
    assert not compiled_decode.plan_decode_compile(True, eager, llama, pool)[0].enabled


@pytest.fixture
def cache_dir(package_cache) -> str:
    return package_cache  # shared with the other modules' builds (tests/unit/replicas/conftest.py)


def built_package(engine, cache_dir: str) -> CompilePlan:
    """The decode package plan of `engine`'s model (compile_max_tokens 32), built if the
    run's cache lacks it as `compile: auto` builds it: by a build process (the step
    crosses to it as a file), where engines with `compile_decode: true` then find it."""
    runner = engine.runner
    forward = compiled_forward.plan_compile(True, runner.model, 32, cache_dir)
    plan, step = compiled_decode.plan_decode_compile(True, forward, runner.model, runner.kv_pool)
    assert plan.package is not None and step is not None
    # where the machine can build it, the package attends through the CPU kernel's C shim
    assert step.attention_kernel == cpu_decode_kernel.load()
    assert step.linear_kernel == cpu_linear.load()  # and its linears through the GEMM kernel
    step = copy.deepcopy(step)  # the build swaps the parameters for fake ones while it traces
    compiled_forward.build_once(
        plan.package, lambda: compiled_forward.build_in_subprocess(step, plan), "building"
    )
    assert plan.package.exists()
    return plan


def test_the_package_answers_as_the_eager_engine_on_any_pool_size(cache_dir) -> None:
    """A real build (compile: true, compile_decode: true), then a second engine with a pool
    of another size loading the same package: both give the eager engine's greedy tokens
    (and transformers'), logprobs within 1e-4 (fp32; fused kernels sum in another order),
    every decode step through the package, the strict memory check after every step."""
    model = tiny_model("llama", seed=4)
    eager = tiny_engine(model, prefill=40)
    plan = built_package(eager, cache_dir)
    greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=True)
    inputs = inputs_for(model.config.vocab_size, seed=7)
    want = eager.generate(inputs, greedy)
    for num_slots in (4096, 1536):
        engine = tiny_engine(
            model,
            prefill=40,
            num_slots=num_slots,
            compile=True,
            compile_decode=True,
            compile_cache_dir=cache_dir,
        )
        decode = engine.runner.compiled_decode
        assert decode is not None, "the decode step package did not install"
        assert decode.package == plan.package
        assert isinstance(decode._fn, aoti_call.ReleasedCall)  # called without the GIL
        shapes = recorded_shapes(decode)
        got = engine.generate(inputs, greedy)
        assert_same_answers(got, want, inputs, model, atol=1e-4)
        assert len(shapes) >= 15, num_slots
        engine.check_memory()


def test_a_sliding_window_models_package_attends_over_its_windows(cache_dir) -> None:
    """A real build for Mistral's layout (every layer over a 12-token window, its KV kept
    apart: the package takes the windows' slots and the sliding stacks as inputs and returns
    their new K/V in the pool's stack order): every decode step of contexts far past the
    window through it, greedy tokens equal the eager engine's and transformers', logprobs
    within 1e-4, the strict memory check after every step. (The forward's package is
    test_compiled_forward.py's Mistral one, built once per run.)"""
    model = tiny_model("mistral", seed=4, sliding_window=12)
    eager = tiny_engine(model, prefill=40)
    assert eager.runner.kv_pool.has_sliding
    plan = built_package(eager, cache_dir)
    engine = tiny_engine(
        model, prefill=40, compile=True, compile_decode=True, compile_cache_dir=cache_dir
    )
    decode = engine.runner.compiled_decode
    assert decode is not None and decode.package == plan.package
    assert (decode.window, decode.sliding_apart) == (12, True)
    shapes = recorded_shapes(decode)
    greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=True)
    inputs = inputs_for(model.config.vocab_size, seed=7)
    assert_same_answers(
        engine.generate(inputs, greedy), eager.generate(inputs, greedy), inputs, model, atol=1e-4
    )
    assert len(shapes) >= 15
    engine.check_memory()


def test_a_bf16_pool_under_a_float32_model_has_its_own_package(cache_dir) -> None:
    """`cache.kv_dtype: bfloat16`: the pool's dtype is in the package's key (a package
    exported for an fp32 pool is not loaded for it), and the package built for it answers
    as transformers attending over bf16-rounded K/V, every decode step through it."""
    model = tiny_model("llama", seed=4)
    fp32, bf16 = tiny_engine(model), tiny_engine(model, kv_dtype="bfloat16")
    forward = compiled_forward.plan_compile(True, fp32.runner.model, 32, cache_dir)
    fp32_plan, _ = compiled_decode.plan_decode_compile(
        True, forward, fp32.runner.model, fp32.runner.kv_pool
    )
    plan = built_package(bf16, cache_dir)
    assert plan.package != fp32_plan.package
    engine = tiny_engine(
        model,
        kv_dtype="bfloat16",
        compile=True,
        compile_decode=True,
        compile_cache_dir=cache_dir,
    )
    decode = engine.runner.compiled_decode
    assert decode is not None and decode.package == plan.package
    shapes = recorded_shapes(decode)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    inputs = inputs_for(model.config.vocab_size, seed=7)
    reference = over_rounded_kv(model, torch.bfloat16)
    for r, prompt in zip(engine.generate(inputs, greedy), inputs, strict=True):
        assert r.output_ids == hf_greedy(reference, prompt, 16)
    assert len(shapes) >= 15
    engine.check_memory()


def test_the_package_runs_verifies_through_the_kernel(cache_dir) -> None:
    """Built with the CPU kernel, the real package also runs history drafts' verifies (rows
    of several tokens): greedy answers equal the eager engine's and transformers'."""
    model = tiny_model("llama", seed=4)
    plan = built_package(tiny_engine(model), cache_dir)
    if not cpu_decode_kernel.load():
        pytest.skip(f"built without the CPU kernel here: {cpu_decode_kernel.why_not()}")
    engine = tiny_engine(
        model,
        history_drafts=True,
        compile=True,
        compile_decode=True,
        compile_cache_dir=cache_dir,
    )
    decode = engine.runner.compiled_decode
    assert decode is not None and decode.package == plan.package and decode.query_tokens > 1
    shapes = recorded_shapes(decode)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [12]]
    got = engine.generate(prompts, greedy)
    for r, prompt in zip(got, prompts, strict=True):
        assert r.output_ids == hf_greedy(model, prompt, 16)[: len(r.output_ids)]
    assert engine.spec_stats.steps > 0 and any(t > rows for t, rows in shapes)
    engine.check_memory()


def test_the_released_call_answers_as_torchs_loader(cache_dir, monkeypatch, caplog) -> None:
    """The package through its C entry points (ctypes, the GIL released) returns what torch's
    loader returns for the same inputs, on a pool of another size; where that cannot load,
    torch's loader runs it, and the log says so."""
    model = tiny_model("llama", seed=4)
    package = built_package(tiny_engine(model), cache_dir).package
    shape = KVShape.from_hf_config(model.config)
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(shape.num_layers, 700, shape.num_kv_heads, shape.head_dim, generator=g)
    width = 3 * kernel_chunks()
    inputs = (
        torch.tensor([5, 9, 11]),
        torch.tensor([4, width, 7]),
        pool,
        pool * 0.5,
        torch.randint(1, 700, (3, width), generator=g),
        torch.tensor([4, width, 7]),
        torch.tensor([2, 0]),
        torch.arange(3),  # one token a row: the attention's rows are the tokens as they are
        torch.arange(3),
    )
    with torch.inference_mode():
        released = aoti_call.ReleasedCall(package)(*inputs)
        loader = compiled_forward.load_flat(package)(*inputs)
        with pytest.raises(TypeError, match="takes 9 tensors, not 7"):  # not an abort
            aoti_call.ReleasedCall(package)(*inputs[:7])
    assert len(released) == len(loader) == 4
    for a, b in zip(released, loader, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)

    def broken(package):
        raise OSError("no such symbol")

    monkeypatch.setattr(aoti_call, "ReleasedCall", broken)
    with caplog.at_level(logging.WARNING, logger=aoti_call.__name__):
        fallback = aoti_call.load_releasing_gil(package)
    assert "runs holding the GIL" in caplog.text
    with torch.inference_mode():
        torch.testing.assert_close(fallback(*inputs)[0], loader[0], atol=0, rtol=0)
