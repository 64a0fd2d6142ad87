"""GRPO-family step: group-relative advantages and the clipped token/sequence-level loss."""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from ..data import GRPOBatch
from ..losses import (
    MISMATCH_EXTREMES,
    aggregate_mismatch_metrics,
    aggregate_parts,
    kl_penalty,
    mask_truncated,
    mismatch_metrics,
    resolve_policy_loss,
)
from ..models import AbstractSelectiveLM
from ..ops import masked_sum
from ._accumulate import (
    _moment_std,
    _set_fields,
    policy_logits,
    tempered_entropies,
    tempered_logprobs,
)
from ._builder import step_builder
from ._distill import _check_reference_vocab
from ._group_logps import shared_prompt_logprobs
from ._grpo_advantages import grpo_advantages
from ._policy_loss_fns import make_policy_loss, read_policy_loss
from ._rl_settings import GRPOSettings
from ._settings import StepOptions, settings_from
from ._state import combine
from ._step import LossFn, PrepareFn, Step, make_step


def _grpo_prepare(settings: GRPOSettings) -> PrepareFn:
    """Advantages from the rewards of the whole (per-device) batch, the loss mask, and the
    reward metrics; the result goes in `batch.advantages` / `batch.completion_mask`."""
    group_size, scale = settings.group_size, settings.scale
    mask_truncated_completions = settings.mask_truncated_completions
    f32 = jnp.float32

    def prepare(batch: GRPOBatch, axis_name: str | None):
        if batch.samples_per_prompt not in (None, group_size):
            raise ValueError(
                f"GRPOBatch.samples_per_prompt={batch.samples_per_prompt} differs from the "
                f"step's group_size={group_size}"
            )
        if batch.advantages is not None:
            adv = batch.advantages.astype(f32)
        elif batch.rewards is not None:
            adv = grpo_advantages(
                batch.rewards.astype(f32), group_size=group_size, scale=scale, axis_name=axis_name
            )
        else:
            raise ValueError("GRPOBatch needs `rewards` or `advantages`")
        loss_mask = batch.completion_mask & batch.mask
        if mask_truncated_completions:
            if batch.truncated is None:
                raise ValueError("mask_truncated_completions=True needs batch.truncated")
            loss_mask = jax.vmap(mask_truncated)(loss_mask, batch.truncated)
        n = jnp.asarray(adv.shape[0], f32)
        sums = {"advantages/mean": (jnp.sum(adv), n), "advantages/_sq": (jnp.sum(adv * adv), n)}
        if batch.rewards is not None:
            rewards = batch.rewards.astype(f32)
            if rewards.shape[0] % group_size != 0:
                raise ValueError(
                    f"batch size {rewards.shape[0]} is not a multiple of group_size={group_size}"
                )
            grouped = rewards.reshape(-1, group_size)
            g = jnp.asarray(grouped.shape[0], f32)
            if group_size > 1:
                std = jnp.std(grouped, axis=-1, ddof=1)
            else:
                std = jnp.zeros(grouped.shape[:1], f32)
            sums["reward"] = (jnp.sum(rewards), n)
            sums["reward_std"] = (jnp.sum(std), g)
            zero_std = jnp.all(grouped == grouped[:, :1], axis=-1)
            sums["frac_reward_zero_std"] = (jnp.sum(zero_std.astype(f32)), g)
        if batch.behaviour_logp is not None and batch.old_logp is not None:
            # max / min ratios: once on the full batch (and over devices), as exact metrics
            pieces = jax.vmap(mismatch_metrics)(
                batch.old_logp.astype(f32), batch.behaviour_logp.astype(f32), loss_mask
            )
            extremes = {k: pieces[k] for k in MISMATCH_EXTREMES}
            for k, v in aggregate_mismatch_metrics(extremes, axis_name=axis_name).items():
                sums[k] = (v, jnp.ones((), f32))
        batch = _set_fields(batch, advantages=adv, completion_mask=loss_mask)
        return batch, sums

    return prepare


