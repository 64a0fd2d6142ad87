"""Users' DPO-family losses: `register_dpo_loss` adds one by name, and `resolve_dpo_loss`
turns a `loss_type` (a built-in name, a registered name or a callable) into the
`LossSpec` that `dpo_loss` / `dpo_batch_loss` and `make_dpo_step` use."""

import inspect
import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array

from ._dpo_losses import DPO_LOSS_TYPES, DPO_LOSSES, DPOLossFn, LogpPair, LossSpec
from ._validation import (
    Hyperparameter,
    callable_name,
    check_choice,
    check_registered_name,
    is_python_number,
)

_REGISTERED: dict[str, LossSpec] = {}
_BUILTIN_KWARGS = ("bco_delta", "discopop_tau", "simpo_gamma")
_SIGNATURE = "fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, *, beta, **kw)"


LENGTH_ARGUMENTS: tuple[str, ...] = ("chosen_len", "rejected_len")
"""The completion lengths a custom DPO-family loss receives when it declares them."""


def _parameters(fn: object) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return None


def declared_lengths(fn: object) -> tuple[str, ...]:
    """The `LENGTH_ARGUMENTS` that `fn` names as parameters (passed only then)."""
    params = _parameters(fn) or {}
    return tuple(n for n in LENGTH_ARGUMENTS if n in params)


def _check_callable(
    fn: object,
    what: str,
    loss_kwargs: Mapping[str, Any] | None = None,
    *,
    complete: bool = True,
    label: str | None = None,
) -> None:
    """Refuse `fn` unless it can be called as a `DPOLossFn` with `loss_kwargs` (and its
    declared lengths); with `complete=False` (at registration) hyperparameters without a
    default may still be missing: `loss_kwargs` gives them later. Errors name it
    `what=label` (default: the function's name)."""
    if not callable(fn):
        raise ValueError(f"{what} must be a callable {_SIGNATURE}, got {fn!r}")
    params = _parameters(fn)
    label = callable_name(fn) if label is None else label
    if params is None:
        return
    kwargs = {"beta": 1.0, **{n: 1.0 for n in declared_lengths(fn)}, **dict(loss_kwargs or {})}
    signature = inspect.Signature(list(params.values()))
    try:
        (signature.bind if complete else signature.bind_partial)(0.0, 0.0, 0.0, 0.0, **kwargs)
    except TypeError as e:
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        firsts = [n for n, p in params.items() if p.kind in positional][:4]
        missing = [
            n
            for n, p in params.items()
            if p.default is p.empty
            and p.kind in (*positional, inspect.Parameter.KEYWORD_ONLY)
            and n not in kwargs
            and n not in firsts
        ]
        if missing and len(firsts) == 4:
            raise ValueError(
                f"{what}={label} takes the hyperparameter {missing[0]!r}, which has "
                "no default: give it in loss_kwargs"
            ) from None
        why = str(e)
        kinds = {p.kind for p in params.values()}
        if len(firsts) < 4 and inspect.Parameter.VAR_POSITIONAL not in kinds:
            why = f"it takes {len(firsts)} positional arguments"
        elif "beta" not in params and inspect.Parameter.VAR_KEYWORD not in kinds:
            why = "it takes no `beta` (declare it, even unused)"
        elif "unexpected keyword" in why:
            own = _hyperparameter_names(fn)
            why += f" (its hyperparameters: {', '.join(own) if own else 'none'})"
        raise ValueError(
            f"{what}={label} cannot be called as {_SIGNATURE}"
            + (f" with loss_kwargs {sorted(loss_kwargs)}" if loss_kwargs else "")
            + f": {why}"
        ) from None


