"""Dr.GRPO's normaliser in the RL stages: with `mode="seq-mean-token-sum-norm"` and no
`constant`, a stage divides by the completion budget (`sampling.max_new_tokens`), as
TRL's `loss_type="dr_grpo"` divides by `max_completion_length`, not by the padded row
width (prompt included) that `make_grpo_step` defaults to on its own."""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import tiny_policies

from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.assets import asset_path

_PROMPTS = [f"Once upon a time {i}" for i in range(4)]
_PARITY = [pl.runs.RewardFunction("parity", lambda p, t: float(len(t) % 2))]


@pytest.fixture(scope="module")
def builtin():
    tok = data.load_tokenizer(asset_path("tok512.bin"))
    return tiny_policies(tok.vocab_size, 0)[0], tok


def _first_loss(builtin, tmp_path, **changes) -> float:
    policy, tok = builtin
    cfg = pl.animal_task_config().grpo
    cfg = dataclasses.replace(
        cfg, prompts_per_rollout=2, group_size=4, rollouts=1, epochs=1, beta=0.0, **changes
    )
    name = f"grpo-{changes.get('constant')}"
    log = pl.tools.MetricsLog(str(tmp_path), name, quiet=True)
    ctx = pl.RunContext(
        ops=pl.OpsConfig(monitor=False, quiet=True),
        log=log,
        key=jax.random.key(3),
        checkpoint_dir=None,
        prompt_length=16,
        max_new_tokens=8,
    )
    pl.runs.run_grpo(policy, tok, _PROMPTS, reward=_PARITY, cfg=cfg, ctx=ctx)
    steps = [r for r in pl.tools.read_records(str(tmp_path)) if r.get("stage") == name]
    return [r["loss"] for r in steps if "step" in r][0]


def test_dr_grpo_divides_by_the_completion_budget(builtin, tmp_path):
    mode = "seq-mean-token-sum-norm"
    default = _first_loss(builtin, tmp_path, mode=mode)
    assert default != 0.0  # a signal: the parity reward differs within a group
    # the same rollout and the same first loss as C = max_new_tokens = 8 set by hand
    assert default == _first_loss(builtin, tmp_path, mode=mode, constant=8.0)
    # and twice the loss at C = 16 (the loss is linear in 1 / C)
    np.testing.assert_allclose(
        default, 2 * _first_loss(builtin, tmp_path, mode=mode, constant=16.0), rtol=1e-6
    )
