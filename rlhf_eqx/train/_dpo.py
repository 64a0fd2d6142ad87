"""DPO-family step, with the reference log-probabilities computed on the fly or cached."""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from ..data import PackedPreferenceBatch, PreferenceBatch
from ..losses import (
    DPO_BATCH_LOSS_TYPES,
    DPO_LOSS_TYPES,
    dpo_batch_loss,
    dpo_implicit_rewards,
    registered_dpo_loss,
    resolve_dpo_loss,
    sft_nll,
)
from ..ops import masked_sum
from ._builder import step_builder
from ._distill import _check_reference_vocab
from ._pair_logps import _cached_reference, _pairs_forward
from ._settings import DPOSettings, StepOptions, settings_from
from ._state import combine
from ._step import LossFn, Step, make_step
from ._step_cache import user_function_key


def dpo_loss_fn(settings: DPOSettings | None = None, **shortcuts: Any) -> LossFn:
    r"""The DPO-family loss function for `make_step` on a `PreferenceBatch` or a
    shared-prompt `PackedPreferenceBatch` (same losses; the packed one runs each prompt
    once, and needs an `AbstractSelectiveLM` such as `Policy`), with `settings` (a
    `DPOSettings`, or its fields as keywords).

    `frozen` is `(frozen_part_of_the_policy, reference_model)`; see `make_dpo_step`.
    Numerators: `dpo` (sum of per-pair losses; denominator the number of pairs with at
    least one completion token, chosen or rejected) and,
    with `rpo_alpha`, `nll` (α × the summed chosen-completion NLL; denominator the
    number of chosen completion tokens). `loss_type` may be a custom loss (see
    `make_dpo_step`).
    """
    s = settings_from(DPOSettings, settings, shortcuts, where="dpo_loss_fn")
    beta, loss_type, label_smoothing = s.beta, s.loss_type, s.label_smoothing
    reference, rpo_alpha = s.reference, s.rpo_alpha
    extra = dict(s.loss_kwargs or {})
    spec = resolve_dpo_loss(loss_type, loss_kwargs=extra, label_smoothing=label_smoothing)
    _check_smoothing_read(spec, loss_type, label_smoothing)
    uses_reference = reference != "none" and not spec.reference_free
    sg = jax.lax.stop_gradient
    f32 = jnp.float32

    def loss_fn(
        params: PyTree,
        frozen: PyTree,
        batch: PreferenceBatch | PackedPreferenceBatch,
        key: PRNGKeyArray | None,
    ):
        frozen_part, ref_model = frozen
        if uses_reference and reference == "model" and ref_model is None:
            raise ValueError("make_dpo_step(reference='model') needs the step's `reference=` model")
        if uses_reference and reference == "cached" and batch.ref_chosen_logp is None:
            raise ValueError(
                "make_dpo_step(reference='cached') needs batch.ref_chosen_logp / "
                "ref_rejected_logp (see compute_reference_logps)"
            )
        if isinstance(batch, PackedPreferenceBatch) and spec.batch:
            raise ValueError(
                f"loss_type={loss_type!r} sorts over the pairs of the batch; use a PreferenceBatch "
                "(a PackedPreferenceBatch may hold empty pair slots)"
            )
        model = combine(params, frozen_part)
        out = _pairs_forward(model, batch, key)
        c, r, w = out.chosen, out.rejected, out.weight
        if not uses_reference:
            rc = rr = None
        elif reference == "cached":
            rc, rr = _cached_reference(batch)
        else:
            tokens, mask = (
                (batch.tokens, batch.mask)
                if isinstance(batch, PackedPreferenceBatch)
                else (batch.chosen_tokens, batch.chosen_mask)
            )
            _check_reference_vocab(model, ref_model, tokens, mask, "make_dpo_step")
            ref = _pairs_forward(ref_model, batch, None)
            rc, rr = ref.chosen, ref.rejected
        if rc is not None:
            rc, rr = sg(rc.astype(f32)), sg(rr.astype(f32))
        real = w > 0
        losses = dpo_batch_loss(
            c,
            r,
            rc,
            rr,
            beta=beta,
            loss_type=loss_type,
            label_smoothing=label_smoothing,
            # empty pair slots of a packed batch: any positive length keeps them finite
            chosen_len=jnp.where(real, out.chosen_len, 1.0),
            rejected_len=jnp.where(real, out.rejected_len, 1.0),
            reference_free=not uses_reference,
            **extra,
        )
        n = jnp.sum(w)
        # A pair with no completion token on either side carries no signal (its loss
        # is constant): it counts in neither part, as a fully-masked row in
        # `aggregate_parts`; a batch of only such pairs is empty (`make_step`).
        counted = real & (out.chosen_len + out.rejected_len > 0)
        nums = {"dpo": jnp.sum(jnp.where(counted, losses, 0.0))}
        dens = {"dpo": jnp.sum(counted.astype(f32))}
        n_c, n_r = jnp.sum(out.chosen_len * w), jnp.sum(out.rejected_len * w)
        metrics = {}
        if rpo_alpha is not None:
            cm = out.chosen_tokens_mask
            nll = masked_sum(jax.vmap(sft_nll)(out.chosen_tokens_logp, cm), cm)
            nums["nll"], dens["nll"] = rpo_alpha * nll, n_c
            metrics["nll_loss"] = (nll, n_c)
        mc, mr, mrc, mrr = _metric_logps(spec, out, c, r, rc, rr)
        if mrc is None:
            rw, rl = jax.vmap(lambda a, b: dpo_implicit_rewards(a, b, beta=beta))(mc, mr)
        else:
            rw, rl = jax.vmap(lambda a, b, x, y: dpo_implicit_rewards(a, b, x, y, beta=beta))(
                mc, mr, mrc, mrr
            )
        wsum = lambda x: jnp.sum(jnp.where(real, x, 0.0))
        metrics.update(
            {
                "rewards/chosen": (wsum(rw), n),
                "rewards/rejected": (wsum(rl), n),
                "rewards/margins": (wsum(rw - rl), n),
                "rewards/accuracies": (wsum((rw > rl).astype(f32)), n),
                "logps/chosen": (wsum(mc), n),
                "logps/rejected": (wsum(mr), n),
                "logits/chosen": (wsum(out.chosen_logit), n_c),
                "logits/rejected": (wsum(out.rejected_logit), n_r),
            }
        )
        return nums, dens, metrics

    return loss_fn


