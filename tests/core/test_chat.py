"""model.chat_tokens: the model's own chat template applied to messages, each message's content
span checked against the tokenizer itself (the same ids as ``apply_chat_template``; the span's
tokens decode to the content, the tokens between spans to the template's scaffolding only)."""

from __future__ import annotations

import pytest
import torch

from interp_engine import InputError, run_with_cache
from interp_engine.chat import chat_tokens

MESSAGES = [{"role": "user", "content": "user"},  # the role's own name, also in the header before it
            {"role": "assistant", "content": " Paris, café ☕."},
            {"role": "user", "content": ""},
            {"role": "user", "content": "And Italy?"}]


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct's tokenizer, which ships a chat template (with a default system turn)."""
    from transformers import AutoTokenizer

    from interp_engine.embedded import ensure

    return AutoTokenizer.from_pretrained(str(ensure()))


def _pieces(tok, ids, spans):
    """The decoded text between and inside the spans, in order."""
    out, at = [], 0
    for start, end in spans:
        out += [tok.decode(ids[at:start]), tok.decode(ids[start:end])]
        at = end
    return out + [tok.decode(ids[at:])]


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_spans_cover_exactly_each_messages_tokens(smol, generation_prompt):
    chat = chat_tokens(smol, MESSAGES, add_generation_prompt=generation_prompt)
    want = smol.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=generation_prompt)["input_ids"]
    ids = chat.tokens[0].tolist()
    assert ids == list(want) and chat.text == smol.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
    pieces = _pieces(smol, ids, chat.spans)
    assert "".join(pieces) == chat.text
    assert pieces[1::2] == [m["content"] for m in MESSAGES]  # each span is its content, nothing more
    for between in pieces[0::2]:  # the rest is the template's: headers, end-of-turn tokens, system turn
        assert between.replace("\n", "").replace("<|im_end|>", "").replace("<|im_start|>", "") in (
            "", "user", "assistant", "userassistant", "assistantuser", "useruser",
            "systemYou are a helpful AI assistant named SmolLM, trained by Hugging Faceuser"), repr(between)
    assert chat.spans == sorted(chat.spans) and chat.spans[2][0] == chat.spans[2][1]  # an empty content: empty


def test_a_token_that_straddles_the_content_counts_as_the_messages(smol):
    """Leading spaces after the header's newline merge with it into one token: the span takes it,
    and no more."""
    messages = [{"role": "user", "content": "   spaced"}]
    chat = chat_tokens(smol, messages)
    start, end = chat.spans[0]
    ids = chat.tokens[0].tolist()
    assert "   spaced" in smol.decode(ids[start:end])
    assert "   spaced" not in smol.decode(ids[start + 1:end]) and "   spaced" not in smol.decode(ids[start:end - 1])


def test_a_template_that_trims_and_a_capture_of_one_message(eager_models, monkeypatch):
    """On the tiny model, with a template set on its tokenizer (one that trims contents): the span
    of the trimmed content, and a capture with positions= over the last message equals those
    positions of the whole capture."""
    model = eager_models("llama")
    with pytest.raises(InputError, match="no chat_template"):
        model.chat_tokens(MESSAGES)
    monkeypatch.setattr(model.tok.hf, "chat_template",
                        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>"
                        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": "  Where is Paris?  "}, {"role": "assistant", "content": "France"}]
    tokens, spans, text = model.chat_tokens(messages, add_generation_prompt=True)
    assert text == "<user>Where is Paris?</user><assistant>France</assistant><assistant>"
    assert [model.to_string(tokens[0, a:b]) for a, b in spans] == ["Where is Paris?", "France"]
    whole = run_with_cache(model, tokens, ["resid_post.1"])["resid_post.1"]
    part = run_with_cache(model, tokens, ["resid_post.1"], positions=list(range(*spans[1])))["resid_post.1"]
    torch.testing.assert_close(part, whole[:, spans[1][0]:spans[1][1]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("messages, words", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"role": "user"}], "message 0 must be a dict with a string 'role' and a string 'content'"),
    ([{"role": "user", "content": ["a", "b"]}], "string 'content'"),
])
def test_bad_messages_are_clear_errors(smol, messages, words):
    with pytest.raises(InputError, match=__import__("re").escape(words)):
        chat_tokens(smol, messages)
