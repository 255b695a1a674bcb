"""A small byte-level BPE tokenizer trained in memory (no downloads), wrapped as a transformers tokenizer.

Its merges make multi-character tokens, so stop strings can span token boundaries, and its byte-level
alphabet splits multi-byte characters (é, 中, emoji) across tokens.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "the stop sign stopped the story at the top of the stairs",
    "stars and stones, storms and stories: stop here, start there",
    "a quick brown fox jumps over the lazy dog and then stops",
    "café naïve résumé — 中文 字符 and emoji 🙂 🚀 mixed with ascii text",
    "question: what is the answer? answer: the answer is forty two",
] * 20


def make_tokenizer(vocab_size: int = 320, corpus: list[str] = CORPUS) -> PreTrainedTokenizerFast:
    """Byte-level BPE with ``vocab_size`` entries: 3 specials, 256 bytes, then merges (learned from ``corpus``)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
