r"""KTO step (Ethayarajh et al. 2024; TRL `KTOTrainer`) on unpaired, labelled completions.

The loss of an example depends on the reference point $z_0$, a mean over the **whole**
batch (`rlhf_eqx.losses.kto_reference_point`), so it cannot be split into per-row
numerators. The step therefore runs in two stages inside one jit region:

1. a gradient-free pass over the mismatched completions of the full (per-device) batch
   (in `micro_batches` chunks, so its memory is a micro-batch's), with the policy and
   the reference, giving $z_0$ — `psum`-reduced over `axis_name`, so every device and
   every micro-batch use the mean of the global batch;
2. `make_step` on the examples with $z_0$ fixed: the per-example losses are then plain
   numerators over the number of examples, and micro-batches and devices are exact.
"""

from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from .._batches import _is_array, _validate
from ..data._errors import DataError
from ..losses import KTO_LOSS_TYPES, KTOLossType, kto_loss, kto_reference_point
from ._accumulate import split_micro_batches
from ._pair_logps import _forward
from ._state import combine
from ._step import NonFinite, Step, _check_token_ids, make_step
from ._step_cache import value_key
from ._validation import check_choice, check_number, check_positive_int

KTOReference = Literal["model", "cached"]


class KTOBatch(eqx.Module):
    """Unpaired examples for KTO: prompt + completion rows, each labelled desirable or not.

    - `tokens`, `mask`, `completion_mask`: `[B, T]` right-padded rows (as a
      `SequenceBatch`); the completion mask marks the scored tokens.
    - `label`: `[B]`, true for a desirable completion, false for an undesirable one.
    - `kl_tokens`, `kl_mask`, `kl_completion_mask`: `[B, T']` the *mismatched* rows that
      estimate the reference point: prompt $i$ followed by another example's completion
      (`data.collate_unpaired` uses the completion of example $i - 1 \\bmod B$, as TRL
      does). Needed by `loss_type="kto"`; `None` for `"apo_zero_unpaired"`.
    - `ref_logp`, `ref_kl_logp`: `[B]` cached reference log-probabilities of the rows
      and of the mismatched rows (`compute_kto_reference_logps`); `None`: the step
      computes them with its `reference=` model.

    Checked at construction like the other batches (`rlhf_eqx.SequenceBatch`): ranks,
    dtypes and shared shapes; the three `kl_*` fields come together or not at all.
    """

    tokens: Int[Array, "B T"]
    mask: Bool[Array, "B T"]
    completion_mask: Bool[Array, "B T"]
    label: Bool[Array, " B"]
    kl_tokens: Int[Array, "B T2"] | None = None
    kl_mask: Bool[Array, "B T2"] | None = None
    kl_completion_mask: Bool[Array, "B T2"] | None = None
    ref_logp: Float[Array, " B"] | None = None
    ref_kl_logp: Float[Array, " B"] | None = None

    def __check_init__(self):
        kind = type(self).__name__
        _validate(self, ("tokens",), ("mask", "completion_mask"), ("ref_logp", "ref_kl_logp"))
        _validate(self, ("kl_tokens",), ("kl_mask", "kl_completion_mask"))
        kl = (self.kl_tokens, self.kl_mask, self.kl_completion_mask)
        if any(x is None for x in kl) and not all(x is None for x in kl):
            raise DataError(
                f"{kind}.kl_tokens, kl_mask and kl_completion_mask must be given together"
            )
        rows = self.tokens.shape[0] if _is_array(self.tokens) else None
        if _is_array(self.kl_tokens) and rows is not None and self.kl_tokens.shape[0] != rows:
            raise DataError(
                f"{kind}.kl_tokens has {self.kl_tokens.shape[0]} rows but {kind}.tokens has "
                f"{rows}; every example needs one mismatched row"
            )
        label = self.label
        if _is_array(label):
            if np.dtype(label.dtype) != np.bool_:
                raise DataError(
                    f"{kind}.label must be boolean (true: desirable), got dtype {label.dtype}"
                )
            if len(label.shape) != 1 or (rows is not None and label.shape[0] != rows):
                raise DataError(
                    f"{kind}.label has shape {tuple(label.shape)}; expected ({rows},), one "
                    "label per row"
                )


def _sequence_logps(model, tokens, mask, completion_mask, micro_batches):
    """Summed completion log-probabilities `[B]` without a gradient, computed in
    `micro_batches` chunks (one chunk's activations alive at a time)."""
    if micro_batches == 1:
        return jax.lax.stop_gradient(_forward(model, tokens, mask, completion_mask, None)[1])
    chunks = split_micro_batches((tokens, mask, completion_mask), micro_batches)
    out = jax.lax.map(lambda c: _forward(model, *c, None)[1], chunks)
    return jax.lax.stop_gradient(out.reshape(-1))


