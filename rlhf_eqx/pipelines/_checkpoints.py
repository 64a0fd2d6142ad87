"""Checkpoints: atomic, checksummed, pruned to the last few; restored into a template of
the run's state (`eqx.tree_serialise_leaves`)."""

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys

import equinox as eqx
import jax
from jaxtyping import PyTree

from rlhf_eqx import distributed as dist

from ._metrics import DiskFullError, fsync_dir
from ._resume_rules import RunDirError

_CKPT_PREFIX = "iter_"
# a checkpoint being written: `iter_<n>.p<process>.tmp<pid>` (`iter_<n>.tmp<pid>`: process 0)
_TMP = re.compile(rf"{_CKPT_PREFIX}\d+(?:\.p(\d+))?\.tmp\d+")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(directory: str, iteration: int, tree: PyTree, meta: dict, *, keep: int) -> str:
    """Write `tree` (arrays via `eqx.tree_serialise_leaves`) and `meta` (JSON) as
    `directory/iter_<iteration>/`, atomically, and keep only the last `keep`.

    The files are written to a temporary directory, flushed, checksummed (SHA-256 of the
    leaves file, stored in `meta.json`) and renamed into place: a crash leaves either
    the previous checkpoints or the new one, never a partial one (temporary directories
    a crash left are removed on the next save). A full disk raises `OSError` naming the
    directory, with the partial files removed. Pruning keeps the last `keep` checkpoints
    up to `iteration` and never removes a later one. The files, the temporary directory's
    entries and the rename are flushed to the device (`fsync`) before the older
    checkpoints go: after a power cut too, the checkpoint is whole or absent.

    The processes of a multi-process run may share `directory` (a shared file system):
    every process holds the same gathered state, writes it under a temporary name of its
    own (`.p<process>.tmp<pid>`), removes only its own leftovers, and the first to put an
    iteration in place keeps it; the others drop their copy (an iteration already there
    whose checksum does not match is replaced).
    """
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, f"{_CKPT_PREFIX}{iteration:08d}")
    tmp = f"{final}.p{jax.process_index()}.tmp{os.getpid()}"
    for name in os.listdir(directory):  # left by a crash of this process of the run
        left = _TMP.fullmatch(name)
        if left and int(left.group(1) or 0) == jax.process_index():
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    try:
        os.makedirs(tmp)
        leaves = os.path.join(tmp, "state.eqx")
        with open(leaves, "wb") as f:
            # an array spanning processes is gathered whole first (every process saves)
            eqx.tree_serialise_leaves(f, dist.to_host(tree) if jax.process_count() > 1 else tree)
            f.flush()
            os.fsync(f.fileno())
        meta = dict(meta, iteration=iteration, sha256=_sha256(leaves))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)  # its two entries, before the rename makes it a checkpoint
    except BaseException as e:
        # asked before the partial files go: their removal frees the space that ran out
        full = _disk_full(e, directory)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFullError(directory, " (checkpoint not written)") from None
        raise
    shared = jax.process_count() > 1
    if shared and _complete(final):
        shutil.rmtree(tmp)  # another process of the run put this iteration in place
    else:
        if os.path.lexists(final):  # a damaged one, or anything else under its name
            _remove(directory, os.path.basename(final))
        try:
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (shared and _complete(final)):
                raise
            # another process of the run was first
        fsync_dir(directory)  # the rename: the commit point, on the device before pruning
    # Prune this run's older checkpoints only: never one past the iteration just written.
    older = [n for n in _checkpoints(directory) if int(n[len(_CKPT_PREFIX) :]) <= iteration]
    for old in older[:-keep]:
        _remove(directory, old)
    return final


def _remove(directory: str, name: str) -> None:
    """Remove the checkpoint `directory/name`: first renamed to a temporary name, so that
    a crash while its files go leaves no half-removed `iter_<n>` (the temporary
    directory is removed by the next save or the next start)."""
    gone = f"{os.path.join(directory, name)}.p{jax.process_index()}.tmp{os.getpid()}"
    try:
        os.rename(os.path.join(directory, name), gone)
    except OSError:  # already removed (another process of the run), or not renamable
        gone = os.path.join(directory, name)
    if os.path.isdir(gone) and not os.path.islink(gone):
        shutil.rmtree(gone, ignore_errors=True)
    else:  # a file (or a link) under a checkpoint's name
        with contextlib.suppress(OSError):
            os.remove(gone)


