"""Chat prompts: a model's own chat template applied to messages, with each message's tokens.

``model.chat_tokens(messages)`` renders ``[{"role": ..., "content": ...}, ...]`` with the
tokenizer's ``chat_template`` (exactly as ``tokenizer.apply_chat_template`` does: the same text,
the same token ids) and says where each message's *content* sits among the tokens: ``spans[i] =
(start, end)``, positions ``start <= p < end``, so a capture or an edit can be restricted to one
message (``positions=range(*spans[-1])``: the last message's tokens). The template's scaffolding
(role headers, end-of-turn tokens, a default system prompt it adds) lies outside every span; a
token that straddles the content's first or last character (a merge across the boundary) counts
as the message's.

Each message's content is located in the rendered text through the renderings of the
conversation's prefixes (message ``i`` lies between the text of ``messages[:i]`` and that of
``messages[:i+1]``); a template whose text for earlier messages changes as the conversation grows
falls back to searching the contents in order. A content the template rewrites (trims, escapes)
is found by its stripped text, or refused with the reason.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import InputError, shown


class ChatTokens(NamedTuple):
    """A rendered chat prompt: ``tokens`` ``[1, pos]``, each message's content span ``(start,
    end)`` in token positions, and the rendered ``text``."""

    tokens: torch.Tensor
    spans: list[tuple[int, int]]
    text: str


def chat_tokens(hf_tokenizer, messages, *, add_generation_prompt: bool = False) -> ChatTokens:
    """``messages`` rendered by ``hf_tokenizer``'s chat template, tokenized, with each message's
    span (see the module docstring). ``add_generation_prompt=True`` ends the prompt with the
    template's opening of an assistant turn (to generate the reply)."""
    messages = _checked(messages)
    if not getattr(hf_tokenizer, "chat_template", None):
        raise InputError("this model's tokenizer has no chat_template (base checkpoints usually ship none); build "
                         "the prompt with model.to_tokens(text), or set tokenizer.chat_template to a Jinja template")
    if not isinstance(add_generation_prompt, bool):
        raise InputError(f"add_generation_prompt must be True or False, got {shown(add_generation_prompt)}")
    text = _render(hf_tokenizer, messages, add_generation_prompt)
    try:
        encoded = hf_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError) as err:
        raise InputError(f"chat_tokens needs a fast tokenizer (one that reports each token's characters): "
                         f"{err}") from None
    ids, offsets = list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
    spans = [_token_span(offsets, start, end) for start, end in _char_spans(hf_tokenizer, messages, text)]
    return ChatTokens(torch.tensor([ids], dtype=torch.long), spans, text)


def _checked(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got "
                         f"{shown(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"message {i} must be a dict with a string 'role' and a string 'content', e.g. "
                             f"{{'role': 'user', 'content': 'Hi'}}; got {shown(m)}")
    return [dict(m) for m in messages]


def _render(hf_tokenizer, messages, add_generation_prompt: bool) -> str:
    try:
        return hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as err:  # noqa: BLE001 - a template's own refusal (raise_exception) is the caller's error
        raise InputError(f"the chat template refused these messages: {type(err).__name__}: {err}") from None


def _char_spans(hf_tokenizer, messages, text: str) -> list[tuple[int, int]]:
    """Each message's content as a character range of ``text``."""
    bounds = []
    for i in range(len(messages) + 1):
        try:
            prefix = _render(hf_tokenizer, messages[:i], False) if i else ""
        except InputError:
            prefix = None
        bounds.append(len(prefix) if prefix is not None and text.startswith(prefix) else None)
    out, cursor = [], 0
    for i, m in enumerate(messages):
        low, high = bounds[i], bounds[i + 1]
        stable = low is not None and high is not None and low <= high
        found = None
        for content in dict.fromkeys((m["content"], m["content"].strip())):
            at = text.rfind(content, low, high) if stable else text.find(content, cursor)
            if at >= 0:
                found = (at, at + len(content))
                break
        if found is None:
            raise InputError(f"message {i}'s content is not in the text the chat template made of it (the template "
                             f"rewrites it); its span cannot be given: pass the content as the template writes it")
        out.append(found)
        cursor = found[1]
    return out


def _token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """The tokens whose characters meet ``[start, end)`` (an empty content: the empty span where it
    would begin)."""
    first = next((j for j, (a, b) in enumerate(offsets) if b > start and b > a), len(offsets))
    if end <= start:
        return first, first
    last = max((j for j, (a, b) in enumerate(offsets) if a < end and b > a), default=first - 1)
    return first, max(first, last + 1)
