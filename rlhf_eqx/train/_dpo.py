"""DPO-family step, with the reference log-probabilities computed on the fly or cached."""

from collections.abc import Callable, Mapping
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from .._batches import PreferenceBatch
from ..losses import (
    DPOLossType,
    combine_losses,
    dpo_batch_loss,
    dpo_implicit_rewards,
    safe_divide,
    sft_nll,
)
from ..ops import logprobs_from_logits, masked_sum, previous_real_index
from ._accumulate import (
    accumulate_gradients,
    apply_optimizer,
    make_jitted,
    sums_to_means,
    vmap_model,
)
from ._state import combine

__all__ = ["make_dpo_step", "compute_reference_logps", "sequence_logps"]

ReferenceMode = Literal["model", "cached", "none"]
_SORTING_TYPES = ("aot", "aot_pair")
_REFERENCE_FREE_TYPES = ("simpo", "orpo")


def _forward(model, tokens, mask, completion_mask, key):
    """Token log-probs `[b, T]`, summed completion log-probs `[b]`, mean-logit sums `[b]`."""
    logits = vmap_model(model, tokens, mask, key)
    logp = jax.vmap(logprobs_from_logits)(logits, tokens, mask)
    m = completion_mask & mask
    seq = masked_sum(logp, m, axis=-1)
    prev, _ = jax.vmap(previous_real_index)(mask)
    mean_logit = jnp.take_along_axis(jnp.mean(logits.astype(jnp.float32), axis=-1), prev, axis=-1)
    return logp, seq, masked_sum(mean_logit, m, axis=-1)


def sequence_logps(
    model: Callable[..., Float[Array, "T V"]],
    tokens: Int[Array, "B T"],
    mask: Bool[Array, "B T"],
    completion_mask: Bool[Array, "B T"],
) -> Float[Array, " B"]:
    r"""Summed completion log-probabilities $\sum_{t \in \text{completion}} \log\pi(y_t \mid y_{<t})$ of each row."""
    return _forward(model, tokens, mask, completion_mask, None)[1]


@eqx.filter_jit
def _reference_logps(reference_model, batch):
    c = sequence_logps(
        reference_model, batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask
    )
    r = sequence_logps(
        reference_model, batch.rejected_tokens, batch.rejected_mask, batch.rejected_completion_mask
    )
    return jax.lax.stop_gradient(c), jax.lax.stop_gradient(r)


def compute_reference_logps(
    reference_model: Callable[..., Float[Array, "T V"]], batch: PreferenceBatch
) -> PreferenceBatch:
    """Fill `batch.ref_chosen_logp` / `ref_rejected_logp` with the reference model's
    summed completion log-probabilities (one jitted forward pass over the batch).

    Run it once per batch before training (TRL `precompute_ref_log_probs`) and use
    `make_dpo_step(..., reference="cached")`: the step then skips the reference forward
    (about a quarter of a DPO step's compute).
    """
    c, r = _reference_logps(reference_model, batch)
    return eqx.tree_at(
        lambda b: (b.ref_chosen_logp, b.ref_rejected_logp),
        batch,
        (c, r),
        is_leaf=lambda x: x is None,
    )


def make_dpo_step(
    optimizer: optax.GradientTransformation,
    *,
    beta: float = 0.1,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
    reference: ReferenceMode = "model",
    rpo_alpha: float | None = None,
    loss_kwargs: Mapping[str, Any] | None = None,
    micro_batches: int = 1,
    donate: bool = True,
) -> Callable[..., tuple[PyTree, Any, dict]]:
    r"""Build the DPO-family update (Rafailov et al. 2023; TRL `DPOTrainer`).

    Sequence log-probabilities are sums of token log-probabilities over each completion
    (`*_completion_mask & *_mask`). The per-pair losses come from
    `rlhf_eqx.losses.dpo_batch_loss` (every `loss_type`, including the batch-sorting
    `"aot"` / `"aot_pair"`, which need `micro_batches=1`) and are averaged over the pairs.
    With `rpo_alpha=α` the token-mean NLL of the chosen completions is added with
    weight α (RPO, Pang et al. 2024; TRL `rpo_alpha`), via `combine_losses`.

    **Arguments:**

    - `optimizer`: e.g. from `make_optimizer`.
    - `beta`, `loss_type`, `label_smoothing`: see `rlhf_eqx.losses.dpo_loss`.
    - `reference`: where the reference log-probabilities come from:
      `"model"` — a frozen reference model passed to the step as `reference=` (its
      output is wrapped in `jax.lax.stop_gradient` and it is never differentiated);
      `"cached"` — `batch.ref_chosen_logp` / `ref_rejected_logp`, filled beforehand by
      `compute_reference_logps`; `"none"` — reference-free (TRL `reference_free`).
      `"simpo"` and `"orpo"` never use a reference.
    - `rpo_alpha`: weight of the chosen NLL term (`None`: no term).
    - `loss_kwargs`: further keyword arguments of `dpo_batch_loss` (`bco_delta`,
      `discopop_tau`, `simpo_gamma`).
    - `micro_batches`, `donate`: see `make_sft_step`.

    **Returns:**

    ```python
    step(params, opt_state, batch: PreferenceBatch, *, frozen=None, reference=None, key=None)
        -> (params, opt_state, metrics)
    ```

    one `eqx.filter_jit` region. Metrics (TRL's names, means over pairs): `loss`,
    `rewards/chosen`, `rewards/rejected` (implicit rewards $\beta(\log\pi_\theta - \log\pi_{\rm ref})$),
    `rewards/margins`, `rewards/accuracies`, `logps/chosen`, `logps/rejected`,
    `logits/chosen`, `logits/rejected` (mean logit over the completion positions and
    the vocabulary), `nll_loss` (with `rpo_alpha`), `grad_norm`, `learning_rate`.
    `rewards/accuracies` counts pairs with a strictly larger chosen reward, as TRL does:
    while the policy equals the reference the rewards are rounding noise (~1e-7), so
    the first step's accuracy is not meaningful.
    """
    if reference not in ("model", "cached", "none"):
        raise ValueError(f"reference must be 'model', 'cached' or 'none', got {reference!r}")
    if loss_type in _SORTING_TYPES and micro_batches != 1:
        raise ValueError(
            f"loss_type={loss_type!r} sorts over the whole batch; it needs micro_batches=1"
        )
    uses_reference = reference != "none" and loss_type not in _REFERENCE_FREE_TYPES
    extra = dict(loss_kwargs or {})

    def update(rest, params, opt_state):
        batch, frozen, ref_model, key = rest
        n_pairs = float(batch.chosen_tokens.shape[0])
        if uses_reference and reference == "model" and ref_model is None:
            raise ValueError("make_dpo_step(reference='model') needs the step's `reference=` model")
        if uses_reference and reference == "cached" and batch.ref_chosen_logp is None:
            raise ValueError(
                "make_dpo_step(reference='cached') needs batch.ref_chosen_logp / "
                "ref_rejected_logp (see compute_reference_logps)"
            )
        chosen_m = batch.chosen_completion_mask & batch.chosen_mask
        nll_denom = jnp.sum(chosen_m).astype(jnp.float32)

        def contribution(p, mb, k):
            model = combine(p, frozen)
            kc, kr = (None, None) if k is None else tuple(jax.random.split(k))
            cm = mb.chosen_completion_mask & mb.chosen_mask
            rm = mb.rejected_completion_mask & mb.rejected_mask
            c_tok, c, c_logit = _forward(model, mb.chosen_tokens, mb.chosen_mask, cm, kc)
            _, r, r_logit = _forward(model, mb.rejected_tokens, mb.rejected_mask, rm, kr)
            if not uses_reference:
                rc = rr = None
            elif reference == "cached":
                rc, rr = mb.ref_chosen_logp, mb.ref_rejected_logp
            else:
                rc = sequence_logps(ref_model, mb.chosen_tokens, mb.chosen_mask, cm)
                rr = sequence_logps(ref_model, mb.rejected_tokens, mb.rejected_mask, rm)
            if rc is not None:
                rc = jax.lax.stop_gradient(rc.astype(jnp.float32))
                rr = jax.lax.stop_gradient(rr.astype(jnp.float32))
            losses = dpo_batch_loss(
                c,
                r,
                rc,
                rr,
                beta=beta,
                loss_type=loss_type,
                label_smoothing=label_smoothing,
                chosen_len=jnp.sum(cm, axis=-1),
                rejected_len=jnp.sum(rm, axis=-1),
                reference_free=not uses_reference,
                **extra,
            )
            dpo_term = jnp.sum(losses) / n_pairs
            if rpo_alpha is None:
                total = dpo_term
                sums = {}
            else:
                nll = jax.vmap(sft_nll)(c_tok, cm)
                nll_term = safe_divide(masked_sum(nll, cm), nll_denom)
                total = combine_losses(
                    {"dpo": dpo_term, "nll": nll_term}, {"dpo": 1.0, "nll": rpo_alpha}
                )
                sums = {"nll_loss": (jax.lax.stop_gradient(nll_term), jnp.zeros((), jnp.float32))}
            if rc is None:
                rw, rl = jax.vmap(lambda a, b: dpo_implicit_rewards(a, b, beta=beta))(c, r)
            else:
                rw, rl = jax.vmap(lambda a, b, x, y: dpo_implicit_rewards(a, b, x, y, beta=beta))(
                    c, r, rc, rr
                )
            sg = jax.lax.stop_gradient
            sums["logits/chosen"] = (sg(jnp.sum(c_logit)), jnp.sum(cm).astype(jnp.float32))
            sums["logits/rejected"] = (sg(jnp.sum(r_logit)), jnp.sum(rm).astype(jnp.float32))
            rows = {"c": sg(c), "r": sg(r), "rw": sg(rw), "rl": sg(rl)}
            return total, (sums, rows)

        loss, grads, sums, rows = accumulate_gradients(
            contribution, params, batch, micro_batches=micro_batches, key=key
        )
        params, opt_state, opt_metrics = apply_optimizer(optimizer, params, opt_state, grads)
        metrics = {"loss": loss, **sums_to_means(sums)}
        rw, rl = rows["rw"], rows["rl"]
        metrics.update(
            {
                "rewards/chosen": jnp.mean(rw),
                "rewards/rejected": jnp.mean(rl),
                "rewards/margins": jnp.mean(rw - rl),
                "rewards/accuracies": jnp.mean((rw > rl).astype(jnp.float32)),
                "logps/chosen": jnp.mean(rows["c"]),
                "logps/rejected": jnp.mean(rows["r"]),
                **opt_metrics,
            }
        )
        return params, opt_state, metrics

    jitted = make_jitted(update, donate=donate)

    def step(
        params: PyTree,
        opt_state: Any,
        batch: PreferenceBatch,
        *,
        frozen: PyTree = None,
        reference: PyTree = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[PyTree, Any, dict]:
        return jitted((batch, frozen, reference, key), params, opt_state)

    return step
