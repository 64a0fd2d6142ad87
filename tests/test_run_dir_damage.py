"""Run directories a crash, a full disk or a hand edit left damaged: what a resume and a
checkpoint write make of them."""

import errno
import os
import types

import equinox as eqx
import jax.numpy as jnp
import pytest

from rlhf_eqx import pipelines as pl


def test_a_short_write_on_a_full_disk_is_named_as_such_and_the_old_checkpoint_kept(
    tmp_path, monkeypatch
):
    # numpy reports a write cut short by a full disk as `OSError: N requested and M
    # written` (no errno), wrapped by equinox; the space it filled is freed when the
    # partial checkpoint is removed, so the device must be asked before that.
    d = str(tmp_path / "ck")
    tree = {"w": jnp.arange(1000.0)}
    pl.tools.save_checkpoint(d, 1, tree, {}, keep=2)
    real_statvfs = os.statvfs

    def partial_files() -> bool:
        return any(".tmp" in n for n in os.listdir(d))

    def statvfs(path):
        st = real_statvfs(path)
        free = 0 if partial_files() else 1 << 40
        return types.SimpleNamespace(f_bavail=free, f_frsize=st.f_frsize)

    def short_write(f, pytree):
        f.write(b"x" * 100)
        try:
            raise OSError("4000 requested and 100 written")
        except OSError as e:
            raise RuntimeError("Error at leaf with path ('w',)") from e

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(eqx, "tree_serialise_leaves", short_write)
    with pytest.raises(OSError) as e:
        pl.tools.save_checkpoint(d, 2, tree, {}, keep=2)
    assert e.value.errno == errno.ENOSPC
    assert str(e.value) == f"no space left on the device of {d} (checkpoint not written)"
    assert sorted(os.listdir(d)) == ["iter_00000001"]
    assert pl.tools.latest_checkpoint(d).endswith("iter_00000001")
