"""Experiment trackers: the `Tracker` protocol behind a run's metrics log, the registry
of backends by name (`ops.trackers`), and the started trackers of one run directory.

A run opens its trackers once (`open_trackers`, or `run_trackers` from a
`PipelineConfig`), and every `MetricsLog` of that run directory (one per stage) sends
its step and evaluation records to them with its stage name. A tracker that cannot be
imported or fails to start prints one line (`tracker wandb: could not start (...); the
run goes on without it`) and the run continues without it; one that fails later is
dropped the same way. Within `trying_once()` (a sweep: its members and seeds each open
trackers) a tracker that could not start is not tried again: one line, not one a run.
Nothing here touches the network: each backend writes locally
unless the user configured otherwise (`_tracker_backends.py`).

Each started tracker's run identity (`Tracker.identity`: a W&B run id, an MLflow run id,
...) is written to the run directory's `trackers.json` (atomically); a resumed run
(`resume=True`) reopens those runs (`Tracker.resume`) instead of starting new ones. A
missing or unreadable `trackers.json` is one line on stderr and new runs.
"""

import abc
import contextlib
import contextvars
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ._config import ConfigError

_ACTIVE: dict[str, "Trackers"] = {}
"""The open trackers of each run directory (absolute path), for its `MetricsLog`s."""

_GAVE_UP: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "rlhf_eqx_trackers_gave_up", default=None
)
"""Inside `trying_once()`: the trackers that could not start (not tried again)."""


class Tracker(abc.ABC):
    """The experiment-tracker protocol: one run of an external tracker (TensorBoard,
    Weights & Biases, MLflow, trackio, or your own), fed by the run's metrics log.

    A backend is built by its factory with the run directory (`register_tracker`), then
    called in this order: `start` once (or `resume`, when the run resumes and
    `trackers.json` holds what its `identity` returned), `log` for each record, `summary`
    at most once, `finish` once (after `fail` when the run ended with an exception).
    Any exception it raises is caught by `Trackers`: the run goes on without that
    tracker.

    ```python
    class PrintTracker(pl.trackers.Tracker):
        def __init__(self, run_dir):
            self.run_dir = run_dir

        def start(self, run_name, config, group):
            print("start", run_name, group)

        def log(self, step, metrics, stage):
            print(stage, step, metrics.get("loss"))

        def summary(self, values):
            print("summary", values)

        def finish(self):
            print("done")

    pl.trackers.register_tracker("print", PrintTracker)  # then --set ops.trackers=print
    ```
    """

    @abc.abstractmethod
    def start(self, run_name: str, config: dict, group: str | None) -> None:
        """Open the tracker's run.

        **Arguments:**

        - `run_name`: the run's name (by default the run directory's base name).
        - `config`: the resolved configuration (`config_to_dict`), nested sections.
        - `group`: the group of related runs (a sweep's members), or `None`.
        """

    @abc.abstractmethod
    def log(self, step: int, metrics: dict[str, float], stage: str) -> None:
        """Record one step (or evaluation) of `stage`: `metrics` are the record's numbers
        as `metrics.jsonl` has them, keys without the stage prefix; `step` counts that
        stage's optimiser steps from 0."""

    @abc.abstractmethod
    def summary(self, values: dict) -> None:
        """Record the run's final summary (`summary.json`: nested per stage)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Close the run (flush, mark it finished)."""

    def fail(self, error: BaseException) -> None:
        """The run ended with `error` (an exception; `KeyboardInterrupt` for an interrupt
        or SIGTERM), called just before `finish`: a backend marks its run failed or
        killed rather than finished. The default does nothing."""
        del error

    def identity(self) -> dict | None:
        """What reopens this tracker's run when the run resumes (JSON: ids, names, paths),
        recorded in the run directory's `trackers.json` after `start` or `resume`; `None`
        (the default): a resumed run starts a new tracker run."""
        return None

    def resume(self, run_name: str, config: dict, group: str | None, identity: dict) -> None:
        """Reopen the run that `identity` (what `identity()` returned before) names and
        continue it, in place of `start`: the run continues from the checkpoint's step, and
        a record it already holds (a step the stopped run logged after its last checkpoint,
        logged again with the same values) is not added twice where the backend allows
        it. An exception here makes the run start a new tracker run (one line on stderr).
        The default starts a new run (`start`)."""
        del identity
        self.start(run_name, config, group)


