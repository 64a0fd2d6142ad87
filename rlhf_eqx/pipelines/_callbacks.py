"""Callbacks: user code hooked into a run (the `Callback` protocol, the `RunHandle` it
sees, and how the loop calls them).

A callback is any object with some of the methods of `Callback` (subclass it to get
no-ops for the others); every method is optional. The loop (`run_iterations`, and so
every stage) calls them in the order given:

- `on_start(run)`: once when the loop starts (`run.resumed` on resume);
- `on_step(run, step, metrics)`: after each completed iteration, `step` iterations
  done, `metrics` its last step record as host floats;
- `on_evaluate(run, step, results)`: after each periodic evaluation
  (`ops.eval_every`), and after the stage's held-out evaluation;
- `on_checkpoint(run, step, path)`: after each checkpoint is written;
- `on_stop(run, reason)`: once when the loop ends, `reason` one of `"done"`,
  `"kl_guard"`, `"diverged"` and `"callback"`.

A callback stops the run on its own criterion with `run.request_stop(reason)` from any
hook, or by returning `"stop"` from `on_step`: the loop ends after that iteration with
`stopped="callback"` and `stop_reason`, and writes a checkpoint marked stopped; resuming
continues from it, as TRL's `resume_from_checkpoint` does, unless a later stage of the
run has trained on its result (then it stays stopped). A callback that keeps state
gives `state_dict() -> dict` (JSON) and `load_state_dict(d)`: the state goes into every
checkpoint and comes back on resume.
An exception in a hook stops the run with a checkpoint of the last completed iteration
and raises `CallbackError`, one line naming the callback and the hook; resuming
continues from that checkpoint.
"""

import copy
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ._checkpoints import latest_checkpoint
from ._config import (
    ConfigError,
)
from ._metrics import MetricsLog

HOOKS = ("on_start", "on_step", "on_evaluate", "on_checkpoint", "on_stop")
"""The hooks a callback may have, in the order of a run."""

RESERVED_NAMES = ("stage", "iteration", "step", "eval", "callback", "after_loop", "event")
"""The fields of a record that `RunHandle.log_metrics` writes itself (or that make a
record an event): not names of a callback's values."""


class Callback:
    """The callback protocol: hooks into a run, each a no-op here. Subclass and
    override what you need (or give any object some of these methods); `run` is the
    `RunHandle` of the running stage.

    ```python
    class StopAtLoss(pl.Callback):
        def __init__(self, target):
            self.target = target

        def on_step(self, run, step, metrics):
            if metrics.get("loss", float("inf")) < self.target:
                run.request_stop(f"loss {metrics['loss']:.3f} < {self.target}")

    pl.run_pipeline(cfg, callbacks=[StopAtLoss(0.5)])
    ```

    Optional: `state_dict() -> dict` (JSON-serialisable) and `load_state_dict(state)`,
    for a callback whose state must survive an interruption (saved with every
    checkpoint, restored on resume), and `name` (default: the class name), the key of
    that state and the name in error messages.
    """

    def on_start(self, run: "RunHandle") -> None:
        """The loop starts (or resumes: `run.resumed`, `run.iteration` > 0)."""

    def on_step(self, run: "RunHandle", step: int, metrics: dict[str, float]) -> str | None:
        """Iteration `step - 1` completed (`step` iterations done: one optimiser step
        for SFT / reward / DPO / KTO, one rollout and its updates for PPO / GRPO /
        online DPO); `metrics` is its last step record as host floats, the rollout's
        numbers under `rollout/*`. Return `"stop"` to stop the run after it."""
        del run, step, metrics
        return None

    def on_evaluate(self, run: "RunHandle", step: int, results: dict) -> None:
        """A periodic evaluation after `step` iterations (`ops.eval_every`), or the
        stage's held-out evaluation after it ended (`results` as in `summary.json`)."""

    def on_checkpoint(self, run: "RunHandle", step: int, path: str) -> None:
        """The checkpoint after `step` iterations was written to `path`."""

    def on_stop(self, run: "RunHandle", reason: str) -> None:
        """The loop ended: `reason` is `"done"`, `"kl_guard"`, `"diverged"` or
        `"callback"` (then `run.stop_reason` says why)."""


class CallbackError(RuntimeError):
    """A callback's hook raised: one line naming the callback, the hook, the stage and
    the iteration, then the error. The run was stopped with a checkpoint of its last
    completed iteration (`checkpoint`), from which `--resume` continues."""

    def __init__(self, callback: str, hook: str, stage: str, step: int, error: BaseException):
        what = " ".join(str(error).split()) or "(no message)"
        super().__init__(
            f"callback {callback}.{hook} failed in {stage} after iteration {step}: "
            f"{type(error).__name__}: {what}"
        )
        self.callback, self.hook, self.stage, self.step = callback, hook, stage, step
        self.checkpoint: str | None = None


