r"""Per-token policy losses by name: `register_policy_loss` adds one, `resolve_policy_loss`
turns a `policy_loss` (a name or a callable) into the `PolicyLossSpec` that the PPO and
GRPO steps call, and the built-in losses are its first entries.

A policy loss is the per-token objective of one completion (or of a batch), below the
aggregation: the steps take the log-probabilities (selective LM head, shared-prompt
packing), add the KL term, weight by a rollout correction and aggregate (`token-mean`,
`seq-mean-token-mean`, Dr.GRPO's constant, ...) around it, whatever the loss.
"""

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Shaped

from ._completion_losses import cispo_policy_loss, gmpo_policy_loss, sapo_policy_loss
from ._grpo import grpo_policy_loss
from ._ppo import ppo_policy_loss
from ._selective_losses import clip_cov_policy_loss, high_entropy_policy_loss, kl_cov_policy_loss
from ._validation import callable_name, check_choice, check_registered_name

PolicyLossFn = Callable[..., Any]
"""A per-token policy loss (see `register_policy_loss`)."""
POLICY_LOSS_ADVANTAGES: tuple[str, ...] = ("sequence", "token", "either")
"""What a policy loss takes as `advantages` (`register_policy_loss(advantages=...)`)."""
POLICY_LOSS_INPUTS: tuple[str, ...] = ("ref_logp", "entropy", "key", "axis_name")
"""Step inputs a policy loss receives when it declares a parameter of that name."""
_SIGNATURE = "fn(logp, old_logp, advantages, mask, **hyperparameters)"


class PolicyLossSpec(NamedTuple):
    """A policy loss and how the steps call it: `batch` (`[B, T]` arrays, else one
    completion, vmapped), `advantages` (one of `POLICY_LOSS_ADVANTAGES`), `name` (for errors)."""

    fn: PolicyLossFn
    batch: bool = False
    advantages: str = "either"
    name: str = ""

    def parameters(self) -> dict[str, inspect.Parameter]:
        """The keyword parameters after the four arrays: hyperparameters and inputs."""
        try:
            params = list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):  # a builtin: nothing to read
            return {}
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        arrays = {p.name for p in [p for p in params if p.kind in positional][:4]}
        var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        return {p.name: p for p in params if p.kind not in var and p.name not in arrays}

    def hyperparameters(self) -> dict[str, inspect.Parameter]:
        """The parameters that are hyperparameters (not a `POLICY_LOSS_INPUTS` name)."""
        return {k: p for k, p in self.parameters().items() if k not in POLICY_LOSS_INPUTS}

    def inputs(self) -> tuple[str, ...]:
        """The `POLICY_LOSS_INPUTS` the loss declares."""
        return tuple(k for k in POLICY_LOSS_INPUTS if k in self.parameters())

    def takes_any_keyword(self) -> bool:
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):
            return True
        return any(p.kind == p.VAR_KEYWORD for p in params)


_REGISTRY: dict[str, PolicyLossSpec] = {}


def _check_fn(fn: object, what: str) -> None:
    """Refuse `fn` unless it takes the four arrays positionally."""
    if not callable(fn):
        raise ValueError(f"{what} must be a callable {_SIGNATURE}, got {fn!r}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 4 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ValueError(
            f"{what}={callable_name(fn)} cannot be called as {_SIGNATURE}: it takes "
            f"{len(positional)} positional arguments"
        )


