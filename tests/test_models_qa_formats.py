"""A checkpoint of another format given where a llama2.c `.bin` is read (a GGUF file
without its suffix, a safetensors file, a PyTorch pickle or zip archive): one line
naming the file, what it is and how to load it."""

import pickle
import shutil
import zipfile

import jax
import pytest

import rlhf_eqx as rx
from rlhf_eqx.assets import asset_path
from rlhf_eqx.models import read_llama2c_header


@pytest.fixture(scope="module")
def policy():
    cfg = rx.TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32)
    return rx.Policy(cfg, key=jax.random.key(0))


def _refused(path, what):
    with pytest.raises(ValueError) as e:
        rx.load_llama2c(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: not a llama2.c checkpoint but {what}")


def test_a_gguf_file_named_bin(policy, tmp_path):
    pytest.importorskip("gguf", reason="GGUF files need the gguf package")
    rx.models.write_gguf(policy, tmp_path / "model.gguf", dtype="f32")
    shutil.copy(tmp_path / "model.gguf", tmp_path / "model.bin")
    _refused(tmp_path / "model.bin", "a GGUF file (magic 'GGUF'); load it with rlhf_eqx.load_gguf")


def test_a_safetensors_file(policy, tmp_path):
    rx.save_hf(policy, tmp_path / "hf")
    _refused(tmp_path / "hf" / "model.safetensors", "a safetensors file; load its Hugging Face")


@pytest.mark.parametrize("archive", ["pickle", "zip"])
def test_a_pytorch_checkpoint_is_named_and_not_unpickled(tmp_path, archive):
    path = tmp_path / "pytorch_model.bin"
    if archive == "pickle":
        path.write_bytes(pickle.dumps({"weight": [0.0] * 8}, protocol=2))
    else:
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    _refused(path, "a PyTorch checkpoint (a pickle or zip archive, not read")


def test_the_llama2c_checkpoint_still_reads():
    sizes, shared, version, _ = read_llama2c_header(asset_path("stories260K.bin"))
    assert (sizes["dim"], shared, version) == (64, True, 0)
