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

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ..data import KTOBatch
from ..losses import KTO_LOSS_TYPES, kto_loss, kto_reference_point
from ..losses.defaults import KTO_BETA, KTO_DESIRABLE_WEIGHT, KTO_LOSS_TYPE, KTO_UNDESIRABLE_WEIGHT
from ._accumulate import _set_fields, split_micro_batches
from ._builder import step_builder
from ._distill import _check_reference_vocab
from ._pair_logps import _forward
from ._settings import StepOptions
from ._state import combine
from ._step import Step, _check_token_ids, make_step
from ._step_cache import value_key
from ._validation import check_choice, check_number

KTO_REFERENCE_MODES: tuple[str, ...] = ("model", "cached")
"""The values of `KTOSettings.reference`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KTOSettings:
    r"""KTO (`make_kto_step`; Ethayarajh et al. 2024, TRL `KTOConfig` defaults).

    - `beta`: $\beta > 0$, the strength of the implicit KL to the reference (may be a JAX
      array, traced under `jax.vmap` for a sweep).
    - `desirable_weight`, `undesirable_weight`: $\lambda_D, \lambda_U \geq 0$, the
      weights of the two kinds of examples (may be JAX arrays).
    - `loss_type`: `"kto"` or `"apo_zero_unpaired"` (`rlhf_eqx.losses.KTO_LOSS_TYPES`).
    - `reference`: `"model"` (the step's `reference=` model) or `"cached"` (the batch's
      `ref_logp` / `ref_kl_logp`, from `compute_kto_reference_logps`).

    Validated when built (see `DPOSettings`): one `ValueError` line naming the field.
    """

    beta: float | Float[Array, ""] = KTO_BETA
    desirable_weight: float | Float[Array, ""] = KTO_DESIRABLE_WEIGHT
    undesirable_weight: float | Float[Array, ""] = KTO_UNDESIRABLE_WEIGHT
    loss_type: str = KTO_LOSS_TYPE
    reference: str = "model"

    def __post_init__(self):
        check_choice("loss_type", self.loss_type, KTO_LOSS_TYPES)
        check_choice("reference", self.reference, KTO_REFERENCE_MODES)
        check_number("beta", self.beta, low=0.0, low_open=True)
        check_number("desirable_weight", self.desirable_weight, low=0.0)
        check_number("undesirable_weight", self.undesirable_weight, low=0.0)


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


def _kto_loss_fn(s: KTOSettings):
    """The loss function for `make_step` on `(KTOBatch, z0 per row)`: numerator the sum
    of the weighted per-example losses, denominator the number of examples."""
    beta, desirable_weight, undesirable_weight = s.beta, s.desirable_weight, s.undesirable_weight
    loss_type, reference = s.loss_type, s.reference
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
            _check_reference_vocab(model, ref_model, batch.tokens, batch.mask, "make_kto_step")
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


@step_builder(KTOSettings)
def make_kto_step(optimizer, settings: KTOSettings, options: StepOptions) -> Step:
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

    - `settings`: a `KTOSettings` with the fields below (TRL's defaults).
    - `beta`, `desirable_weight`, `undesirable_weight`, `loss_type`: see
      `rlhf_eqx.losses.kto_loss`; the numbers may be JAX arrays (e.g. traced, to
      `jax.vmap` a run over β). `"apo_zero_unpaired"` uses no reference point and no
      mismatched rows.
    - `reference`: `"model"` — a frozen reference model passed to the step as
      `reference=` (never differentiated); `"cached"` — `batch.ref_logp` and
      `batch.ref_kl_logp`, filled beforehand by `compute_kto_reference_logps` (TRL
      `precompute_ref_log_probs`).
    - `optimizer`, `options` (a `StepOptions`) and `**shortcuts` (`beta=0.2`,
      `micro_batches=2`): see `step_builder`. With `axis_name`, $z_0$ is the mean over
      the mismatched rows of every device (TRL averages the per-process means, the same
      for equal per-device batches).

    Invalid choices and out-of-range numbers raise `ValueError` when the record is built.

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
    reference = settings.reference
    micro_batches, axis_name = options.micro_batches, options.axis_name
    check_token_ids = options.check_token_ids
    uses_kl = settings.loss_type == "kto"
    inner = make_step(
        _kto_loss_fn(settings),
        optimizer,
        dataclasses.replace(options, donate=False, check_token_ids=None),
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

    # equal builds share one program: the step's own donation is not part of it
    same = (optimizer, settings, dataclasses.replace(options, donate=None))
    shared = lambda: ("kto", value_key(same))  # noqa: E731
    return Step(
        update, donate=options.donate, batch_type=KTOBatch, extras=("reference",), shared=shared
    )


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
    return _set_fields(batch, ref_logp=ref, ref_kl_logp=kl)
