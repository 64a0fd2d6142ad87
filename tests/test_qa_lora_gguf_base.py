"""A PEFT adapter made on a Hugging Face checkpoint, loaded onto that checkpoint written
as GGUF and read back (whose q / k rows GGUF stores permuted for llama.cpp's rotary
layout): the adapter's columns must land on the same q / k outputs, so the model
computes what PEFT computed (`tests/fixtures/peft/reference.npz`)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import rlhf_eqx as rx

pytest.importorskip("gguf", reason="GGUF files need the gguf package")
from rlhf_eqx.models import load_gguf_policy, write_gguf  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
REFERENCE = np.load(os.path.join(FIXTURES, "peft", "reference.npz"))


@pytest.mark.parametrize("quantized", [False, True])
def test_peft_adapter_on_a_gguf_base_computes_what_peft_computes(quantized, tmp_path):
    hf = rx.load_hf(os.path.join(FIXTURES, "hf", "llama3"), dtype="float32")
    write_gguf(hf, tmp_path / "base.gguf", dtype="f32")
    base = load_gguf_policy(tmp_path / "base.gguf", quantized=quantized)
    model = rx.load_lora_adapter(base, os.path.join(FIXTURES, "peft", "rslora_regex"))
    tokens = jnp.asarray(REFERENCE["tokens"], jnp.int32)
    logits = np.asarray(model(tokens, jnp.ones(tokens.shape, bool)))
    np.testing.assert_allclose(logits, REFERENCE["rslora_regex"], atol=2e-5, rtol=0)
    merged = rx.merge_lora(rx.dequantize(model) if quantized else model)
    np.testing.assert_allclose(
        np.asarray(merged(tokens, jnp.ones(tokens.shape, bool))),
        REFERENCE["rslora_regex"],
        atol=2e-5,
        rtol=0,
    )
