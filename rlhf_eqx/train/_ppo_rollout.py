"""PPO rollouts made into the batch a PPO step consumes (`prepare_ppo_batch`, a
`PPOBatch`): token-aligned values, advantages, and the policy's log-probabilities and
values in one forward pass."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree

from ..data import PPOBatch
from ..losses import (
    KL_KINDS,
    KLKind,
    gae,
    kl_penalty,
    kl_shaped_rewards,
    whiten_advantages,
)
from ..models import AbstractSelectiveLM
from ..ops import masked_sum, masked_whiten, previous_real_index
from ._accumulate import tempered_entropies, tempered_logprobs, vmap_model
from ._rl_settings import SampledSettings
from ._state import combine
from ._validation import check_choice, check_number


def token_values(values: Float[Array, " T"], mask: Bool[Array, " T"]) -> Float[Array, " T"]:
    """Align a critic's outputs with the tokens: `out[t] = values[prev(t)]`.

    A `ValueModel`'s `values[s]` is the value of the state after token `s`; token `t`
    is sampled from the state after the previous real token, so its value is read
    there (TRL `PPOTrainer`: `full_value[:, context_length - 1 : -1]`). 0 where `t` has
    no previous real token or is masked.
    """
    prev, has_prev = previous_real_index(mask)
    return jnp.where(mask & has_prev, values[prev], jnp.zeros_like(values))


def _check_advantage_settings(kl_coef, gamma, lam, kl_kind) -> None:
    """`ValueError` naming the argument: `kl_coef >= 0`, `gamma`, `lam` in [0, 1], a known
    `kl_kind` (Python numbers only; arrays pass)."""
    check_number("kl_coef", kl_coef, low=0.0)
    check_number("gamma", gamma, low=0.0, high=1.0)
    check_number("lam", lam, low=0.0, high=1.0)
    check_choice("kl_kind", kl_kind, KL_KINDS)


def compute_advantages(
    scores: Float[Array, " B"],
    logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    values: Float[Array, "B T"],
    completion_mask: Bool[Array, "B T"],
    *,
    kl_coef: float | Float[Array, ""],
    gamma: float = 1.0,
    lam: float = 0.95,
    kl_kind: KLKind = "k1",
    whiten: bool = True,
    whiten_rewards: bool = False,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"], dict[str, Float[Array, ""]]]:
    r"""PPO advantages of a rollout: KL-shaped per-token rewards → GAE → whitening.

    $$r_t = -\beta_{\rm KL}\,\mathrm{kl}_t + \mathbb 1[t = t_{\rm last}]\,s,\qquad
    (A, R) = \mathrm{GAE}_{\gamma,\lambda}(r, V),\qquad A \leftarrow \mathrm{whiten}(A)$$

    over the completion tokens (Ziegler et al. 2019; Ouyang et al. 2022; TRL
    `PPOTrainer`), with `kl_shaped_rewards`, `gae` and `whiten_advantages` (masked mean
    and variance over the whole batch). The returns are not whitened.

    With `whiten_rewards` (TRL `PPOConfig.whiten_rewards`, default off) the shaped
    rewards are scaled before GAE,
    $r \leftarrow (r - \mu_r)/\sqrt{\sigma_r^2 + 10^{-8}} + \mu_r$ with the masked mean
    and unbiased variance over every completion token of the batch: unit variance, the
    mean kept (TRL's `masked_whiten(rewards, shift_mean=False)`). `whiten` whitens the
    advantages after GAE (TRL always does).

    **Arguments:** `scores` `[B]` (reward-model scores), `logp` / `ref_logp` `[B, T]`
    (token log-probabilities of the sampling policy and the reference), `values`
    `[B, T]` (token-aligned, see `token_values`), `completion_mask` `[B, T]`; `kl_coef`
    $\beta_{\rm KL}$, `gamma`, `lam`, `kl_kind` (see `kl_penalty`; TRL's
    `kl_estimator` is `"k1"` or `"k3"`), `whiten`, `whiten_rewards`.

    **Returns:** `(advantages, returns, stats)` with the TRL metrics
    `objective/kl` (mean over sequences of the summed per-token KL), `objective/scores`,
    `objective/non_score_reward` (mean summed KL penalty) and `objective/rlhf_reward`.

    A Python `kl_coef` below 0, a `gamma` or `lam` outside $[0, 1]$ (or any of them not
    finite) and an unknown `kl_kind` raise `ValueError` naming the argument, as in
    `prepare_ppo_batch`; JAX arrays are taken as given.
    """
    _check_advantage_settings(kl_coef, gamma, lam, kl_kind)
    m = completion_mask
    f32 = jnp.float32
    logp = logp.astype(f32)
    ref_logp = ref_logp.astype(f32)
    rewards = jax.vmap(
        lambda s, a, b, mi: kl_shaped_rewards(s, a, b, mi, kl_coef=kl_coef, kind=kl_kind)
    )(scores.astype(f32), logp, ref_logp, m)
    if whiten_rewards:
        rewards = masked_whiten(rewards, m, shift_mean=False)
    adv, ret = jax.vmap(lambda r, v, mi: gae(r, v, mi, gamma=gamma, lam=lam))(
        rewards, values.astype(f32), m
    )
    if whiten:
        adv = whiten_advantages(adv, m)
    kl = kl_penalty(logp, ref_logp, kind=kl_kind)
    seq_kl = masked_sum(kl, m, axis=-1)
    non_score = -jnp.asarray(kl_coef, f32) * jnp.mean(seq_kl)
    stats = {
        "objective/kl": jnp.mean(seq_kl),
        "objective/scores": jnp.mean(scores.astype(f32)),
        "objective/non_score_reward": non_score,
        "objective/rlhf_reward": jnp.mean(scores.astype(f32)) + non_score,
    }
    return adv, ret, stats


def _pair(model, frozen, key):
    """`(policy, value, policy_key, value_key)` of a `(policy, value)` pair, each model
    combined with its frozen part (`frozen`: a pair too, or `None`)."""
    policy, value = model
    pf, vf = (None, None) if frozen is None else frozen
    kp, kv = (None, None) if key is None else tuple(jax.random.split(key))
    return combine(policy, pf), combine(value, vf), kp, kv


def policy_and_values(model, frozen, tokens, mask, key):
    """`(logits [b, T, V], token-aligned values [b, T])` of a `(policy, value)` pair or of a
    combined model returning `(logits, values)`."""
    if isinstance(model, tuple):
        policy, value, kp, kv = _pair(model, frozen, key)
        logits = vmap_model(policy, tokens, mask, kp)
        values = vmap_model(value, tokens, mask, kv)
    else:
        whole = combine(model, frozen)
        out = vmap_model(whole, tokens, mask, key)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            shape = getattr(out, "shape", None)
            got = f"an array of shape {tuple(shape)}" if shape is not None else type(out).__name__
            raise ValueError(
                "PPO's params (and the model given to prepare_ppo_batch) must be a "
                "(policy, value_model) pair or one model returning (logits, values): "
                f"{type(whole).__name__} returned {got} for tokens of shape "
                f"{tuple(tokens.shape)}"
            )
        logits, values = out
    values = jax.vmap(token_values)(values.astype(jnp.float32), mask)
    return logits, values


def policy_logps_and_values(model, frozen, tokens, mask, select, key, *, temperature, entropy_grad):
    """`(logp [b, T], entropy [b, T], values [b, T])` for the PPO loss, read at `select`.

    When the policy of a `(policy, value)` pair meets `AbstractSelectiveLM` (e.g.
    `Policy`) and the entropy needs no gradient, its LM head runs only on the positions
    that predict the selected tokens (`selected_logprobs`, entropies in the same
    chunks); otherwise from full logits. Outside `select` the values may differ
    between the two paths and must not be read."""
    if isinstance(model, tuple) and not entropy_grad:
        policy, value, kp, kv = _pair(model, frozen, key)
        if isinstance(policy, AbstractSelectiveLM):
            logp, _, ent = policy.selected_logprobs(
                tokens, mask, select, key=kp, temperature=temperature, with_entropy=True
            )
            values = vmap_model(value, tokens, mask, kv)
            return logp, ent, jax.vmap(token_values)(values.astype(jnp.float32), mask)
    logits, values = policy_and_values(model, frozen, tokens, mask, key)
    logp = tempered_logprobs(logits, tokens, mask, temperature)
    return logp, tempered_entropies(logits, mask, temperature), values


@eqx.filter_jit
def _prepare(model, reference, tokens, mask, completion_mask, scores, kl_coef, settings):
    gamma, lam, kl_kind, whiten, whiten_rewards, temperature = settings
    logits, values = policy_and_values(model, None, tokens, mask, None)
    logp = tempered_logprobs(logits, tokens, mask, temperature)
    ref_logits = vmap_model(reference, tokens, mask, None)
    ref_logp = tempered_logprobs(ref_logits, tokens, mask, temperature)
    m = completion_mask & mask
    adv, ret, stats = compute_advantages(
        scores,
        logp,
        ref_logp,
        values,
        m,
        kl_coef=kl_coef,
        gamma=gamma,
        lam=lam,
        kl_kind=kl_kind,
        whiten=whiten,
        whiten_rewards=whiten_rewards,
    )
    zero = jnp.zeros_like(logp)
    batch = PPOBatch(
        tokens=tokens,
        mask=mask,
        completion_mask=m,
        old_logp=jnp.where(m, logp, zero),
        old_values=jnp.where(m, values, zero),
        advantages=adv,
        returns=ret,
    )
    return batch, stats


def prepare_ppo_batch(
    model: PyTree,
    reference: Callable[..., Float[Array, "T V"]],
    tokens: Int[Array, "B T"],
    mask: Bool[Array, "B T"],
    completion_mask: Bool[Array, "B T"],
    scores: Float[Array, " B"],
    *,
    kl_coef: float | Float[ArrayLike, ""],
    gamma: float = 1.0,
    lam: float = 0.95,
    kl_kind: KLKind = "k1",
    whiten: bool = True,
    whiten_rewards: bool = False,
    temperature: float = SampledSettings.temperature,
) -> tuple[PPOBatch, dict[str, Float[Array, ""]]]:
    """Turn sampled sequences and their scores into a `PPOBatch` (one jitted pass).

    `model` is the `(policy, value_model)` pair (or one model returning
    `(logits, values)`), as used by `make_ppo_step`; `reference` the frozen reference
    policy. Computes the sampling policy's token log-probabilities and the reference's
    at the sampling `temperature` (logits / T, as `rlhf_eqx.generate` reports them, so
    an on-policy ratio is exactly 1), the token-aligned values, then
    `compute_advantages` (with `kl_kind`, `whiten` of the advantages and
    `whiten_rewards` of the shaped rewards). Pass the same `temperature` to
    `make_ppo_step`.

    **Returns:** `(batch, stats)`; `stats` as `compute_advantages`.
    """
    _check_advantage_settings(kl_coef, gamma, lam, kl_kind)
    SampledSettings(temperature=temperature)  # the one rule of a sampling temperature
    coef = jnp.asarray(kl_coef, jnp.float32)
    return _prepare(
        model,
        reference,
        tokens,
        mask,
        completion_mask,
        scores.astype(jnp.float32),
        coef,
        (gamma, lam, kl_kind, bool(whiten), bool(whiten_rewards), float(temperature)),
    )
