"""The public form of a step builder: a settings record, a `StepOptions` and shortcuts."""

import functools
import inspect
from collections.abc import Callable
from typing import Any

import optax

from ._settings import StepOptions, split_shortcuts
from ._step import Step
from ._step_cache import own_record


def step_builder(record: type) -> Callable[[Callable[..., Step]], Callable[..., Step]]:
    """Turn `build(optimizer, settings, options, *, ...) -> Step` into a public step builder

    ```python
    make_x_step(optimizer, settings=None, *, ..., options=None, **shortcuts) -> Step
    ```

    the form of every step builder of this package (`make_sft_step`, `make_dpo_step`,
    ...), `record` being the builder's settings record (e.g. `SFTSettings`) and `...`
    the keyword-only arguments of `build` itself, if any (PPO's `value_optimizer`).

    ```python
    @rx.train.step_builder(MySettings)
    def make_my_step(optimizer, settings: MySettings, options: rx.train.StepOptions):
        loss_fn = my_loss(settings)  # (params, frozen, batch, key) -> (nums, dens, metrics)
        return rx.train.make_step(loss_fn, optimizer, options, cache_key=("my", settings))
    ```

    **Arguments of the public builder:**

    - `optimizer`: an `optax.GradientTransformation`, e.g. from `make_optimizer`.
    - `settings`: a `record` (`None`: its defaults), or a config that inherits it (a
      pipeline's stage config): only the record's own fields count.
    - `options`: a `StepOptions` (`micro_batches`, `axis_name`, `donate`, `nonfinite`,
      `check_token_ids`: see `make_step`; `None`: its defaults).
    - `**shortcuts`: any field of either record as a keyword (`beta=0.2`,
      `micro_batches=2`), replacing the record's; with `settings` a subclass of the
      record, also its fields that its loss takes as hyperparameters (`margin=2.0`);
      another keyword is a `TypeError` naming every valid one.

    `build` receives the settings as a plain `record` with the shortcuts applied (so
    that `(name, settings)` is a `cache_key` for `make_step`: equal settings share one
    compiled program), the `StepOptions`, and its own keyword arguments as given. The
    public builder keeps `build`'s name and docstring (`functools.wraps`); its
    signature (`inspect.signature`, `help`) is the one above, with `optimizer`
    annotated `optax.GradientTransformation` unless `build` annotates it.

    **Returns:** the decorator.
    """

    def decorate(build: Callable[..., Step]) -> Callable[..., Step]:
        params = list(inspect.signature(build).parameters.values())
        own = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
        names = {p.name for p in own}
        required = [p.name for p in own if p.default is inspect.Parameter.empty]
        where = build.__name__

        @functools.wraps(build)
        def builder(optimizer, settings=None, *, options=None, **shortcuts):
            kwargs = {k: shortcuts.pop(k) for k in names & set(shortcuts)}
            missing = [repr(k) for k in required if k not in kwargs]
            if missing:
                raise TypeError(
                    f"{where}() missing required keyword-only argument(s): {', '.join(missing)}"
                )
            settings, options = split_shortcuts(record, settings, options, shortcuts, where=where)
            return build(optimizer, own_record(record, settings), options, **kwargs)

        kw = inspect.Parameter.KEYWORD_ONLY
        optimizer = params[0]
        if optimizer.annotation is inspect.Parameter.empty:
            optimizer = optimizer.replace(annotation=optax.GradientTransformation)
        builder.__signature__ = inspect.Signature(
            [
                optimizer,
                params[1].replace(annotation=record | None, default=None),
                *own,
                inspect.Parameter("options", kw, default=None, annotation=StepOptions | None),
                inspect.Parameter("shortcuts", inspect.Parameter.VAR_KEYWORD, annotation=Any),
            ],
            return_annotation=Step,
        )
        return builder

    return decorate
