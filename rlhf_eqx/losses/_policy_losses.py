r"""Policy losses adopted after DAPO: their names and shared helpers, and an adaptive entropy
coefficient.

- Per completion (`_completion_losses.py`; the conventions of `grpo_policy_loss`: `logp`,
  `old_logp` `[T]`, a scalar advantage, a mask `[T]`; per-token loss and stats, 0 where
  masked): `cispo_policy_loss`, `gmpo_policy_loss`, `sapo_policy_loss`.
- Per batch (`_selective_losses.py`; they select tokens by statistics of the whole batch):
  `clip_cov_policy_loss`, `kl_cov_policy_loss`, `high_entropy_policy_loss` (with its
  selection `entropy_quantile_mask`), all on `[B, T]` arrays with one advantage per row.
  With `axis_name` (inside `jax.pmap` / `shard_map`) the statistics and the selection
  cover the tokens of every device, so a data-parallel run selects the same tokens as one
  device holding the whole batch. The selection carries no gradient.
- `adaptive_entropy_coef`: a pure update of an entropy-bonus coefficient towards a target
  entropy.

Every log-ratio $\log\pi_\theta - \log\pi_{\rm old}$ is clamped to $[-20, 20]$ before it is
exponentiated (as `grpo_policy_loss`), so extreme log-probabilities give finite losses and
gradients. Hyperparameters may be Python numbers (checked eagerly) or JAX scalars (traced).
"""

from typing import Literal

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from ._validation import Hyperparameter, check_non_negative, check_python_number

POLICY_LOSSES: tuple[str, ...] = (
    "grpo",
    "cispo",
    "gmpo",
    "sapo",
    "clip_cov",
    "kl_cov",
    "high_entropy",
)
"""The policy losses of the GRPO step (`make_grpo_step(policy_loss=...)`): `"grpo"` is
`grpo_policy_loss`; each other name `x` is `x_policy_loss`."""
PolicyLoss = Literal[POLICY_LOSSES]  # type: ignore[valid-type]
COV_SELECTIONS: tuple[str, ...] = ("random", "top")
"""How `clip_cov_policy_loss` picks among its candidate tokens (`select`)."""
BATCH_POLICY_LOSSES: tuple[str, ...] = ("clip_cov", "kl_cov", "high_entropy")
"""The entries of `POLICY_LOSSES` whose token selection depends on the whole batch."""

# A policy loss's statistics: per-token, each shaped as the loss (`[T]` or `[B, T]`).
Stats = dict[str, Float[Array, "*B T"]]


def _check_fraction(name: str, value: object) -> None:
    check_python_number(name, value, lambda v: 0.0 < v <= 1.0, "in (0, 1]")


def adaptive_entropy_coef(
    coef: Float[ArrayLike, ""],
    entropy: Float[ArrayLike, ""],
    *,
    target: Hyperparameter,
    lr: Hyperparameter,
    max_coef: Hyperparameter | None = None,
) -> Float[Array, ""]:
    r"""One update of an entropy-bonus coefficient that steers the entropy to a target.

    $$\alpha \leftarrow \mathrm{clip}\big(\alpha + \eta\,(H_{\rm target} - H),\;
      0,\; \alpha_{\max}\big)$$

    An integral controller: the coefficient of the bonus $-\alpha H$ grows while the
    policy's entropy $H$ is below the target and shrinks (never below 0) above it — the
    automatic temperature of SAC (Haarnoja et al. 2018, "Soft Actor-Critic Algorithms
    and Applications", there on $\log\alpha$) and the adaptive entropy control of
    Skywork-OR1 (He et al. 2025). Pure and jittable: a run keeps `coef` as state, passes
    it to the step that applies the bonus (`make_grpo_step`'s step takes
    `entropy_coef=`), and updates it from the step's `entropy` metric:

    ```python
    coef = jnp.asarray(0.0)
    for batch in batches:
        params, opt_state, m = step(params, opt_state, batch, entropy_coef=coef)
        coef = adaptive_entropy_coef(coef, m["entropy"], target=0.3, lr=1e-3)
    ```

    **Arguments:** `coef` $\alpha$; `entropy` $H$ (the measured mean token entropy);
    `target` $H_{\rm target}$; `lr` $\eta \geq 0$; `max_coef` $\alpha_{\max}$ (`None`: no
    upper bound).

    **Returns:** the new coefficient, a float32 scalar.
    """
    check_non_negative("lr", lr)
    check_non_negative("max_coef", max_coef)
    f32 = jnp.float32
    new = jnp.asarray(coef, f32) + lr * (target - jnp.asarray(entropy, f32))
    new = jnp.maximum(new, 0.0)
    return new if max_coef is None else jnp.minimum(new, max_coef)
