"""`check_loss_matches`: a user's loss against a library loss of the same registry (the
DPO family of `register_dpo_loss`, the per-token policy losses of `register_policy_loss`)
on shared random inputs, values and gradients."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..losses import (
    dpo_batch_loss,
    dpo_loss_types,
    policy_loss_names,
    resolve_dpo_loss,
    resolve_policy_loss,
)
from ..train import GRPOSettings, PPOSettings, make_policy_loss

REGISTRIES: tuple[str, ...] = ("dpo", "policy")
"""The registries `check_loss_matches` compares in."""
# Input kinds: ordinary values, extreme log-probabilities (log-ratios beyond any clamp),
# ties (policy equal to the reference / chosen equal to rejected) and degenerate masks.
_DPO_KINDS = ("ordinary", "extreme", "ties")
_POLICY_KINDS = ("ordinary", "extreme", "padded", "one-token", "all-masked")
# How a mismatch message names the inputs at the differing entry.
_DPO_INPUT_NAMES = (
    "chosen_logp",
    "rejected_logp",
    "ref_chosen_logp",
    "ref_rejected_logp",
    "chosen_len",
    "rejected_len",
)
_POLICY_INPUT_NAMES = ("logp", "old_logp", "advantages", "mask")


def _which(library_loss: object, registry: str | None) -> str:
    if registry is not None:
        if registry not in REGISTRIES:
            raise ValueError(f"registry={registry!r}: must be one of {', '.join(REGISTRIES)}")
        return registry
    if not isinstance(library_loss, str):
        raise ValueError("library_loss is not a name: say which registry, registry='dpo'|'policy'")
    tables = (("dpo", dpo_loss_types()), ("policy", policy_loss_names()))
    found = [r for r, names in tables if library_loss in names]
    if not found:
        raise ValueError(
            f"library_loss={library_loss!r} is not a loss name: DPO losses are "
            f"{', '.join(dpo_loss_types())}; policy losses are {', '.join(policy_loss_names())}"
        )
    if len(found) > 1:
        raise ValueError(
            f"library_loss={library_loss!r} names a DPO loss and a policy loss: pass "
            "registry='dpo' or registry='policy'"
        )
    return found[0]


def _default_settings(*losses: object) -> GRPOSettings | PPOSettings:
    """The settings of a policy-loss comparison when none are given: PPO's when one of
    the losses takes per-token advantages only (as `"ppo"`), else GRPO's."""
    token_only = set(policy_loss_names("token")) - set(policy_loss_names("sequence"))
    if any(isinstance(loss, str) and loss in token_only for loss in losses):
        return PPOSettings()
    return GRPOSettings(group_size=1)


def _name(loss: object) -> str:
    return repr(loss) if isinstance(loss, str) else getattr(loss, "__qualname__", repr(loss))


def _inputs_at(names: tuple[str, ...], arrays: tuple[Any, ...], at: tuple[int, ...]) -> str:
    """`name=value` of each input at entry `at` (an input with fewer axes, as a per-row
    advantage, at its leading indices), for a mismatch message."""
    parts = []
    for name, x in zip(names, arrays):
        x = np.asarray(x)
        value = x[at[: x.ndim]]
        parts.append(f"{name}={value.item() if value.ndim == 0 else value.tolist()!r}")
    return ", ".join(parts)


def _mismatch(
    what: str,
    kind: str,
    i: int,
    got: np.ndarray,
    want: np.ndarray,
    rtol: float,
    atol: float,
    inputs: tuple[tuple[str, ...], tuple[Any, ...]] | None = None,
) -> None:
    """Raise `AssertionError` naming the first differing entry and, with `inputs`
    (`(names, arrays)`), the inputs there (or return when close)."""
    if got.shape != want.shape:
        raise AssertionError(
            f"{what} on {kind} inputs (example {i}): shape {got.shape} vs {want.shape}"
        )
    close = np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    if close.all():
        return
    at = tuple(int(k) for k in np.argwhere(~close)[0])
    where = "" if inputs is None else f" (inputs there: {_inputs_at(*inputs, at)})"
    raise AssertionError(
        f"{what} on {kind} inputs (example {i}) differ at {at}: user {got[at]!r}, library "
        f"{want[at]!r}{where} ({int((~close).sum())} of {close.size} entries differ)"
    )