def register_dpo_loss(
    name: str, fn: DPOLossFn, *, length_normalised: bool = False, reference_free: bool = False
) -> DPOLossFn:
    r"""Add a per-pair DPO-family loss under `name`, usable wherever a `loss_type` is.

    Once registered, `loss_type=name` works in `dpo_loss`, `dpo_batch_loss`,
    `rlhf_eqx.train.make_dpo_step` / `dpo_loss_fn` and the pipelines' `dpo.loss_type`
    (a configuration is validated against `dpo_loss_types()`), in this process. Passing
    `fn` itself as `loss_type` does the same without a name (with both flags off).
    Keyword names of the built-in losses (`bco_delta`, `discopop_tau`, `simpo_gamma`)
    are not available to a custom loss.

    **The loss** is called once per pair (batches go through `jax.vmap`) as

    ```python
    fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, *, beta, **loss_kwargs)
        -> Float[Array, ""]
    ```

    with the policy's and the reference's sequence log-probabilities $\log\pi(y|x)$ of
    the chosen and rejected completions (scalars; the reference ones are 0 without a
    reference: `reference="none"`, `reference_free=True` or a `reference_free` loss),
    the temperature `beta` (a Python number or a JAX scalar, traced under a sweep) and
    the step's `loss_kwargs` (e.g. a margin), and returns the pair's loss, a float
    scalar (refused otherwise, naming `loss_type`). `label_smoothing` and the built-in
    losses' `bco_delta` / `discopop_tau` / `simpo_gamma` are not passed: a custom loss
    takes its own hyperparameters from `loss_kwargs`: one without a default must be
    given there (refused otherwise, naming it, when the settings are built), and its
    value may be a JAX array (traced: a change does not recompile). A loss that declares
    the parameters `chosen_len` / `rejected_len` also receives the completions' token
    counts (float scalars), unchanged by `length_normalised`. The DPO
    step averages the losses over the pairs and logs the usual metrics (`rewards/*` with
    the same `beta`).

    For instance IPO (Azar et al. 2023, eq. 17), $(\bar u - \frac{1}{2\beta})^2$:

    ```python
    def ipo(c, r, rc, rr, *, beta):
        return jnp.square((c - r) - (rc - rr) - 1.0 / (2.0 * beta))

    register_dpo_loss("my_ipo", ipo, length_normalised=True)
    ```

    or length-regularised DPO (R-DPO, Park et al. 2024, "Disentangling Length from
    Quality in Direct Preference Optimization"; the optimum of the RLHF objective with
    the reward $r - \alpha|y|$),
    $-\log\sigma\big(\beta u + \alpha(|y_w| - |y_l|)\big)$, with $\alpha$ from
    `loss_kwargs={"alpha": ...}`:

    ```python
    def r_dpo(c, r, rc, rr, *, beta, alpha, chosen_len, rejected_len):
        u = (c - r) - (rc - rr)
        return -jax.nn.log_sigmoid(beta * u + alpha * (chosen_len - rejected_len))

    register_dpo_loss("r_dpo", r_dpo)
    ```

    **Arguments:**

    - `name`: the `loss_type` name; a built-in name (`DPO_LOSS_TYPES`) is refused, a name
      registered before is replaced.
    - `fn`: the loss (a `DPOLossFn`, as above).
    - `length_normalised`: pass per-token averages (the log-probabilities divided by the
      completion lengths) instead of sums, as `"ipo"` / `"simpo"` do.
    - `reference_free`: the loss uses no reference model (the step then runs none; the
      reference arguments are 0), as `"simpo"` / `"orpo"`.

    **Returns:** `fn`, unchanged.
    """
    check_registered_name(name, DPO_LOSSES, "loss_type")
    _check_callable(fn, "fn", complete=False)
    _REGISTERED[name] = LossSpec(
        None,
        length_normalised=bool(length_normalised),
        reference_free=bool(reference_free),
        custom=fn,
        name=repr(name),
    )
    return fn


def registered_dpo_loss(loss_type: object) -> object:
    """The function a registered `loss_type` name stands for now (`None` for a built-in
    name or a callable): part of a step's cache key, so that a name registered again
    never reuses a build of the loss it replaced."""
    spec = _REGISTERED.get(loss_type) if isinstance(loss_type, str) else None
    return None if spec is None else spec.custom


def _check_name(loss_type: str) -> None:
    """A `loss_type` name is one of `dpo_loss_types()`; a list of them (TRL's
    `loss_type=[...]` with `loss_weights`) is refused with what stands for it here."""
    names = [n for n in re.split(r"[\s,\[\]()'\"]+", loss_type) if n]
    if len(names) > 1 and loss_type not in dpo_loss_types():
        sft = "; TRL's 'sft' term is rpo_alpha" if "sft" in names else ""
        raise ValueError(
            f"{names} is a list: one loss_type per run (a weighted sum of losses, TRL's "
            "loss_type list with loss_weights, is one custom loss_type: register it with "
            f"rlhf_eqx.losses.register_dpo_loss{sft})"
        )
    check_choice("loss_type", loss_type, dpo_loss_types())


def dpo_loss_types() -> tuple[str, ...]:
    """Every valid `loss_type` name now: `DPO_LOSS_TYPES`, then the registered ones."""
    return DPO_LOSS_TYPES + tuple(_REGISTERED)


def dpo_loss_hyperparameters(loss_type: object) -> tuple[str, ...]:
    """The hyperparameters a DPO-family `loss_type` takes from `loss_kwargs`: a built-in
    loss's `bco_delta`, `discopop_tau`, `simpo_gamma`; a custom one's keyword parameters
    after its four log-probabilities, but `beta` and the `LENGTH_ARGUMENTS` (which the
    step passes itself). A `ValueError` names an unknown `loss_type`."""
    if isinstance(loss_type, str):
        _check_name(loss_type)
        custom = None if loss_type in DPO_LOSSES else _REGISTERED[loss_type].custom
    elif callable(loss_type):
        custom = loss_type
    else:
        raise ValueError(f"loss_type must be a name in {dpo_loss_types()} or a callable")
    if custom is None:
        return _BUILTIN_KWARGS
    return _hyperparameter_names(custom)


