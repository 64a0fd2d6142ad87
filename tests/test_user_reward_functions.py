"""The user's reward functions, called as TRL calls them (`BatchFunctionReward`): one call
per rollout with every completion, the data file's other columns as keywords, the
scores as a list or a numpy or jax array (`None` where a function does not score),
weighted; a function that raises or returns the wrong thing is one line naming it;
`ppo.reward_functions=MODULE:NAME` from the command line on a prompt file."""

import importlib
import json
import re
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import text_rollout

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main


@pytest.fixture(scope="module")
def tok():
    return pl.tools.load_model("builtin")[1]


_PROMPTS = ("Once upon a time", "Once upon a time", "Tom had a", "Tom had a")
_TEXTS = (" a cat", " a big dog", " ball", " red ball")

_MODULE = """
import jax.numpy as jnp
import numpy as np

SEEN = {}
OUT = None


def length(prompts, completions, **kwargs):
    SEEN.update(kwargs, prompts=prompts, completions=completions)
    return [float(len(c)) for c in completions]


def has_answer(completions, answer, **kwargs):
    return np.asarray([a in c for a, c in zip(answer, completions)], np.float32)


def only_dogs(completions, **kwargs):  # None: not scored by this function
    return jnp.asarray([1.0, 2.0, 3.0, 4.0])[:2].tolist() + [None, None]


def conversational(prompts, completions, **kwargs):  # TRL's conversational example
    SEEN.update(prompts=prompts, completions=completions, keywords=sorted(kwargs))
    return [float(len(c[0]["content"])) for c in completions]


def returns(completions, **kwargs):
    return OUT


def broken(completions, **kwargs):
    return {}["missing"]


X = 3
"""


def _module(tmp_path, monkeypatch, name: str, source: str):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def _source(tok, specs, weights=(), columns=None):
    c = pl.PPOConfig(reward_source="task", reward_functions=specs, reward_weights=weights)
    judge = pl.JudgeConfig()
    return pl.runs.stage_reward_source(
        c, task=[], tokenizer=tok, judge=judge, judges={}, columns=columns
    )


def test_functions_get_every_completion_and_the_columns_and_are_weighted(
    tok, tmp_path, monkeypatch
):
    mod = _module(tmp_path, monkeypatch, "rewards_weighted", _MODULE)
    columns = {"Once upon a time": {"answer": "cat", "level": 1}, "Tom had a": {"answer": "red"}}
    specs = tuple(f"rewards_weighted:{n}" for n in ("length", "has_answer", "only_dogs"))
    source = _source(tok, specs, (1.0, 10.0, 0.5), columns)
    scored = source.score(text_rollout(tok, _PROMPTS, _TEXTS, 2))
    lengths = np.asarray([len(t) for t in _TEXTS], np.float64)
    want = lengths + 10.0 * np.asarray([1, 0, 0, 1]) + 0.5 * np.asarray([1.0, 2.0, 0, 0])
    np.testing.assert_allclose(scored.scores, want, rtol=1e-6)
    assert scored.metrics == {
        "reward/length": pytest.approx(lengths.mean()),
        "reward/has_answer": 0.5,
        "reward/only_dogs": 1.5,
    }
    seen = mod.SEEN
    assert seen["prompts"] == list(_PROMPTS) and seen["completions"] == list(_TEXTS)
    assert seen["answer"] == ["cat", "cat", "red", "red"]
    assert seen["level"] == [1, 1, None, None]  # a column a record lacks: None
    assert [len(ids) for ids in seen["completion_ids"]] == [len(tok.encode(t)) for t in _TEXTS]


def test_conversational_prompts_reach_the_functions_as_trl_passes_them(tok, tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "rewards_chat", _MODULE)
    path = tmp_path / "chat.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": p}], "level": i}
        for i, p in enumerate(("Name a cat.", "Name a dog."))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = list(rx.data.load_prompts(str(path)))
    assert [r.columns for r in records] == [
        {"prompt": row["prompt"], "level": row["level"]} for row in rows
    ]
    columns = {r.prompt: r.columns for r in records}
    source = _source(tok, ("rewards_chat:conversational",), columns=columns)
    texts = (" Tom.", " Rex!!")
    scored = source.score(text_rollout(tok, [r.prompt for r in records], texts))
    np.testing.assert_array_equal(scored.scores, [5.0, 6.0])
    assert mod.SEEN["prompts"] == [row["prompt"] for row in rows]
    assert mod.SEEN["completions"] == [[{"role": "assistant", "content": t}] for t in texts]
    assert mod.SEEN["keywords"] == ["completion_ids", "level"]  # the prompt is not repeated


@pytest.mark.parametrize(
    "out, message",
    [
        ([1.0], "returned 1 scores for 4 completions"),
        (1.0, "returned float 1.0: expected a list of 4 scores"),
        ("1111", "returned str '1111': expected a list of 4 scores"),
        (np.ones((2, 2)), r"returned an array of shape \(2, 2\): expected 4 scores"),
        ([1.0, float("nan"), 0.0, 0.0], r"returned nan for prompt 0 \(completion 1\): not finite"),
        (jnp.asarray([0, 0, jnp.inf, 0]), r"returned .*inf.* for prompt 1 \(completion 2\): not"),
        ([1.0, "2", 0.0, 0.0], "returned '2' for prompt 0 .*not a real number"),
    ],
)
def test_a_wrong_return_is_one_line_naming_the_function(tok, tmp_path, monkeypatch, out, message):
    mod = _module(tmp_path, monkeypatch, "rewards_wrong", _MODULE)
    monkeypatch.setattr(mod, "OUT", out)
    source = _source(tok, ("rewards_wrong:returns",))
    with pytest.raises(ValueError, match=f"^reward function 'returns' {message}"):
        source.score(text_rollout(tok, _PROMPTS, _TEXTS, 2))


