"""Each stage's update for a sweep: `build_step(hyper) -> step`, the step its separate
run makes (`rlhf_eqx.train.make_*_step`) with the member's grid values traced — the
loss settings in `TRACEABLE` and the optimiser's peak learning rate — so that one
compiled program (`make_program`) serves every grid point."""

import dataclasses

import rlhf_eqx as rx

from ._lr_scale import build_optimizer
from ._runs import rl_step_settings


def traced_optimizer(c, h: dict, total: int):
    """The optimiser of `c.optim` over `total` updates with the member's traced peak
    learning rate `h["optim.learning_rate"]` when the grid varies it."""
    optim = c.optim
    if "optim.learning_rate" in h:
        optim = dataclasses.replace(optim, learning_rate=h["optim.learning_rate"])
    return build_optimizer(optim, total)


def _traced(cls, c, h: dict, fields: tuple[str, ...], **fixed):
    """The step settings `cls` (e.g. `rlhf_eqx.train.DPOSettings`) of the stage settings
    `c`, with the grid's values of `fields` (and `fixed`) in place: the step's own
    settings class, whose numbers may be traced arrays (a stage's section may declare
    them plain floats)."""
    settings = cls(**{f.name: getattr(c, f.name) for f in dataclasses.fields(cls)})
    return dataclasses.replace(settings, **{k: h[k] for k in fields if k in h}, **fixed)


def dpo_step_builder(c, total: int):
    """`make_dpo_step` with the member's traced `beta`, `label_smoothing` and learning
    rate."""

    def build(h: dict):
        settings = _traced(rx.train.DPOSettings, c, h, ("beta", "label_smoothing"))
        return rx.train.make_dpo_step(traced_optimizer(c, h, total), settings, options=c.options)

    return build


def sft_step_builder(c, total: int):
    """`make_sft_step` with the member's learning rate."""
    return lambda h: rx.train.make_sft_step(traced_optimizer(c, h, total), c, options=c.options)


def reward_step_builder(c, total: int):
    """`make_reward_step` (one reward model) with the member's learning rate."""
    return lambda h: rx.train.make_reward_step(traced_optimizer(c, h, total), c, options=c.options)


def kto_step_builder(c, total: int):
    """`make_kto_step` on cached reference log-probabilities with the member's traced
    `beta`, `desirable_weight`, `undesirable_weight` and learning rate."""

    def build(h: dict):
        settings = rx.train.KTOSettings(
            beta=h.get("beta", c.beta),
            desirable_weight=h.get("desirable_weight", c.desirable_weight),
            undesirable_weight=h.get("undesirable_weight", c.undesirable_weight),
            loss_type=c.loss_type,
            reference="cached",
        )
        return rx.train.make_kto_step(traced_optimizer(c, h, total), settings, options=c.options)

    return build


def grpo_step_builder(c, temperature: float, total: int, completion_budget: int):
    """`make_grpo_step` with the member's traced `beta` and learning rate; the step's
    temperature is the sampling one and Dr.GRPO's normaliser the `completion_budget` (as
    `grpo_state_and_step`, `rl_step_settings`)."""
    c = rl_step_settings(c, temperature, completion_budget)

    def build(h: dict):
        settings = _traced(rx.train.GRPOSettings, c, h, ("beta",))
        return rx.train.make_grpo_step(traced_optimizer(c, h, total), settings, options=c.options)

    return build


def ppo_step_builder(c, temperature: float, total: int, completion_budget: int):
    """`make_ppo_step` with the member's traced `clip_eps`, `vf_coef`, `ent_coef` and
    learning rate (`kl_coef` enters the KL-shaped rewards, per member); the step's
    temperature is the sampling one and Dr.GRPO's normaliser the `completion_budget` (as
    `run_ppo`, `rl_step_settings`)."""
    c = rl_step_settings(c, temperature, completion_budget)

    def build(h: dict):
        fields = ("clip_eps", "vf_coef", "ent_coef")
        settings = _traced(rx.train.PPOSettings, c, h, fields)
        return rx.train.make_ppo_step(traced_optimizer(c, h, total), settings, options=c.options)

    return build
