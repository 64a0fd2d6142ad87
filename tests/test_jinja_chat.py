"""Hugging Face (jinja2) chat templates: rendering, `{% generation %}` assistant masks,
the fallback without them, per-token masks, loading from tokenizer_config.json."""

import json

import numpy as np
import pytest
from helpers import train_byte_bpe
from hypothesis import given, strategies as st

from rlhf_eqx import data
from rlhf_eqx.assets import asset_path

pytest.importorskip("jinja2")

# ChatML (Qwen style) with the assistant's turn (content and <|im_end|>) in a generation
# block, as templates written for `return_assistant_tokens_mask` do.
CHATML_GENERATION = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2-style, no generation blocks: a default system prompt, tools rendered with tojson.
QWEN_LIKE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}You are helpful.{%- endif %}
{{- '\\n\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "And in French? Not 'hi'."},
    {"role": "assistant", "content": "Salut, ça va ?"},
]


def _expected_chatml(messages, generation_prompt=False):
    """The ChatML text, built piece by piece, with the assistant spans (content and
    <|im_end|>)."""
    text, spans = "", []
    for m in messages:
        text += f"<|im_start|>{m['role']}\n"
        if m["role"] == "assistant":
            start = len(text)
            text += m["content"] + "<|im_end|>"
            spans.append((start, len(text)))
            text += "\n"
        else:
            text += m["content"] + "<|im_end|>\n"
    if generation_prompt:
        text += "<|im_start|>assistant\n"
    return text, spans


def test_renders_like_format_chat_and_marks_generation_blocks():
    tmpl = data.JinjaChatTemplate(CHATML_GENERATION, eos_token="<|im_end|>")
    assert tmpl.has_generation_blocks
    text, spans = _expected_chatml(MESSAGES, generation_prompt=True)
    assert tmpl.render(MESSAGES, add_generation_prompt=True) == text
    assert text == data.format_chat(MESSAGES, "chatml")  # the built-in ChatML agrees
    out = tmpl.render_with_assistant_mask(MESSAGES, add_generation_prompt=True)
    assert out.text == text and list(out.spans) == spans
    assert ["".join(text[s:e]) for s, e in out.spans] == [
        "hi<|im_end|>",
        "Salut, ça va ?<|im_end|>",
    ]
    expected = np.zeros(len(text), bool)
    for s, e in spans:
        expected[s:e] = True
    np.testing.assert_array_equal(out.char_mask, expected)


def test_fallback_locates_assistant_contents_in_order():
    """Without generation blocks: the same mask as the generation template gives, the
    user's quote of "hi" before the assistant's reply is not taken for it."""
    plain = CHATML_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tmpl = data.JinjaChatTemplate(plain, eos_token="<|im_end|>")
    assert not tmpl.has_generation_blocks
    messages = [{"role": "user", "content": "Reply hi"}, {"role": "assistant", "content": "hi"}]
    messages += MESSAGES[3:]
    text, spans = _expected_chatml(messages)
    out = tmpl.render_with_assistant_mask(messages)
    assert out.text == text and list(out.spans) == spans
    no_eos = tmpl.render_with_assistant_mask(messages, include_eos=False)
    assert list(no_eos.spans) == [(s, e - len("<|im_end|>")) for s, e in spans]


def test_qwen_like_template_with_tools_and_default_system():
    tmpl = data.JinjaChatTemplate(QWEN_LIKE, eos_token="<|im_end|>")
    tool = {"name": "calculator", "description": "Évalue", "parameters": {"type": "object"}}
    messages = MESSAGES[1:3]
    text = tmpl.render(messages, tools=[tool], add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\nYou are helpful.\n\n# Tools\n<tools>\n")
    assert json.dumps(tool, ensure_ascii=False) in text  # tojson keeps "É" and <, >
    out = tmpl.render_with_assistant_mask(messages, tools=[tool])
    (span,) = out.spans
    assert out.text[span[0] : span[1]] == "hi<|im_end|>"
    assert out.text.endswith("<|im_start|>assistant\nhi<|im_end|>\n")


def test_rewritten_assistant_content_is_an_error():
    tmpl = data.JinjaChatTemplate(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    )
    with pytest.raises(data.DataError, match=r"message 1 \(assistant\).*generation"):
        tmpl.render_with_assistant_mask(MESSAGES[1:3])


def test_template_errors_and_sandbox():
    with pytest.raises(data.DataError, match="syntax error"):
        data.JinjaChatTemplate("{% for m in messages %}")
    tmpl = data.JinjaChatTemplate("{{ raise_exception('only user/assistant roles') }}")
    with pytest.raises(data.DataError, match="only user/assistant roles"):
        tmpl.render(MESSAGES)
    unsafe = data.JinjaChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(data.DataError, match="chat template error"):
        unsafe.render(MESSAGES)
    mutate = data.JinjaChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(data.DataError, match="chat template error"):
        mutate.render(MESSAGES)


# ------------------------------------------------------------------------ token masks


def _train_hf(directory):
    words = ["hi", "say", "salut", "ça", "va", "user", "assistant", "system", "be", "brief"]
    path = train_byte_bpe(
        directory,
        words,
        vocab_size=320,
        special_tokens=("<pad>", "<unk>", "<|im_start|>", "<|im_end|>"),
        words_per_line=8,
    )
    return data.HFTokenizer.from_file(path, bos_token="<|im_start|>", eos_token="<|im_end|>")


@pytest.mark.parametrize("kind", ["hf", "bytes", "llama2c"])
def test_token_mask_covers_exactly_the_assistant_text(kind, tmp_path):
    if kind == "hf":
        tok = _train_hf(tmp_path)
    elif kind == "bytes":
        tok = data.ByteTokenizer()
    else:
        tok = data.Llama2cTokenizer.from_file(asset_path("tok512.bin"))
    tmpl = data.JinjaChatTemplate(CHATML_GENERATION, eos_token="<|im_end|>")
    out = tmpl.render_with_assistant_mask(MESSAGES, tokenizer=tok)
    assert out.ids == tok.encode(out.text)
    ids, offsets = data.token_offsets(tok, out.text)
    assert ids == out.ids and len(out.token_mask) == len(ids)
    covered = np.zeros(len(out.text), bool)
    for (s, e), marked in zip(offsets, out.token_mask):
        if marked:
            covered[s:e] = True
    # the assistant characters are covered, and nothing else but partial tokens at the
    # edges of a span (no token here straddles a span edge: they start and end at "\n"
    # and special tokens)
    np.testing.assert_array_equal(covered, out.char_mask)
    if kind == "hf":  # the special tokens are single tokens, the closing one marked
        im_end = tok.tokenizer.token_to_id("<|im_end|>")
        marked_ends = [i for i, m in zip(ids, out.token_mask) if m and i == im_end]
        assert len(marked_ends) == 2


@given(st.text(alphabet=st.sampled_from("ab ,é\n"), min_size=1, max_size=12))
def test_byte_token_mask_matches_characters(content):
    tok = data.ByteTokenizer()
    tmpl = data.JinjaChatTemplate(CHATML_GENERATION)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]
    out = tmpl.render_with_assistant_mask(messages, tokenizer=tok)
    per_byte = np.concatenate(
        [np.full(len(c.encode("utf-8")), m) for c, m in zip(out.text, out.char_mask)]
    )
    np.testing.assert_array_equal(out.token_mask, per_byte)


def test_tokenizer_that_does_not_round_trip_is_refused():
    class Lossy(data.ByteTokenizer):
        def decode(self, ids):
            return super().decode(ids).lower()

    tmpl = data.JinjaChatTemplate(CHATML_GENERATION)
    with pytest.raises(data.DataError, match="does not decode the rendered text back"):
        tmpl.render_with_assistant_mask([{"role": "user", "content": "Hi"}], tokenizer=Lossy())


# ---------------------------------------------------------------------------- loading


def test_load_chat_template_from_config_and_directory(tmp_path):
    config = {
        "bos_token": {"content": "<|endoftext|>"},
        "eos_token": "<|im_end|>",
        "chat_template": CHATML_GENERATION,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for path in (tmp_path, tmp_path / "tokenizer_config.json"):
        tmpl = data.load_chat_template(path)
        assert (tmpl.bos_token, tmpl.eos_token) == ("<|endoftext|>", "<|im_end|>")
        assert tmpl.render(MESSAGES) == _expected_chatml(MESSAGES)[0]
    named = dict(
        config,
        chat_template=[{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}],
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(named))
    assert data.load_chat_template(tmp_path).render([]) == "A"
    assert data.load_chat_template(tmp_path, name="tool_use").render([]) == "B"
    with pytest.raises(data.DataError, match="no chat template named 'rag'"):
        data.load_chat_template(tmp_path, name="rag")
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")  # the newer layout wins
    assert data.load_chat_template(tmp_path).render([]) == "<|im_end|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(data.DataError, match="has no chat_template"):
        data.load_chat_template(tmp_path)
    with pytest.raises(data.DataError, match="no tokenizer_config.json"):
        data.load_chat_template(tmp_path / "missing")
