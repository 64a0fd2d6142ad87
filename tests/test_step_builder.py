"""`rlhf_eqx.train.step_builder`: the one public form of every step builder, for the
package's builders and a user's own, and the signature the API reference shows."""

import dataclasses
import inspect
import os

import optax
import pytest
from test_train_common import CumMeanLM, counted, sequence_batch, traces

import rlhf_eqx as rx

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
P = inspect.Parameter


@dataclasses.dataclass(frozen=True, kw_only=True)
class HalfSettings:
    scale: float = 0.5

    def __post_init__(self):
        rx.train.check_number("scale", self.scale, low=0.0, low_open=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HalfConfig(HalfSettings):
    """A stage config that inherits the record, as the pipeline's configs do."""

    note: str = "not a setting of the step"


CALLS = []


@rx.train.step_builder(HalfSettings)
def make_half_step(optimizer, settings: HalfSettings, options: rx.train.StepOptions, *, tag="a"):
    """The half step's own docstring."""
    CALLS.append((optimizer, settings, options, tag))
    return len(CALLS)


def _last_call(*args, **kwargs):
    CALLS.clear()
    make_half_step(*args, **kwargs)
    return CALLS[-1]


def test_the_public_signature_is_the_builders_form():
    params = inspect.signature(make_half_step).parameters
    assert [(n, p.kind) for n, p in params.items()] == [
        ("optimizer", P.POSITIONAL_OR_KEYWORD),
        ("settings", P.POSITIONAL_OR_KEYWORD),
        ("tag", P.KEYWORD_ONLY),
        ("options", P.KEYWORD_ONLY),
        ("shortcuts", P.VAR_KEYWORD),
    ]
    assert params["optimizer"].annotation is optax.GradientTransformation
    assert params["settings"].annotation == (HalfSettings | None)
    assert params["settings"].default is None and params["tag"].default == "a"
    assert params["options"].annotation == (rx.train.StepOptions | None)
    assert params["options"].default is None
    assert make_half_step.__name__ == "make_half_step"
    assert make_half_step.__doc__ == "The half step's own docstring."
    assert inspect.signature(make_half_step.__wrapped__).parameters.keys() == {
        "optimizer",
        "settings",
        "options",
        "tag",
    }


def test_settings_options_and_shortcuts_reach_the_build():
    opt = optax.sgd(0.1)
    assert _last_call(opt) == (opt, HalfSettings(), rx.train.StepOptions(), "a")
    got = _last_call(opt, scale=0.25, micro_batches=2, tag="b")
    assert got == (opt, HalfSettings(scale=0.25), rx.train.StepOptions(micro_batches=2), "b")
    # a shortcut replaces the given record's field, of either record
    options = rx.train.StepOptions(micro_batches=3)
    got = _last_call(opt, HalfSettings(scale=2.0), options=options, nonfinite="raise", scale=3.0)
    assert got[1] == HalfSettings(scale=3.0)
    assert got[2] == rx.train.StepOptions(micro_batches=3, nonfinite="raise")
    # a config that inherits the record arrives as the plain record (its own fields only)
    settings = _last_call(opt, settings=HalfConfig(scale=0.75))[1]
    assert type(settings) is HalfSettings and settings == HalfSettings(scale=0.75)


def test_bad_calls_are_refused_with_the_builders_name():
    opt = optax.sgd(0.1)
    with pytest.raises(TypeError, match=r"^make_half_step\(\) got unexpected keyword .*'bogus'"):
        make_half_step(opt, bogus=1)
    with pytest.raises(TypeError, match=r"make_half_step: settings must be a HalfSettings"):
        make_half_step(opt, rx.train.SFTSettings())
    with pytest.raises(ValueError, match=r"^scale=-1"):
        make_half_step(opt, scale=-1)
    with pytest.raises(ValueError, match=r"^micro_batches=0"):
        make_half_step(opt, micro_batches=0)


def test_a_config_and_shortcuts_share_the_builders_program(getkey):
    """An SFT step built from a config that inherits `SFTSettings` (with a field of its
    own) and one built from keyword shortcuts are one build: the second compiles nothing."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class SFTConfig(rx.train.SFTSettings):
        steps: int = 3

    model = counted(CumMeanLM(getkey()))
    batch = sequence_batch(getkey())
    opt = rx.train.make_optimizer(learning_rate=1e-2, total_steps=10)
    builds = [
        rx.train.make_sft_step(opt, SFTConfig(mode="seq-mean-token-mean"), micro_batches=2),
        rx.train.make_sft_step(
            opt, mode="seq-mean-token-mean", options=rx.train.StepOptions(micro_batches=2)
        ),
    ]
    losses = []
    for n, step in enumerate(builds):
        state = rx.train.init_train_state(model, opt)
        losses.append(state.apply(step, batch)[1]["loss"])
        if n == 0:
            once = traces(model)
    assert once > 0 and traces(model) == once
    assert losses[0] == losses[1]
    with pytest.raises(TypeError, match=r"^make_sft_step\(\) got unexpected keyword"):
        rx.train.make_sft_step(opt, beta=0.1)
    missing = (
        r"^make_ensemble_reward_step\(\) missing required keyword-only argument\(s\): 'members'$"
    )
    with pytest.raises(TypeError, match=missing):
        rx.train.make_ensemble_reward_step(opt, margin=0.5)


def test_the_api_reference_shows_the_public_signature():
    griffe = pytest.importorskip("griffe")
    extension = os.path.join(ROOT, "docs", "griffe_signatures.py") + ":RuntimeSignatures"
    package = griffe.load("rlhf_eqx", extensions=griffe.load_extensions(extension))

    def shown(name):
        return [
            (p.name, p.kind.value, str(p.annotation), p.default)
            for p in package[f"train.{name}"].parameters
        ]

    assert shown("make_ppo_step") == [
        ("optimizer", "positional or keyword", "GradientTransformation", None),
        ("settings", "positional or keyword", "PPOSettings | None", "None"),
        ("value_optimizer", "keyword-only", "GradientTransformation | None", "None"),
        ("options", "keyword-only", "StepOptions | None", "None"),
        ("shortcuts", "variadic keyword", "Any", None),
    ]
    assert [p[0] for p in shown("make_sft_step")] == [
        "optimizer",
        "settings",
        "options",
        "shortcuts",
    ]
    # an undecorated function is documented as written
    assert [p[0] for p in shown("make_step")][:3] == ["loss_fn", "optimizer", "options"]
