"""The run directory: one owner (a lock), new runs never mix with old ones, resume checks
what it resumes, and `config.json` is written only after every check has passed.

`open_run_dir(cfg, run_dir, resume=..., overwrite=...)` is what `run_pipeline` and
`run_on_data` call before loading anything:

1. **Lock.** `<run_dir>/.lock` is held with `fcntl.flock` for the whole run and names
   its holder (process id, host, start time). The kernel releases the lock when the
   process dies, even by `kill -9`, so a lock left behind is detected as stale and
   taken over; a live holder makes a second run refuse at once, naming it. A path that
   is a file (or a link to nothing) or cannot be written is refused in one line naming
   it (`RunDirError`).
2. **New run or resume.** A directory that already holds a run (`metrics.jsonl`,
   `summary.json` or stage checkpoints) is refused for a new run,
   naming `--resume` and `--overwrite`; `overwrite=True` first moves the old run aside
   to `<run_dir>.replaced-<UTC time>` (nothing is deleted), and puts it back when the
   new run fails or is interrupted (Ctrl-C, SIGTERM) before anything ran (a bad data
   file, a model that does not load: `RunDir`), so that the old run is where it was.
   A directory of several runs (a sweep, a run over several seeds: `holds_runs`) is
   refused for a run and its resume alike (`overwrite` moves it aside too).
3. **Resume checks.** The requested configuration is compared with the stored
   `config.json`; any difference outside the resumable fields (`RESUMABLE_FIELDS` and each
   stage's `Stage.resumable`) is refused, naming each field with its old and new value.
   Iteration counts (each stage's `steps`, `rollouts`, `rounds`) may change,
   but not for a stage whose later stages already have checkpoints built on it, nor below
   a stage's latest checkpoint. A line of `metrics.jsonl` that is not a JSON object,
   step records missing (or repeated) before a stage's latest checkpoint, and a data
   file or model whose fingerprint differs from the recorded one (`data.json`,
   `model.json`) are refused too, naming the file, the line or the steps. Nothing in the
   directory changes before these checks have passed.
4. **Clean-up.** Checkpoint directories left half-written by a crash (`*.tmp*`) are
   removed; a torn last line of `metrics.jsonl` is cut (any other line that is not a
   JSON object refuses the resume, naming it: nothing is trained that the end of the
   run could not read back); the records a resumed run will write again (the events
   of no iteration, `rewritten_on_resume`: `data_quality`, `data_filter`, `kto_weights`,
   `reward_selection`, `summary`, ...) are dropped.
"""

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
from collections.abc import Sequence

from ..data import dataset_files
from ._checkpoints import newest_meta
from ._config_io import config_to_dict
from ._loop_state import check_iteration_count, check_logged_steps
from ._metrics import (
    DiskFullError,
    bad_line,
    drop_records,
    fsync_dir,
    json_text,
    repair_metrics,
)
from ._pipeline_config import (
    PipelineConfig,
)
from ._resume_rules import (
    RunDirError,
    check_resumable,
    check_upstream_counts,
    moved_inputs,
    requested_iterations,
    unused_fields,
)

# A `config.json` alone (a run that stopped before it logged anything) is no run.
_RUN_MARKERS = ("metrics.jsonl", "summary.json")
LOCK_NAME = ".lock"


# What marks a directory of several runs: a sweep (`sweep.json`, `_sweep.py`) or a run
# over several seeds (`seeds_summary.json` and `seed-<seed>/` run directories,
# `_seeds.py`). A single run never goes into one, nor one into a single run's directory.
_MANY_RUNS = {"sweep.json": "a sweep", "seeds_summary.json": "a run over several seeds"}


def holds_runs(run_dir: str) -> str | None:
    """What `run_dir` holds when it is a directory of several runs (`"a sweep"`, `"a run
    over several seeds"`), else `None`."""
    if not os.path.isdir(run_dir):
        return None
    for marker, what in _MANY_RUNS.items():
        if os.path.exists(os.path.join(run_dir, marker)):
            return what
    for name in os.listdir(run_dir):
        number = name.removeprefix("seed-")
        if name != number and number.isdigit() and holds_run(os.path.join(run_dir, name)):
            return "a run over several seeds"
    return None


def holds_run(run_dir: str) -> bool:
    """Whether `run_dir` holds (part of) a run: metrics, a summary or a stage's
    checkpoints."""
    if not os.path.isdir(run_dir):
        return False
    if any(os.path.exists(os.path.join(run_dir, m)) for m in _RUN_MARKERS):
        return True
    return bool(_stages_with_checkpoints(run_dir))


@contextlib.contextmanager
def removed_if_nothing_ran(path: str):
    """Within: a failure (an exception) or an interrupt (Ctrl-C, SIGTERM: a
    `KeyboardInterrupt`) before anything ran removes `path` when this call created it —
    a run directory, a sweep's or a run over seeds — so that the same command works
    once its input is fixed (a bad record, a model that does not load, a reward function
    that raises at the first rollout), and an interrupted start leaves no empty run
    behind (its resume command starts the run anew). "Ran" is a
    checkpoint or a step record (not an event of data preparation or monitoring) in a
    `metrics.jsonl` below `path`: a directory with one, or one that existed before, is
    kept as it is (one that `--overwrite` replaced is back by then: `RunDir`)."""
    fresh = not os.path.exists(path)
    try:
        yield
    except (Exception, KeyboardInterrupt) as e:
        if fresh and os.path.isdir(path) and _remove_unrun(path):
            _mark_nothing_ran(e)
        raise


def _remove_unrun(path: str) -> bool:
    """Remove the directory `path` when nothing ran in it (`_anything_ran`), holding its
    lock meanwhile; whether it was removed. A directory another run holds (one that
    started there after `removed_if_nothing_ran` looked: the refusal that brought it
    here) is that run's, and stays."""
    try:
        lock = RunLock(path)
    except (RunDirError, OSError):
        return False
    if _anything_ran(path):
        lock.release()
        return False
    shutil.rmtree(path, ignore_errors=True)
    lock.release(remove=False)  # its file went with the directory
    return True


def _mark_nothing_ran(error: BaseException | None) -> None:
    """Mark an interrupt that came before anything ran (`error.nothing_ran = True`): the
    command line then says to run the same command again, not to resume (there is
    nothing of this run to resume, and with `--overwrite` a resume would continue the
    previous run put back)."""
    if isinstance(error, KeyboardInterrupt):
        error.nothing_ran = True