def _kl_reference_logps(ref_model, batch: KTOBatch, reference: str, micro_batches: int) -> Array:
    """The reference log-probabilities of the mismatched rows: cached, or computed."""
    if reference == "cached":
        if batch.ref_kl_logp is None:
            raise ValueError(
                "make_kto_step(reference='cached') needs batch.ref_kl_logp (see "
                "compute_kto_reference_logps)"
            )
        return batch.ref_kl_logp
    if ref_model is None:
        raise ValueError("make_kto_step(reference='model') needs the step's `reference=` model")
    return _sequence_logps(
        ref_model, batch.kl_tokens, batch.kl_mask, batch.kl_completion_mask, micro_batches
    )


def _kto_loss_fn(
    *,
    beta,
    desirable_weight,
    undesirable_weight,
    loss_type: str,
    reference: str,
):
    """The loss function for `make_step` on `(KTOBatch, z0 per row)`: numerator the sum
    of the weighted per-example losses, denominator the number of examples."""
    f32 = jnp.float32
    sg = jax.lax.stop_gradient

    def loss_fn(params: PyTree, frozen: PyTree, rows, key: PRNGKeyArray | None):
        batch, z0 = rows
        frozen_part, ref_model = frozen
        model = combine(params, frozen_part)
        cm = batch.completion_mask & batch.mask
        _, logp, logit_sum = _forward(model, batch.tokens, batch.mask, cm, key)
        logp = logp.astype(f32)
        if reference == "cached":
            if batch.ref_logp is None:
                raise ValueError(
                    "make_kto_step(reference='cached') needs batch.ref_logp (see "
                    "compute_kto_reference_logps)"
                )
            ref = batch.ref_logp
        else:
            if ref_model is None:
                raise ValueError(
                    "make_kto_step(reference='model') needs the step's `reference=` model"
                )
            ref = _forward(ref_model, batch.tokens, batch.mask, cm, None)[1]
        ref = sg(ref.astype(f32))

        def one(lp, rlp, label, z):
            return kto_loss(
                lp,
                rlp,
                label,
                z,
                beta=beta,
                desirable_weight=desirable_weight,
                undesirable_weight=undesirable_weight,
                loss_type=loss_type,
            )

        losses = jax.vmap(one)(logp, ref, batch.label, z0)
        n = jnp.asarray(losses.shape[0], f32)
        good, bad = batch.label, ~batch.label
        n_good, n_bad = jnp.sum(good).astype(f32), jnp.sum(bad).astype(f32)
        rewards = sg(beta * (logp - ref))
        tokens = jnp.sum(cm, axis=-1).astype(f32)
        on = lambda sel, x: jnp.sum(jnp.where(sel, x, 0.0))
        metrics = {
            "rewards/chosen": (on(good, rewards), n_good),
            "rewards/rejected": (on(bad, rewards), n_bad),
            "logps/chosen": (on(good, logp), n_good),
            "logps/rejected": (on(bad, logp), n_bad),
            "logits/chosen": (on(good, logit_sum.astype(f32)), on(good, tokens)),
            "logits/rejected": (on(bad, logit_sum.astype(f32)), on(bad, tokens)),
            # totals over the global batch (a zero count makes the mean the sum)
            "count/chosen": (n_good, jnp.zeros((), f32)),
            "count/rejected": (n_bad, jnp.zeros((), f32)),
        }
        return {"kto": jnp.sum(losses)}, {"kto": n}, metrics

    return loss_fn


def _margins(metrics, grads):
    del grads
    metrics = dict(metrics)
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics


def make_kto_step(
    optimizer: optax.GradientTransformation,
    *,
    beta: float | Float[Array, ""] = 0.1,
    desirable_weight: float | Float[Array, ""] = 1.0,
    undesirable_weight: float | Float[Array, ""] = 1.0,
    loss_type: KTOLossType = "kto",
    reference: KTOReference = "model",
    micro_batches: int = 1,
    axis_name: str | None = None,
    donate: bool | None = None,
    nonfinite: NonFinite = "skip",
    check_token_ids: int | None = None,
) -> Step:
    r"""Build the KTO update (Ethayarajh et al. 2024; TRL `KTOTrainer`).

    $$\mathcal{L}(\theta) = \frac1B\sum_{i=1}^{B} \begin{cases}
    \lambda_D\big(1 - \sigma(\beta(h_i - z_0))\big) & \text{desirable } i\\
    \lambda_U\big(1 - \sigma(\beta(z_0 - h_i))\big) & \text{undesirable } i
    \end{cases}$$

    with $h_i = \log\pi_\theta(y_i|x_i) - \log\pi_{\rm ref}(y_i|x_i)$ (sums over the
    completion tokens) and $z_0$ = `kto_reference_point` of the batch's mismatched rows,
    computed with the current policy, without gradient, before the update (see the
    module docstring). $B$ counts every example of the global batch (all devices), as
    TRL's mean over the batch.

    **Arguments:**

    - `optimizer`: e.g. from `make_optimizer`.
    - `beta`, `desirable_weight`, `undesirable_weight`, `loss_type`: see
      `rlhf_eqx.losses.kto_loss`; the numbers may be JAX arrays (e.g. traced, to
      `jax.vmap` a run over β). `"apo_zero_unpaired"` uses no reference point and no
      mismatched rows.
    - `reference`: `"model"` — a frozen reference model passed to the step as
      `reference=` (never differentiated); `"cached"` — `batch.ref_logp` and
      `batch.ref_kl_logp`, filled beforehand by `compute_kto_reference_logps` (TRL
      `precompute_ref_log_probs`).
    - `micro_batches`, `axis_name`, `donate`, `nonfinite`, `check_token_ids`: see
      `make_step`. With `axis_name`, $z_0$ is the mean over the mismatched rows of every
      device (TRL averages the per-process means, the same for equal per-device
      batches).

    Invalid choices and out-of-range numbers raise `ValueError` here, at build time.

    **Returns:**

    ```python
    step(params, opt_state, batch: KTOBatch, *, frozen=None, reference=None, key=None)
        -> (params, opt_state, metrics)
    ```

    one `eqx.filter_jit` region. Metrics (TRL's names): `loss`, `kl` ($z_0$),
    `rewards/chosen` / `rewards/rejected` (means of $\beta h$ over the desirable /
    undesirable examples; 0 when there are none), `rewards/margins` (their difference),
    `logps/chosen`, `logps/rejected`, `logits/chosen`, `logits/rejected` (mean logit
    over the completion positions and the vocabulary, as the DPO step reports it),
    `count/chosen`, `count/rejected` (examples in the global batch), `grad_norm`,
    `learning_rate`, `nonfinite`. The `key` (dropout) is used for the policy's pass over
    the examples; the pass that estimates $z_0$ runs without it.
    """
    check_choice("loss_type", loss_type, KTO_LOSS_TYPES)
    check_choice("reference", reference, ("model", "cached"))
    check_number("beta", beta, low=0.0, low_open=True)
    check_number("desirable_weight", desirable_weight, low=0.0)
    check_number("undesirable_weight", undesirable_weight, low=0.0)
    check_positive_int("micro_batches", micro_batches)
    uses_kl = loss_type == "kto"
    inner = make_step(
        _kto_loss_fn(
            beta=beta,
            desirable_weight=desirable_weight,
            undesirable_weight=undesirable_weight,
            loss_type=loss_type,
            reference=reference,
        ),
        optimizer,
        micro_batches=micro_batches,
        axis_name=axis_name,
        donate=False,
        nonfinite=nonfinite,
        metrics_fn=_margins,
        extras=("reference",),
    )

    def update(rest, params, opt_state):
        batch, frozen, key = rest
        frozen_part, ref_model = frozen
        if check_token_ids is not None:
            batch = _check_token_ids(batch, check_token_ids)
        B = batch.tokens.shape[0]
        if uses_kl:
            if batch.kl_tokens is None:
                raise ValueError(
                    "make_kto_step(loss_type='kto') needs the mismatched rows "
                    "batch.kl_tokens / kl_mask / kl_completion_mask (data.collate_unpaired "
                    "builds them)"
                )
            policy = combine(params, frozen_part)  # not differentiated here
            kl_logp = _sequence_logps(
                policy, batch.kl_tokens, batch.kl_mask, batch.kl_completion_mask, micro_batches
            )
            ref_kl_logp = _kl_reference_logps(ref_model, batch, reference, micro_batches)
            z0 = kto_reference_point(
                kl_logp.astype(jnp.float32), ref_kl_logp.astype(jnp.float32), axis_name=axis_name
            )
        else:
            z0 = jnp.zeros((), jnp.float32)
        rows = (batch, jnp.broadcast_to(z0, (B,)))
        params, opt_state, metrics = inner(
            params, opt_state, rows, frozen=frozen_part, reference=ref_model, key=key
        )
        metrics["kl"] = z0
        return params, opt_state, metrics

    same = (optimizer, beta, desirable_weight, undesirable_weight, loss_type, reference)
    same += (micro_batches, axis_name, nonfinite, check_token_ids)  # equal builds: one program
    shared = lambda: ("kto", value_key(same))  # noqa: E731
    return Step(update, donate=donate, batch_type=KTOBatch, extras=("reference",), shared=shared)


@eqx.filter_jit
def _reference_logps(reference_model, batch: KTOBatch):
    cm = batch.completion_mask & batch.mask
    ref = _forward(reference_model, batch.tokens, batch.mask, cm, None)[1]
    kl = None
    if batch.kl_tokens is not None:
        kl = _forward(
            reference_model, batch.kl_tokens, batch.kl_mask, batch.kl_completion_mask, None
        )[1]
        kl = jax.lax.stop_gradient(kl)
    return jax.lax.stop_gradient(ref), kl


def compute_kto_reference_logps(
    reference_model: Callable[..., Float[Array, "T V"]], batch: KTOBatch
) -> KTOBatch:
    """Fill `batch.ref_logp` (and `batch.ref_kl_logp`, when the batch has mismatched rows)
    with the reference model's summed completion log-probabilities, `[B]` each (one
    jitted forward pass).

    Run it once per batch before training (TRL `precompute_ref_log_probs`) and use
    `make_kto_step(..., reference="cached")`: the step then skips the reference forward
    passes.
    """
    ref, kl = _reference_logps(reference_model, batch)
    return eqx.tree_at(
        lambda b: (b.ref_logp, b.ref_kl_logp),
        batch,
        (ref, kl),
        is_leaf=lambda x: x is None,
    )