def _hyperparameter_names(fn: object) -> tuple[str, ...]:
    """A custom loss's keyword parameters after its four log-probabilities, but `beta`
    and the `LENGTH_ARGUMENTS`."""
    params = list((_parameters(fn) or {}).values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    arrays = {p.name for p in [p for p in params if p.kind in positional][:4]}
    skip = arrays | {"beta", *LENGTH_ARGUMENTS}
    var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return tuple(p.name for p in params if p.kind not in var and p.name not in skip)


def resolve_dpo_loss(
    loss_type: object,
    *,
    loss_kwargs: Mapping[str, Any] | None = None,
    label_smoothing: object = 0.0,
) -> LossSpec:
    """The `LossSpec` of a `loss_type` (a name or a `DPOLossFn`), with a `ValueError`
    naming `loss_type` for an unknown name or a callable that cannot take `loss_kwargs`.
    A built-in loss takes only the one of `bco_delta`, `discopop_tau`, `simpo_gamma` it
    reads (`dpo_loss_hyperparameters`; another of them, which it would ignore, is a
    `ValueError` naming `loss_kwargs` and the loss that reads it; an unknown name a
    `TypeError`, as an unknown keyword); a custom one takes any but those, and no
    `label_smoothing` other than 0. (`label_smoothing` itself is not checked against a
    built-in loss here: `make_dpo_step` refuses it for a loss without label smoothing,
    `LossSpec.reads`.)"""
    if isinstance(loss_type, str):
        _check_name(loss_type)
        spec = DPO_LOSSES.get(loss_type) or _REGISTERED[loss_type]
    elif callable(loss_type):
        spec = LossSpec(None, custom=loss_type, name=callable_name(loss_type))
    else:
        raise ValueError(
            f"loss_type must be a name in {dpo_loss_types()} or a callable {_SIGNATURE}, "
            f"got {loss_type!r}"
        )
    names = set(loss_kwargs or {})
    if spec.custom is None:
        own = [n for n in spec.reads if n in _BUILTIN_KWARGS]
        if names - set(_BUILTIN_KWARGS):
            raise TypeError(
                f"loss_kwargs={dict(loss_kwargs or {})!r}: loss_type={loss_type!r} takes no "
                f"keyword arguments {sorted(names - set(_BUILTIN_KWARGS))} (its own: "
                f"{', '.join(own) if own else 'none'}; only a custom loss_type receives others)"
            )
        unread = sorted(names - set(spec.reads))
        if unread:
            readers = {
                n: ", ".join(repr(t) for t, sp in DPO_LOSSES.items() if n in sp.reads)
                for n in unread
            }
            raise ValueError(
                f"loss_kwargs={dict(loss_kwargs or {})!r}: loss_type={loss_type!r} does not "
                f"read {', '.join(f'{n} (read by {readers[n]})' for n in unread)}; its own "
                f"keyword arguments: {', '.join(own) if own else 'none'}"
            )
        return spec
    if names & set(LENGTH_ARGUMENTS):
        raise ValueError(
            f"loss_kwargs {sorted(names & set(LENGTH_ARGUMENTS))} are the completion lengths, "
            f"which a custom loss_type ({spec.name}) receives by declaring them; rename them"
        )
    if names & set(_BUILTIN_KWARGS):
        raise ValueError(
            f"loss_kwargs {sorted(names & set(_BUILTIN_KWARGS))} are the built-in losses' "
            f"hyperparameters and never reach a custom loss_type ({spec.name}); rename them"
        )
    _check_callable(spec.custom, "loss_type", loss_kwargs, label=spec.name)
    if not (is_python_number(label_smoothing) and label_smoothing == 0.0):
        raise ValueError(
            f"label_smoothing={label_smoothing!r} is not passed to a custom loss_type "
            f"({spec.name}); give it its hyperparameters in loss_kwargs"
        )
    return spec


def call_custom_loss(
    spec: LossSpec,
    pair: LogpPair,
    beta: Hyperparameter,
    loss_kwargs: Mapping[str, Any],
    chosen_len: Any = None,
    rejected_len: Any = None,
) -> Array:
    """A custom loss of one pair, its output checked: one float scalar. The completion
    lengths are passed when the loss declares `chosen_len` / `rejected_len`."""
    lengths = {"chosen_len": chosen_len, "rejected_len": rejected_len}
    wanted = {n: lengths[n] for n in declared_lengths(spec.custom)}
    if any(v is None for v in wanted.values()):
        raise ValueError(
            f"loss_type={spec.name} takes {sorted(wanted)}: pass chosen_len and rejected_len "
            "(the completions' token counts)"
        )
    wanted = {n: jnp.asarray(v) for n, v in wanted.items()}
    out = spec.custom(
        pair.chosen,
        pair.rejected,
        pair.ref_chosen,
        pair.ref_rejected,
        beta=beta,
        **wanted,
        **loss_kwargs,
    )
    shape, dtype = jnp.shape(out), jnp.result_type(out)
    if shape != () or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"loss_type={spec.name} must return one float loss per pair (shape ()), got "
            f"shape {shape} and dtype {dtype}"
        )
    return jnp.asarray(out)
