"""`rx.save_gguf` refuses what `rx.load_gguf` would refuse to read back: a chat template
that does not compile or cannot render a user turn is named, with the file, before
anything is written (an existing file at the target stays as it was)."""

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
