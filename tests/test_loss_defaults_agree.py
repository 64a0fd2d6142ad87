"""Each default hyperparameter is written once, in `rlhf_eqx.losses.defaults`: the
per-sample loss and the settings record field that sets it in a step both name the same
constant (not two equal literals), so a loss called alone computes what the step does and
a default changes in one place. A literal written again in either place fails here."""

import ast
import dataclasses
import inspect
import textwrap

import pytest

from rlhf_eqx import losses as L, train as T
from rlhf_eqx.losses import defaults as D

DPO, KTO, GRPO, PPO = T.DPOSettings, T.KTOSettings, T.GRPOSettings, T.PPOSettings
PAIRS = [
    (L.dpo_loss, {"beta": (DPO, "beta"), "label_smoothing": (DPO, "label_smoothing")}),
    (L.dpo_loss, {"loss_type": (DPO, "loss_type")}),
    (L.dpo_batch_loss, {"beta": (DPO, "beta"), "label_smoothing": (DPO, "label_smoothing")}),
    (L.dpo_batch_loss, {"loss_type": (DPO, "loss_type")}),
    (L.dpo_implicit_rewards, {"beta": (DPO, "beta")}),
    (L.orpo_loss, {"beta": (DPO, "beta")}),
    (L.kto_loss, {"beta": (KTO, "beta"), "loss_type": (KTO, "loss_type")}),
    (L.kto_loss, {"desirable_weight": (KTO, "desirable_weight")}),
    (L.kto_loss, {"undesirable_weight": (KTO, "undesirable_weight")}),
    (L.generalized_jsd, {"beta": (T.DistillSettings, "beta")}),
    (L.grpo_policy_loss, {"clip_eps": (GRPO, "clip_eps"), "importance": (GRPO, "importance")}),
    (L.grpo_policy_loss, {"beta": (GRPO, "beta")}),
    (L.ppo_policy_loss, {"clip_eps": (PPO, "clip_eps")}),
    (L.clipped_surrogate, {"clip_eps": (PPO, "clip_eps")}),
    (L.ppo_value_loss, {"clip_eps": (PPO, "vf_clip_eps")}),
    (L.group_advantages, {"scale": (GRPO, "scale")}),
    (L.cispo_policy_loss, {"clip_eps_high": (GRPO, "cispo_eps_high")}),
    (L.gmpo_policy_loss, {"clip_eps": (GRPO, "gmpo_clip")}),
    (L.sapo_policy_loss, {"tau_pos": (GRPO, "sapo_tau_pos"), "tau_neg": (GRPO, "sapo_tau_neg")}),
    (L.kl_cov_policy_loss, {"kl_coef": (GRPO, "kl_cov_coef"), "fraction": (GRPO, "cov_fraction")}),
    (
        L.clip_cov_policy_loss,
        {"fraction": (GRPO, "cov_fraction"), "select": (GRPO, "clip_cov_select")},
    ),
    (
        L.clip_cov_policy_loss,
        {"cov_low": (GRPO, "clip_cov_low"), "cov_high": (GRPO, "clip_cov_high")},
    ),
    (L.clip_cov_policy_loss, {"clip_eps": (GRPO, "clip_eps")}),
    (L.high_entropy_policy_loss, {"rho": (GRPO, "entropy_rho"), "clip_eps": (GRPO, "clip_eps")}),
    (L.high_entropy_policy_loss, {"importance": (GRPO, "importance")}),
    (L.entropy_quantile_mask, {"rho": (GRPO, "entropy_rho")}),
    (L.bradley_terry_loss, {"margin": (T.RewardSettings, "margin")}),
    (L.bradley_terry_loss, {"center_coef": (T.RewardSettings, "center_coef")}),
]
# Defaults of `None` (a switch that is off) are no number to tune: both sides say None.
OFF = [
    (L.grpo_policy_loss, {"delta": (GRPO, "delta"), "clip_eps_high": (GRPO, "clip_eps_high")}),
    (L.ppo_policy_loss, {"dual_clip": (PPO, "dual_clip")}),
    (L.cispo_policy_loss, {"clip_eps_low": (GRPO, "cispo_eps_low")}),
]
# The DPO family's keyword hyperparameters that are `loss_kwargs` entries, not fields.
LOSS_ONLY = {
    "bco_delta": "BCO_DELTA",
    "discopop_tau": "DISCOPOP_TAU",
    "simpo_gamma": "SIMPO_GAMMA",
}


def _unwrap(fn):
    return inspect.unwrap(fn)