def register_policy_loss(
    name: str, fn: PolicyLossFn, *, batch: bool = False, advantages: str = "either"
) -> PolicyLossFn:
    r"""Add a per-token policy loss under `name`, usable as `policy_loss=name` in
    `rlhf_eqx.train.make_grpo_step` / `make_ppo_step` (their settings records and the
    pipelines' `grpo.policy_loss` / `ppo.policy_loss`), in this process. Passing `fn`
    itself as `policy_loss` does the same without a name.

    **The loss** is called on one completion (batches go through `jax.vmap`) as

    ```python
    fn(logp, old_logp, advantages, mask, **hyperparameters)
        -> per_token  |  (per_token, stats)
    ```

    with the current policy's log-probabilities `logp` `[T]` (differentiated), the
    behaviour (old) policy's `old_logp` `[T]`, the `advantages` (one scalar per
    completion in GRPO, `[T]` per token in PPO) and the loss mask `[T]`; it returns the
    per-token loss `[T]` (any value where `mask` is false: the step zeroes it), alone or
    with a dict of per-token stats, of which the steps log `clipped`, `clipped_low`,
    `clipped_high` (`clip_ratio*`, `policy/clipfrac`; 0 for a loss that returns none of
    them) and `selected` (`selected_frac`).
    The step then adds its KL term ($\beta$ k3, GRPO), applies `rollout_correction`
    and aggregates with its `mode`, so every aggregation mode, micro-batching, devices,
    shared-prompt packing and the selective LM head apply unchanged.

    **Hyperparameters** are the keyword parameters after the four arrays. Each takes its
    value from the step's settings: the `loss_kwargs` entry of that name, else the
    settings field of that name (e.g. `clip_eps`), else its default; one with none of
    these is refused when the settings are built, naming it. Values may be JAX arrays,
    traced under `jax.jit` / `jax.vmap`: a change does not recompile. Parameters named
    in `POLICY_LOSS_INPUTS` receive step inputs instead: `ref_logp` (the reference
    log-probabilities; the step then needs a reference), `entropy` (the token
    entropies), `key` (a PRNG key derived from the step's, or `None`) and `axis_name`
    (the step's device axis, for batch losses).

    For instance PPO's clipped surrogate (Schulman et al. 2017, eq. 7), as GRPO uses it
    (Shao et al. 2024):

    ```python
    def clipped(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high):
        high = clip_eps if clip_eps_high is None else clip_eps_high
        ratio = jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))
        return -jnp.minimum(ratio * advantages,
                            jnp.clip(ratio, 1 - clip_eps, 1 + high) * advantages)

    register_policy_loss("my_clip", clipped)
    step = rx.train.make_grpo_step(optimizer, group_size=8, policy_loss="my_clip")
    ```

    **Arguments:**

    - `name`: the `policy_loss` name; a built-in name (`POLICY_LOSSES`, `"ppo"`) is
      refused, a name registered before is replaced.
    - `fn`: the loss, as above.
    - `batch`: call `fn` once on the `[B, T]` arrays of the (micro-)batch (advantages
      `[B]` or `[B, T]`) instead of once per completion, for losses that select tokens
      by batch statistics (as `"clip_cov"`); with `axis_name` they see every device.
    - `advantages`: `"sequence"` (one advantage per completion: GRPO only), `"token"`
      (`[T]`: PPO only) or `"either"` (default: written with broadcasting, both steps).

    **Returns:** `fn`, unchanged.
    """
    check_registered_name(name, _BUILTIN, "policy_loss")
    _check_fn(fn, "fn")
    check_choice("advantages", advantages, POLICY_LOSS_ADVANTAGES)
    _REGISTRY[name] = PolicyLossSpec(fn, bool(batch), advantages, repr(name))
    return fn


def policy_loss_names(advantages: str | None = None) -> tuple[str, ...]:
    """Every valid `policy_loss` name now (built-in, then registered); with `advantages`
    (`"sequence"`: GRPO, `"token"`: PPO), those that take such advantages."""
    if advantages is not None:
        check_choice("advantages", advantages, POLICY_LOSS_ADVANTAGES[:2])
    return tuple(
        k
        for k, s in _REGISTRY.items()
        if advantages is None or s.advantages in (advantages, "either")
    )


def resolve_policy_loss(policy_loss: object, *, advantages: str | None = None) -> PolicyLossSpec:
    """The `PolicyLossSpec` of a `policy_loss` (a name or a callable), with a one-line
    `ValueError` naming `policy_loss` for an unknown name (with `advantages`: one that does
    not take that kind of advantages) or a callable of the wrong signature."""
    if isinstance(policy_loss, str):
        check_choice("policy_loss", policy_loss, policy_loss_names(advantages))
        return _REGISTRY[policy_loss]
    if callable(policy_loss):
        _check_fn(policy_loss, "policy_loss")
        return PolicyLossSpec(policy_loss, name=callable_name(policy_loss))
    raise ValueError(
        f"policy_loss={policy_loss!r}: must be a name in {policy_loss_names(advantages)} or "
        f"a callable {_SIGNATURE}"
    )


# --- the built-in losses: their hyperparameters are named as the settings' fields --------


def _ppo(logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high, dual_clip):
    """PPO's clipped surrogate (Schulman et al. 2017): `ppo_policy_loss`."""
    return ppo_policy_loss(
        logp, old_logp, advantages, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
        dual_clip=dual_clip,
    )  # fmt: skip


def _grpo(logp, old_logp, advantage, mask, *, clip_eps, clip_eps_high, importance, delta):
    """GRPO's clipped loss (Shao et al. 2024), GSPO with `importance="sequence"`."""
    return grpo_policy_loss(
        logp, old_logp, advantage, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
        importance=importance, delta=delta,
    )  # fmt: skip


def _cispo(logp, old_logp, advantage, mask, *, cispo_eps_low, cispo_eps_high):
    """CISPO (MiniMax 2025): `cispo_policy_loss`."""
    return cispo_policy_loss(
        logp, old_logp, advantage, mask, clip_eps_low=cispo_eps_low, clip_eps_high=cispo_eps_high
    )


