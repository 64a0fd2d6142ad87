"""A DPO-family loss of the wrong form is refused in one line that says what is wrong:
too few positional log-probabilities, no `beta`, or a `loss_kwargs` entry it does not
take (with the hyperparameters it does)."""

import jax
import pytest

from rlhf_eqx import losses, train


def three(chosen, rejected, ref_chosen, *, beta):
    return -jax.nn.log_sigmoid(beta * (chosen - rejected - ref_chosen))


def no_beta(chosen, rejected, ref_chosen, ref_rejected):
    return -jax.nn.log_sigmoid((chosen - rejected) - (ref_chosen - ref_rejected))


def shifted(chosen, rejected, ref_chosen, ref_rejected, *, beta, shift=0.0):
    return -jax.nn.log_sigmoid(beta * ((chosen - rejected) - (ref_chosen - ref_rejected)) - shift)


@pytest.mark.parametrize(
    "fn, why",
    [(three, "it takes 3 positional arguments"), (no_beta, r"it takes no `beta`")],
)
def test_a_loss_of_the_wrong_form_is_refused_saying_why(fn, why):
    with pytest.raises(ValueError, match=f"^fn={fn.__name__} cannot be called as .*: {why}"):
        losses.register_dpo_loss("wrong_form", fn)


def test_an_unknown_loss_kwarg_lists_the_loss_hyperparameters():
    losses.register_dpo_loss("shifted_sigmoid", shifted)
    with pytest.raises(ValueError, match=r"'shfit' \(its hyperparameters: shift\)$"):
        train.DPOSettings(loss_type="shifted_sigmoid", loss_kwargs={"shfit": 0.5})
    assert train.DPOSettings(loss_type="shifted_sigmoid", loss_kwargs={"shift": 0.5})
