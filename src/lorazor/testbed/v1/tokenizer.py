"""A character-level transformers tokenizer over a fixed alphabet (built with `tokenizers`)."""

from __future__ import annotations

import string

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
ALPHABET = string.ascii_letters + string.digits + " \n.,:;?!'\"()*/+-=<>_%"


def build_tokenizer():
    """Pad 0, bos 1, eos 2, unk 3, then one token per character; left padding for generation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in ALPHABET:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                 unk_token="<unk>")
    hf.padding_side = "left"
    return hf
