"""The per-sample losses of `rlhf_eqx.losses` keep defaults of their own (the losses
layer does not import the settings records); each equals the default of the record
field that sets it in a step, so a loss called alone computes what the step does."""

import dataclasses
import inspect

import pytest

from rlhf_eqx import losses as L, train as T

DPO, KTO, GRPO, PPO = T.DPOSettings, T.KTOSettings, T.GRPOSettings, T.PPOSettings
PAIRS = [
    (L.dpo_loss, {"beta": (DPO, "beta"), "label_smoothing": (DPO, "label_smoothing")}),
    (L.dpo_loss, {"loss_type": (DPO, "loss_type")}),
    (L.dpo_batch_loss, {"beta": (DPO, "beta"), "label_smoothing": (DPO, "label_smoothing")}),
    (L.kto_loss, {"beta": (KTO, "beta"), "loss_type": (KTO, "loss_type")}),
    (L.kto_loss, {"desirable_weight": (KTO, "desirable_weight")}),
    (L.kto_loss, {"undesirable_weight": (KTO, "undesirable_weight")}),
    (L.generalized_jsd, {"beta": (T.DistillSettings, "beta")}),
    (L.generalized_jsd, {"temperature": (T.DistillSettings, "temperature")}),
    (L.grpo_policy_loss, {"clip_eps": (GRPO, "clip_eps"), "importance": (GRPO, "importance")}),
    (L.grpo_policy_loss, {"beta": (GRPO, "beta"), "delta": (GRPO, "delta")}),
    (L.ppo_policy_loss, {"clip_eps": (PPO, "clip_eps"), "dual_clip": (PPO, "dual_clip")}),
    (L.ppo_value_loss, {"clip_eps": (PPO, "vf_clip_eps")}),
    (L.group_advantages, {"scale": (GRPO, "scale")}),
    (L.cispo_policy_loss, {"clip_eps_high": (GRPO, "cispo_eps_high")}),
    (L.cispo_policy_loss, {"clip_eps_low": (GRPO, "cispo_eps_low")}),
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
    (L.high_entropy_policy_loss, {"rho": (GRPO, "entropy_rho"), "clip_eps": (GRPO, "clip_eps")}),
    (L.bradley_terry_loss, {"margin": (T.RewardSettings, "margin")}),
    (L.bradley_terry_loss, {"center_coef": (T.RewardSettings, "center_coef")}),
    (T.prepare_ppo_batch, {"temperature": (PPO, "temperature")}),
]


@pytest.mark.parametrize("fn, fields", PAIRS, ids=lambda x: getattr(x, "__name__", ""))
def test_a_loss_default_is_its_record_default(fn, fields):
    params = inspect.signature(fn).parameters
    for name, (record, field) in fields.items():
        default = {f.name: f.default for f in dataclasses.fields(record)}[field]
        assert params[name].default == default, (fn.__name__, name, record.__name__, field)
