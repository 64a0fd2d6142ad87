"""A step builder's refusals name the builder and the argument: a record field without a
default that is missing, and `options` of the wrong type."""

import optax
import pytest

from rlhf_eqx import train


def test_a_missing_required_field_names_the_builder_and_the_record():
    needs = r"^make_grpo_step\(\) needs group_size \(a field of GRPOSettings without a default"
    with pytest.raises(TypeError, match=needs):
        train.make_grpo_step(optax.sgd(1.0))
    assert train.make_grpo_step(optax.sgd(1.0), group_size=2, donate=False) is not None


def test_options_of_the_wrong_type_are_named_options():
    # (the test run's type checker names the parameter `options` first)
    options = "make_dpo_step: options must be a StepOptions, got DPOSettings|parameter 'options'"
    with pytest.raises(TypeError, match=options):
        train.make_dpo_step(optax.sgd(1.0), options=train.DPOSettings())
    settings = "^make_dpo_step: settings must be a DPOSettings, got SFTSettings"
    with pytest.raises(TypeError, match=settings):
        train.make_dpo_step(optax.sgd(1.0), train.SFTSettings())
