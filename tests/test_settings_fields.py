"""Every setting of every registered stage is checked before anything is loaded.

The fields are enumerated from the configuration's dataclasses (each stage's section,
the sections its `--help` lists, their nested records: `optim`, `options`, `lora`,
`rollout_correction`, the judge; the shared sections and the top-level fields), and an
invalid value is built from each field's type: a negative count, NaN and infinities for
a number, a word that is no choice, a wrong type. Each must be refused by the run with
one `ConfigError` line naming the dotted field, the value and the valid range or
choices, before any weights are read (the model loaders raise if called). Free-text
fields, which have no invalid value, are listed with the reason."""

import dataclasses
import types
import typing
from collections.abc import Mapping

import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl

EXEMPT = {
    "out": "the run directory: any path, created when the run starts",
    "notes": "free text describing the configuration",
    "sampling.stop_strings": "any non-empty strings are stop strings",
    "prm.separator": "any non-empty string separates steps (its last token marks each end)",
    "ops.tracker_group": "any name groups the run with others in the experiment trackers",
}
"""Fields with no invalid value of their type, and why."""

SHARED = ("sampling", "data", "model", "ops")
REQUIREMENT = ("must", "expected", "only", "known", "does not use", "no such", "encodes to")
"""Words of a message that states what is valid."""


class Loaded(Exception):
    pass


@pytest.fixture
def no_loading(monkeypatch):
    def load(*a, **k):
        raise Loaded(a)

    monkeypatch.setattr(rx, "load_hf", load)
    monkeypatch.setattr(rx, "load_llama2c", load)


def _section_type(tp):
    """The dataclass of a section field (`X` or `X | None`), else `None`."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        found = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return found[0] if len(found) == 1 else None
    return None


def leaves(cls, prefix: str = ""):
    """`(dotted path, type)` of every setting of the config dataclass `cls`, nested
    sections included (fields set from another section are not settings)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("set_by") or f.name == "extra":
            continue
        sub = _section_type(hints[f.name])
        if sub is not None:
            yield from leaves(sub, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hints[f.name]


def invalid_values(tp) -> list[str]:
    """Command-line values that no field of type `tp` accepts."""
    union = typing.get_origin(tp) in (types.UnionType, typing.Union)
    arms = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
    out: list[str] = []
    for a in arms:
        origin = typing.get_origin(a)
        if a is bool:
            out += ["maybe"]
        elif a is int:
            out += ["-5", "abc"]
        elif a is float:
            out += ["nan", "inf", "abc"]
        elif a is str:
            out += ["bogus"]
        elif origin is tuple:
            out += ["-1" if typing.get_args(a)[0] is int else "bogus"]
        elif a in (dict, Mapping) or origin in (dict, Mapping):
            out += ["bogus"]
    return list(dict.fromkeys(out))


def _sections(stage) -> tuple[str, ...]:
    """The config sections a stage reads: its own and those its `--help` lists."""
    return tuple(dict.fromkeys((stage.key, *stage.sections)))


def _owned_sections(stage) -> tuple[str, ...]:
    """The sections whose fields are tried with `stage`: those it reads that no stage
    registered before it reads (each section's fields are tried once)."""
    before = set()
    for st in pl.config.stages():
        if st.name == stage.name:
            break
        before |= set(_sections(st))
    return tuple(s for s in _sections(stage) if s not in before)


def _context(stage, section: str) -> list[str]:
    """Overrides that make the stage use `section` (the judge is read only by a stage
    whose rewards come from it)."""
    return [f"{stage.key}.reward_source=judge"] if section == "judge" else []


def _attempt(tmp_path, stage, overrides, *, keep_stages: bool = False):
    cfg = dataclasses.replace(pl.animal_task_config(), out=str(tmp_path / "run"))
    if stage.builtin is None:  # a data-file stage: a file that is never read
        (tmp_path / "data.jsonl").write_text("{}\n")
        cfg = pl.apply_overrides(cfg, [f"data.path={tmp_path / 'data.jsonl'}", *overrides])
        return pl.run_on_data(cfg, stage.name)
    cfg = pl.apply_overrides(cfg, overrides)
    if not keep_stages:
        cfg = dataclasses.replace(cfg, stages=stage.prerequisites(cfg))
    return pl.run_pipeline(cfg)


def _problems(tmp_path, stage, cases) -> list[str]:
    """The cases `(path, value, context)` that were not refused as they must be."""
    problems = []
    for path, value, context in cases:
        try:
            _attempt(tmp_path, stage, [*context, f"{path}={value}"], keep_stages=path == "stages")
        except pl.ConfigError as e:
            msg = str(e)
            named = f"{path}=" in msg and value in msg
            if not named or "\n" in msg or not any(w in msg for w in REQUIREMENT):
                problems.append(f"{path}={value}: unclear message {msg!r}")
        except Loaded:
            problems.append(f"{path}={value}: accepted (the model was loaded)")
        else:
            problems.append(f"{path}={value}: accepted")
    return problems


def _cases(sections, cfg, context_of):
    for section in sections:
        for path, tp in leaves(type(getattr(cfg, section)), f"{section}."):
            if path in EXEMPT:
                continue
            values = invalid_values(tp)
            assert values, f"{path}: no invalid value for {tp}; list it in EXEMPT with a reason"
            for v in values:
                yield path, v, context_of(section)


@pytest.mark.parametrize("name", [st.name for st in pl.config.stages() if _owned_sections(st)])
def test_every_setting_of_the_stage_is_refused_before_loading(tmp_path, no_loading, name):
    stage = pl.config.get_stage(name)
    cfg = pl.animal_task_config()
    cases = list(_cases(_owned_sections(stage), cfg, lambda s: _context(stage, s)))
    problems = _problems(tmp_path, stage, cases)
    assert not problems, "\n".join(problems)
    assert not (tmp_path / "run").exists()  # nothing written


def test_every_shared_and_top_level_setting_is_refused_before_loading(tmp_path, no_loading):
    stage = pl.config.get_stage("sft")
    cfg = pl.animal_task_config()
    cases = list(_cases(SHARED, cfg, lambda s: []))
    hints = typing.get_type_hints(pl.PipelineConfig)
    top = [f.name for f in dataclasses.fields(pl.PipelineConfig) if _section_type(hints[f.name])]
    for f in dataclasses.fields(pl.PipelineConfig):
        if f.name in (*top, "sections") or f.name in EXEMPT:
            continue
        cases += [(f.name, v, []) for v in invalid_values(hints[f.name])]
    assert {"label_noise", "eval_samples", "stages"} <= {c[0] for c in cases}
    problems = _problems(tmp_path, stage, cases)
    assert not problems, "\n".join(problems)


def test_the_exempt_fields_exist_and_the_enumeration_reaches_nested_records():
    cfg = pl.animal_task_config()
    paths = {p for p, _ in leaves(pl.PipelineConfig)}
    for stage in pl.config.stages():
        for section in _sections(stage):
            paths |= {p for p, _ in leaves(type(getattr(cfg, section)), f"{section}.")}
    assert set(EXEMPT) <= paths
    owned = [s for st in pl.config.stages() for s in _owned_sections(st)]
    assert sorted(owned) == sorted({s for st in pl.config.stages() for s in _sections(st)})
    for nested in (
        "grpo.rollout_correction.mode",
        "grpo.optim.learning_rate",
        "grpo.options.micro_batches",
        "grpo.lora.rank",
        "judge.yes",
        "multiturn.turn_tokens",
        "multiturn-dpo.prompts_per_round",
    ):
        assert nested in paths
    assert "grpo.temperature" not in paths  # set from sampling.temperature
