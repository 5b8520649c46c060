"""A completion prompt's ids (replicas/prompts.py): a prompt that starts a sequence takes the
tokenizer's special tokens (Gemma 3's BOS, without which the base model writes noise), an
append turn's text does not (it follows the session's tokens), ids stay as given."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from sessionserve.replicas.prompts import prompt_ids

BOS = 0


def bos_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer that puts a BOS first, as Gemma's does."""
    vocab = {"<bos>": BOS, "<unk>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", unk_token="<unk>")


def test_a_prompt_that_starts_a_sequence_gets_the_tokenizers_bos() -> None:
    tok = bos_tokenizer()
    assert prompt_ids(tok, "hello world", starts=True) == [BOS, 2, 3]
    assert prompt_ids(tok, "hello world") == [2, 3]  # an append turn's new text
    assert prompt_ids(tok, [3, 2], starts=True) == [3, 2]  # ids as the client gave them
    assert prompt_ids(tok, None, starts=True) == [BOS]
