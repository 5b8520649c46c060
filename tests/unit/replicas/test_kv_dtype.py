"""`cache.kv_dtype: bfloat16` under a float32 model: the pool holds bf16 (half the bytes a
token), every token's K/V is rounded when written and attention reads it so, its own step
included. The reference is transformers' `generate` with its SDPA attention reading K/V
rounded the same way (`tests.models.over_rounded_kv`): greedy answers equal it token for
token on every path a decode step can take on a CPU (the eager gather and SDPA, the
in-place CPU kernel, the decode step package's formula and its kernel, run eagerly here; a
real package build is in test_compiled_decode.py), for sessions, verifies, the host tier and
a sliding-window model (Gemma 3) too, and differ from the float32 reference's on some of these
prompts, so the rounding is not a no-op."""

from __future__ import annotations

import pytest
import torch

from sessionserve.errors import InvalidConfigError
from sessionserve.replicas import assembly
from sessionserve.replicas.attention import cpu_decode_kernel
from sessionserve.wire import SamplingParams
from tests.models import (
    GEMMA3_SHAPE,
    hf_greedy,
    over_rounded_kv,
    tiny_engine,
    tiny_model,
)
from tests.unit.replicas.test_compiled_decode import with_eager_decode

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
PROMPTS = [[5 + (7 * i) % 200 for i in range(n)] for n in (3, 20, 41, 70)]
PATHS = ["eager", "cpu_kernel", "step_formula", "step_kernel"]


def bf16_kv_engine(model, path: str, tmp_path, **kw):
    """An engine over `model` with a bf16 pool whose decode steps take `path`."""
    if "kernel" in path and not cpu_decode_kernel.load():
        pytest.skip(f"the CPU decode kernel cannot be used here: {cpu_decode_kernel.why_not()}")
    engine = tiny_engine(model, kv_dtype="bfloat16", **kw)
    runner = engine.runner
    if path == "cpu_kernel":
        assembly.install_decode_kernel(runner.backend, runner.model, runner.kv_pool, tmp_path)
        assert runner.backend.decode_kernel is not None
    elif path.startswith("step_"):
        with_eager_decode(engine, attention_kernel=path == "step_kernel")
    return engine


def assert_as_transformers_over_bf16_kv(reference, prompt: list[int], r) -> None:
    """Greedy tokens equal `generate`'s over bf16 K/V (`reference`: `over_rounded_kv`), and
    each token's logprob the one the reference's forward gives it, within 1e-4 (fp32 paths
    sum in other orders: ~1e-6 here; attending to a token's own K/V unrounded in its own
    step moved them ~3e-3)."""
    assert r.output_ids == hf_greedy(reference, prompt, len(r.output_ids))
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + r.output_ids[:-1]])).logits[0]
    want = torch.log_softmax(logits[len(prompt) - 1 :], -1)
    want = want[torch.arange(len(r.output_ids)), torch.tensor(r.output_ids)]
    assert [x.logprob for x in r.logprobs] == pytest.approx(want.tolist(), abs=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_bf16_kv_answers_as_transformers_attending_over_bf16_kv(path, tmp_path) -> None:
    model = tiny_model("llama", seed=3)
    engine = bf16_kv_engine(model, path, tmp_path)
    pool = engine.runner.kv_pool
    assert next(engine.runner.model.parameters()).dtype is torch.float32
    assert pool.dtype is torch.bfloat16
    assert pool.nbytes() * 2 == tiny_engine(model).runner.kv_pool.nbytes()  # same slots
    got = engine.generate(PROMPTS, GREEDY)
    reference = over_rounded_kv(model, torch.bfloat16)
    for r, prompt in zip(got, PROMPTS, strict=True):
        assert_as_transformers_over_bf16_kv(reference, prompt, r)
    fp32 = [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]
    assert any(r.output_ids != want for r, want in zip(got, fp32, strict=True))
    if path.startswith("step_"):
        assert engine.runner.compiled_decode.calls >= GREEDY.max_tokens - 1
    engine.check_memory()


@pytest.mark.parametrize("path", ["eager", "step_kernel"])
def test_bf16_kv_verifies_keep_the_plain_answers(path, tmp_path) -> None:
    """History drafts verified over a bf16 pool (rows of several tokens; rejected drafts'
    slots freed): greedy answers equal transformers' over bf16 K/V."""
    model = tiny_model("llama", seed=3)
    engine = bf16_kv_engine(model, path, tmp_path, history_drafts=True)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [12]]
    reference = over_rounded_kv(model, torch.bfloat16)
    for r, prompt in zip(engine.generate(prompts, GREEDY), prompts, strict=True):
        assert r.output_ids == hf_greedy(reference, prompt, GREEDY.max_tokens)
    assert engine.spec_stats.steps > 0
    engine.check_memory()