def grpo_loss(
    settings: GRPOSettings | None = None, *, axis_name: str | None = None, **shortcuts: Any
) -> LossFn:
    """The GRPO-family loss function for `make_step` on a prepared `GRPOBatch` (advantages
    filled, `completion_mask` the loss mask), with `settings` (a `GRPOSettings`, or its
    fields as keywords); `frozen` is `(frozen_part, reference_model, entropy_coef)` (the
    last optional). `axis_name`: the device axis the batch policy losses gather their
    tokens over. See `make_grpo_step`."""
    s = settings_from(GRPOSettings, settings, shortcuts, where="grpo_loss")
    beta, mode, constant, temperature = s.beta, s.mode, s.constant, s.temperature
    rollout_correction = s.rollout_correction
    uses_kl = not (isinstance(beta, int | float) and beta == 0)
    f32 = jnp.float32
    # With a rollout correction the KL term is added after the weights (they weight the
    # policy surrogate only, as in veRL and TRL).
    kl_in_loss = uses_kl and rollout_correction is None
    policy_loss = make_policy_loss(s, GRPOSettings, advantages="sequence", axis_name=axis_name)
    wants_ref = "ref_logp" in resolve_policy_loss(s.policy_loss).inputs()

    def logprobs(model, batch, key, *, entropy: bool, entropy_grad: bool = False):
        """Token log-probs `[B, T]` (and entropies, or `None`) at the loss-mask tokens.

        A model that meets `AbstractSelectiveLM` (e.g. `Policy`) runs its LM head only on
        the positions that predict those tokens, in chunks (its entropies carry no
        gradient); any other model, or an entropy that needs a gradient, uses full
        logits. Positions outside the loss mask are never read by the loss."""
        m = batch.completion_mask
        if isinstance(model, AbstractSelectiveLM) and not entropy_grad:
            kw = dict(key=key, temperature=temperature, with_entropy=entropy)
            if batch.prompt_length is None:
                out = model.selected_logprobs(batch.tokens, batch.mask, m, **kw)
            else:
                out = shared_prompt_logprobs(model, batch, m, **kw)
            return out[0], (out[2] if entropy else None)
        logits = policy_logits(model, batch.tokens, batch.mask, key)
        logp = tempered_logprobs(logits, batch.tokens, batch.mask, temperature)
        if not entropy:
            return logp, None
        return logp, tempered_entropies(logits, batch.mask, temperature)

    def loss_fn(params: PyTree, frozen: PyTree, batch: GRPOBatch, key: PRNGKeyArray | None):
        frozen_part, ref_model, *rest = frozen
        ent_coef = rest[0] if rest else None
        need_ref = (uses_kl or wants_ref) and batch.ref_logp is None
        if need_ref and ref_model is None:
            raise ValueError(
                "beta != 0 (or a policy_loss that takes ref_logp) needs batch.ref_logp or the "
                "step's `reference=` model"
            )
        m = batch.completion_mask
        model = combine(params, frozen_part)
        logp, ent = logprobs(model, batch, key, entropy=True, entropy_grad=ent_coef is not None)
        old_logp = jax.lax.stop_gradient(logp) if batch.old_logp is None else batch.old_logp
        ref_logp = batch.ref_logp
        if need_ref:
            _check_reference_vocab(model, ref_model, batch.tokens, batch.mask, "make_grpo_step")
            ref_logp = logprobs(ref_model, batch, None, entropy=False)[0]
        if ref_logp is not None:
            # zeroed where masked: a NaN there would reach the gradient through the KL
            ref_logp = jnp.where(m, jax.lax.stop_gradient(ref_logp.astype(f32)), 0.0)

        per_token, stats = policy_loss(
            logp, old_logp.astype(f32), batch.advantages, m, ent, ref_logp, key
        )
        zero = jnp.zeros_like(per_token)
        kl = zero if ref_logp is None else jnp.where(m, kl_penalty(logp, ref_logp, kind="k3"), zero)
        if kl_in_loss:
            per_token = per_token + beta * kl
        rc_sums = {}
        if rollout_correction is not None or batch.behaviour_logp is not None:
            per_token, m, rc_sums = _rollout_correction(
                rollout_correction, per_token, kl, beta, uses_kl, old_logp, batch, m
            )
        num, den = aggregate_parts(per_token, m, mode=mode, constant=constant)
        n = jnp.sum(m).astype(f32)
        flag = lambda name: masked_sum(stats.get(name, zero), m)
        metrics = {
            "clip_ratio": (flag("clipped"), n),
            "clip_ratio/low_mean": (flag("clipped_low"), n),
            "clip_ratio/high_mean": (flag("clipped_high"), n),
            "kl": (masked_sum(kl, m), n),
            "entropy": (masked_sum(ent, m), n),
            **rc_sums,
        }
        if "selected" in stats:
            metrics["selected_frac"] = (masked_sum(stats["selected"], m), n)
        nums, dens = {"policy": num}, {"policy": den}
        if ent_coef is not None:
            ent_num, _ = aggregate_parts(ent, m, mode=mode, constant=constant)
            nums["entropy"], dens["entropy"] = -jnp.asarray(ent_coef, f32) * ent_num, den
        return nums, dens, metrics

    return loss_fn


