"""`load_tokenizer` tells a GGUF file by its magic bytes as well as by its `.gguf` name: a
GGUF file named `tok.bin` or without a suffix loads its tokenizer from the metadata, as
`tok.gguf` does, instead of reaching the llama2.c reader of `.bin`."""

import shutil

import jax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import data
from rlhf_eqx.assets import asset_path

TEXT = "Once upon a time, a little dog ran."


@pytest.fixture(scope="module")
def tok512():
    return data.load_tokenizer(asset_path("tok512.bin"))


@pytest.fixture(scope="module")
def gguf_path(tok512, tmp_path_factory):
    cfg = rx.TransformerConfig(
        vocab_size=512, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64
    )
    path = tmp_path_factory.mktemp("gguf") / "tok.gguf"
    rx.save_gguf(rx.Policy(cfg, key=jax.random.key(0)), path, tokenizer=tok512, dtype="f32")
    return path


@pytest.mark.parametrize("name", ["tok.gguf", "tok.bin", "tokenizer", "TOK.GGUF"])
def test_a_gguf_file_loads_its_tokenizer_whatever_its_name(tok512, gguf_path, tmp_path, name):
    path = tmp_path / name
    shutil.copyfile(gguf_path, path)
    tok = data.load_tokenizer(path)
    assert isinstance(tok, data.HFTokenizer)
    assert tok.vocab_size == 512
    assert tok.encode(TEXT) == tok512.encode(TEXT)
    assert tok.decode(tok512.encode(TEXT)) == tok512.decode(tok512.encode(TEXT))
    assert tok.bos_id == tok512.bos_id and tok.eos_id == tok512.eos_id


def test_a_llama2c_bin_file_still_loads_as_llama2c(tok512, tmp_path):
    path = tmp_path / "tok.bin"
    shutil.copyfile(asset_path("tok512.bin"), path)
    tok = data.load_tokenizer(path)
    assert isinstance(tok, data.Llama2cTokenizer)
    assert tok.encode(TEXT) == tok512.encode(TEXT)


def test_a_file_of_another_kind_without_a_suffix_is_refused_by_type(tmp_path):
    path = tmp_path / "tokenizer"
    path.write_bytes(b"GGU")  # shorter than the magic
    with pytest.raises(data.DataError, match="unknown tokenizer file type"):
        data.load_tokenizer(path)
