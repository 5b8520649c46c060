"""A chat turn keeps the session's own tokens where the conversation's text is unchanged
(replicas/retokenize.py): a constrained answer written in small pieces is not re-prefilled
because the tokenizer would spell it otherwise."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sessionserve.replicas.retokenize import continue_history
from sessionserve.wire import SamplingParams
from tests.models import tiny_engine, tiny_model


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level with merges (`{"` and `ab` are tokens of their own) and a special token:
    a text has one canonical spelling and others."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for merged in ('{"', "ab"):
        vocab[merged] = len(vocab)
    vocab["<|end|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("{", '"'), ("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    return fast


TOK = merging_tokenizer()


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids


def decode(tokens: list[int]) -> str:
    return TOK.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_the_sessions_spelling_of_an_answer_is_kept_and_only_the_new_text_follows() -> None:
    prompt = ids("Q: x<|end|>")
    answer = [TOK.convert_tokens_to_ids("{"), TOK.convert_tokens_to_ids('"')] + ids("ab")
    assert decode(answer) == '{"ab' and ids('{"ab') != answer  # not the canonical spelling
    history = prompt + answer
    fresh = ids('Q: x<|end|>{"ab<|end|>Q: y<|end|>')
    spliced = continue_history(history, fresh, decode)
    assert spliced[: len(history)] == history
    assert spliced[len(history) :] == ids("<|end|>Q: y<|end|>")
    assert decode(spliced) == decode(fresh)


def test_a_changed_conversation_keeps_its_fresh_tokens() -> None:
    history = ids("Q: x<|end|>") + [TOK.convert_tokens_to_ids("a"), TOK.convert_tokens_to_ids("b")]
    edited = ids("Q: x<|end|>ac<|end|>")  # the answer was edited: nothing to keep past it
    assert continue_history(history, edited, decode) == edited
    assert continue_history(history, history + ids("z"), decode) == history + ids("z")
    assert continue_history(history, ids("Q"), decode) == ids("Q")  # shorter: unchanged


def test_an_engine_chat_turn_reuses_a_non_canonical_answer() -> None:
    """End to end in the engine: the session holds text in a spelling that is not the
    tokenizer's (here put there by an append turn); the next chat turn brings the
    conversation as fresh text and reuses all of it."""
    model = tiny_model(vocab_size=len(TOK), eos_token_id=TOK.eos_token_id)
    engine = tiny_engine(model, tokenizer=TOK)
    sid = engine.open_session("s")
    pieces = [TOK.convert_tokens_to_ids(t) for t in ("{", '"', "a", "b")]
    ascii3 = SamplingParams(max_tokens=3, temperature=0, lark_grammar="start: /[a-z]{3}/")
    first = engine.generate([ids("Q: x<|end|>") + pieces], ascii3, session_id=sid)[0]
    history = ids("Q: x<|end|>") + pieces + first.output_ids
    fresh = ids(decode(history) + "<|end|>Q: y<|end|>")
    assert fresh[: len(history)] != history  # the tokenizer spells it otherwise
    greedy = SamplingParams(max_tokens=3, temperature=0)
    second = engine.generate([fresh], greedy, session_id=sid, mode="chat")[0]
    assert second.cached_source == "session"
    assert second.cached_tokens >= len(history) - 1
    assert second.prompt_tokens == len(history) + len(ids("<|end|>Q: y<|end|>"))
    engine.checker.check_idle()