def _rollout_correction(correction, per_token, kl, beta, uses_kl, old_logp, batch, m):
    """Weight the per-token policy loss by `correction` (then add the KL term) and drop
    its rejected tokens from the loss mask; return `(per_token, mask, mismatch metric sums)`."""
    if batch.behaviour_logp is None:
        raise ValueError("rollout_correction needs batch.behaviour_logp (the sampler's log-probs)")
    old = jax.lax.stop_gradient(old_logp.astype(jnp.float32))
    behaviour = batch.behaviour_logp.astype(jnp.float32)
    kept = m
    if correction is not None:
        w, kept = jax.vmap(correction)(old, behaviour, m)
        per_token = per_token * w
        if uses_kl:
            per_token = per_token + beta * kl
    pieces = jax.vmap(lambda o, b, mk, k: mismatch_metrics(o, b, mk, kept=k))(
        old, behaviour, m, kept
    )
    sums = {k: (jnp.sum(v), jnp.sum(c)) for k, (v, c) in pieces.items()}
    return per_token, kept, {k: v for k, v in sums.items() if k not in MISMATCH_EXTREMES}


def _advantage_std(metrics, grads):
    del grads
    metrics = dict(metrics)
    metrics["advantages/std"] = _moment_std(metrics, "advantages")
    del metrics["advantages/mean"]
    return metrics