def _anything_ran(path: str) -> bool:
    """Whether below `path` a checkpoint (`iter_*`) or a step record of a
    `metrics.jsonl` (a record with a `step` and no `event`) was written."""
    for root, dirs, files in os.walk(path):
        if any(d.startswith("iter_") for d in dirs):
            return True
        if "metrics.jsonl" not in files:
            continue
        with open(os.path.join(root, "metrics.jsonl"), "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    return True  # not ours to judge: keep it
                if isinstance(rec, dict) and "step" in rec and "event" not in rec:
                    return True
    return False


def _stages_with_checkpoints(run_dir: str) -> list[str]:
    found = []
    for name in sorted(os.listdir(run_dir)):
        ck = os.path.join(run_dir, name, "checkpoints")
        if os.path.isdir(ck) and any(n.startswith("iter_") for n in os.listdir(ck)):
            found.append(name)
    return found


def remove_partial_checkpoints(run_dir: str) -> list[str]:
    """Remove the `*.tmp*` checkpoint directories a crash left under
    `<run_dir>/<stage>/checkpoints/`; returns what was removed."""
    removed = []
    if not os.path.isdir(run_dir):
        return removed
    for name in os.listdir(run_dir):
        ck = os.path.join(run_dir, name, "checkpoints")
        if not os.path.isdir(ck):
            continue
        for n in os.listdir(ck):
            if ".tmp" in n:
                shutil.rmtree(os.path.join(ck, n), ignore_errors=True)
                removed.append(os.path.join(ck, n))
    return removed


def _remove_partial_files(run_dir: str) -> list[str]:
    """Remove the temporary files of atomic writes (`config.json.tmp<pid>`,
    `metrics.jsonl.tmp<pid>`, ...) a crash left in `run_dir`."""
    removed = []
    for n in os.listdir(run_dir):
        path = os.path.join(run_dir, n)
        if ".json" in n and ".tmp" in n and os.path.isfile(path):
            os.remove(path)
            removed.append(path)
    return removed


def _process_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class RunLock:
    """An exclusive `flock` on `<run_dir>/.lock` that names its holder; `release()`
    (or leaving the `with` block) unlocks and removes the file."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_NAME)
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as e:
            raise _unusable_dir(run_dir, e) from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise _unusable_dir(run_dir, e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise RunDirError(
                    f"{run_dir} is in use by another run ({holder}); wait for it to finish "
                    "or use another --out"
                ) from None
            if _same_file(fd, self.path):
                break
            # The holder removed the file as it released it, after it was opened here: the
            # lock taken is on a file no other run sees; take the one at the path instead.
            os.close(fd)
        self.stale = _read_holder(fd) if os.fstat(fd).st_size else None
        pid = os.getpid()
        info = {
            "pid": pid,
            "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "process_start": _process_start(pid),
            "argv": sys.argv,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd: int | None = fd

    def release(self, *, remove: bool = True) -> None:
        """Unlock; `remove`: remove the lock file first (not when it is gone already, or
        its path another run's now)."""
        if self.fd is None:
            return
        try:
            if remove:
                os.remove(self.path)
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _unusable_dir(run_dir: str, e: OSError) -> Exception:
    """`e`, raised creating `run_dir` or its lock, as the one line a user acts on: a
    `RunDirError` naming `run_dir` for a path that is (or passes through) a file or a
    link to nothing, a directory without write permission and a read-only file system;
    a full disk as `DiskFullError` (`disk_error`); any other error as it is."""
    if e.errno in (errno.EEXIST, errno.ENOTDIR) and not os.path.isdir(run_dir):
        if os.path.islink(run_dir) and not os.path.exists(run_dir):
            what = f"is a link to {os.readlink(run_dir)}, which does not exist"
        elif os.path.lexists(run_dir):
            what = "is a file"
        else:
            what = "passes through a file"
        return RunDirError(
            f"{run_dir} {what}, not a directory; choose a directory for the run (--out)"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = e.filename or run_dir
        why = "read-only file system" if e.errno == errno.EROFS else "permission denied"
        return RunDirError(
            f"{run_dir}: cannot write the run directory ({where}: {why}); choose a writable --out"
        )
    return disk_error(e, run_dir)


def _same_file(fd: int, path: str) -> bool:
    """Whether the open file `fd` is the file at `path` (not one removed since)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _read_holder(fd: int) -> str:
    try:
        raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        info = json.loads(raw)
        return f"process {info.get('pid')} on host {info.get('host')}, since {info.get('started')}"
    except (OSError, ValueError, AttributeError):
        return "holder unknown"


class RunDir:
    """An opened run directory (`open_run_dir`): its path, its lock, whether it resumes,
    the notes the opening made (a stale lock taken over, partial checkpoints removed, a
    previous run moved aside) and where `--overwrite` moved the previous run
    (`replaced`, else `None`).

    Left by an exception or an interrupt (Ctrl-C, SIGTERM: a `KeyboardInterrupt`)
    before anything ran in it (no checkpoint, no step record: `_anything_ran`), a run
    that replaced another puts it back: the new directory is removed and the previous
    run renamed back to `path`, untouched, so that a failed or interrupted `--overwrite`
    (a bad data file, say) loses nothing."""

    def __init__(
        self,
        path: str,
        lock: RunLock,
        resume: bool,
        notes: list[str],
        replaced: str | None = None,
    ):
        self.path = path
        self.lock = lock
        self.resume = resume
        self.notes = notes
        self.replaced = replaced

    def close(self) -> None:
        self.lock.release()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if _undone(error) and self.replaced and not _anything_ran(self.path):
            _put_back(self.path, self.replaced, self.lock, error)
            _mark_nothing_ran(error)
        self.close()


def open_run_dir(
    cfg: PipelineConfig, run_dir: str, *, resume: bool = False, overwrite: bool = False
) -> RunDir:
    """Take `run_dir` for the run of `cfg` (see the module docstring): lock it, refuse a
    new run into an old one (unless `overwrite`, which moves the old one aside), check a
    resume against the stored configuration, clean what a crash left, then write
    `config.json`. Raises `RunDirError` with what to do; use as a context manager."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other")
    notes: list[str] = []
    many = holds_runs(run_dir)
    if many is not None and not overwrite:
        raise RunDirError(
            f"{run_dir} holds {many}, not a single run; choose another --out (or "
            "--overwrite to move it aside)"
        )
    replaced = None
    if overwrite and (holds_run(run_dir) or many is not None):
        replaced = _move_aside(run_dir)
        notes.append(f"moved the previous run in {run_dir} to {replaced}")
    try:
        lock = RunLock(run_dir)
    except BaseException:
        if replaced is not None and not os.path.exists(run_dir):
            os.rename(replaced, run_dir)
        raise
    try:
        if lock.stale:
            notes.append(
                f"took over the lock of a run that ended without releasing it ({lock.stale})"
            )
        new = config_to_dict(cfg)
        cfg_path = os.path.join(run_dir, "config.json")
        if not resume and holds_run(run_dir):
            raise RunDirError(
                f"{run_dir} already holds a run; pass --resume to continue it or "
                "--overwrite to move it aside and start again (or choose another --out)"
            )
        if resume and holds_run(run_dir):
            if not os.path.isfile(cfg_path):
                raise RunDirError(
                    f"{run_dir}: no config.json to check the resumed configuration against"
                )
            try:
                with open(cfg_path) as f:
                    old = json.load(f)
            except ValueError as e:
                raise RunDirError(f"{cfg_path}: not JSON ({e})") from None
            # Every check before anything in the directory changes: a refused resume
            # leaves it as it was.
            changes = check_resumable(old, new, where=run_dir)
            notes += resume_notes(run_dir, old, new, changes)
            _check_same_data_stages(run_dir, old, new)
            check_upstream_counts(run_dir, changes, _stages_with_checkpoints)
            metrics = os.path.join(run_dir, "metrics.jsonl")
            bad = bad_line(metrics)
            if bad is not None:
                raise RunDirError(
                    f"{metrics}:{bad[0]}: {bad[1]} (a line edited or written by something "
                    "else); fix or remove that line, then resume again"
                )
            check_stage_checkpoints(run_dir, new)
            _check_inputs(run_dir, cfg)
            removed = remove_partial_checkpoints(run_dir) + _remove_partial_files(run_dir)
            if removed:
                notes.append(f"removed {len(removed)} partial file(s) left by a crash")
            if repair_metrics(metrics):
                notes.append(f"cut a torn last line of {metrics}")
            drop_records(metrics, rewritten_on_resume)
        elif resume:
            notes.append(f"nothing to resume in {run_dir}: starting a new run")
        write_json_atomic(cfg_path, new)
    except BaseException as e:
        if replaced is not None and _undone(e):
            _put_back(run_dir, replaced, lock, e)
        lock.release()
        raise
    return RunDir(run_dir, lock, resume, notes, replaced)


def resume_notes(
    run_dir: str, old: dict, new: dict, changes, *, stored: str = "config.json"
) -> list[str]:
    """The lines a resume that `check_resumable` accepted prints about its stored
    configuration `old` (the file `stored` of `run_dir`): each data file or model that
    moved with the same contents (`moved_inputs`), and the settings this version no
    longer has (`unused_fields`), named once."""
    notes = []
    for field, a, b in moved_inputs(run_dir, new, changes):
        what, record = ("data file", DATA_NAME) if field == "data.path" else ("model", MODEL_NAME)
        notes.append(
            f"{field}: the {what} moved ({a} -> {b}); its contents are the same (size and "
            f"SHA-256 as recorded in {record}): the run goes on with {b}"
        )
    unused = unused_fields(old)
    if unused:
        notes.append(
            f"{os.path.join(run_dir, stored)}: {', '.join(unused)}: no longer used "
            "(settings neither this version of the library nor a stage registered now has); "
            "the run goes on without them"
        )
    return notes


def _check_same_data_stages(run_dir: str, old: dict, new: dict) -> None:
    """Refuse (`RunDirError`) to resume a run on a data file (`data.path`) with stages
    that leave out one it ran (`sft --data FILE` resumed by `dpo --data FILE`): a stage
    on a data file starts from `model.source`, not from the stages before it, so the
    other stage would not continue the run, only replace its summary. The built-in
    task's pipeline may change its `stages` (a stage added trains from SFT's result)."""
    if (new.get("data") or {}).get("path") is None:
        return
    ran, asked = old.get("stages"), new.get("stages")
    if not (isinstance(ran, list) and isinstance(asked, list)):
        return
    left = [s for s in ran if s not in asked]
    if left:
        raise RunDirError(
            f"{run_dir} holds a run of {', '.join(map(str, ran))} on a data file, which "
            f"{', '.join(map(str, asked))} does not continue (a stage on a data file "
            f"starts from model.source); choose another --out (--model {run_dir} trains "
            "from its exported policy)"
        )


def check_stage_checkpoints(run_dir: str, new: dict) -> None:
    """Check the latest checkpoint of each stage in `run_dir` (`<stage>/checkpoints/`)
    against the resumed configuration `new` (a config dict) before anything is written,
    as each stage's loop would check it only as it starts (after `config.json`, and the
    stages before it, changed the directory): refuse (`RunDirError`) one past the
    stage's requested iteration count (`requested_iterations`, `check_iteration_count`)
    or one whose earlier steps lack their records in `metrics.jsonl`
    (`check_logged_steps`). A stage without a complete checkpoint is left to its loop."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    for stage in _stages_with_checkpoints(run_dir):
        found = newest_meta(os.path.join(run_dir, stage, "checkpoints"))
        if found is None:
            continue
        path, saved = found
        count = requested_iterations(stage, new, saved)
        if count is not None and "iteration" in saved:
            check_iteration_count(path, saved, count, stage)
        if isinstance(saved.get("steps"), int):
            check_logged_steps(metrics, stage, saved["steps"], path)


def _move_aside(run_dir: str) -> str:
    """Move the run in `run_dir` to `<run_dir>.replaced-<UTC time>` (`--overwrite`),
    holding its lock meanwhile: a live run is never moved away. A directory that holds
    the working directory is refused (the new run would go where the old one went).
    Returns where it went."""
    here, target = os.path.realpath(os.getcwd()), os.path.realpath(run_dir)
    if os.path.commonpath([here, target]) == target:
        raise RunDirError(
            f"--overwrite cannot move {run_dir} aside: it holds the working directory "
            f"({here}); run from another directory, or choose another --out"
        )
    old_lock = RunLock(run_dir)
    try:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
        name = os.path.normpath(run_dir)
        aside = f"{name}.replaced-{stamp}"
        n = 1
        while os.path.exists(aside):
            aside = f"{name}.replaced-{stamp}-{n}"
            n += 1
        os.rename(run_dir, aside)
    except BaseException:
        old_lock.release()
        raise
    old_lock.path = os.path.join(aside, LOCK_NAME)
    old_lock.release()
    return aside


def _undone(error: BaseException | None) -> bool:
    """Whether a run left by `error` before anything ran is undone (`RunDir`,
    `removed_if_nothing_ran`): an exception or an interrupt (Ctrl-C, SIGTERM: a
    `KeyboardInterrupt`), not a normal exit nor `SystemExit` / `GeneratorExit`."""
    return isinstance(error, (Exception, KeyboardInterrupt))


def _put_back(run_dir: str, aside: str, lock: RunLock, error: BaseException | None = None) -> None:
    """Undo `_move_aside` for a run that failed or was interrupted (`error`) before
    anything ran: remove the new run's directory `run_dir` (while `lock`, its lock, is
    held: no other run starts in it meanwhile), unlock, and rename the previous run
    `aside` back to `run_dir`; a note on stderr says so (after an interrupt, that the
    same command with `--overwrite` replaces it: a `--resume` would continue the
    previous run), or where the previous run stays when `run_dir` is taken again
    meanwhile."""
    shutil.rmtree(run_dir, ignore_errors=True)
    lock.release(remove=False)  # its file went with the directory
    try:
        os.rename(aside, run_dir)
    except OSError as e:
        print(
            f"note: the previous run stays in {aside} ({run_dir}: {e.strerror or e})",
            file=sys.stderr,
        )
        return
    if isinstance(error, KeyboardInterrupt):
        print(
            f"note: interrupted before anything ran: the previous run is back in {run_dir} "
            "(to replace it, run the same command with --overwrite again; --resume would "
            "continue the previous run)",
            file=sys.stderr,
        )
        return
    print(f"note: nothing ran: the previous run is back in {run_dir}", file=sys.stderr)


def rewritten_on_resume(record: dict) -> bool:
    """Whether a resumed run writes `record` of `metrics.jsonl` again, whatever checkpoint
    it resumes from: the events of no iteration — those a stage writes as it prepares its
    data (`data_quality`, `data_filter`, `kto_weights`, `heldout_one_label`,
    `no_validation`) or as it ends (`reward_selection`, the run's `summary`). Every
    stage of a resumed run prepares and ends again, a finished one too."""
    return "event" in record and (
        "iteration" not in record or record["event"] in ("data_quality", "data_filter", "summary")
    )


DATA_NAME = "data.json"
MODEL_NAME = "model.json"


def _check_inputs(run_dir: str, cfg: PipelineConfig) -> None:
    """Refuse a resume whose data file (`data.json`) or model files (`model.json`) changed
    since the run started, before anything in `run_dir` changes (`check_data`,
    `check_model`: they record the same fingerprints again; the run calls them once more
    as it starts, at no cost: `files_fingerprint` keeps the last ones)."""
    from ._pipeline import check_model

    if cfg.data.path is not None and os.path.isfile(os.path.join(run_dir, DATA_NAME)):
        check_data(run_dir, cfg.data.path, resume=True)
    if os.path.isfile(os.path.join(run_dir, MODEL_NAME)):
        check_model(run_dir, cfg.model.source, cfg.model.tokenizer, resume=True)


# The last fingerprints taken, by the files' (path, size, mtime, inode): a run's start
# checks its data file and model twice (before and after its directory is opened).
_FINGERPRINTS: dict[tuple, tuple[int, str]] = {}


def files_fingerprint(files: Sequence[str]) -> tuple[int, str]:
    """The total size of `files` and the SHA-256 of their bytes one after the other."""
    stats = [os.stat(f) for f in files]
    key = tuple(
        (os.path.abspath(f), s.st_size, s.st_mtime_ns, s.st_ino) for f, s in zip(files, stats)
    )
    if key in _FINGERPRINTS:
        return _FINGERPRINTS[key]
    h = hashlib.sha256()
    size = 0
    for file in files:
        size += os.path.getsize(file)
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    if len(_FINGERPRINTS) >= 8:
        _FINGERPRINTS.clear()
    _FINGERPRINTS[key] = (size, h.hexdigest())
    return size, h.hexdigest()


def data_fingerprint(path: str) -> dict:
    """What identifies a data file's contents: its path, size and the SHA-256 of its
    bytes (everything the readers read). For a `datasets` directory, the size and
    SHA-256 of its Arrow files one after the other (`data.dataset_files`: every split of
    a `DatasetDict` unless the path names one, `DIR:SPLIT`)."""
    size, sha = files_fingerprint(dataset_files(path, all_splits=True))
    return {"path": os.path.abspath(path), "size": size, "sha256": sha}


def check_data(run_dir: str, path: str, *, resume: bool) -> None:
    """Record the fingerprint of the data file `path` in `<run_dir>/data.json`; when a run
    resumes, first refuse (`RunDirError`) a file whose size or contents differ from the
    recorded ones: the resumed steps would train on other data than the first ones, as
    with a changed configuration. A run that recorded none (an older one) records it
    now."""
    check_recorded(run_dir, DATA_NAME, data_fingerprint(path), f"the data file {path}", resume)


def check_recorded(run_dir: str, name: str, new: dict, what: str, resume: bool) -> None:
    """Record the fingerprint `new` (`size`, `sha256`, ...) in `<run_dir>/<name>`; when a
    run resumes, first refuse (`RunDirError`, naming `what`) one that differs from the
    recorded fingerprint. A run that recorded none (an older one) records it now."""
    stored = os.path.join(run_dir, name)
    if resume and os.path.isfile(stored):
        try:
            with open(stored) as f:
                old = json.load(f)
        except ValueError as e:
            raise RunDirError(f"{stored}: not JSON ({e})") from None
        if (old.get("size"), old.get("sha256")) != (new["size"], new["sha256"]):
            raise RunDirError(
                f"{run_dir}: cannot resume: {what} changed since the run "
                f"started (size {old.get('size')} -> {new['size']} bytes, sha256 "
                f"{str(old.get('sha256'))[:12]}... -> {new['sha256'][:12]}...); restore it, "
                "or start a new run on it (another --out, or --overwrite)"
            )
    write_json_atomic(stored, new)


def write_json_atomic(path: str, obj) -> None:
    """Write `obj` as JSON to `path` through a temporary file and a rename (a crash
    leaves the old file or the new one); a NaN or infinite number as the string `"NaN"`,
    `"Infinity"` or `"-Infinity"` (`json_text`: bare tokens are not JSON). A full disk
    raises `OSError` naming the directory, with the temporary file removed."""
    tmp = f"{path}.tmp{os.getpid()}"
    text = json_text(obj, indent=1)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    except OSError as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise disk_error(e, os.path.dirname(path) or ".") from None


def disk_error(e: OSError, directory: str) -> OSError:
    """`e` with a one-line message naming `directory` when the disk is full."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(directory)
    return e