def _check_smoothing_read(spec, loss_type: object, label_smoothing: object) -> None:
    """Refuse a `label_smoothing` other than 0 for a built-in loss that does not read it
    (`hinge`, `ipo`, ...: TRL's `DPOTrainer` ignores it there); a traced value is not
    checked. A custom loss's is refused by `resolve_dpo_loss`."""
    if spec.custom is not None or "label_smoothing" in spec.reads:
        return
    if not isinstance(label_smoothing, int | float) or label_smoothing == 0.0:
        return
    smoothed = [t for t in DPO_LOSS_TYPES if "label_smoothing" in resolve_dpo_loss(t).reads]
    raise ValueError(
        f"label_smoothing={label_smoothing!r}: loss_type={loss_type!r} does not smooth its "
        f"labels (the losses that do: {', '.join(smoothed)}); leave it at 0"
    )


def _metric_logps(spec, out, c, r, rc, rr):
    r"""The log-probabilities the metrics are taken of, as TRL logs them.

    TRL's `DPOTrainer._compute_loss` (TRL 1.x) logs `rewards/*` as
    $\beta(\log\pi_\theta(y) - \log\pi_{\rm ref}(y))$ and `logps/*` as
    $\log\pi_\theta(y)$ of the **summed** completion log-probabilities for every loss
    type, `"ipo"` and `"sigmoid_norm"` included (they divide by the completion length
    inside the loss only). Its `CPOTrainer` (`"simpo"`: `concatenated_forward(...,
    average_log_prob=loss_type in ["ipo", "simpo"])`) and `ORPOTrainer`
    (`average_log_prob=True`) log the **per-token averages** $\log\pi_\theta(y) / |y|$
    (`get_batch_loss_metrics`: `rewards/chosen` $= \beta\,\log\pi_\theta(y_w)/|y_w|$,
    no reference). So a loss with `spec.per_token_metrics` (`"simpo"`, `"orpo"`) gets
    the averages (a length of 0 counts as 1, as in the loss), every other one the sums.
    """
    if not spec.per_token_metrics:
        return c, r, rc, rr
    cl, rl = jnp.maximum(out.chosen_len, 1.0), jnp.maximum(out.rejected_len, 1.0)
    if rc is None:
        return c / cl, r / rl, None, None
    return c / cl, r / rl, rc / cl, rr / rl


def _custom_loss(loss_type: object) -> object:
    """The user's function a `loss_type` stands for (a registered name's now, or the
    callable itself); `None` for a built-in loss."""
    return loss_type if callable(loss_type) else registered_dpo_loss(loss_type)