def _parameter_defaults(fn) -> dict[str, ast.expr]:
    """The default expressions of `fn`'s parameters, as written in its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(_unwrap(fn))))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    a = node.args
    positional = a.posonlyargs + a.args
    pairs = list(zip(positional[len(positional) - len(a.defaults) :], a.defaults))
    pairs += [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
    return {arg.arg: d for arg, d in pairs}


def _field_defaults(record: type) -> dict[str, ast.expr]:
    """The default expressions of the fields `record` (and its bases) declare."""
    out: dict[str, ast.expr] = {}
    for cls in reversed(record.__mro__):
        if not dataclasses.is_dataclass(cls) or cls is object:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)).body
        for stmt in body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if stmt.value is not None:
                    out[stmt.target.id] = stmt.value
    return out


def _constant_name(expr: ast.expr) -> str | None:
    """The `rlhf_eqx.losses.defaults` constant an expression names (`DPO_BETA`,
    `defaults.DPO_BETA`), or `None` for anything else (a literal)."""
    name = expr.id if isinstance(expr, ast.Name) else getattr(expr, "attr", None)
    return name if name is not None and hasattr(D, name) else None


def _check(fn, param: str, record: type, field: str) -> None:
    written = _parameter_defaults(fn)[param]
    declared = _field_defaults(record)[field]
    where = f"{fn.__name__}({param}=) / {record.__name__}.{field}"
    a, b = _constant_name(written), _constant_name(declared)
    assert a is not None, f"{where}: the loss writes {ast.unparse(written)}, not a constant"
    assert b is not None, f"{where}: the record writes {ast.unparse(declared)}, not a constant"
    assert a == b, f"{where}: name different constants, {a} and {b}"
    value = getattr(D, a)
    record_default = {f.name: f.default for f in dataclasses.fields(record)}[field]
    assert inspect.signature(fn).parameters[param].default == value == record_default, where


@pytest.mark.parametrize("fn, fields", PAIRS, ids=lambda x: getattr(x, "__name__", ""))
def test_a_loss_and_its_record_name_one_constant(fn, fields):
    for param, (record, field) in fields.items():
        _check(fn, param, record, field)


@pytest.mark.parametrize("fn, fields", OFF, ids=lambda x: getattr(x, "__name__", ""))
def test_switches_that_are_off_are_none_on_both_sides(fn, fields):
    for param, (record, field) in fields.items():
        written = _parameter_defaults(fn)[param]
        declared = _field_defaults(record)[field]
        for expr in (written, declared):
            assert isinstance(expr, ast.Constant) and expr.value is None, (fn.__name__, param)


@pytest.mark.parametrize("fn", [L.dpo_loss, L.dpo_batch_loss], ids=lambda f: f.__name__)
def test_the_dpo_loss_kwargs_defaults_are_constants(fn):
    written = _parameter_defaults(fn)
    for param, constant in LOSS_ONLY.items():
        assert _constant_name(written[param]) == constant, (fn.__name__, param)


def test_the_temperature_defaults_are_the_sampler_s():
    import rlhf_eqx as rx

    temperature = inspect.signature(T.prepare_ppo_batch).parameters["temperature"].default
    assert temperature == PPO().temperature == rx.DEFAULT_TEMPERATURE
    assert inspect.signature(L.generalized_jsd).parameters["temperature"].default == (
        T.DistillSettings().temperature
    )


def test_the_checker_finds_a_literal_written_again():
    """The check fails for a loss or a record that restates the number."""

    def restated(x, *, beta=0.1):
        return x

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Restated:
        beta: float = 0.1

    def named(x, *, beta=D.DPO_BETA):
        return x

    with pytest.raises(AssertionError, match="the loss writes 0.1, not a constant"):
        _check(restated, "beta", DPO, "beta")
    with pytest.raises(AssertionError, match="the record writes 0.1"):
        _check(named, "beta", Restated, "beta")
    _check(named, "beta", DPO, "beta")

    def other(x, *, beta=D.KTO_BETA):
        return x

    with pytest.raises(AssertionError, match="different constants"):
        _check(other, "beta", DPO, "beta")


def test_every_constant_is_read():
    """No constant of `defaults` is left behind when a default moves."""
    sources = [inspect.getsource(m) for m in _modules()]
    for name in [n for n in vars(D) if n.isupper()]:
        assert sum(s.count(name) for s in sources) >= 1, name


def _modules():
    import sys

    return [
        m
        for n, m in sorted(sys.modules.items())
        if n.startswith(("rlhf_eqx.losses._", "rlhf_eqx.train._")) and m is not None
    ]
