"""Token batches and their padding.

``to_tokens("text")`` gives a ``[1, pos]`` tensor of token ids. ``to_tokens(["a", "b c"])``
gives a ``[batch, pos]`` batch, right-padded with ``PAD_ID = -1``. A negative id is never a
real token, so the padding mask is exactly ``tokens >= 0``: the engine, the Cache and the
cluster all read the mask that way, and no padded position can be taken for real data.
Right padding under causal attention means no real position ever sees a padded one.

BOS: by default ``to_tokens`` adds what the tokenizer itself adds (``add_special_tokens=True``:
the tiny test tokenizers prepend ``<s>``; SmolLM2's adds nothing). ``prepend_bos=True`` makes the
first token the tokenizer's BOS whatever its default, ``prepend_bos=False`` leaves it off.
"""

from __future__ import annotations

import torch
from .errors import InputError, shown

PAD_ID = -1


def pad_batch(rows: list[list[int]] | list[torch.Tensor]) -> torch.Tensor:
    """Right-pad token id lists to one ``[batch, pos]`` tensor with ``PAD_ID``."""
    rows = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in rows]
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def unpad(tokens):
    """Each row of a padded batch (a tensor or a numpy array) as a one-prompt batch ``[1, len]``
    of its real token ids: how a batch is split for a backend that takes one prompt per call."""
    return [row[row >= 0][None] for row in tokens]


def fed_tokens(prompt: torch.Tensor, generated: list[int]) -> torch.Tensor:
    """The tokens a generation ran through the model, ``[1, len(prompt) + len(generated) - 1]``:
    the prompt, then each generated token but the last (sampled, never fed back)."""
    return torch.cat([prompt.cpu(), torch.tensor([generated[:-1]], dtype=torch.long)], dim=1)


class Tokenizer:
    """A thin wrapper over a Hugging Face tokenizer that speaks the engine's token format."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer

    def to_tokens(self, text: str | list[str], *, prepend_bos: bool | None = None) -> torch.Tensor:
        """``str`` -> ``[1, pos]``; ``list[str]`` -> right-padded ``[batch, pos]`` (pad = -1)."""
        if isinstance(text, str):
            return pad_batch([self.encode(text, prepend_bos=prepend_bos)])
        if isinstance(text, (list, tuple)):
            if not text:
                raise InputError("to_tokens got an empty list of prompts; pass a string or a list of at least one string")
            for i, t in enumerate(text):
                if not isinstance(t, str):
                    raise InputError(f"to_tokens takes a string or a list of strings; item {i} is "
                                     f"{type(t).__name__} ({shown(t)})")
            return pad_batch([self.encode(t, where=f"prompt {i}", prepend_bos=prepend_bos) for i, t in enumerate(text)])
        raise InputError(f"to_tokens takes a string or a list of strings, got {type(text).__name__}")

    def encode(self, text: str, *, where: str = "the prompt", prepend_bos: bool | None = None) -> list[int]:
        """Token ids of one prompt: special tokens as the tokenizer adds them (``prepend_bos=None``),
        or with a BOS forced on (``True``) or off (``False``)."""
        if not isinstance(text, str):
            raise InputError(f"{where} must be a string, got {type(text).__name__} ({shown(text)})")
        check_text(text, where)
        ids = list(self.hf(text, add_special_tokens=True)["input_ids"])
        bos = self.hf.bos_token_id
        if prepend_bos is None:
            return ids
        if prepend_bos and bos is None:
            raise InputError("prepend_bos=True, but this tokenizer has no BOS token; use prepend_bos=None")
        starts = bool(ids) and bos is not None and ids[0] == bos
        if prepend_bos and not starts:
            return [bos, *ids]
        if not prepend_bos and starts:
            return ids[1:]
        return ids

    def decode(self, ids) -> str:
        ids = torch.as_tensor(ids).reshape(-1)
        return self.hf.decode(ids[ids >= 0].tolist())

    def to_string(self, tokens):
        """``[pos]``, ``[1, pos]`` or a list of ids -> ``str``; ``[batch, pos]`` -> one ``str`` per row
        (padding dropped)."""
        ids = torch.as_tensor(tokens)
        if ids.dim() == 2 and ids.shape[0] > 1:
            return [self.decode(row) for row in ids]
        return self.decode(ids)

    def to_str_tokens(self, text_or_tokens, *, prepend_bos: bool | None = None):
        """Each token as its text. ``"text"``, ``[pos]``, ``[1, pos]`` or a list of ids ->
        ``list[str]``; a list of strings or a ``[batch, pos]`` batch -> one list per row (padding dropped)."""
        if isinstance(text_or_tokens, str):
            text_or_tokens = self.encode(text_or_tokens, prepend_bos=prepend_bos)
        elif isinstance(text_or_tokens, (list, tuple)) and text_or_tokens and all(
                isinstance(t, str) for t in text_or_tokens):
            return [self.to_str_tokens(t, prepend_bos=prepend_bos) for t in text_or_tokens]
        ids = torch.as_tensor(text_or_tokens)
        if ids.dim() == 2 and ids.shape[0] > 1:
            return [self.to_str_tokens(row) for row in ids]
        ids = ids.reshape(-1)
        return [self.hf.decode([i]) for i in ids[ids >= 0].tolist()]

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id


def check_text(text: str, where: str = "the prompt") -> None:
    """Refuse a string that is not text: one holding lone surrogates (what decoding bytes with
    ``errors="surrogateescape"`` leaves), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InputError(
            f"{where} holds {text[err.start:err.end]!r} at character {err.start}, a lone surrogate: not valid "
            f"Unicode, so it cannot be tokenized. Remove it, or decode the source bytes with errors='replace'"
        ) from None