@step_builder(DPOSettings)
def make_dpo_step(optimizer, settings: DPOSettings, options: StepOptions) -> Step:
    r"""Build the DPO-family update (Rafailov et al. 2023; TRL `DPOTrainer`).

    Sequence log-probabilities are sums of token log-probabilities over each completion
    (`*_completion_mask & *_mask`). The per-pair losses come from
    `rlhf_eqx.losses.dpo_batch_loss` (every `loss_type`, including the batch-sorting
    `"aot"` / `"aot_pair"`, which need `micro_batches=1` and one device) and are
    averaged over the pairs that have a completion token (chosen or rejected). With
    `rpo_alpha=α` the token-mean NLL of the chosen completions is added with weight α
    (RPO, Pang et al. 2024; TRL `rpo_alpha`).

    **Arguments:**

    - `settings`: a `DPOSettings` with the fields below (TRL's defaults).
    - `beta`, `loss_type`, `label_smoothing`: see `rlhf_eqx.losses.dpo_loss`. `beta`
      and `label_smoothing` may be JAX arrays (e.g. traced, to `jax.vmap` a run over β).
      A `label_smoothing` other than 0 with a loss that does not smooth its labels
      (any but `sigmoid`, `robust`, `exo_pair`, `sigmoid_norm`, `simpo`, `aot`,
      `aot_pair`) raises `ValueError`: it would have no effect.
      `loss_type` may also be a user's per-pair loss, or its name once registered with
      `rlhf_eqx.losses.register_dpo_loss` (see there): a callable
      `fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, *, beta,
      **loss_kwargs) -> Float[Array, ""]` of one pair's sequence log-probabilities
      (scalars; the reference ones 0 with `reference="none"`), returning the pair's
      loss. It runs with everything below — shared-prompt packed batches, cached
      references, micro-batches, devices, traced `beta` — and the same metrics; a
      wrong signature (for `loss_kwargs`) raises `ValueError` here, a result that is
      not one float per pair when the step is traced, both naming `loss_type`.
    - `reference`: where the reference log-probabilities come from:
      `"model"` — a frozen reference model passed to the step as `reference=` (its
      output is wrapped in `jax.lax.stop_gradient` and it is never differentiated);
      `"cached"` — `batch.ref_chosen_logp` / `ref_rejected_logp`, filled beforehand by
      `compute_reference_logps`; `"none"` — reference-free (TRL `reference_free`).
      `"simpo"` and `"orpo"` never use a reference.
    - `rpo_alpha`: weight of the chosen NLL term (`None`: no term).
    - `loss_kwargs`: further keyword arguments of `dpo_batch_loss` (`bco_delta` of
      `"bco_pair"`, `discopop_tau` of `"discopop"`, `simpo_gamma` of `"simpo"`; another
      loss's is refused), or of a custom `loss_type` (its hyperparameters, which may be
      traced too). `bco_delta` is a fixed $\delta$ (default 0) here and in the `dpo`
      stages, where TRL's `DPOTrainer` updates it each step to the running mean of the
      implicit rewards (`RunningMoments`; `rlhf_eqx.losses.RunningMean` keeps such a
      mean): `"bco_pair"` with the default is TRL's at $\delta = 0$.
    - `optimizer`, `options` (a `StepOptions`) and `**shortcuts` (`beta=0.2`,
      `micro_batches=2`): see `step_builder`.

    Invalid choices and out-of-range numbers raise `ValueError` when the record is built.

    **Returns:**

    ```python
    step(params, opt_state, batch: PreferenceBatch | PackedPreferenceBatch, *,
         frozen=None, reference=None, key=None) -> (params, opt_state, metrics)
    ```

    A `PackedPreferenceBatch` (`data.pack_preferences`) writes each prompt once, followed
    by both completions, which attend to it and to themselves only: the losses,
    gradients and metrics are those of the unpacked batch (averaged over the real pairs),
    while the prompt is computed once per pair instead of twice. It needs a policy (and
    reference) meeting `AbstractSelectiveLM`, e.g. `Policy`.

    one `eqx.filter_jit` region. Metrics (TRL's names, means over pairs): `loss`,
    `rewards/chosen`, `rewards/rejected` (implicit rewards
    $\beta(\log\pi_\theta - \log\pi_{\rm ref})$), `rewards/margins`, `rewards/accuracies`,
    `logps/chosen`, `logps/rejected`, `logits/chosen`, `logits/rejected` (mean logit over the
    completion positions and the vocabulary), `nll_loss` (with `rpo_alpha`), `grad_norm`,
    `learning_rate`, `nonfinite`, `empty_batch`. The rewards and `logps/*` are taken of the
    summed completion log-probabilities for every loss type, `"ipo"` and `"sigmoid_norm"`
    included, as TRL 1.x's `DPOTrainer` logs them (those two divide by the length inside
    the loss only), and of the per-token averages $\log\pi_\theta(y)/|y|$ for `"simpo"`
    and `"orpo"` (no reference), as TRL's `CPOTrainer` and `ORPOTrainer` log them
    (`get_batch_loss_metrics`). `rewards/accuracies` counts pairs with a strictly
    larger chosen reward, as TRL does: while the policy equals the reference the rewards are
    rounding noise (~1e-7), so the first step's accuracy is not meaningful.

    **Empty batches.** A batch with zero rows raises `ValueError` when the step is
    traced. A batch whose completion masks are all false (no pair has a completion
    token) has nothing to learn from: the update is skipped and `empty_batch = 1`
    (see `make_step`).
    """
    loss_type = settings.loss_type
    batch_loss = isinstance(loss_type, str) and loss_type in DPO_BATCH_LOSS_TYPES
    if batch_loss and (options.micro_batches != 1 or options.axis_name is not None):
        raise ValueError(
            f"loss_type={loss_type!r} sorts over the whole batch; it needs micro_batches=1 "
            "and no axis_name"
        )
    return make_step(
        dpo_loss_fn(settings),
        optimizer,
        options,
        batch_type=(PreferenceBatch, PackedPreferenceBatch),
        extras=("reference",),
        cache_key=("dpo", settings, user_function_key(_custom_loss(loss_type))),
    )