@pytest.mark.parametrize("path", ["eager", "step_kernel"])
def test_bf16_kv_session_turns_equal_full_history_requests(path, tmp_path) -> None:
    """Sampled with seeds: a session's turns (its KV kept in bf16 between them) give what a
    bf16-KV engine without sessions or a radix cache gives the whole history, turn by turn,
    with the strict memory check after each."""
    model = tiny_model("qwen2", seed=5)
    g = torch.Generator().manual_seed(4)
    turns = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (30, 9, 50)]
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11)
    sessions = bf16_kv_engine(model, path, tmp_path)
    plain = bf16_kv_engine(model, path, tmp_path, radix=False)
    sid, history = sessions.open_session(), []
    for i, turn in enumerate(turns):
        (r,) = sessions.generate([turn], sampled, session_id=sid)
        history += turn
        (want,) = plain.generate([history], sampled)
        assert r.output_ids == want.output_ids, f"turn {i}"
        assert r.cached_tokens == (len(history) - len(turn) - 1 if i else 0)
        history += r.output_ids
        sessions.check_memory()
    sessions.close_session(sid)
    sessions.checker.check_idle()


def test_a_backend_reading_kv_in_the_models_dtype_refuses_another(monkeypatch) -> None:
    """FlashInfer reads the KV in the model's dtype: a kv_dtype other than the model's is a
    configuration error that says what to change, not wrong answers."""

    class ModelDtypeOnly:
        name = "flashinfer"

    monkeypatch.setattr(assembly, "select_backend", lambda *a, **kw: ModelDtypeOnly())
    with pytest.raises(InvalidConfigError, match="attention_backend: torch, or kv_dtype: auto"):
        tiny_engine(kv_dtype="bfloat16")


def test_a_bf16_session_parks_in_half_the_host_bytes_and_answers_as_if_resident() -> None:
    """The host tier copies the pool's bytes: a session parked from a bf16 pool takes half of
    what the same session takes from a float32 pool, and comes back bit for bit (greedy
    tokens and logprobs equal the resident session's)."""
    model = tiny_model("llama", seed=3)
    greedy = SamplingParams(max_tokens=10, temperature=0, logprobs=True, ignore_eos=True)
    turns = [[3 + (t * 13 + j * 7) % 240 for j in range(n)] for t, n in enumerate((300, 9))]
    parked_bytes = {}
    for kv_dtype in ("auto", "bfloat16"):
        resident = tiny_engine(model, kv_dtype=kv_dtype)
        tiered = tiny_engine(model, kv_dtype=kv_dtype, host_tier_bytes=64 << 20)
        sids = {e: e.open_session("s") for e in (resident, tiered)}
        for i, turn in enumerate(turns):
            if i:
                assert tiered.park_session("s")
                parked_bytes[kv_dtype] = tiered.checker.check_idle().host_bytes
            (want,) = resident.generate([turn], greedy, session_id=sids[resident])
            (r,) = tiered.generate([turn], greedy, session_id=sids[tiered])
            assert r.output_ids == want.output_ids
            assert [x.logprob for x in r.logprobs] == [x.logprob for x in want.logprobs]
            assert r.cached_source == ("host" if i else "none")
        tiered.close_session("s")
        assert tiered.checker.check_idle().host_bytes == 0
    assert parked_bytes["bfloat16"] * 2 == parked_bytes["auto"] > 0


def test_a_sliding_window_session_over_bf16_kv_answers_as_transformers() -> None:
    """Gemma 3's sliding layers keep their KV apart, in the pool's dtype too: session turns
    several windows long, each as transformers over bf16 K/V on the whole history."""
    model = tiny_model("gemma3", seed=1)
    window = GEMMA3_SHAPE["sliding_window"]
    engine = tiny_engine(model, kv_dtype="bfloat16", page_size=4, prefill=window + 3)
    assert engine.runner.kv_pool.has_sliding
    assert engine.runner.kv_pool.sliding_k.dtype is torch.bfloat16
    reference = over_rounded_kv(model, torch.bfloat16)
    greedy = SamplingParams(max_tokens=window, temperature=0, ignore_eos=True, logprobs=True)
    sid, history = engine.open_session(), []
    for turn in range(3):
        new = [3 + (turn * 17 + j * 5) % 240 for j in range(window + 7 * turn)]
        (r,) = engine.generate([new], greedy, session_id=sid)
        history += new
        assert r.cached_tokens == (0 if turn == 0 else len(history) - len(new) - 1)
        assert_as_transformers_over_bf16_kv(reference, history, r)
        history += r.output_ids
        engine.check_memory()
    assert len(history) > 4 * window
    engine.close_session(sid)
    engine.checker.check_idle()
