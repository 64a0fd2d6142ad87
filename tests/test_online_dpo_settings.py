"""The DPO settings of the `dpo` and `online-dpo` stages and of `make_dpo_step` either act
on the loss or are refused in one line naming the field: label smoothing for a loss that
smooths its labels, a built-in loss's hyperparameter for the loss that reads it, and a
loss that sorts over the batch on whole batches only."""

import re

import jax.numpy as jnp
import optax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl

# TRL's `DPOTrainer` applies `label_smoothing` to these losses only (the others ignore it)
SMOOTHED = {"sigmoid", "robust", "exo_pair", "sigmoid_norm", "simpo", "aot", "aot_pair"}
READS = {"bco_pair": "bco_delta", "discopop": "discopop_tau", "simpo": "simpo_gamma"}


def _refused(overrides: list[str], field: str) -> str:
    with pytest.raises(pl.ConfigError, match=rf"^{re.escape(field)}=") as e:
        pl.config.validate_config(pl.apply_overrides(pl.PipelineConfig(), overrides))
    assert "\n" not in str(e.value)
    return str(e.value)


def _accepted(overrides: list[str]) -> None:
    pl.config.validate_config(pl.apply_overrides(pl.PipelineConfig(), overrides))


@pytest.mark.parametrize("loss_type", sorted(set(rx.losses.DPO_LOSS_TYPES) - SMOOTHED))
def test_label_smoothing_of_a_loss_without_it_is_refused(loss_type):
    with pytest.raises(ValueError, match=r"^label_smoothing=0\.1: loss_type=") as e:
        rx.train.make_dpo_step(optax.sgd(0.1), loss_type=loss_type, label_smoothing=0.1)
    assert "sigmoid" in str(e.value)  # names the losses that read it
    msg = _refused([f"dpo.loss_type={loss_type}", "dpo.label_smoothing=0.1"], "dpo.label_smoothing")
    assert loss_type in msg


@pytest.mark.parametrize("loss_type", sorted(SMOOTHED))
def test_label_smoothing_of_a_smoothing_loss_is_accepted(loss_type):
    rx.train.make_dpo_step(optax.sgd(0.1), loss_type=loss_type, label_smoothing=0.1)
    _accepted([f"dpo.loss_type={loss_type}", "dpo.label_smoothing=0.1"])


def test_label_smoothing_changes_the_loss_it_is_accepted_for():
    c, r, rc, rr = (jnp.array([x]) for x in (-3.0, -5.0, -4.0, -4.5))
    plain = rx.losses.dpo_batch_loss(c, r, rc, rr, label_smoothing=0.0)
    smoothed = rx.losses.dpo_batch_loss(c, r, rc, rr, label_smoothing=0.1)
    assert float(jnp.abs(plain - smoothed)[0]) > 1e-3


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "bco_pair", "discopop"])
def test_a_builtin_hyperparameter_of_another_loss_is_refused(loss_type):
    other = "simpo_gamma"
    with pytest.raises(ValueError, match=rf"^loss_kwargs=.*{other}") as e:
        rx.train.DPOSettings(loss_type=loss_type, loss_kwargs={other: 1.0})
    assert "simpo" in str(e.value).split(other, 1)[1]  # whose hyperparameter it is
    _refused(
        [f"dpo.loss_type={loss_type}", f'dpo.loss_kwargs={{"{other}": 1.0}}'], "dpo.loss_kwargs"
    )


@pytest.mark.parametrize("loss_type, name", sorted(READS.items()))
def test_a_builtin_hyperparameter_is_accepted_by_its_loss_and_changes_it(loss_type, name):
    s = rx.train.DPOSettings(loss_type=loss_type, loss_kwargs={name: 0.3})
    _accepted([f"dpo.loss_type={loss_type}", f'dpo.loss_kwargs={{"{name}": 0.3}}'])
    c, r, rc, rr, n = (jnp.array([x]) for x in (-3.0, -5.0, -4.0, -4.5, 3.0))
    kw = dict(loss_type=loss_type, chosen_len=n, rejected_len=n)
    assert float(rx.losses.dpo_batch_loss(c, r, rc, rr, **kw, **s.loss_kwargs)[0]) != float(
        rx.losses.dpo_batch_loss(c, r, rc, rr, **kw)[0]
    )


@pytest.mark.parametrize("loss_type", ["aot", "aot_pair"])
def test_a_batch_sorting_loss_with_micro_batches_is_refused_naming_the_field(loss_type):
    msg = _refused(
        [f"dpo.loss_type={loss_type}", "dpo.options.micro_batches=2", "dpo.batch_size=4"],
        "dpo.options.micro_batches",
    )
    assert loss_type in msg
    _accepted([f"dpo.loss_type={loss_type}", "dpo.batch_size=4"])


# --- the judge that labels online DPO's pairs (`run_online_dpo(label=...)`) ---------------


@pytest.fixture(scope="module")
def builtin():
    return pl.tools.load_model("builtin")


