"""Property-testing tools for loss functions: hypothesis strategies and invariant checks.

Import it explicitly (`import rlhf_eqx.testing`); it needs `hypothesis`. The strategies
draw log-probabilities down to -1e4 with every kind of mask (right/left padding, random,
fully masked rows), preference pairs (with ties), reward groups up to ±1e6 and
hyperparameters from 1e-8 to 1e8 (`scales`, for β and temperatures); the checks raise
`AssertionError` with a message when an invariant fails.

Property-testing your own loss takes a few lines:

```python
import jax.numpy as jnp
from hypothesis import given

import rlhf_eqx.testing as rt
from rlhf_eqx.losses import aggregate, kl_penalty


def my_kl_loss(logp, ref_logp, mask):  # [B, T] -> scalar
    # padding zeroed before the estimator: a NaN there would reach its gradient
    logp, ref_logp = jnp.where(mask, logp, 0.0), jnp.where(mask, ref_logp, 0.0)
    per_token = kl_penalty(logp, ref_logp, kind="k3")
    return aggregate(per_token, mask, mode="seq-mean-token-mean")


@given(rt.logprob_arrays(n=2, batch=3, length=6))
def test_my_kl_loss(data):
    logp, ref_logp, mask = data
    rt.check_finite(my_kl_loss, logp, ref_logp, mask)  # values and gradients
    rt.check_padding_invariance(my_kl_loss, (logp, ref_logp), mask, nonfinite=True)
    rt.check_masked_gradients_zero(my_kl_loss, (logp, ref_logp), mask, nonfinite=True)
    rt.check_all_masked_contributes_nothing(my_kl_loss, (logp, ref_logp), mask)
    rt.check_permutation_invariance(my_kl_loss, (logp, ref_logp, mask))
```

The checks compile `fn` with `jax.jit` (pass `jit=False` to run eagerly); fixed shapes
and module-level functions let every hypothesis example reuse one compilation.
`nonfinite=True` also writes NaN and infinities into the padding (`NONFINITE_FILL`):
without the two `jnp.where` above, `kl_penalty`'s gradient at a NaN in the padding is
`0 * NaN`, which finite junk never shows.

Because the first example of a test compiles, Hypothesis' per-example deadline (200 ms
in its default profile) would fail it. Importing `rlhf_eqx.testing` therefore turns the
deadline off: if the active settings profile has a deadline, it loads a profile
`"rlhf_eqx"` equal to it with `deadline=None`. A profile you load afterwards, or
`@settings(deadline=...)` on a test, takes precedence.

To check that your own loss equals a library one before training with it,
`check_loss_matches(my_loss, "sigmoid")` (a DPO-family loss, see
`rlhf_eqx.losses.register_dpo_loss`) or `check_loss_matches(my_loss, "grpo")` (a
per-token policy loss, see `rlhf_eqx.losses.register_policy_loss`) compares values and
gradients on shared random inputs, extreme values and degenerate masks included.

For a clipped policy loss, `check_ppo_clip_gradient_zero(loss_fn, logp, old_logp,
advantages, mask, clip_eps=..., clip_eps_high=...)` checks that no gradient flows
where the ratio is clipped, nor at masked positions.
"""

from ._checks import (
    DEFAULT_FILL as DEFAULT_FILL,
    NONFINITE_FILL as NONFINITE_FILL,
    check_all_masked_contributes_nothing as check_all_masked_contributes_nothing,
    check_finite as check_finite,
    check_masked_gradients_zero as check_masked_gradients_zero,
    check_padding_invariance as check_padding_invariance,
    check_permutation_invariance as check_permutation_invariance,
    check_ppo_clip_gradient_zero as check_ppo_clip_gradient_zero,
)
from ._loss_match import REGISTRIES as REGISTRIES, check_loss_matches as check_loss_matches
from ._strategies import (
    PreferencePairs as PreferencePairs,
    logprob_arrays as logprob_arrays,
    masks as masks,
    preference_pairs as preference_pairs,
    reward_groups as reward_groups,
    scales as scales,
    use_no_deadline as _use_no_deadline,
)

_use_no_deadline()