_REGISTRY: dict[str, Callable[[str], Tracker]] = {}


def register_tracker(name: str, factory: Callable[[str], Tracker]) -> None:
    """Make `factory(run_dir) -> Tracker` selectable as `ops.trackers=name` (a name
    registered again replaces the earlier factory)."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"register_tracker: name={name!r}: must be letters, digits, - or _")
    _REGISTRY[name] = factory


def tracker_names() -> tuple[str, ...]:
    """The names `ops.trackers` accepts: the built-in `tensorboard`, `wandb`, `mlflow`,
    `trackio` and any registered with `register_tracker`."""
    return tuple(_REGISTRY)


def check_tracker_names(names: Iterable[str], field: str = "ops.trackers") -> None:
    """A `ConfigError` naming `field`, the unknown name and the known ones, for a name in
    `names` that is not a registered tracker."""
    for name in names:
        if name not in _REGISTRY:
            raise ConfigError(
                f"{field}={name}: must be one of {', '.join(tracker_names())} "
                "(known trackers; register_tracker adds others)"
            )


def _detail(error: BaseException) -> str:
    """The first line of `error`'s message (its type's name when it has none)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _say(name: str, what: str, error: BaseException) -> None:
    print(f"tracker {name}: {what} ({_detail(error)}); the run goes on without it", file=sys.stderr)


def flatten(values: Mapping, prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """`{"a": {"b": 1}}` as `{"a/b": 1}` (nested mappings joined with `sep`)."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key, sep))
        else:
            out[key] = v
    return out


class Trackers:
    """The started trackers of one run directory. `log`, `summary` and `finish` pass on
    to each; a tracker that raises is dropped with one line on stderr, and the run goes
    on. While open (from `open_trackers` to `finish`) every `MetricsLog` of the run
    directory logs to them. As a context manager it finishes on exit."""

    def __init__(self, run_dir: str, trackers: Mapping[str, Tracker], *, quiet: bool = False):
        self.run_dir = run_dir
        self.trackers = dict(trackers)
        self.quiet = quiet
        self.started = time.time()
        self.summarised = False

    @property
    def names(self) -> tuple[str, ...]:
        """The trackers still running."""
        return tuple(self.trackers)

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                call(tracker)
            except Exception as e:  # a tracker never stops the run
                del self.trackers[name]
                _say(name, f"could not {what}", e)

    def log(self, step: int, metrics: dict[str, float], stage: str) -> None:
        """Send one record of `stage` to every tracker."""
        if metrics:
            self._each("log", lambda t: t.log(step, metrics, stage))

    def summary(self, values: dict) -> None:
        """Send the final summary to every tracker."""
        self.summarised = True
        self._each("log the summary", lambda t: t.summary(values))

    def finish(self) -> None:
        """Log the run's `summary.json` (when this run wrote it and no summary was sent),
        finish every tracker and stop routing the run directory's metrics to them."""
        if not self.summarised and self.trackers:
            path = os.path.join(self.run_dir, "summary.json")
            try:
                if os.path.getmtime(path) >= self.started - 1.0:
                    from ._metrics import read_json  # (the metrics log imports this module)

                    self.summary(read_json(path))  # non-finite numbers read back
            except (OSError, ValueError):
                pass
        with _silenced(self.quiet):
            self._each("finish", lambda t: t.finish())
        self.trackers = {}
        if _ACTIVE.get(os.path.abspath(self.run_dir)) is self:
            del _ACTIVE[os.path.abspath(self.run_dir)]

    def __enter__(self) -> "Trackers":
        return self

    def fail(self, error: BaseException) -> None:
        """Tell every tracker that the run ended with `error` (`Tracker.fail`), before
        `finish`."""
        # a tracker of its own class, not a `Tracker`, may lack it
        self._each("mark the run failed", lambda t: getattr(t, "fail", lambda e: None)(error))

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None and self.trackers:
            self.fail(error)
        self.finish()


def open_trackers(
    names: Iterable[str],
    run_dir: str,
    config: dict,
    *,
    group: str | None = None,
    run_name: str | None = None,
    resume: bool = False,
    route: bool = True,
    quiet: bool = False,
) -> Trackers:
    """Start the trackers `names` (registered names, `tracker_names()`) for the run in
    `run_dir`, and route the metrics of every `MetricsLog` of `run_dir` to them until
    `finish`.

    **Arguments:**

    - `names`: the trackers to start, e.g. `("tensorboard", "wandb")`; an unknown name
      is a `ConfigError` listing the known ones.
    - `run_dir`: the run directory (the trackers' local files go inside it, and
      `trackers.json`: each started tracker's `identity()`).
    - `config`: the resolved configuration to record (`config_to_dict(cfg)`).
    - `group`: the group of this run in the trackers (sweep members: one group, one
      run each); `None`: no group.
    - `run_name`: the run's name; default the run directory's base name.
    - `resume`: reopen the tracker runs `trackers.json` records (`Tracker.resume`)
      rather than start new ones. A missing or unreadable file, or a tracker it does
      not name, starts a new run with one line on stderr; never an error.
    - `route`: `False` starts them without routing `run_dir`'s metrics logs to them
      (a log's own trackers).
    - `quiet`: drop what the trackers' libraries print on standard output while they
      start and finish (trackio's lines about its store, dashboard and run), as
      `ops.quiet` drops the run's own; what they print on standard error stays.

    **Returns:** the `Trackers`; those that could not start are left out with one line
    on stderr each (`tracker wandb: could not start (...); the run goes on without it`).
    """
    names = tuple(dict.fromkeys(names))
    check_tracker_names(names)
    os.makedirs(run_dir, exist_ok=True)
    run_name = run_name or os.path.basename(os.path.abspath(run_dir))
    found = recorded_runs(run_dir) if resume and names else None
    recorded = dict(found or {})
    started: dict[str, Tracker] = {}
    gave_up = _GAVE_UP.get()
    for name in names:
        if gave_up is not None and name in gave_up:
            continue  # it could not start for an earlier run of this sweep (said then)
        if found is not None and name not in found:
            print(
                f"tracker {name}: {TRACKERS_FILE} records no run of it; it starts a new run",
                file=sys.stderr,
            )
        with _silenced(quiet):
            tracker = _start_one(
                name, run_dir, (run_name, config, group), recorded.get(name), resume=resume
            )
        if tracker is not None:
            started[name] = tracker
            recorded[name] = _identity(name, tracker)
        elif gave_up is not None:
            gave_up.add(name)
    if started:
        _record_runs(run_dir, recorded)
    out = Trackers(run_dir, started, quiet=quiet)
    if route:
        previous = _ACTIVE.get(os.path.abspath(run_dir))
        if previous is not None:
            previous.finish()
        _ACTIVE[os.path.abspath(run_dir)] = out
    return out


@contextlib.contextmanager
def trying_once() -> Iterator[None]:
    """Within it, `open_trackers` does not try again a tracker that could not start for
    an earlier run (its one line said so): a sweep opens the trackers of each member and
    seed, and a tracker whose server is unreachable would otherwise cost each of them its
    retries and one line."""
    token = _GAVE_UP.set(set())
    try:
        yield
    finally:
        _GAVE_UP.reset(token)


def start_trackers(names: Iterable[str], run_dir: str, config: dict, **options) -> Trackers:
    """`open_trackers` (with its keyword `options`) without routing `run_dir`'s metrics
    logs to them."""
    return open_trackers(names, run_dir, config, route=False, **options)


TRACKERS_FILE = "trackers.json"
"""The run directory's record of its tracker runs: `{tracker name: identity}`."""


def recorded_runs(run_dir: str) -> dict[str, dict | None] | None:
    """The tracker runs `run_dir/trackers.json` records (`{name: identity}`); `None`
    with one line on stderr when the file is missing or unreadable (the trackers then
    start new runs)."""
    path = os.path.join(run_dir, TRACKERS_FILE)
    try:
        with open(path) as f:
            out = json.load(f)
        if not isinstance(out, dict) or not all(
            v is None or isinstance(v, dict) for v in out.values()
        ):
            raise ValueError("not a mapping of tracker names to their runs")
    except FileNotFoundError:
        print(f"trackers: {path} is missing; each tracker starts a new run", file=sys.stderr)
        return None
    except (OSError, ValueError) as e:
        print(
            f"trackers: {path} is unreadable ({_detail(e)}); each tracker starts a new run",
            file=sys.stderr,
        )
        return None
    return out


_QUIET = contextvars.ContextVar("rlhf_eqx_trackers_quiet", default=False)


@contextlib.contextmanager
def _silenced(quiet: bool) -> Iterator[None]:
    """Standard output dropped while `quiet` (what a tracker's library prints), and
    `starting_quietly()` true for the backends whose library prints its notes on standard
    error (W&B: its banner and run summary; it is then started in its quiet mode)."""
    token = _QUIET.set(quiet)
    try:
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            yield
    finally:
        _QUIET.reset(token)


def starting_quietly() -> bool:
    """Whether the tracker being started belongs to a quiet run (`ops.quiet`,
    `open_trackers(..., quiet=True)`): a backend may then start its library in a mode that
    prints only warnings."""
    return _QUIET.get()


def _identity(name: str, tracker: Tracker) -> dict | None:
    """`tracker.identity()` when it is a JSON object (or `None`); otherwise one line on
    stderr and `None` (a resumed run starts a new run of it): an identity that raises
    or is not JSON would fail the run, and one that is not a mapping would make the whole
    `trackers.json` unreadable, every tracker's record with it."""
    try:
        ask = getattr(tracker, "identity", None)  # a tracker not a `Tracker` may lack it
        identity = ask() if callable(ask) else None
        if identity is not None and not isinstance(identity, dict):
            raise TypeError(f"identity() returned {type(identity).__name__}, not a dict")
        json.dumps(identity, allow_nan=False)
    except Exception as e:
        print(
            f"tracker {name}: could not record its run ({_detail(e)}); a resumed run "
            "starts a new run of it",
            file=sys.stderr,
        )
        return None
    return identity


def _record_runs(run_dir: str, runs: Mapping[str, dict | None]) -> None:
    from ._rundir import write_json_atomic

    try:
        write_json_atomic(os.path.join(run_dir, TRACKERS_FILE), dict(runs))
    except OSError as e:  # the run goes on; a resume then starts new tracker runs
        print(f"trackers: could not record the tracker runs ({e})", file=sys.stderr)


def _start_one(
    name: str,
    run_dir: str,
    run: tuple[str, dict, str | None],
    identity: dict | None,
    *,
    resume: bool = False,
) -> Tracker | None:
    """`name`'s tracker, resumed from `identity` (else started); `None` when it could
    not start (one line on stderr). A new tracker run of a resumed run (no identity
    recorded, or the recorded run lost) catches up with the run's earlier records
    where the backend can (`catch_up`: the built-in ones log `metrics.jsonl` again, or
    TensorBoard purges the steps after the checkpoint), so that it holds the whole run."""
    if identity is not None:
        try:
            tracker = _REGISTRY[name](run_dir)
            tracker.resume(*run, identity)
            return tracker
        except Exception as e:  # a run the store no longer has: a new run
            print(
                f"tracker {name}: could not resume its run ({_detail(e)}); it starts a new run",
                file=sys.stderr,
            )
    try:
        tracker = _REGISTRY[name](run_dir)
        tracker.start(*run)
    except Exception as e:  # a missing library or a refused start: go on without it
        _say(name, "could not start", e)
        return None
    catch_up = getattr(tracker, "catch_up", None)
    if resume and callable(catch_up):
        try:
            catch_up()
        except Exception as e:  # the new run lacks the earlier steps; it logs the rest
            print(
                f"tracker {name}: could not log the run's earlier records ({_detail(e)})",
                file=sys.stderr,
            )
    return tracker


def active_trackers(run_dir: str) -> Trackers | None:
    """The trackers open for `run_dir` (`open_trackers`), or `None`."""
    return _ACTIVE.get(os.path.abspath(run_dir))


def run_trackers(
    cfg: Any,
    run_dir: str,
    *,
    resume: bool = False,
    run_name: str | None = None,
    group: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Trackers:
    """`open_trackers` for a pipeline run of `cfg` (a `PipelineConfig`): the trackers of
    `cfg.ops.trackers` (and `tensorboard` when `cfg.ops.tensorboard`), the resolved
    configuration, and `cfg.ops.tracker_group` as the group; `resume=True` (the run
    resumes) continues the tracker runs the run directory records. `run_name` (default
    the run directory's name), `group` (default `cfg.ops.tracker_group`) and `extra`
    (sections added to the recorded configuration) serve a sweep's members."""
    from ._config_io import config_to_dict

    ops = cfg.ops
    names = tuple(ops.trackers) + (("tensorboard",) if ops.tensorboard else ())
    group = group or ops.tracker_group or None
    config = {**config_to_dict(cfg), **(extra or {})}
    return open_trackers(
        names, run_dir, config, group=group, run_name=run_name, resume=resume, quiet=ops.quiet
    )