class RunHandle:
    """What a callback sees of the running stage, kept current by the loop.

    - `stage`, `num_iterations`; `iteration` (iterations completed), `steps`
      (optimiser steps taken), `state` (the loop's state: a `TrainState`, or a run's
      own state pytree holding one), `history` (a copy of this call's step records:
      changing it changes nothing of the run), `resumed`;
    - `log` (the stage's `MetricsLog`), `run_dir`, `checkpoint_dir`;
    - `policy()`: the current policy with LoRA merged (stages that train a policy:
      `has_policy`);
    - `log_metrics(values)`: write `values` to `metrics.jsonl` as an evaluation record
      of this iteration (`"eval": true, "callback": true`; kept or rewritten exactly on
      resume, left out of the step plots);
    - `request_stop(reason)`: stop after the current iteration (`stopped="callback"`,
      `stop_reason=reason`); `stop_reason` says whether one was requested.
    """

    def __init__(
        self,
        *,
        stage: str,
        num_iterations: int,
        log: MetricsLog,
        checkpoint_dir: str | None,
        state: Any,
        iteration: int = 0,
        steps: int = 0,
        resumed: bool = False,
        history: list[dict] | None = None,
        policy_of: Callable[[Any], Any] | None = None,
    ):
        self.stage = stage
        self.num_iterations = num_iterations
        self.log = log
        self.checkpoint_dir = checkpoint_dir
        self.state = state
        self.iteration = iteration
        self.steps = steps
        self.resumed = resumed
        self._history = [] if history is None else history
        self.stop_reason: str | None = None
        # set once the loop has ended (`on_stop`, the held-out `on_evaluate`): records
        # written then come after the last checkpoint and are written again on resume
        self.after_loop = False
        self._policy_of = policy_of

    @property
    def history(self) -> list[dict]:
        """This call's step records, a copy: the loop's own list (what a rollback keeps,
        the stage's summary) does not change with what a callback does to it."""
        return [dict(record) for record in self._history]  # flat records of numbers

    @property
    def run_dir(self) -> str:
        """The run directory (that of `metrics.jsonl`)."""
        return self.log.run_dir

    @property
    def has_policy(self) -> bool:
        """Whether the stage trains a policy (`policy()` works): not the reward model or
        the PRM."""
        return self._policy_of is not None

    def policy(self) -> Any:
        """The current policy, LoRA adapters merged. `ValueError` in a stage that trains
        no policy (the reward model: use `run.state`)."""
        if self._policy_of is None:
            raise ValueError(f"{self.stage}: this run trains no policy; use run.state")
        return self._policy_of(self.state)

    def request_stop(self, reason: str) -> None:
        """Stop the run after the current iteration; `reason` goes into the summary
        (`stop_reason`) and the `callback_stop` event. The first request wins."""
        if self.stop_reason is None:
            self.stop_reason = str(reason) or "stop requested"

    def log_metrics(self, values: dict) -> None:
        """Write `values` as an evaluation record of the current iteration (marked
        `"after_loop": true` once the loop has ended: a resumed run writes it again).
        A `ValueError` for a name the record's own fields use (`RESERVED_NAMES`: a
        `"step"` of the callback's would move the record to another step in
        `metrics.jsonl` and the trackers, an `"event"` would hide it from them)."""
        taken = sorted(str(k) for k in values if k in RESERVED_NAMES)
        if taken:
            raise ValueError(
                f"log_metrics: {', '.join(map(repr, taken))} name the record's own fields "
                f"({', '.join(RESERVED_NAMES)}); give the values other names"
            )
        mark = {"after_loop": True} if self.after_loop else {}
        self.log.write(
            {"eval": True, "callback": True, "iteration": self.iteration, "step": self.steps}
            | mark
            | dict(values)
        )


def _latest(checkpoint_dir: str | None) -> str | None:
    """The newest intact checkpoint of `checkpoint_dir`, or `None` (none, or no directory)."""
    if not checkpoint_dir:
        return None
    try:
        return latest_checkpoint(checkpoint_dir)
    except Exception:  # every checkpoint damaged: no resume to offer
        return None


def _name(cb: Any) -> str:
    name = getattr(cb, "name", None)
    return name if isinstance(name, str) and name else type(cb).__name__


