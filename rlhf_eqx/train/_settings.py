r"""Typed hyperparameter records: one owner per setting.

Each step builder takes one record of its algorithm's settings and one `StepOptions`:

```python
settings = rx.train.DPOSettings(beta=0.1, loss_type="ipo")
step = rx.train.make_dpo_step(optimizer, settings, options=rx.train.StepOptions(micro_batches=2))
# the same step, with keyword shortcuts for any field of either record:
step = rx.train.make_dpo_step(optimizer, beta=0.1, loss_type="ipo", micro_batches=2)
```

A record is a frozen dataclass that validates itself when it is built: a bad value
raises one `ValueError` line naming the field, the value and the valid range or choices
(`beta=-0.1: must be > 0`). Its defaults are the only ones: the builders and the
pipeline's configs (which inherit these records, so `--set dpo.beta` is
`DPOSettings.beta`) read them from here; a field that is also a keyword of a per-sample
loss (`beta` of `rlhf_eqx.losses.dpo_loss`) defaults to the constant of
`rlhf_eqx.losses.defaults` that the loss names too (`DPO_BETA`), so each number is
written once. Numeric hyperparameters that a step allows
to be traced may be JAX arrays, including tracers under `jax.jit` / `jax.vmap` (a run
vmapped over β builds `DPOSettings(beta=b)` from a traced `b`); their values are not
checked. The records of PPO and GRPO are in `_rl_settings.py`.
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from jaxtyping import Array, Float

from ..losses import DPOLossFn, dpo_loss_hyperparameters, resolve_dpo_loss
from ..losses.defaults import (
    DPO_BETA,
    DPO_LABEL_SMOOTHING,
    DPO_LOSS_TYPE,
    REWARD_CENTER_COEF,
    REWARD_MARGIN,
)
from ._validation import (
    check_aggregation,
    check_choice,
    check_number,
    check_positive_int,
    loss_kwargs_with_fields,
)

NonFinite = Literal["skip", "raise"]
# The records annotate their choices as plain `str` (the valid values are in their
# docstrings and tuples below), so that a bad value gets the record's one-line error
# rather than the shape checker's report on the annotation.
NONFINITE_MODES: tuple[str, ...] = ("skip", "raise")
"""The values of `StepOptions.nonfinite`."""
SCHEDULES: tuple[str, ...] = ("cosine", "constant", "linear")
"""The values of `OptimizerSettings.schedule`."""
REFERENCE_MODES: tuple[str, ...] = ("model", "cached", "none")
"""The values of `DPOSettings.reference`."""

_record = dataclasses.dataclass(frozen=True, kw_only=True)


@_record
class StepOptions:
    """How a step runs, shared by every builder (see `make_step`).

    - `micro_batches`: split each (per-device) batch into this many micro-batches and
      accumulate; same loss and gradient as the full batch.
    - `axis_name`: the device axis of `jax.pmap` / `shard_map` the step runs under
      (`None`: one device, or `jax.jit` on a sharded mesh; such a step refuses to run
      inside `jax.pmap` / `shard_map`).
    - `donate`: donate `params` / `opt_state` (`None`: only through `TrainState.apply`).
    - `nonfinite`: `"skip"` a non-finite update (default) or `"raise"`.
    - `check_token_ids`: a vocabulary size; every integer array of the batch is checked
      to lie in `[0, vocab)` inside the step (`None`: no check).
    """

    micro_batches: int = 1
    axis_name: str | None = None
    donate: bool | None = None
    nonfinite: str = "skip"
    check_token_ids: int | None = None

    def __post_init__(self):
        check_positive_int("micro_batches", self.micro_batches)
        if self.axis_name is not None and not isinstance(self.axis_name, str):
            raise ValueError(f"axis_name={self.axis_name!r}: must be a string or None")
        if self.donate is not None and not isinstance(self.donate, bool):
            raise ValueError(f"donate={self.donate!r}: must be True, False or None")
        check_choice("nonfinite", self.nonfinite, NONFINITE_MODES)
        if self.check_token_ids is not None:
            check_positive_int("check_token_ids", self.check_token_ids)


@_record
class OptimizerSettings:
    r"""AdamW with a linear warmup, then a decay, after global-norm gradient clipping
    (see `make_optimizer` and `make_schedule`).

    - `learning_rate`: the peak learning rate, $> 0$ (may be a JAX array).
    - `warmup_ratio`: the fraction of the steps spent in the linear warmup, in $[0, 1)$.
    - `weight_decay`: decoupled weight decay, $\geq 0$ (may be a JAX array).
    - `max_grad_norm`: clip the gradient to this global norm, $> 0$ (`None`: no clipping).
    - `schedule`: `"cosine"`, `"linear"` or `"constant"` after the warmup.
    - `b1`, `b2`, `eps`: Adam's moment decays (in $[0, 1)$) and epsilon ($\geq 0$).
    """

    learning_rate: float | Float[Array, ""]
    warmup_ratio: float = 0.0
    weight_decay: float | Float[Array, ""] = 0.0
    max_grad_norm: float | None = 1.0
    schedule: str = "cosine"
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        check_number("learning_rate", self.learning_rate, low=0.0, low_open=True)
        check_number("warmup_ratio", self.warmup_ratio, low=0.0, high=1.0, high_open=True)
        check_number("weight_decay", self.weight_decay, low=0.0)
        check_number("max_grad_norm", self.max_grad_norm, low=0.0, low_open=True, allow_none=True)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_number("b1", self.b1, low=0.0, high=1.0, high_open=True)
        check_number("b2", self.b2, low=0.0, high=1.0, high_open=True)
        check_number("eps", self.eps, low=0.0)


@_record
class SFTSettings:
    """Supervised fine-tuning (`make_sft_step`): the aggregation `mode` of the token NLL
    over the completion tokens and its Dr.GRPO `constant` (see
    `rlhf_eqx.losses.aggregate_parts`; `"token-mean"` is TRL's `SFTTrainer`)."""

    mode: str = "token-mean"
    constant: float | None = None

    def __post_init__(self):
        check_aggregation(self.mode, self.constant)


@_record
class RewardSettings:
    r"""The Bradley-Terry reward model (`make_reward_step`): `margin` $m$ subtracted from
    each pair's score difference and `center_coef` $\lambda_c \geq 0$ (TRL
    `center_rewards_coefficient`)."""

    center_coef: float = REWARD_CENTER_COEF
    margin: float = REWARD_MARGIN

    def __post_init__(self):
        check_number("center_coef", self.center_coef, low=0.0)
        check_number("margin", self.margin)


@_record
class DPOSettings:
    r"""The DPO family (`make_dpo_step`; Rafailov et al. 2023, TRL `DPOConfig` defaults).

    - `beta`: $\beta > 0$, the strength of the implicit KL to the reference (may be a
      JAX array, traced under `jax.vmap` for a sweep).
    - `loss_type`: a name of `rlhf_eqx.losses.dpo_loss_types()` (built-in or registered
      with `register_dpo_loss`) or a user's per-pair loss (see `make_dpo_step`).
    - `label_smoothing`: in $[0, 0.5)$ (cDPO / robust DPO; built-in losses only).
    - `reference`: `"model"` (the step's `reference=` model), `"cached"` (the batch's
      reference log-probabilities) or `"none"` (reference-free).
    - `rpo_alpha`: weight $\geq 0$ of the chosen completions' NLL (RPO; `None`: none).
    - `loss_kwargs`: further keyword arguments of the loss (`bco_delta`, `discopop_tau`,
      `simpo_gamma`, or a custom loss's own).
    """

    beta: float | Float[Array, ""] = DPO_BETA
    loss_type: str | DPOLossFn = DPO_LOSS_TYPE
    label_smoothing: float | Float[Array, ""] = DPO_LABEL_SMOOTHING
    reference: str = "model"
    rpo_alpha: float | None = None
    loss_kwargs: Mapping[str, Any] | None = None

    def __post_init__(self):
        check_number("beta", self.beta, low=0.0, low_open=True)
        check_number("label_smoothing", self.label_smoothing, low=0.0, high=0.5, high_open=True)
        check_choice("reference", self.reference, REFERENCE_MODES)
        check_number("rpo_alpha", self.rpo_alpha, low=0.0, allow_none=True)
        if self.loss_kwargs is not None and not isinstance(self.loss_kwargs, Mapping):
            raise ValueError(f"loss_kwargs={self.loss_kwargs!r}: must be a mapping or None")
        # the loss's own rule: a known name, or a callable that takes `loss_kwargs`
        try:
            resolve_dpo_loss(
                self.loss_type,
                loss_kwargs=loss_kwargs_with_fields(DPOSettings, self),
                label_smoothing=self.label_smoothing,
            )
        except (ValueError, TypeError) as e:
            if re.match(r"[A-Za-z_]\w*=", str(e)):
                raise
            raise type(e)(f"loss_type={self.loss_type!r}: {e}") from None

    def _loss_hyperparameters(self) -> tuple[str, ...]:
        """What the loss takes from `loss_kwargs`; a subclass's field of such a name is
        passed to it (`loss_kwargs_with_fields`)."""
        return dpo_loss_hyperparameters(self.loss_type)


R = TypeVar("R")


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def shortcut_names(cls: type, settings: Any) -> tuple[str, ...]:
    """The fields a keyword shortcut may replace: those of the record `cls`, and, when
    `settings` is an instance of a subclass (a user's record with a field for their
    loss), the subclass's fields that its loss takes as hyperparameters (they reach the
    loss, `loss_kwargs_with_fields`)."""
    names = field_names(cls)
    takes = getattr(cls, "_loss_hyperparameters", None)
    if takes is None or not isinstance(settings, cls) or type(settings) is cls:
        return names
    hyper = set(takes(settings))
    return names + tuple(n for n in field_names(type(settings)) if n in hyper and n not in names)


def settings_from(
    cls: type[R], settings: R | None, shortcuts: Mapping[str, Any], *, where: str
) -> R:
    """`settings` (or `cls()`) with the keyword `shortcuts` replacing its fields
    (`shortcut_names`); an unknown keyword is a `TypeError` naming the valid ones."""
    names = shortcut_names(cls, settings)
    unknown = sorted(set(shortcuts) - set(names))
    if unknown:
        raise TypeError(
            f"{where}() got unexpected keyword argument(s) {unknown}; the fields of "
            f"{cls.__name__} are {', '.join(names)}"
        )
    if settings is None:
        required = [
            f.name
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [n for n in required if n not in shortcuts]
        if missing:
            raise TypeError(
                f"{where}() needs {', '.join(missing)} (a field of {cls.__name__} without a "
                f"default): pass it, or a {cls.__name__}"
            )
        return cls(**shortcuts)
    if not isinstance(settings, cls):
        got = type(settings).__name__
        what = "options" if cls is StepOptions else "settings"
        raise TypeError(f"{where}: {what} must be a {cls.__name__}, got {got}")
    return dataclasses.replace(settings, **shortcuts) if shortcuts else settings  # type: ignore[type-var]


def split_shortcuts(
    cls: type[R],
    settings: R | None,
    options: StepOptions | None,
    shortcuts: Mapping[str, Any],
    *,
    where: str,
) -> tuple[R, StepOptions]:
    """The settings record and the `StepOptions` of a builder called as
    `make_x_step(optimizer, settings, *, options, **shortcuts)`: each shortcut replaces
    the field of the record it names (`settings`' fields first); an unknown keyword is a
    `TypeError` naming every valid one."""
    names = shortcut_names(cls, settings)
    own, step = set(names), set(field_names(StepOptions))
    unknown = sorted(set(shortcuts) - own - step)
    if unknown:
        raise TypeError(
            f"{where}() got unexpected keyword argument(s) {unknown}; the fields of "
            f"{cls.__name__} are {', '.join(names)} and those of StepOptions "
            f"are {', '.join(field_names(StepOptions))}"
        )
    mine = {k: v for k, v in shortcuts.items() if k in own}
    theirs = {k: v for k, v in shortcuts.items() if k not in own}
    return (
        settings_from(cls, settings, mine, where=where),
        settings_from(StepOptions, options, theirs, where=where),
    )