def _ids(row) -> bool:
    return isinstance(row, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in row)


def _as_tensor(tokens):
    """A ``list[int]`` as ``[1, pos]`` and a list of them as a right-padded batch; anything else as given."""
    if _ids(tokens) and tokens:
        return torch.tensor([list(tokens)], dtype=torch.long)
    if isinstance(tokens, (list, tuple)) and tokens and all(_ids(row) for row in tokens):
        if any(i < 0 for row in tokens for i in row):
            raise InputError("token id lists hold ids >= 0 (a batch of lists is right-padded here); got a negative id")
        if not all(tokens):
            raise InputError(f"empty prompt at batch row {[len(r) for r in tokens].index(0)}: every prompt needs a token")
        return pad_batch([list(row) for row in tokens])
    return tokens


def check_tokens(tokens, d_vocab: int, n_ctx: int, *, single: bool = False, why: str = "") -> torch.Tensor:
    """Validate a token batch and return it as a ``[batch, pos]`` long tensor.

    One prompt's ids may also come as a ``list[int]`` or a 1-D tensor (read as ``[1, pos]``, as
    decoderesearch's interp-engine takes them), and a batch as a list of such lists (right-padded
    here, as ``to_tokens`` pads).

    Raises :class:`InputError` naming the problem: not a dense tensor with values, wrong dtype or
    shape, ids out of the vocabulary, an empty prompt, a prompt longer than the model's positions,
    or (with ``single``) more than one prompt (``why`` is then the message).
    """
    tokens = _as_tensor(tokens)
    if not isinstance(tokens, torch.Tensor):
        raise InputError(
            f"tokens must be a torch tensor of token ids (or a list of int ids), got {type(tokens).__name__}; "
            f"use model.to_tokens('text') or model.tok.to_tokens([...])"
        )
    if tokens.is_nested or tokens.layout != torch.strided:
        raise InputError(f"tokens must be a dense [batch, pos] tensor, got a {'nested' if tokens.is_nested else tokens.layout} "
                         f"one; use model.tok.to_tokens([...]) for a padded batch")
    if tokens.device.type == "meta":
        raise InputError("tokens are on the meta device, which holds shapes but no values; pass real ids "
                         "(model.to_tokens('text')), on the CPU or the model's device")
    if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise InputError(f"tokens must hold integer ids, got dtype {tokens.dtype}; use model.to_tokens('text')")
    if tokens.dim() == 1:  # one prompt's ids
        tokens = tokens[None]
    if tokens.dim() != 2:
        raise InputError(f"tokens must be [batch, pos], got shape {tuple(tokens.shape)}")
    tokens = tokens.long().cpu()
    if tokens.shape[0] == 0:
        raise InputError("the token batch is empty (batch size 0); pass at least one prompt, e.g. model.to_tokens('text')")
    if single and tokens.shape[0] != 1:
        raise InputError(why or f"one prompt per call, got a batch of {tokens.shape[0]}; pass tokens[i:i+1]")
    if (tokens < PAD_ID).any():
        raise InputError(f"negative token id {int(tokens.min())}: only {PAD_ID} (padding) may be negative")
    if (tokens >= d_vocab).any():
        raise InputError(f"token id {int(tokens.max())} is not in the vocabulary (size {d_vocab})")
    lengths = (tokens >= 0).sum(dim=1)
    if (lengths == 0).any():
        raise InputError(f"empty prompt at batch row {int((lengths == 0).nonzero()[0])}: every prompt needs a token")
    mask = tokens >= 0
    if not torch.equal(mask, torch.arange(tokens.shape[1]) < lengths[:, None]):
        raise InputError("padding must be at the end of each row (right padding with -1), as to_tokens makes it")
    if int(lengths.max()) > n_ctx:
        raise InputError(
            f"prompt of {int(lengths.max())} tokens is longer than the model's {n_ctx} positions; "
            f"truncate it (tokens[:, :{n_ctx}])"
        )
    return tokens