def _gmpo(logp, old_logp, advantage, mask, *, gmpo_clip):
    """GMPO (Zhao et al. 2025): `gmpo_policy_loss`."""
    return gmpo_policy_loss(logp, old_logp, advantage, mask, clip_eps=gmpo_clip)


def _sapo(logp, old_logp, advantage, mask, *, sapo_tau_pos, sapo_tau_neg):
    """SAPO (Gao et al. 2025): `sapo_policy_loss`."""
    return sapo_policy_loss(
        logp, old_logp, advantage, mask, tau_pos=sapo_tau_pos, tau_neg=sapo_tau_neg
    )


def _clip_cov(
    logp, old_logp, advantages, mask, *, clip_eps, clip_eps_high, cov_fraction, clip_cov_low,
    clip_cov_high, clip_cov_select, key, axis_name,
):  # fmt: skip
    """Clip-Cov (Cui et al. 2025): `clip_cov_policy_loss`."""
    if clip_cov_select == "random" and key is None:
        raise ValueError(
            "policy_loss='clip_cov' with clip_cov_select='random' draws its tokens at "
            "random: call the step with key=..."
        )
    return clip_cov_policy_loss(
        logp, old_logp, advantages, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
        fraction=cov_fraction, cov_low=clip_cov_low, cov_high=clip_cov_high,
        select=clip_cov_select, key=key, axis_name=axis_name,
    )  # fmt: skip


def _kl_cov(logp, old_logp, advantages, mask, *, cov_fraction, kl_cov_coef, axis_name):
    """KL-Cov (Cui et al. 2025): `kl_cov_policy_loss`."""
    return kl_cov_policy_loss(
        logp, old_logp, advantages, mask, fraction=cov_fraction, kl_coef=kl_cov_coef,
        axis_name=axis_name,
    )  # fmt: skip


def _high_entropy(
    logp, old_logp, advantages, mask, *, entropy, entropy_rho, clip_eps, clip_eps_high,
    importance, delta, axis_name,
):  # fmt: skip
    """The clipped loss on the high-entropy tokens (Wang et al. 2025)."""
    return high_entropy_policy_loss(
        logp, old_logp, advantages, mask, entropy, rho=entropy_rho, clip_eps=clip_eps,
        clip_eps_high=clip_eps_high, importance=importance, delta=delta, axis_name=axis_name,
    )  # fmt: skip


_BUILTIN: dict[str, PolicyLossSpec] = {
    "grpo": PolicyLossSpec(_grpo, advantages="sequence"),
    "cispo": PolicyLossSpec(_cispo, advantages="sequence"),
    "gmpo": PolicyLossSpec(_gmpo, advantages="sequence"),
    "sapo": PolicyLossSpec(_sapo, advantages="sequence"),
    "clip_cov": PolicyLossSpec(_clip_cov, batch=True, advantages="sequence"),
    "kl_cov": PolicyLossSpec(_kl_cov, batch=True, advantages="sequence"),
    "high_entropy": PolicyLossSpec(_high_entropy, batch=True, advantages="sequence"),
    "ppo": PolicyLossSpec(_ppo, advantages="token"),
}
_REGISTRY.update({k: s._replace(name=repr(k)) for k, s in _BUILTIN.items()})


def per_token_output(
    spec: PolicyLossSpec, out: Any, like: Float[Array, "*B T"]
) -> tuple[Float[Array, "*B T"], dict[str, Shaped[ArrayLike, "*B T"]]]:
    """`(per_token, stats)` of a loss's output, checked: a float array shaped as `like`
    and a dict of arrays of that shape."""
    if isinstance(out, (tuple, list)) and (len(out) != 2 or not isinstance(out[1], dict)):
        raise ValueError(
            f"policy_loss={spec.name} must return the per-token loss or (loss, stats dict)"
        )
    per_token, stats = out if isinstance(out, (tuple, list)) else (out, {})
    # a per-completion loss is vmapped: name the shapes of one completion
    each, cut = ("", 0) if spec.batch else (" per completion", 1)
    shape, dtype = jnp.shape(per_token), jnp.result_type(per_token)
    if shape != like.shape or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"policy_loss={spec.name} must return a float per-token loss of shape "
            f"{like.shape[cut:]}{each} (as logp), got shape {shape[cut:]} and dtype {dtype}"
        )
    for name, value in stats.items():
        if jnp.shape(value) != like.shape:
            raise ValueError(
                f"policy_loss={spec.name}: stats {name!r} must be per-token, of shape "
                f"{like.shape[cut:]}{each} (as logp), got shape {jnp.shape(value)[cut:]}"
            )
    return jnp.asarray(per_token), stats
