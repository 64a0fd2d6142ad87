"""A step builder given a user's subclass of its settings record takes the subclass's
loss hyperparameter fields as keyword shortcuts too (`make_dpo_step(opt, MySettings(),
margin=2.0)`), as it takes the record's own; other subclass fields stay refused."""

import dataclasses

import jax.numpy as jnp
import optax
import pytest
from helpers import assert_tree_allclose
from test_train_common import CumMeanLM, preference_batch, sgd_delta

from rlhf_eqx import losses, train


def shifted_hinge(chosen, rejected, ref_chosen, ref_rejected, *, beta, shift):
    """SLiC's hinge (Zhao et al. 2023) with its margin `shift`: max(0, shift - βu)."""
    return jnp.maximum(0.0, shift - beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))


losses.register_dpo_loss("shifted_hinge", shifted_hinge)


@dataclasses.dataclass(frozen=True)
class ShiftSettings(train.DPOSettings):
    loss_type: str = "shifted_hinge"
    shift: float = 1.0
    note: str = ""  # not a hyperparameter of the loss


def _same_step(got, want):
    assert float(got[1]["loss"]) == pytest.approx(float(want[1]["loss"]), rel=1e-6)
    assert_tree_allclose(got[0], want[0], rtol=1e-6, atol=1e-7)


def test_a_subclass_hyperparameter_is_a_shortcut(getkey):
    policy, reference = CumMeanLM(getkey()), CumMeanLM(getkey())
    batch = preference_batch(getkey())

    def run(settings=None, **kw):
        step = train.make_dpo_step(optax.sgd(1.0), settings, donate=False, **kw)
        return sgd_delta(step, policy, batch, reference=reference)

    want = run(ShiftSettings(shift=3.0, beta=0.2))
    _same_step(run(ShiftSettings(), shift=3.0, beta=0.2), want)
    _same_step(run(loss_type="shifted_hinge", loss_kwargs={"shift": 3.0}, beta=0.2), want)
    assert float(run(ShiftSettings())[1]["loss"]) != float(want[1]["loss"])
    with pytest.raises(TypeError, match=r"\['note'\]; the fields of DPOSettings are .*, shift"):
        train.make_dpo_step(optax.sgd(1.0), ShiftSettings(), note="x")
    with pytest.raises(TypeError, match=r"\['shift'\]"):  # no subclass given: not a field
        train.make_dpo_step(optax.sgd(1.0), shift=3.0)
