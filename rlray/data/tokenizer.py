"""An offline character-level tokenizer for tiny test models.

Contract: `char_tokenizer()` returns a `PreTrainedTokenizerFast` built without any
download: one token per character of `CHARS`, plus `<pad>`, `<bos>`, `<|im_end|>`
(the eos) and `<unk>`. Decoding concatenates characters (no spaces inserted).
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<|im_end|>", "<unk>"]
CHARS = string.ascii_lowercase + string.digits + ":= +-*?,.()"


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
    )


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids: bos (when the tokenizer has one) then the text's ids."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids
