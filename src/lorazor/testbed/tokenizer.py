"""A byte-level BPE tokenizer for testbed v2, trained on its corpus and the tasks' training text,
so answers are tens of tokens as in the paper (not hundreds of characters)."""

from __future__ import annotations

# The testbed's tasks are plain prompts: a chat is its messages' contents in order, so a single user
# message is the very prompt a completion gets (and gets the same answer).
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}{% if not loop.last %}\n{% endif %}"
                 "{% endfor %}")

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
VOCAB_SIZE = 4096


def train_tokenizer(texts, vocab_size: int = VOCAB_SIZE):
    """A `PreTrainedTokenizerFast` (pad 0, bos 1, eos 2, unk 3, left padding) learned from `texts`
    (an iterable of strings). Deterministic for the same texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                 unk_token="<unk>")
    hf.padding_side = "left"
    return hf