@step_builder(GRPOSettings)
def make_grpo_step(optimizer, settings: GRPOSettings, options: StepOptions) -> Step:
    r"""Build the GRPO-family update (Shao et al. 2024; TRL `GRPOTrainer`).

    Advantages are computed once on the **full** batch (`grpo_advantages` of
    `batch.rewards`, or `batch.advantages` as given; with `axis_name`, `scale="batch"`
    uses the rewards of every device); the loss is
    `aggregate_mode(grpo_policy_loss(...))` over the completion tokens. Log-probabilities
    and entropies are taken at the sampling `temperature` (logits / T), which must be
    the one the completions were sampled at. Variants:

    - DAPO (Yu et al. 2025): `clip_eps_high > clip_eps` (clip-higher),
      `mode="token-mean"`, `mask_truncated_completions=True` (overlong filtering);
    - Dr.GRPO (Liu et al. 2025): `scale="none"`, `mode="seq-mean-token-sum-norm"`
      with `constant` = the maximum completion length;
    - GSPO (Zheng et al. 2025): `importance="sequence"`;
    - KL to a reference: `beta > 0` (k3 estimator; reference log-probabilities from
      `batch.ref_logp`, or from the step's `reference=` model when that is `None`).

    `policy_loss` (one of `rlhf_eqx.losses.POLICY_LOSSES`, a name registered with
    `rlhf_eqx.losses.register_policy_loss` or such a per-token loss itself, with its
    hyperparameters from `loss_kwargs` and the fields of the same name) replaces the
    clipped loss; `beta`, `mode`, the advantages and the masking apply to every choice:

    - `"grpo"` (default): `grpo_policy_loss` as above;
    - `"cispo"`: `cispo_policy_loss(clip_eps_low=cispo_eps_low, clip_eps_high=cispo_eps_high)`
      (MiniMax-M1; the paper reduces with `mode="token-mean"`);
    - `"gmpo"`: `gmpo_policy_loss(clip_eps=gmpo_clip)`, the log-space clip range
      $(e^{-c}, e^{c})$ (Zhao et al. 2025; `mode="seq-mean-token-mean"` is the paper's);
    - `"sapo"`: `sapo_policy_loss(tau_pos=sapo_tau_pos, tau_neg=sapo_tau_neg)` (Qwen 2025);
    - `"clip_cov"`: `clip_cov_policy_loss` with `clip_eps` / `clip_eps_high`,
      `fraction=cov_fraction`, bounds `(clip_cov_low, clip_cov_high)` and
      `select=clip_cov_select` (`"random"` needs the step's `key=`);
    - `"kl_cov"`: `kl_cov_policy_loss(fraction=cov_fraction, kl_coef=kl_cov_coef)`
      (Cui et al. 2025);
    - `"high_entropy"`: `high_entropy_policy_loss(rho=entropy_rho)` with `clip_eps`,
      `clip_eps_high`, `importance`, `delta` (Wang et al. 2025), on the entropies the step
      computes anyway (for its `entropy` metric).

    `importance` and `delta` apply to `"grpo"` and `"high_entropy"` only. The batch losses
    (`"clip_cov"`, `"kl_cov"`, `"high_entropy"`) select over the tokens of the current
    micro-batch of every device (`axis_name`): a `pmap`-ed step equals one device's step
    on the whole batch, while `micro_batches=k` selects within each micro-batch (as TRL
    and veRL do); they log `selected_frac` (the fraction of tokens cut, penalised or
    kept).

    **Entropy bonus.** `step(..., entropy_coef=c)` (a JAX scalar, so that changing it
    does not recompile) adds the term $-c\,H$ (`loss/entropy`; same aggregation `mode`)
    and computes the entropies from full logits so that they carry a gradient. Keep `c`
    as run state and update it with `rlhf_eqx.losses.adaptive_entropy_coef` from the
    `entropy` metric to follow a target entropy.

    **Off-policy rollouts.** With `batch.behaviour_logp` (the sampler's log-probs $\mu$)
    the step logs the training–sampling mismatch (`rlhf_eqx.losses.mismatch_metrics`
    of $\pi_{\rm old}$ = `batch.old_logp`, or the current policy when it is `None`, against
    $\mu$): `rollout_corr/kl`, `k3_kl`, `rollout_is_mean`, `training_ppl`,
    `rollout_ppl`, `ppl_ratio`, `log_ppl_diff`, `rollout_is_masked_fraction`,
    `rollout_is_seq_masked_fraction`, and, when `batch.old_logp` is given,
    `rollout_is_max` / `rollout_is_min` (over the whole batch and every device).
    `rollout_correction=RolloutCorrection(level=..., mode=..., upper=..., lower=...)`
    also corrects the loss (veRL rollout importance sampling; see
    `rlhf_eqx.losses.importance_weights`): each token's policy loss is multiplied by its
    weight (the KL term is not) and rejected tokens leave the loss mask of every term
    (numerators and denominators alike, so micro-batches and devices stay exact). It
    needs `batch.behaviour_logp`. Without `behaviour_logp` and `rollout_correction` the
    step is unchanged.

    A policy that meets `AbstractSelectiveLM` (e.g. `Policy`) scores only the loss-mask
    tokens, with its LM head in chunks (entropies included); a batch with
    `prompt_length` / `samples_per_prompt` set also runs each group's prompt once.

    **Arguments:** `settings`, a `GRPOSettings`: `group_size` $G$ (rows
    `i*G : (i+1)*G` share a prompt; per device under `pmap`), `scale` (see
    `group_advantages`), `clip_eps`, `clip_eps_high` (`None`: same as `clip_eps`),
    `importance`, `beta` (default 0.0, TRL's), `delta` (see `grpo_policy_loss`), `mode`
    / `constant` (see `aggregate_parts`), `mask_truncated_completions`, `temperature`,
    `policy_loss` and its parameters, `rollout_correction` (above); `optimizer`,
    `options` (a `StepOptions`) and `**shortcuts`: see `step_builder`. Invalid values
    raise `ValueError` when the record is built.

    **Returns:**

    ```python
    step(params, opt_state, batch: GRPOBatch, *, frozen=None, reference=None, key=None,
         entropy_coef=None) -> (params, opt_state, metrics)
    ```

    one `eqx.filter_jit` region. Metrics (token means over the completion tokens that
    count): `loss`, `clip_ratio` (and `clip_ratio/low_mean`, `clip_ratio/high_mean`),
    `kl` (k3 to the reference, 0 without one), `entropy`, `reward` (mean), `reward_std`
    (mean of the per-group standard deviations, as TRL), `frac_reward_zero_std`
    (fraction of groups whose rewards are all equal: they carry no signal),
    `advantages/std`, `grad_norm`, `learning_rate`, `nonfinite`.
    """
    return make_step(
        grpo_loss(settings, axis_name=options.axis_name),
        optimizer,
        options,
        prepare=_grpo_prepare(settings),
        metrics_fn=_advantage_std,
        batch_type=GRPOBatch,
        extras=("reference", "entropy_coef"),
        cache_key=("grpo", settings, read_policy_loss(settings)),
    )