def test_a_judge_template_without_the_completion_is_refused(builtin):
    """A template that never shows the judge the completion scores every completion of a
    prompt alike (online DPO would get no pair): refused as the `judge.template` setting
    is, in one line naming `template`."""
    policy, tok = builtin
    for t in ("Q: {prompt} Good?", "Q: {prompt} {{completion}} Good?"):
        with pytest.raises(ValueError, match=r"^template=.*\{completion\}") as e:
            rx.train.judge_reward(policy, tok, template=t, yes_token="y", no_token="n")
        assert "\n" not in str(e.value)
    judge = rx.train.judge_reward(
        policy, tok, template="Q: {prompt} A: {completion!s} Good?", yes_token="y", no_token="n"
    )
    scores = judge.score(["Once", "Once"], [" upon a time", " there was a cat"])
    assert scores[0] != scores[1]  # the completion reaches the judge


@pytest.mark.parametrize("value", ["sigmoid,sft", "[sigmoid, bco_pair]", "sigmoid bco_pair"])
def test_a_list_of_loss_types_is_refused_pointing_at_the_weighted_sum(value):
    """TRL's `loss_type=[...]` with `loss_weights` (MPO) is one custom loss here: the
    refusal says so (and that TRL's `"sft"` term is `rpo_alpha`), in one line."""
    with pytest.raises(ValueError, match=r"^loss_type=.*one loss_type") as e:
        rx.train.DPOSettings(loss_type=value)
    assert "loss_weights" in str(e.value) and "\n" not in str(e.value)
    assert ("rpo_alpha" in str(e.value)) == ("sft" in value)
    msg = _refused([f"dpo.loss_type={value}"], "dpo.loss_type")
    assert "register_dpo_loss" in msg


def test_an_unknown_keyword_of_a_builtin_loss_is_refused_naming_loss_kwargs():
    _refused(['dpo.loss_kwargs={"margin": 1.0}'], "dpo.loss_kwargs")


# --- `dpo.reference`: what the runs compute -------------------------------------------------

_PAIRS = [
    ("Once upon a time", " a dog ran far away.", " the."),
    ("The cat", " sat on a big mat.", " mat mat"),
    ("Tom had", " a red ball.", " a"),
    ("The sun", " was warm and bright.", " sun sun sun"),
]


def _seen_references(tmp_path, builtin, **settings) -> tuple[list[bool], list[dict]]:
    """Whether each step's batch carried reference log-probabilities, and its metrics."""
    from rlhf_eqx import data

    policy, tok = builtin
    seen = []

    def make_step(optimizer, cfg, *, options):
        step = rx.train.make_dpo_step(optimizer, cfg, options=options)

        def recorded(params, opt_state, batch, **kw):
            seen.append(batch.ref_chosen_logp is not None)
            return step(params, opt_state, batch, **kw)

        return recorded

    ctx = pl.RunContext(
        ops=pl.OpsConfig(quiet=True, monitor=False),
        log=pl.tools.MetricsLog(str(tmp_path / str(settings)), "dpo", quiet=True),
        key=__import__("jax").random.key(0),
        prompt_length=8,
    )
    cfg = pl.DPOConfig(steps=2, batch_size=2, max_length=24, **settings)
    pairs = [data.PreferenceRecord(*p) for p in _PAIRS]
    res = pl.runs.run_dpo(policy, tok, pairs, cfg=cfg, ctx=ctx, make_step=make_step)
    return seen, res.loop.history


@pytest.mark.parametrize(
    "settings, scored",
    [
        ({}, True),
        ({"reference": "none"}, False),
        ({"loss_type": "simpo"}, False),
        ({"loss_type": "orpo"}, False),
        ({"loss_type": "ipo"}, True),
    ],
)
def test_the_reference_is_computed_only_for_a_step_that_reads_it(
    tmp_path, builtin, settings, scored
):
    seen, history = _seen_references(tmp_path, builtin, **settings)
    assert seen == [scored, scored]
    assert all(jnp.isfinite(h["loss"]) for h in history)


def test_a_reference_free_run_of_the_dpo_step_skips_the_reference(tmp_path, builtin):
    """`reference="none"` (TRL `reference_free`): the rewards are β·log π of the policy."""
    from rlhf_eqx import data

    policy, tok = builtin
    ctx = pl.RunContext(
        ops=pl.OpsConfig(quiet=True, monitor=False),
        log=pl.tools.MetricsLog(str(tmp_path), "dpo", quiet=True),
        key=__import__("jax").random.key(0),
        prompt_length=8,
    )
    cfg = pl.DPOConfig(steps=1, batch_size=2, max_length=24, reference="none", beta=0.5)
    pairs = [data.PreferenceRecord(*p) for p in _PAIRS]
    h = pl.runs.run_dpo(policy, tok, pairs, cfg=cfg, ctx=ctx).loop.history[0]
    assert h["rewards/chosen"] == pytest.approx(0.5 * h["logps/chosen"], rel=1e-5)


def _needs_margin(c, r, rc, rr, *, beta, margin):
    return jnp.maximum(0.0, margin - beta * ((c - rc) - (r - rr)))


rx.losses.register_dpo_loss("settings_test_needs_margin", _needs_margin)


def test_a_stage_config_whose_field_gives_its_loss_a_hyperparameter_passes_its_checks():
    """A DPO variant's stage settings (a `DPOConfig` subclass whose field is its loss's
    hyperparameter without a default) pass the stage's checks."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class MarginConfig(pl.DPOConfig):
        loss_type: str = "settings_test_needs_margin"
        margin: float = 0.5

    MarginConfig().check("margin")
    with pytest.raises(pl.ConfigError, match=r"^margin\.label_smoothing=0\.1: "):
        pl.DPOConfig(loss_type="hinge", label_smoothing=0.1).check("margin")