def _dpo_inputs(rng: np.random.Generator, kind: str, batch: int):
    if kind == "extreme":
        draw = lambda: (
            -rng.choice([0.0, 1e-3, 1.0, 1e2, 1e4], size=batch) * rng.uniform(0.5, 1.0, batch)
        )
    else:
        draw = lambda: -rng.uniform(0.0, 60.0, batch)
    c, r, rc, rr = draw(), draw(), draw(), draw()
    if kind == "ties":
        half = np.arange(batch) % 2 == 0
        rc, rr = np.where(half, c, rc), np.where(half, r, rr)  # policy == reference
        r, rr = np.where(~half, c, r), np.where(~half, rc, rr)  # chosen == rejected
    lengths = rng.integers(1, 65, size=(2, batch)).astype(np.float32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return [f32(x) for x in (c, r, rc, rr)], f32(lengths[0]), f32(lengths[1])


def _other_beta(beta: float) -> float:
    """A second temperature for the DPO comparison: 4 x `beta` (`beta` / 4 above 1), so a
    loss that ignores `beta` (a number written into it instead) cannot match."""
    return beta / 4.0 if beta > 1.0 else 4.0 * beta


def _check_dpo(user, library, user_kwargs, library_kwargs, beta, n_examples, seed, rtol, atol):
    _compare_dpo(user, library, user_kwargs, library_kwargs, beta, n_examples, seed, rtol, atol)
    other = _other_beta(beta)
    try:
        _compare_dpo(
            user, library, user_kwargs, library_kwargs, other, n_examples, seed, rtol, atol
        )
    except AssertionError as e:
        raise AssertionError(
            f"at beta={other!r} (they agree at beta={beta!r}: does the loss use its `beta` "
            f"argument?), {e}"
        ) from None


def _compare_dpo(user, library, user_kwargs, library_kwargs, beta, n_examples, seed, rtol, atol):
    def losses_and_grads(loss_type, kwargs, logps, cl, rl):
        def total(lp):
            out = dpo_batch_loss(
                *lp, beta=beta, loss_type=loss_type, chosen_len=cl, rejected_len=rl, **kwargs
            )
            return jnp.sum(out), out

        (_, out), grads = jax.value_and_grad(total, has_aux=True)(logps)
        return out, grads

    rng = np.random.default_rng(seed)
    for i in range(n_examples):
        kind = _DPO_KINDS[i % len(_DPO_KINDS)]
        logps, cl, rl = _dpo_inputs(rng, kind, batch=8)
        got, g_got = losses_and_grads(user, user_kwargs, logps, cl, rl)
        want, g_want = losses_and_grads(library, library_kwargs, logps, cl, rl)
        inputs = (_DPO_INPUT_NAMES, (*logps, cl, rl))
        _mismatch("per-pair losses", kind, i, np.asarray(got), np.asarray(want), rtol, atol, inputs)
        for name, a, b in zip(("chosen", "rejected"), g_got, g_want):
            _mismatch(
                f"gradients w.r.t. the {name} log-probs",
                kind,
                i,
                np.asarray(a),
                np.asarray(b),
                rtol,
                atol,
                inputs,
            )


def _dpo_flags_differ(user: object, library: object) -> str:
    """A hint for a DPO mismatch: the registration flags in which the two losses differ
    (a loss registered without `length_normalised=True` against `"ipo"`, say)."""
    try:
        u, lib = resolve_dpo_loss(user), resolve_dpo_loss(library)
    except (TypeError, ValueError):
        return ""
    what = {
        "length_normalised": "takes per-token averages (length_normalised)",
        "reference_free": "runs without a reference (reference_free)",
    }
    notes = [
        f"{_name(user) if getattr(u, flag) else _name(library)} {text}, "
        f"{_name(library) if getattr(u, flag) else _name(user)} does not"
        for flag, text in what.items()
        if getattr(u, flag) != getattr(lib, flag)
    ]
    return f" (note: {'; '.join(notes)})" if notes else ""


def _policy_inputs(rng: np.random.Generator, kind: str, B: int, T: int, token_advantages: bool):
    old = -rng.uniform(0.05, 5.0, (B, T))
    spread = 30.0 if kind == "extreme" else 0.4
    logp = old + rng.uniform(-spread, spread, (B, T))
    if kind == "extreme":
        # log-ratios far below and far above the ±20 clamp: the policy or the old policy
        # at -1e4 where the other is an ordinary log-probability
        logp = np.where(rng.random((B, T)) < 0.3, -1e4, np.minimum(logp, 0.0))
        old = np.where((rng.random((B, T)) < 0.3) & (logp > -1e3), -1e4, old)
    mask = rng.random((B, T)) < 0.7
    if kind == "padded":
        mask = np.arange(T)[None, :] < rng.integers(0, T + 1, (B, 1))
    elif kind == "one-token":
        mask = np.arange(T)[None, :] == rng.integers(0, T, (B, 1))
    elif kind == "all-masked":
        mask = np.zeros((B, T), bool)
    mask[0] = False  # a fully masked row in every batch
    adv_shape = (B, T) if token_advantages else (B,)
    adv = rng.normal(0.0, 1.0, adv_shape) * (rng.random(adv_shape) > 0.2)
    entropy = rng.uniform(0.0, 3.0, (B, T))
    ref = logp + rng.normal(0.0, 0.3, (B, T))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return f32(logp), f32(old), f32(adv), jnp.asarray(mask), f32(entropy), f32(ref)


def _check_policy(
    user, library, user_kwargs, library_kwargs, settings, n_examples, seed, rtol, atol
):
    if settings is None:
        settings = _default_settings(library, user)
    record = GRPOSettings if isinstance(settings, GRPOSettings) else PPOSettings
    if not isinstance(settings, (GRPOSettings, PPOSettings)):
        raise ValueError(f"settings={settings!r}: must be a GRPOSettings or a PPOSettings")
    advantages = "sequence" if record is GRPOSettings else "token"
    _compare_policy(
        user, library, user_kwargs, library_kwargs, settings, record, n_examples, seed, rtol, atol
    )
    asymmetric = _asymmetric_clip(user, library, settings, advantages)
    if asymmetric is not None:
        try:
            _compare_policy(
                user,
                library,
                user_kwargs,
                library_kwargs,
                asymmetric,
                record,
                n_examples,
                seed,
                rtol,
                atol,
            )
        except AssertionError as e:
            raise AssertionError(
                f"under an asymmetric clip, clip_eps_high={asymmetric.clip_eps_high!r} "
                f"(clip_eps={asymmetric.clip_eps!r}; the settings' clip_eps_high="
                f"{settings.clip_eps_high!r} clips both sides alike), {e}"
            ) from None
    other = _other_clip_eps(user, library, settings, advantages)
    if other is not None:
        try:
            _compare_policy(
                user, library, user_kwargs, library_kwargs, other, record, n_examples, seed,
                rtol, atol,
            )  # fmt: skip
        except AssertionError as e:
            raise AssertionError(
                f"at clip_eps={other.clip_eps!r} (they agree at the settings' clip_eps="
                f"{settings.clip_eps!r}: does the loss use its `clip_eps` argument?), {e}"
            ) from None


def _other_clip_eps(user, library, settings, advantages):
    """`settings` with `clip_eps` halved (the upper clip kept where it is set) when both
    losses read `clip_eps` and it is a positive Python number, so a loss that declares
    the clip but writes its own number in fails; `None` when there is nothing to vary."""
    if not all(_reads(loss, "clip_eps", advantages) for loss in (user, library)):
        return None
    eps = settings.clip_eps
    if isinstance(eps, bool) or not isinstance(eps, int | float) or eps <= 0:
        return None
    return dataclasses.replace(settings, clip_eps=round(0.5 * eps, 6))


def _reads(loss: object, name: str, advantages: str) -> bool:
    try:
        spec = resolve_policy_loss(loss, advantages=advantages)
    except (TypeError, ValueError):
        return False
    return name in spec.parameters()


def _asymmetric_clip(user, library, settings, advantages):
    """`settings` with `clip_eps_high` 1.5 x `clip_eps` when both losses read
    `clip_eps_high` and `settings` clip both sides alike (`None` or `clip_eps`), so a loss
    that declares the upper clip but ignores it is seen; `None` when there is nothing to
    add."""
    if not all(_reads(loss, "clip_eps_high", advantages) for loss in (user, library)):
        return None
    high = settings.clip_eps_high
    if high is not None and not bool(np.all(np.asarray(high) == np.asarray(settings.clip_eps))):
        return None
    eps = settings.clip_eps
    high = round(1.5 * eps, 6) if isinstance(eps, int | float) else 1.5 * eps
    return dataclasses.replace(settings, clip_eps_high=high)


def _compare_policy(
    user, library, user_kwargs, library_kwargs, settings, record, n_examples, seed, rtol, atol
):
    advantages = "sequence" if record is GRPOSettings else "token"

    def build(loss, kwargs):
        s = dataclasses.replace(settings, policy_loss=loss, loss_kwargs=dict(kwargs) or None)
        fn = make_policy_loss(s, record, advantages=advantages, axis_name=None)

        def total(lp, old, adv, m, ent, ref, key):
            per_token, _ = fn(lp, old, adv, m, ent, ref, key)
            return jnp.sum(per_token), per_token

        return jax.jit(jax.value_and_grad(total, has_aux=True))

    ours, theirs = build(user, user_kwargs), build(library, library_kwargs)
    rng = np.random.default_rng(seed)
    for i in range(n_examples):
        kind = _POLICY_KINDS[i % len(_POLICY_KINDS)]
        args = _policy_inputs(rng, kind, 4, 8, advantages == "token")
        key = jax.random.key(seed + i)
        (_, got), g_got = ours(*args, key)
        (_, want), g_want = theirs(*args, key)
        m = np.asarray(args[3])
        inputs = (_POLICY_INPUT_NAMES, args[:4])
        _mismatch(
            "per-token losses",
            kind,
            i,
            np.asarray(got) * m,
            np.asarray(want) * m,
            rtol,
            atol,
            inputs,
        )
        _mismatch(
            "gradients w.r.t. logp",
            kind,
            i,
            np.asarray(g_got),
            np.asarray(g_want),
            rtol,
            atol,
            inputs,
        )


def check_loss_matches(
    user_loss: str | Callable[..., Any],
    library_loss: str | Callable[..., Any],
    *,
    registry: str | None = None,
    user_kwargs: Mapping[str, Any] | None = None,
    library_kwargs: Mapping[str, Any] | None = None,
    beta: float = 0.1,
    settings: GRPOSettings | PPOSettings | None = None,
    n_examples: int = 15,
    seed: int = 0,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Check that a user's loss equals a library loss, values and gradients, on shared
    random inputs; raise `AssertionError` naming the first difference.

    Both losses go through the path a training step takes, so registration flags and
    hyperparameter resolution count:

    - **DPO family** (`registry="dpo"`; `register_dpo_loss`): per-pair losses of
      `dpo_batch_loss(..., beta=beta, loss_type=...)` with the completion lengths, and
      their gradients w.r.t. the policy's chosen / rejected log-probabilities, on
      batches of 8 pairs: ordinary log-probabilities, extreme ones (down to -1e4, and
      exact zeros) and ties (policy equal to the reference, chosen equal to rejected),
      lengths 1..64; then again at a second temperature, 4 `beta` (`beta` / 4 when
      `beta` > 1), so that a loss that ignores its `beta` fails, the message naming it.
    - **policy losses** (`registry="policy"`; `register_policy_loss`): the per-token loss
      a GRPO step (`settings` a `GRPOSettings`) or PPO step (a `PPOSettings`) computes
      from `settings` with `policy_loss` replaced, and its gradient w.r.t. `logp`, on
      `[4, 8]` batches: ratios inside and outside the clip range, extreme
      log-probabilities (-1e4 for the policy or the old policy: log-ratios beyond the
      ±20 clamp on both sides), right-padded, one-token and fully masked rows and
      batches, zero advantages. Without `settings`: `PPOSettings()` when either loss
      takes per-token advantages only (`"ppo"`, a loss registered with
      `advantages="token"`), else `GRPOSettings(group_size=1)`. Entropies, reference
      log-probabilities and a key are given to losses that declare them; both losses
      get the same. When both losses read `clip_eps_high` and `settings` clip both
      sides alike (`clip_eps_high` `None` or `clip_eps`), they are compared again under
      an asymmetric clip, `clip_eps_high` = 1.5 `clip_eps`: a loss that declares the
      upper clip but ignores it fails, the message naming `clip_eps_high`. When both
      read `clip_eps`, they are compared again with it halved, so that a loss that
      writes its own clip in fails, the message naming `clip_eps`.

    **Arguments:**

    - `user_loss`, `library_loss`: names (built-in or registered) or callables.
    - `registry`: `"dpo"` or `"policy"`; `None` infers it from `library_loss`'s name.
    - `user_kwargs`, `library_kwargs`: each loss's `loss_kwargs` (its hyperparameters);
      for a built-in DPO loss, its keywords (`simpo_gamma`, ...).
    - `beta`: the DPO temperature; `settings`: the policy losses' settings (fields such
      as `clip_eps` are hyperparameters of the losses that name them; `None`: above).
    - `n_examples`, `seed`: how many batches, drawn from which seed (kinds in turn).
    - `rtol`, `atol`: the tolerance of `numpy.isclose` (NaN equals NaN).
    """
    user_kwargs, library_kwargs = dict(user_kwargs or {}), dict(library_kwargs or {})
    which = _which(library_loss, registry)
    try:
        if which == "dpo":
            _check_dpo(
                user_loss,
                library_loss,
                user_kwargs,
                library_kwargs,
                beta,
                n_examples,
                seed,
                rtol,
                atol,
            )
        else:
            _check_policy(
                user_loss,
                library_loss,
                user_kwargs,
                library_kwargs,
                settings,
                n_examples,
                seed,
                rtol,
                atol,
            )
    except ValueError as e:
        if "loss_kwargs" not in str(e):
            raise
        raise ValueError(
            f"{e} (check_loss_matches gives user_kwargs to {_name(user_loss)} and "
            f"library_kwargs to {_name(library_loss)} as their loss_kwargs)"
        ) from None
    except AssertionError as e:
        hint = _dpo_flags_differ(user_loss, library_loss) if which == "dpo" else ""
        raise AssertionError(
            f"{which} loss {_name(user_loss)} does not match {_name(library_loss)}: {e}{hint}"
        ) from None
