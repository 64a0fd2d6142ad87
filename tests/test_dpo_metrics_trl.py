"""The DPO step's `rewards/*` and `logps/*` metrics are TRL's, loss type by loss type,
against numbers computed by hand from TRL's formulas:

- TRL 1.x `DPOTrainer._compute_loss`: `chosen_rewards = beta * (chosen_logps -
  ref_chosen_logps)` of the **summed** completion log-probabilities for every loss type
  (`"ipo"` and `"sigmoid_norm"` divide by the length inside the loss only);
- `CPOTrainer` (`"simpo"`) and `ORPOTrainer` (`"orpo"`): `concatenated_forward(...,
  average_log_prob=True)`, so `chosen_rewards = beta * chosen_logps / |y_w|`, no
  reference, and `logps/chosen` the per-token average.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_train_common import CumMeanLM, preference_batch, sgd_delta

import rlhf_eqx as rx
from rlhf_eqx.train import make_dpo_step, sequence_logps

BETA = 0.3


def _logps(model, batch):
    c = sequence_logps(model, batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask)
    r = sequence_logps(
        model, batch.rejected_tokens, batch.rejected_mask, batch.rejected_completion_mask
    )
    return np.asarray(c, np.float64), np.asarray(r, np.float64)


def _lengths(batch):
    # every completion token follows the 3-token prompt, so each is predicted and counted
    cl = jnp.sum(batch.chosen_completion_mask & batch.chosen_mask, axis=-1)
    rl = jnp.sum(batch.rejected_completion_mask & batch.rejected_mask, axis=-1)
    return np.asarray(cl, np.float64), np.asarray(rl, np.float64)


def _batch():
    """Pairs of different lengths, each with completion tokens on both sides (TRL's data
    has no empty completion; its per-token average of one would be 0 / 0)."""
    batch = preference_batch(jax.random.key(2), B=6, T=10)
    keep = jnp.asarray([0, 1, 2, 4, 5])  # row 3's chosen completion is empty
    return jax.tree.map(lambda x: x[keep], batch)


def _trl_metrics(c, r, rc, rr):
    """`get_batch_loss_metrics` / `_compute_loss`: means over the pairs."""
    chosen, rejected = BETA * (c - rc), BETA * (r - rr)
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "rewards/accuracies": (chosen > rejected).astype(float).mean(),
        "logps/chosen": c.mean(),
        "logps/rejected": r.mean(),
    }


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sigmoid_norm", "simpo", "orpo"])
def test_the_dpo_metrics_are_trl_s(loss_type):
    policy = CumMeanLM(jax.random.key(0))
    reference = CumMeanLM(jax.random.key(1))
    batch = _batch()
    c, r = _logps(policy, batch)
    rc, rr = _logps(reference, batch)
    cl, rl = _lengths(batch)
    assert cl.min() > 0 and rl.min() > 0 and len(set(cl)) > 1 and not np.array_equal(cl, rl)
    if loss_type in ("simpo", "orpo"):  # CPOTrainer / ORPOTrainer: averages, no reference
        zero = np.zeros_like(c)
        want = _trl_metrics(c / cl, r / rl, zero, zero)
    else:  # DPOTrainer: sums, whatever the loss divides by inside
        want = _trl_metrics(c, r, rc, rr)
    step = make_dpo_step(optax.sgd(0.0), beta=BETA, loss_type=loss_type)
    _, got = sgd_delta(step, policy, batch, reference=reference)
    for name, value in want.items():
        np.testing.assert_allclose(float(got[name]), value, rtol=2e-5, atol=1e-6, err_msg=name)
    # the sums and the averages differ here, so the check tells the two apart
    if loss_type in ("simpo", "orpo"):
        assert abs(float(got["logps/chosen"]) - c.mean()) > 1e-2
    else:
        assert abs(float(got["logps/chosen"]) - (c / cl).mean()) > 1e-2


def test_the_loss_is_unchanged_for_the_length_normalised_types():
    """The metrics change, not the loss: IPO's and SimPO's loss as TRL's formulas."""
    policy = CumMeanLM(jax.random.key(0))
    reference = CumMeanLM(jax.random.key(1))
    batch = _batch()
    c, r = _logps(policy, batch)
    rc, rr = _logps(reference, batch)
    cl, rl = _lengths(batch)
    ipo = (((c - rc) / cl - (r - rr) / rl) - 1 / (2 * BETA)) ** 2
    gamma = rx.losses.defaults.SIMPO_GAMMA
    logits = c / cl - r / rl - gamma / BETA
    simpo = np.logaddexp(0.0, -BETA * logits)  # -log sigmoid(beta * logits), no smoothing
    for loss_type, want in (("ipo", ipo.mean()), ("simpo", simpo.mean())):
        step = make_dpo_step(optax.sgd(0.0), beta=BETA, loss_type=loss_type)
        _, got = sgd_delta(step, policy, batch, reference=reference)
        np.testing.assert_allclose(float(got["loss"]), want, rtol=2e-5, err_msg=loss_type)
