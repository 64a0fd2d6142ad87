"""Weighted sums of named loss terms (multi-loss DPO, RPO)."""

from collections.abc import Mapping

from jaxtyping import Array, Float

from ._validation import Hyperparameter


def combine_losses(
    terms: Mapping[str, Float[Array, "*shape"]], weights: Mapping[str, Hyperparameter]
) -> Float[Array, "*shape"]:
    r"""Weighted sum $\sum_k w_k \mathcal{L}_k$ of named loss terms.

    Mirrors TRL's `DPOConfig(loss_type=[...], loss_weights=[...])` and `rpo_alpha`:
    RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization") is

    ```python
    combine_losses({"dpo": dpo_term, "nll": nll_chosen}, {"dpo": 1.0, "nll": alpha})
    ```

    with `nll_chosen` the chosen completion's token-mean NLL. Every weighted term must be
    present and every term must have a weight (a typo raises instead of silently
    dropping a term).
    """
    if set(terms) != set(weights):
        raise ValueError(
            f"terms {sorted(terms)} and weights {sorted(weights)} must have the same keys"
        )
    if not terms:
        raise ValueError("combine_losses needs at least one term")
    keys = sorted(terms)
    total = terms[keys[0]] * weights[keys[0]]
    for k in keys[1:]:
        total = total + terms[k] * weights[k]
    return total