class CallbackList:
    """The callbacks of one run, named (`name` or the class name; a repeated name gets
    `#2`, `#3`), called in order by `call`, their state gathered by `state_dict` and
    given back by `load_state_dict`."""

    def __init__(self, callbacks: Sequence[Any] = ()):
        self.items: list[tuple[str, Any]] = []
        seen: dict[str, int] = {}
        for cb in callbacks:
            if isinstance(cb, type):
                raise TypeError(f"callbacks: got the class {cb.__name__}; pass an instance")
            if not any(callable(getattr(cb, h, None)) for h in HOOKS):
                raise TypeError(
                    f"callbacks: {cb!r} has none of the hooks {', '.join(HOOKS)} "
                    "(subclass rlhf_eqx.pipelines.Callback)"
                )
            name = _name(cb)
            seen[name] = seen.get(name, 0) + 1
            self.items.append((name if seen[name] == 1 else f"{name}#{seen[name]}", cb))

    def __bool__(self) -> bool:
        return bool(self.items)

    def call(self, hook: str, run: RunHandle, *args: Any) -> None:
        """Call `hook(run, *args)` of every callback that has it. `on_step` returning
        `"stop"` requests a stop; an exception becomes `CallbackError`."""
        for name, cb in self.items:
            fn = getattr(cb, hook, None)
            if fn is None:
                continue
            try:
                out = fn(run, *args)
            except Exception as e:
                error = CallbackError(name, hook, run.stage, run.iteration, e)
                # where a resume continues from, until the loop sets the checkpoint it
                # writes for the failure (`on_stop` and the held-out `on_evaluate`, after
                # the loop: its last checkpoint)
                error.checkpoint = _latest(run.checkpoint_dir)
                raise error from e
            if hook == "on_step" and isinstance(out, str) and out == "stop":
                run.request_stop(f"{name}.on_step returned 'stop'")

    def state_dict(self, run: RunHandle) -> dict:
        """`{name: state}` of the callbacks with a `state_dict` method (each state must
        be JSON-serialisable: it goes into the checkpoint's `meta.json`)."""
        out = {}
        for name, cb in self.items:
            fn = getattr(cb, "state_dict", None)
            if fn is not None:
                try:
                    text = json.dumps(fn())
                except Exception as e:
                    raise CallbackError(name, "state_dict", run.stage, run.iteration, e) from e
                out[name] = json.loads(text)  # a snapshot: later hooks may change the state
        return out

    def load_state_dict(self, states: dict, run: RunHandle) -> None:
        """Give each callback with a `load_state_dict` method its saved state (one
        saved under its name); callbacks without saved state keep theirs."""
        for name, cb in self.items:
            fn = getattr(cb, "load_state_dict", None)
            if fn is not None and name in states:
                try:
                    fn(states[name])
                except Exception as e:
                    raise CallbackError(name, "load_state_dict", run.stage, run.iteration, e) from e


def after_evaluation(callbacks: Sequence[Any], loop: Any, results: dict) -> None:
    """Call `on_evaluate` of `callbacks` with a copy of a stage's held-out `results`,
    after the stage's loop ended (`loop`: its `LoopResult`, whose `run` the callbacks
    saw); what a callback does to its copy leaves the summary as it was."""
    run = getattr(loop, "run", None)
    if callbacks and run is not None:
        run.after_loop = True
        CallbackList(callbacks).call("on_evaluate", run, run.iteration, copy.deepcopy(results))


def load_object(spec: str, what: str, example: str) -> Any:
    """The object `spec` names as `module:Name` (`Name` may be dotted), the module
    imported with the current directory first on the path; a `ConfigError` starting with
    `what` and saying what is wrong otherwise (`example`: a valid spec, in the message),
    an exception raised while the module is imported included (a syntax error, an error
    of its top-level code: its type and message, with the file and line of a syntax
    error)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{what}: expected MODULE:NAME, e.g. {example}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{what}: cannot import {module} ({e})") from None
    except Exception as e:  # the module's own code failed while imported
        raise ConfigError(f"{what}: importing {module} raised {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what}: {module} has no {attr}")
        obj = getattr(obj, part)
    return obj


def load_callback(spec: str) -> Any:
    """The callback `spec` names as `module:Name` (the command line's `--callback`): the
    module is imported with the current directory first on the path; a class `Name` is
    instantiated without arguments, any other object is used as it is. A `ConfigError`
    naming `--callback` and what is wrong otherwise."""
    obj = load_object(spec, f"--callback {spec}", "my_callbacks:EarlyStop")
    attr = spec.partition(":")[2]
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as e:
            raise ConfigError(
                f"--callback {spec}: {attr}() failed: {type(e).__name__}: {e}"
            ) from None
    try:
        CallbackList([obj])
    except TypeError as e:
        raise ConfigError(f"--callback {spec}: {e}") from None
    return obj
