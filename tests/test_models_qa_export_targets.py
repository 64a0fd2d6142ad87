"""Where an export cannot be written: a path through a file, a directory that cannot be
made or written, a directory given where one file is read. Each is one line naming the
target, and nothing is left behind (no temporary file, no directory made for it)."""

import errno
import gc
import os

import jax
import pytest

import rlhf_eqx as rx
from rlhf_eqx.models import load_gguf_policy, save_gguf_adapter, write_gguf

pytest.importorskip("gguf", reason="GGUF files need the gguf package")


@pytest.fixture(scope="module")
def policy():
    cfg = rx.TransformerConfig(
        vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32
    )
    return rx.Policy(cfg, key=jax.random.key(0))


@pytest.fixture(scope="module")
def adapted(policy):
    return rx.apply_lora(policy, rx.LoRAConfig(rank=2), key=jax.random.key(1))


def _writers(policy, adapted):
    return {
        "gguf": lambda p: write_gguf(policy, p, dtype="f32"),
        "gguf adapter": lambda p: save_gguf_adapter(adapted, p),
        "hf": lambda p: rx.save_hf(policy, p),
        "peft adapter": lambda p: rx.save_lora_adapter(adapted, p),
    }


def _one_line(e, *parts):
    msg = str(e.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert str(part) in msg, (part, msg)


@pytest.mark.parametrize("kind", ["gguf", "gguf adapter", "hf", "peft adapter"])
def test_a_target_under_a_file_names_the_file(policy, adapted, tmp_path, kind):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a directory")
    target = blocker / "sub" / "model"
    with pytest.raises(NotADirectoryError) as e:
        _writers(policy, adapted)[kind](target)
    _one_line(e, target, f"{blocker} is a file, not a directory")
    assert blocker.read_text() == "not a directory"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


@pytest.mark.parametrize("kind", ["gguf", "gguf adapter", "hf", "peft adapter"])
def test_a_directory_that_cannot_be_written_is_not_a_full_disk(
    policy, adapted, tmp_path, monkeypatch, kind
):
    """The temporary file (GGUF) or staging directory (Hugging Face, PEFT) cannot be
    made, on a device that reports no free space (as /proc does): the error is the
    permission, naming the target, not 'no space left'."""
    target = tmp_path / "new" / "deeper" / "model"
    real_open, real_mkdir = os.open, os.mkdir

    def refuse(path, *a, real):
        if os.path.basename(path).startswith("."):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, *a)

    monkeypatch.setattr(os, "open", lambda p, *a: refuse(p, *a, real=real_open))
    monkeypatch.setattr(os, "mkdir", lambda p, *a: refuse(p, *a, real=real_mkdir))
    monkeypatch.setattr(os, "statvfs", lambda d: os.statvfs_result((4096,) * 2 + (0,) * 8))
    with pytest.raises(PermissionError) as e:
        _writers(policy, adapted)[kind](target)
    _one_line(e, f"cannot write {target}", "Permission denied", target.parent)
    assert "no space" not in str(e.value)
    assert os.listdir(tmp_path) == []  # the directories made for it are gone too


def test_a_failed_gguf_export_keeps_the_old_file(policy, tmp_path, monkeypatch):
    target = tmp_path / "model.gguf"
    write_gguf(policy, target, dtype="f32")
    before = target.read_bytes()
    real_open = os.open

    def refuse(path, *a):
        if os.path.basename(path).startswith("."):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, *a)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(PermissionError, match="what was there before is unchanged"):
        write_gguf(policy, target, dtype="f16")
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.gguf"]


def test_a_directory_that_cannot_be_made_is_named(policy, tmp_path, monkeypatch):
    real_mkdir = os.mkdir

    def refuse(path, *a):
        if os.path.basename(path) == "made":
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_mkdir(path, *a)

    monkeypatch.setattr(os, "mkdir", refuse)
    target = tmp_path / "made" / "model.gguf"
    with pytest.raises(PermissionError) as e:
        write_gguf(policy, target, dtype="f32")
    _one_line(e, f"cannot write {target}", f"the directory {tmp_path / 'made'} cannot be made")
    assert os.listdir(tmp_path) == []


def test_a_directory_given_as_a_gguf_file_says_so(policy, tmp_path):
    write_gguf(policy, tmp_path / "a.gguf", dtype="f32")
    with pytest.raises(IsADirectoryError) as e:
        load_gguf_policy(tmp_path)
    _one_line(e, f"{tmp_path}: is a directory, not a GGUF file (it holds a.gguf)")


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # file left open
def test_a_full_disk_while_writing_gguf_is_one_line_and_keeps_the_old_file(
    policy, tmp_path, monkeypatch
):
    import gguf

    target = tmp_path / "model.gguf"
    write_gguf(policy, target, dtype="f32")
    before = target.read_bytes()

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full)
    with pytest.raises(OSError) as e:
        write_gguf(policy, target, dtype="f16")
    assert e.value.errno == errno.ENOSPC
    _one_line(e, f"no space left on the device of {target} (GGUF file not written")
    assert target.read_bytes() == before and os.listdir(tmp_path) == ["model.gguf"]
    gc.collect()  # an unclosed temporary file would be reported here


def test_a_gguf_target_that_is_a_symbolic_link_is_written_where_it_points(policy, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    write_gguf(policy, store / "model.gguf", dtype="f32")
    link = tmp_path / "current.gguf"
    link.symlink_to(store / "model.gguf")
    write_gguf(policy, link, dtype="f16")
    assert link.is_symlink() and os.readlink(link) == str(store / "model.gguf")
    assert load_gguf_policy(link).cfg == policy.cfg
    assert sorted(os.listdir(store)) == ["model.gguf"]
    assert sorted(os.listdir(tmp_path)) == ["current.gguf", "store"]
