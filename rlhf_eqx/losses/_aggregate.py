"""Reducing per-token losses over a batch: the aggregation modes and their exact split.

Every mode is written as `numerator / denominator`, where the numerator is a *sum over
sequences* and the denominator depends only on the mask (never on the loss values). A
gradient-accumulation or data-parallel step therefore computes the denominator of the
full batch first, sums the numerators of its micro-batches, and divides once:

```python
_, denom = aggregate_parts(per_token, mask, mode=mode)  # full batch, masks only
num = sum(aggregate_parts(pt_i, m_i, mode=mode)[0] for pt_i, m_i in micro_batches)
loss = num / denom  # == aggregate(per_token, mask, mode=mode)
```
"""

from typing import Literal

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ..ops import masked_mean, masked_sum
from ._validation import Hyperparameter, check_choice, check_positive

AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
"""The `mode`s of `aggregate` / `aggregate_parts`."""
AggregationMode = Literal[AGGREGATION_MODES]  # type: ignore[valid-type]


def aggregate_parts(
    per_token: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    mode: AggregationMode,
    constant: Hyperparameter | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    r"""Numerator and denominator of a batch reduction of per-token values.

    With $x_{bt}$ the per-token values, $m_{bt}$ the mask, $n_b = \sum_t m_{bt}$ the
    number of real tokens of row $b$ and $S = \#\{b : n_b > 0\}$ the number of non-empty
    rows, the modes are (numerator / denominator):

    - `"token-mean"`: $\sum_{b,t} m_{bt} x_{bt} \,/\, \sum_b n_b$. DAPO (Yu et al.
      2025); TRL GRPO `loss_type="dapo"` / `"bnpo"`; veRL `agg_loss` `token-mean`.
    - `"seq-mean-token-mean"`: $\sum_{b: n_b>0} \frac{1}{n_b}\sum_t m_{bt} x_{bt} \,/\, S$.
      GRPO (Shao et al. 2024); TRL `loss_type="grpo"`; veRL `seq-mean-token-mean`.
    - `"seq-mean-token-sum"`: $\sum_{b,t} m_{bt} x_{bt} \,/\, S$. veRL
      `seq-mean-token-sum`.
    - `"seq-mean-token-sum-norm"`: $\sum_{b,t} m_{bt} x_{bt} \,/\, (S \cdot C)$. Dr.GRPO
      (Liu et al. 2025); TRL `loss_type="dr_grpo"` with $C$ = `max_completion_length`.

    $C$ is `constant` (default: `T`, the padded length); keep it fixed during training.
    Fully-masked rows contribute to neither part (they are not counted in $S$; TRL's
    `grpo`/`dr_grpo` count them in the batch size, which differs only when a whole
    completion is masked, e.g. by overlong filtering).

    Because the numerator is a sum over rows and the denominator depends on the mask
    only, summing the numerators of micro-batches and dividing by the full batch's
    denominator reproduces `aggregate` on the full batch exactly.

    **Arguments:**

    - `per_token`: per-token values `[B, T]` (entries where `mask` is false are ignored,
      even if NaN/inf).
    - `mask`: `[B, T]`, true on the tokens that count.
    - `mode`: one of the modes above.
    - `constant`: the Dr.GRPO normaliser $C$ (only for `"seq-mean-token-sum-norm"`).

    **Returns:** `(numerator, denominator)`, float scalars; the denominator is 0 only when
    every row is fully masked.
    """
    check_choice("mode", mode, AGGREGATION_MODES)
    if constant is not None and mode != "seq-mean-token-sum-norm":
        raise ValueError("`constant` is only used by mode='seq-mean-token-sum-norm'")
    dtype = per_token.dtype
    counts = jnp.sum(mask, axis=-1).astype(dtype)
    non_empty = jnp.sum(counts > 0).astype(dtype)
    if mode == "token-mean":
        return masked_sum(per_token, mask), jnp.sum(counts)
    if mode == "seq-mean-token-mean":
        return jnp.sum(masked_mean(per_token, mask, axis=-1)), non_empty
    if mode == "seq-mean-token-sum":
        return masked_sum(per_token, mask), non_empty
    check_positive("constant", constant)
    if constant is None:
        c = float(per_token.shape[-1])
    elif isinstance(constant, (int, float)):
        c = float(constant)
    else:
        c = jnp.asarray(constant).astype(dtype)
    return masked_sum(per_token, mask), non_empty * c


def safe_divide(
    numerator: Float[Array, "*shape"], denominator: Float[Array, "*shape"]
) -> Float[Array, "*shape"]:
    """`numerator / denominator`, and 0 where the denominator is 0 (gradient-safe)."""
    ok = denominator != 0
    return jnp.where(ok, numerator / jnp.where(ok, denominator, jnp.ones_like(denominator)), 0.0)


def aggregate(
    per_token: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    mode: AggregationMode,
    constant: Hyperparameter | None = None,
) -> Float[Array, ""]:
    """Reduce per-token values over a batch: `numerator / denominator` of `aggregate_parts`.

    Returns 0 when every row is fully masked. See `aggregate_parts` for the modes, their
    formulas and the TRL / veRL names.
    """
    num, den = aggregate_parts(per_token, mask, mode=mode, constant=constant)
    return safe_divide(num, den)
