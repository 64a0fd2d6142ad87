r"""The GRPO step's policy losses other than `grpo_policy_loss`: the per-token loss of a
(micro-)batch for `make_grpo_step(policy_loss=...)` (their parameters are fields of
`GRPOSettings`, which checks them).

The per-completion losses (`"cispo"`, `"gmpo"`, `"sapo"`) are vmapped over the rows, so
micro-batching and data parallelism leave them exact. The batch losses (`"clip_cov"`,
`"kl_cov"`, `"high_entropy"`) select tokens by statistics of the tokens they are given:
the step gives them the current micro-batch of every device (their `axis_name` gathers
the devices' rows). Without micro-batching a `pmap`-ed step therefore selects exactly
the tokens one device would select on the whole batch; with `micro_batches=k` each
micro-batch is selected on its own (its token count, means and quantile), as TRL selects
per gradient-accumulation step and veRL per micro-batch.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ..losses import (
    cispo_policy_loss,
    clip_cov_policy_loss,
    gmpo_policy_loss,
    high_entropy_policy_loss,
    kl_cov_policy_loss,
    kl_penalty,
    sapo_policy_loss,
)
from ._rl_settings import GRPOSettings

# The stream of the step's key that draws Clip-Cov's random priorities (the key itself
# goes to the model).
_CLIP_COV_STREAM = 1

PolicyTokenLoss = Callable[..., tuple[Float[Array, "B T"], dict[str, Float[Array, "B T"]]]]


def make_policy_loss(
    settings: GRPOSettings, *, uses_kl: bool, axis_name: str | None
) -> PolicyTokenLoss:
    """The per-token loss of `settings.policy_loss` (not `"grpo"`; its parameters were
    checked by `GRPOSettings`):
    `loss(logp, old_logp, advantages, mask, entropy, ref_logp, key) -> (per_token, stats)`
    on `[B, T]` arrays, with `beta` times the k3 KL to `ref_logp` added (when `uses_kl`)
    and `stats["kl"]` (zeros without `ref_logp`)."""
    s = settings
    policy_loss, importance, delta, beta = s.policy_loss, s.importance, s.delta, s.beta
    clip_eps = s.clip_eps
    clip_eps_high = clip_eps if s.clip_eps_high is None else s.clip_eps_high
    cispo_eps_low, cispo_eps_high, gmpo_clip = s.cispo_eps_low, s.cispo_eps_high, s.gmpo_clip
    sapo_tau_pos, sapo_tau_neg, cov_fraction = s.sapo_tau_pos, s.sapo_tau_neg, s.cov_fraction
    clip_cov_low, clip_cov_high = s.clip_cov_low, s.clip_cov_high
    clip_cov_select, kl_cov_coef, entropy_rho = s.clip_cov_select, s.kl_cov_coef, s.entropy_rho

    def rows(fn, **kw):
        return lambda lp, olp, a, m: jax.vmap(lambda *x: fn(*x, **kw))(lp, olp, a, m)

    def loss(logp, old_logp, adv, m, ent, ref_logp, key: PRNGKeyArray | None):
        if policy_loss == "cispo":
            fn = rows(cispo_policy_loss, clip_eps_low=cispo_eps_low, clip_eps_high=cispo_eps_high)
        elif policy_loss == "gmpo":
            fn = rows(gmpo_policy_loss, clip_eps=gmpo_clip)
        elif policy_loss == "sapo":
            fn = rows(sapo_policy_loss, tau_pos=sapo_tau_pos, tau_neg=sapo_tau_neg)
        elif policy_loss == "clip_cov":
            if clip_cov_select == "random" and key is None:
                raise ValueError(
                    "policy_loss='clip_cov' with clip_cov_select='random' draws its tokens at "
                    "random: call the step with key=..."
                )
            k = None if key is None else jax.random.fold_in(key, _CLIP_COV_STREAM)
            fn = lambda *x: clip_cov_policy_loss(
                *x,
                clip_eps=clip_eps,
                clip_eps_high=clip_eps_high,
                fraction=cov_fraction,
                cov_low=clip_cov_low,
                cov_high=clip_cov_high,
                select=clip_cov_select,
                key=k,
                axis_name=axis_name,
            )
        elif policy_loss == "kl_cov":
            fn = lambda *x: kl_cov_policy_loss(
                *x, fraction=cov_fraction, kl_coef=kl_cov_coef, axis_name=axis_name
            )
        else:
            fn = lambda *x: high_entropy_policy_loss(
                *x,
                ent,
                rho=entropy_rho,
                clip_eps=clip_eps,
                clip_eps_high=clip_eps_high,
                importance=importance,
                delta=delta,
                axis_name=axis_name,
            )
        per_token, stats = fn(logp, old_logp, adv, m)
        zero = jnp.zeros_like(per_token)
        kl = zero if ref_logp is None else jnp.where(m, kl_penalty(logp, ref_logp, kind="k3"), zero)
        if uses_kl:
            per_token = per_token + beta * kl
        return per_token, {**stats, "kl": kl}

    return loss
