"""Incremental detokenization: the streamed text equals the full decode, multi-byte characters
split across tokens are never sent in halves, and each step decodes only a short window."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sessionserve.replicas.detokenize import IncrementalText
from sessionserve.wire import SamplingParams
from tests.models import tiny_engine

TEXT = "naïve café, Zürich → 東京 😀 ok! " * 60  # 2-, 3- and 4-byte characters


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: every UTF-8 byte is its own token, so each multi-byte
    character is split across 2-4 tokens (the hard case for streaming)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_streamed_text_of_a_long_multibyte_answer_equals_the_full_decode() -> None:
    tok = byte_tokenizer()
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT)  # multi-byte characters really span several tokens
    stream = IncrementalText(tok)
    deltas = [stream.extend([t]) for t in ids]
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 100  # it waited inside characters
    # O(new tokens) per step: each step decodes a window of a few tokens, not the answer
    assert stream.decoded_tokens < 12 * len(ids)


def test_bursts_of_tokens_decode_the_same() -> None:
    """Accepted speculative runs arrive several tokens at a time."""
    tok = byte_tokenizer()
    ids = tok.encode(TEXT)
    stream = IncrementalText(tok)
    out, i, step = [], 0, 1
    while i < len(ids):
        out.append(stream.extend(ids[i : i + step]))
        i, step = i + step, step % 7 + 1
    assert "".join(out) == TEXT and stream.text == TEXT


def test_stop_strings_are_found_incrementally() -> None:
    """A stop string spanning two tokens ends the answer where it completes, and the answer's
    text is cut before it."""
    engine = tiny_engine()
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = engine.generate([[5, 6, 7]], p)[0]
    words = plain.text.split()
    stop = f"{words[3]} {words[4]}"  # spans tokens 4 and 5 of the answer
    first = plain.text.index(stop)
    stopped = engine.generate([[5, 6, 7]], p.model_copy(update={"stop": [stop]}))[0]
    assert stopped.finish_reason == "stop" and stopped.text == plain.text[:first]
    assert stopped.output_ids == plain.output_ids[: len(stopped.output_ids)]
    assert len(stopped.output_ids) == 5


def _stream_bytes(tmp_path, sampling: dict) -> tuple[list, int]:
    """300 tokens from a model over raw bytes through the replica shim: the pieces, and how
    many tokens the tokenizer decoded in all (engine and shim)."""
    import asyncio

    from sessionserve.replicas.server import ReplicaServer
    from sessionserve.wire import GenerateCall
    from tests.models import tiny_model

    tiny_model(vocab_size=256, init_std=0.02).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    srv = ReplicaServer(
        {"model": {"path": str(tmp_path)}, "cache": {"num_slots": 2048, "max_rows": 8}}
    )
    tok, decoded = srv.engine.tokenizer, [0]
    real_decode = tok.decode

    def counting_decode(ids, *a, **kw):
        decoded[0] += len(ids)
        return real_decode(ids, *a, **kw)

    tok.decode = counting_decode
    try:
        prompt = byte_tokenizer().encode("café 東京 😀")
        params = {"max_tokens": 300, "temperature": 1.0, "seed": 3, "ignore_eos": True}
        call = GenerateCall(params | sampling, prompt=prompt)

        async def collect():
            return [p async for p in srv.generate(call)]

        return asyncio.run(collect()), decoded[0]
    finally:
        srv.shutdown()


def test_a_replica_streams_byte_level_output_whole(tmp_path) -> None:
    """Through the replica shim: a model over raw bytes streams 300 tokens (random bytes,
    valid multi-byte sequences among them); the deltas add up to the final answer exactly and
    no delta carries a replacement character the final text does not have there."""
    pieces, _ = _stream_bytes(tmp_path, {})
    final = pieces[-1]
    deltas = [p.text for p in pieces[:-1]]
    assert final.completion_tokens == 300
    assert "".join(deltas) == final.text
    assert any(ord(c) > 127 and c != "\ufffd" for c in final.text)  # real multi-byte chars


def test_with_stop_strings_the_answer_is_decoded_once(tmp_path) -> None:
    """The engine decodes the answer for its stop check; the shim streams that text instead of
    decoding it again. Decode work per token stays that of one incremental decoder (about
    2 x (context + 1) tokens per step, less in practice) plus the final answer's decode."""
    plain, plain_work = _stream_bytes(tmp_path / "a", {})
    stopped, work = _stream_bytes(tmp_path / "b", {"stop": ["\x00\x01never"]})
    assert stopped[-1].completion_tokens == 300 and stopped[-1].text == plain[-1].text
    assert "".join(p.text for p in stopped[:-1]) == stopped[-1].text
    assert work / 300 < 9, work / 300  # measured: 6.6 (12.1 when both decoded)
    assert abs(work - plain_work) < 300  # the same decoder's work, moved to the engine
