"""Helpers for smoke tests of the harness without a real model: a byte tokenizer for tiny models."""

from __future__ import annotations

import torch


class _Enc(dict):
    __getattr__ = dict.__getitem__


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255); bos=1, eos=2, pad=0 (control bytes, absent from text).

    Enough of the tokenizer API for the harness: ``encode``, ``decode``, ``__call__``,
    ``apply_chat_template`` (a plain "User:/Assistant:" layout).
    """

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0
    bos_token, eos_token = "\x01", "\x02"
    chat_template = None
    locks_hf_prepend_bos = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b for b in text.encode("utf-8") if b not in (0, 1, 2)]
        return ([self.bos_token_id] if add_special_tokens else []) + ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if torch.is_tensor(ids):
            ids = ids.tolist()
        keep = [i for i in ids if 0 <= i < 256 and not (skip_special_tokens and i in (0, 1, 2))]
        return bytes(keep).decode("utf-8", errors="replace")

    def __call__(self, text, add_special_tokens: bool = True, return_tensors=None, **kw):
        ids = self.encode(text, add_special_tokens)
        if return_tensors == "pt":
            return _Enc(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        return _Enc(input_ids=ids)
