"""`rx.save_gguf` refuses what `rx.load_gguf` would refuse to read back: a chat template
that does not compile or cannot render a user turn is named, with the file, before
anything is written (an existing file at the target stays as it was)."""

import equinox as eqx
import jax
import pytest

import rlhf_eqx as rx
from rlhf_eqx import data
from rlhf_eqx.assets import asset_path

pytest.importorskip("gguf", reason="GGUF files need the gguf package")
pytest.importorskip("jinja2", reason="chat templates need jinja2")


@pytest.fixture(scope="module")
def model():
    tok = data.load_tokenizer(asset_path("tok512.bin"))
    cfg = rx.TransformerConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, d_ff=32)
    return rx.Policy(cfg, key=jax.random.key(0)), tok


@pytest.mark.parametrize(
    "template, why",
    [
        ("{{ foo( }}", "chat template syntax error at line 1"),
        ("{{ messages | nosuchfilter }}", "No filter named 'nosuchfilter'"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ],
)
def test_a_chat_template_load_gguf_would_refuse_is_not_written(model, tmp_path, template, why):
    policy, tok = model
    target = tmp_path / "model.gguf"
    rx.save_gguf(policy, target, tokenizer=tok, dtype="f32")
    before = target.read_bytes()
    with pytest.raises(data.DataError) as e:
        rx.save_gguf(policy, target, tokenizer=tok, chat_template=template)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"save_gguf: {target}: chat_template: ")
    assert why in msg and "nothing written" in msg
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_a_chat_template_that_renders_round_trips(model, tmp_path):
    policy, tok = model
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rx.save_gguf(policy, tmp_path / "m.gguf", tokenizer=tok, chat_template=template)
    _, back = rx.load_gguf(tmp_path / "m.gguf")
    assert back.chat_template == template


def test_a_bfloat16_model_exports_bit_for_bit_as_bf16(tmp_path):
    """`dtype="bf16"` keeps a bfloat16 model's weights exactly (f16 would round the small
    ones and refuse the large ones), and its range: a weight past float16's 65504."""
    import jax.numpy as jnp
    import numpy as np

    cfg = rx.TransformerConfig(
        vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=32, dtype="bfloat16"
    )
    policy = rx.Policy(cfg, key=jax.random.key(0))
    wide = lambda w: w.at[0, 0, 0].set(1e5) if w.ndim == 3 and w.shape[-1] == 32 else w
    layers = jax.tree.map(wide, policy.transformer.layers)
    policy = eqx.tree_at(lambda m: m.transformer.layers, policy, layers)
    with pytest.raises(ValueError, match="write it with dtype='bf16' or 'f32'"):
        rx.models.write_gguf(policy, tmp_path / "f16.gguf", dtype="f16")
    rx.models.write_gguf(policy, tmp_path / "bf16.gguf", dtype="bf16")
    back = rx.models.load_gguf_policy(tmp_path / "bf16.gguf", dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(policy), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    tokens = jnp.arange(1, 9)
    mask = jnp.ones(tokens.shape, bool)
    np.testing.assert_array_equal(back(tokens, mask), policy(tokens, mask))
