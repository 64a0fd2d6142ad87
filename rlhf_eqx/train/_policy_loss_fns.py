r"""The per-token policy loss of the PPO and GRPO steps: `settings.policy_loss` (a name of
`rlhf_eqx.losses.policy_loss_names()` or a callable) resolved, its hyperparameters taken
from the settings, and its call on a (micro-)batch.

Every loss, built-in or a user's, goes through here. A hyperparameter (a keyword parameter
of the loss after its four arrays) takes the `loss_kwargs` entry of its name, else the
settings field of its name, else its default; the values are passed as they are (JAX
arrays stay traced). Per-completion losses are vmapped over the rows, so micro-batching
and data parallelism leave them exact. Batch losses (`"clip_cov"`, `"kl_cov"`,
`"high_entropy"`, or `register_policy_loss(batch=True)`) select tokens by statistics of
the tokens they are given: the step gives them the current micro-batch of every device
(their `axis_name` gathers the devices' rows). Without micro-batching a `pmap`-ed step
therefore selects exactly the tokens one device would select on the whole batch; with
`micro_batches=k` each micro-batch is selected on its own (its token count, means and
quantile), as TRL selects per gradient-accumulation step and veRL per micro-batch.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ..losses import (
    POLICY_LOSS_INPUTS,
    POLICY_LOSSES,
    PolicyLossSpec,
    per_token_output,
    policy_loss_names,
    resolve_policy_loss,
)
from ._step_cache import user_function_key
from ._validation import check_choice, loss_kwargs_with_fields

# The stream of the step's key that the loss's `key` comes from (the key itself goes to
# the model).
_LOSS_STREAM = 1
# The built-in policy losses: no name of theirs can be registered again.
_BUILTIN_NAMES = (*POLICY_LOSSES, "ppo")
# The settings fields that say which loss runs, not how: never a hyperparameter.
_NOT_HYPERPARAMETERS = ("policy_loss", "loss_kwargs")

PolicyTokenLoss = Callable[..., tuple[Float[Array, "B T"], dict[str, Float[Array, "B T"]]]]


def _named(names: list[str]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def policy_loss_spec(settings: Any, record: type, *, advantages: str) -> PolicyLossSpec:
    """Resolve `settings.policy_loss` for a step whose advantages are `advantages` and
    check its hyperparameters and inputs against `settings` (a `record`): one
    `ValueError` line naming the field, the `loss_kwargs` entry or the hyperparameter."""
    name = settings.policy_loss
    if isinstance(name, str) and name not in policy_loss_names(advantages):
        own = policy_loss_names(advantages)
        if name in policy_loss_names():
            step = "GRPO (one advantage per completion)" if advantages == "token" else "PPO"
            raise ValueError(
                f"policy_loss={name!r}: must be one of {', '.join(own)} ({name!r} is for {step})"
            )
        check_choice("policy_loss", name, own)
    spec = resolve_policy_loss(name, advantages=advantages)
    policy_hyperparameters(spec, settings, record)
    if "ref_logp" in spec.inputs() and advantages == "token":
        raise ValueError(
            f"policy_loss={spec.name} takes ref_logp: the PPO step has no reference "
            "log-probabilities (its KL is in the rewards)"
        )
    return spec


def check_loss_reads(
    settings: Any, spec: PolicyLossSpec, field: str, inert: object, advantages: str
) -> None:
    """Refuse `settings.<field>` set away from `inert` when the loss does not read it."""
    value = getattr(settings, field)
    if value == inert or field in spec.parameters():
        return
    takers = [
        n for n in policy_loss_names(advantages) if field in resolve_policy_loss(n).parameters()
    ]
    raise ValueError(
        f"{field}={value!r}: applies to policy_loss {_named(takers)} only, not {spec.name}"
    )


def policy_loss_takes(policy_loss: object, *, advantages: str) -> tuple[str, ...]:
    """The hyperparameters `policy_loss` takes by name (none known for a loss that takes
    any keyword)."""
    spec = resolve_policy_loss(policy_loss, advantages=advantages)
    return () if spec.takes_any_keyword() else tuple(spec.hyperparameters())


def policy_hyperparameters(spec: PolicyLossSpec, settings: Any, record: type) -> dict[str, Any]:
    """The keyword arguments of `spec.fn`: `loss_kwargs` (with a subclass's fields the
    loss takes, `loss_kwargs_with_fields`), then the fields of `record` (the settings
    class) by name; a hyperparameter with neither and no default is refused."""
    kwargs = dict(loss_kwargs_with_fields(record, settings) or {})
    fields = {f.name for f in dataclasses.fields(record)} - set(_NOT_HYPERPARAMETERS)
    wanted = spec.hyperparameters()
    for name in kwargs:
        if name in fields:
            raise ValueError(
                f"loss_kwargs {name!r} is a field of {record.__name__}: set the field instead "
                "(the loss reads it), or rename the loss's hyperparameter if it means "
                "something else"
            )
        if name in POLICY_LOSS_INPUTS:
            raise ValueError(f"loss_kwargs {name!r} is a step input, not a hyperparameter")
        if name not in wanted and not spec.takes_any_keyword():
            raise ValueError(
                f"loss_kwargs {name!r} is not a hyperparameter of policy_loss={spec.name} "
                f"(it takes {sorted(wanted) or 'none'})"
            )
    out = dict(kwargs)
    for name, param in wanted.items():
        if name in out:
            continue
        if name in fields:
            out[name] = getattr(settings, name)
        elif param.default is param.empty:
            raise ValueError(
                f"policy_loss={spec.name} takes the hyperparameter {name!r}, which has no "
                f"default: give it in loss_kwargs (or name a field of {record.__name__})"
            )
    return out


def _zero_masked(x: Array | None, mask: Array) -> Array | None:
    return None if x is None else jnp.where(mask, x, jnp.zeros_like(x))


def make_policy_loss(
    settings: Any, record: type, *, advantages: str, axis_name: str | None
) -> PolicyTokenLoss:
    """The per-token loss of `settings.policy_loss` on `[B, T]` arrays:
    `loss(logp, old_logp, advantages, mask, entropy, ref_logp, key) -> (per_token, stats)`,
    0 where `mask` is false, with `stats` the loss's own (no KL term: the step adds it).
    `advantages` are `[B]` (`"sequence"`, GRPO) or `[B, T]` (`"token"`, PPO)."""
    spec = policy_loss_spec(settings, record, advantages=advantages)
    hyper = policy_hyperparameters(spec, settings, record)
    wants = spec.inputs()

    def loss(logp, old_logp, adv, m, ent, ref_logp, key: PRNGKeyArray | None):
        if "ref_logp" in wants and ref_logp is None:
            raise ValueError(
                f"policy_loss={spec.name} takes ref_logp: give batch.ref_logp or the step's "
                "`reference=` model"
            )
        k = None if key is None else jax.random.fold_in(key, _LOSS_STREAM)
        # The batch's per-token inputs are zeroed where masked: a NaN / inf there (e.g. in
        # padding) would otherwise reach the gradient through the loss's products, since
        # masking the loss afterwards multiplies the NaN by a zero cotangent.
        old_logp, ref_logp = (_zero_masked(x, m) for x in (old_logp, ref_logp))
        if jnp.ndim(adv) == m.ndim:
            adv = _zero_masked(adv, m)
        inputs = {"ref_logp": ref_logp, "entropy": ent, "key": k}
        if spec.batch:
            kw = {n: inputs[n] for n in wants if n != "axis_name"}
            if "axis_name" in wants:
                kw["axis_name"] = axis_name
            out = spec.fn(logp, old_logp, adv, m, **kw, **hyper)
        else:
            if k is not None and "key" in wants:
                inputs["key"] = jax.random.split(k, logp.shape[0])
            rows = {n: inputs[n] for n in wants if n != "axis_name"}
            static = {"axis_name": axis_name} if "axis_name" in wants else {}
            mapped = {n: v for n, v in rows.items() if v is not None}
            nones = {n: None for n, v in rows.items() if v is None}

            def one(lp, olp, a, mi, row):
                return spec.fn(lp, olp, a, mi, **row, **nones, **static, **hyper)

            out = jax.vmap(one)(logp, old_logp, adv, m, mapped)
        per_token, stats = per_token_output(spec, out, logp)
        zero = jnp.zeros_like(per_token)
        stats = {k_: jnp.where(m, jnp.asarray(v), zero) for k_, v in stats.items()}
        return jnp.where(m, per_token, zero), stats

    return loss


def read_policy_loss(settings: Any) -> object:
    """The `policy_loss` a settings record names, resolved to its function, as part of a
    build's cache key (`user_function_key`): re-registering a name must not reuse a build
    of the old loss, and a closure is not cached."""
    name = settings.policy_loss
    if isinstance(name, str) and name in _BUILTIN_NAMES:  # never registered again
        return name
    return user_function_key(resolve_policy_loss(name).fn)