def test_a_function_that_raises_is_named_with_its_file_and_line(tok, tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "rewards_raising", _MODULE)
    source = _source(tok, ("rewards_raising:broken",))
    line = _MODULE.splitlines().index('    return {}["missing"]') + 1
    match = (
        rf"^reward function 'broken' raised KeyError: 'missing' \(at rewards_raising.py:{line}\)"
    )
    with pytest.raises(ValueError, match=match):
        source.score(text_rollout(tok, _PROMPTS, _TEXTS))


def test_reward_function_settings_are_refused_before_loading(tmp_path, monkeypatch):
    mod = "rewards_refused"
    _module(tmp_path, monkeypatch, mod, _MODULE)
    cases = {
        "ppo.reward_functions=bogus": "ppo.reward_functions=bogus: expected MODULE:NAME",
        f"ppo.reward_functions={mod}:nope": f"ppo.reward_functions={mod}:nope: {mod} has no nope",
        f"ppo.reward_functions={mod}:X": f"ppo.reward_functions={mod}:X: expected a function",
        f"ppo.reward_functions={mod}:length": "score only with ppo.reward_source=task",
        "ppo.reward_weights=1": "ppo.reward_weights=(1.0,): only with ppo.reward_functions",
    }
    for override, message in cases.items():
        cfg = pl.apply_overrides(pl.animal_task_config(), [override])
        with pytest.raises(pl.ConfigError, match=re.escape(message)):
            pl.config.validate_config(cfg)
    task = ["ppo.reward_source=task", f"ppo.reward_functions={mod}:length"]
    for weights, message in (("1,2", "expected one weight per function"), ("nan", "finite")):
        cfg = pl.apply_overrides(pl.animal_task_config(), [*task, f"ppo.reward_weights={weights}"])
        with pytest.raises(pl.ConfigError, match=message):
            pl.config.validate_config(cfg)
    pl.config.validate_config(pl.apply_overrides(pl.animal_task_config(), task))


@pytest.mark.slow
def test_ppo_on_a_prompt_file_with_functions_from_a_module(tmp_path, monkeypatch):
    mod = "rewards_ppo_file"
    _module(
        tmp_path,
        monkeypatch,
        mod,
        """
        import json

        def length(completions, **kwargs):
            return [len(c) / 10 for c in completions]

        def kinds(prompts, completions, answer, topic, **kwargs):
            with open("seen.jsonl", "a") as f:
                f.write(json.dumps({"answer": answer, "topic": topic}) + "\\n")
            return [float(t == "cats") for t in topic]
        """,
    )
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"Once upon a time {i}", "answer": i, "topic": "cats"} for i in range(8)]
    rows += [{"prompt": f"Tom had a {i}", "topic": "dogs"} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["ppo", "--data", str(path), "--out", str(tmp_path / "run"), "--quiet"]
    argv += ["--set", "ops.monitor=false", "--set", "ppo.reward_source=task"]
    argv += ["--set", f"ppo.reward_functions={mod}:length,{mod}:kinds"]
    argv += ["--set", "ppo.reward_weights=1,2", "--set", "ppo.rollouts=1"]
    argv += ["--set", "ppo.prompts_per_rollout=4", "--set", "sampling.max_new_tokens=8"]
    argv += ["--set", "eval_samples=1", "--set", "data.heldout_fraction=0.25"]
    assert main(argv) == 0
    (it,) = [r for r in pl.tools.read_records(str(tmp_path / "run")) if "rollout/score" in r]
    assert {"rollout/reward/length", "rollout/reward/kinds"} <= set(it)
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    for call in seen:  # each completion's own record's columns, numbers as the file has them
        for answer, topic in zip(call["answer"], call["topic"]):
            assert (topic, answer is None) in (("cats", False), ("dogs", True))
            assert answer is None or isinstance(answer, int)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert np.isfinite(summary["ppo"]["heldout_reward"])


@pytest.mark.slow
def test_a_run_whose_reward_function_raises_leaves_nothing_in_the_way(tmp_path, monkeypatch):
    """A reward function that raises at the first rollout stops the run before any step:
    its directory (which holds only events of the data preparation) is removed, so the
    same command works once the function is fixed."""
    mod = "rewards_fixed_later"
    source = """
        def score(completions, **kwargs):
            return [float(len(c) > 3) for c in completions]{}
        """
    _module(tmp_path, monkeypatch, mod, source.format(" + kwargs['nope']"))
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"Once upon a time {i}"} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    argv = ["grpo", "--data", str(path), "--out", str(run), "--quiet"]
    argv += ["--set", f"grpo.reward_functions={mod}:score"]  # the monitor logs an event
    argv += ["--set", "grpo.rollouts=1", "--set", "grpo.prompts_per_rollout=2"]
    argv += ["--set", "grpo.group_size=2", "--set", "sampling.max_new_tokens=4"]
    argv += ["--set", "eval_samples=1", "--set", "data.heldout_fraction=0.25"]
    assert main(argv) == 1
    assert not run.exists()
    monkeypatch.delitem(sys.modules, mod)
    _module(tmp_path, monkeypatch, mod, source.format(""))
    assert main(argv) == 0
    assert (run / "summary.json").exists()