def _damage(path: str) -> str | None:
    """What is wrong with the checkpoint `path` (`None`: its leaves file matches the
    checksum in its `meta.json`)."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if _sha256(os.path.join(path, "state.eqx")) == meta["sha256"]:
            return None
        return "checksum mismatch"
    except FileNotFoundError as e:
        return f"missing {os.path.basename(e.filename or '?')}"
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable: {type(e).__name__}"


def _complete(path: str) -> bool:
    """Whether `path` is a whole checkpoint (`_damage`)."""
    return _damage(path) is None


def _disk_full(e: BaseException, directory: str) -> bool:
    """Whether `e` (or an error it wraps: serialisers re-raise write errors as their own)
    comes from a full disk. A short write can carry no errno (numpy's `OSError: N
    requested and M written`), so for such an error a device with less than 1 MiB free
    also counts: asked while the partial files that filled it are still there. An
    `OSError` with another errno (no permission, a read-only file system) is not a full
    disk, however little the device has free."""
    seen, short_write = set(), False
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        short_write = short_write or (isinstance(e, OSError) and e.errno is None)
        e = e.__cause__ or e.__context__
    if not short_write:
        return False
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def _checkpoints(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    names = [
        n
        for n in os.listdir(directory)
        if n.startswith(_CKPT_PREFIX) and n[len(_CKPT_PREFIX) :].isdigit()
    ]
    return sorted(names)


def latest_checkpoint(directory: str, *, set_aside: bool = False) -> str | None:
    """The newest complete checkpoint under `directory` whose checksum matches (older
    ones are tried when the newest is damaged, each skipped with a warning), or `None`
    when there is none. `set_aside` (a run resuming from it): the damaged ones are
    renamed `<name>.damaged`, kept to look at but no longer among the last `keep` that
    `save_checkpoint` keeps, where they would take the place of whole older ones.

    A directory whose checkpoints are *all* damaged raises `RunDirError` naming it and
    each checkpoint: whoever asks continues a run, and starting it again from iteration
    0 would not be what was asked (`--overwrite` moves the run aside for a new start)."""
    path, damaged = _newest(directory)
    for name, why in damaged:
        aside = _set_aside(directory, name) if set_aside and path is not None else None
        print(
            f"warning: skipping damaged checkpoint {os.path.join(directory, name)} "
            f"({why}){f'; kept as {aside}' if aside else ''}",
            file=sys.stderr,
        )
    if path is not None:
        return path
    if damaged:
        raise RunDirError(
            f"{directory}: every checkpoint is damaged "
            f"({'; '.join(f'{name}: {why}' for name, why in damaged)}), so the run "
            "cannot continue; start it again with --overwrite (the run is moved aside) or "
            "another --out"
        )
    return None


def _set_aside(directory: str, name: str) -> str | None:
    """Rename the damaged checkpoint `directory/name` to `<name>.damaged` (`-<n>` added
    when taken): out of the checkpoints that pruning counts and a resume reads, kept for
    whoever wants to look at it. Returns the new path, or `None` when it could not be
    renamed (another process of the run did, say)."""
    aside = os.path.join(directory, f"{name}.damaged")
    n = 1
    while os.path.lexists(aside):
        aside = os.path.join(directory, f"{name}.damaged-{n}")
        n += 1
    try:
        os.rename(os.path.join(directory, name), aside)
    except OSError:
        return None
    return aside


def _newest(directory: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest complete checkpoint under `directory` (`None`: none) and the damaged
    ones newer than it, as `(name, what is wrong)`."""
    damaged = []
    for name in reversed(_checkpoints(directory)):
        path = os.path.join(directory, name)
        why = _damage(path)
        if why is None:
            return path, damaged
        damaged.append((name, why))
    return None, damaged


def newest_meta(directory: str) -> tuple[str, dict] | None:
    """`(path, meta.json)` of the checkpoint `latest_checkpoint` would resume from, read
    quietly (no warning, no refusal: it only looks); `None` when there is none."""
    path, _ = _newest(directory)
    if path is None:
        return None
    with open(os.path.join(path, "meta.json")) as f:
        return path, json.load(f)


def restore_checkpoint(path: str, like: PyTree) -> tuple[PyTree, dict]:
    """Read a checkpoint written by `save_checkpoint` into the structure of `like`."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    leaves = os.path.join(path, "state.eqx")
    if _sha256(leaves) != meta.get("sha256"):
        raise ValueError(f"checkpoint {path}: checksum mismatch (file damaged)")
    try:
        tree = eqx.tree_deserialise_leaves(leaves, like)
    except Exception as e:
        raise ValueError(
            f"checkpoint {path} does not match this run's model/optimiser ({e})"
        ) from None
    return tree, meta


def discard_checkpoints_after(directory: str, iteration: int) -> None:
    """Remove the checkpoints past `iteration` (a rollback to an earlier state makes them
    the past of a run that no longer happened)."""
    for name in _checkpoints(directory):
        if int(name[len(_CKPT_PREFIX) :]) > iteration:
            _remove(directory, name)
