"""End-of-turn tokens stop generation: a tokenizer's `stop_ids` (EOS and its model's
end-of-turn ids: a GGUF file's `tokenizer.ggml.eot_token_id` / `eom_token_id`, an HF
directory's `generation_config.json` `eos_token_id` list) are the default stop set of
the pipelines' sampler, the server and the multi-turn environment, and are written back
by `save_gguf` and `save_hf`. The llama2.c and byte tokenizers stop at EOS alone, so the
built-in pipeline's defaults (EOS and BOS) are unchanged."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import rlhf_eqx as rx
from rlhf_eqx import data, pipelines as pl
from rlhf_eqx.envs import AnimalFollowUpEnv
from rlhf_eqx.models import config_from_hf, write_gguf
from rlhf_eqx.serving import Server

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package")

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PAD, EOS, BOS, UNK, SOT, EOT = range(6)
WORDS = ["\n", "▁", "user", "model", "▁hello", "▁there", *"abcdefghijklmnopqrstuvwxyz"]
V = 64
TOKENS = [*SPECIAL, *WORDS, *(f"<unused{i}>" for i in range(V - len(SPECIAL) - len(WORDS)))]
# Gemma's chat template, shortened: every turn ends in <end_of_turn>
TEMPLATE = (
    "{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _gemma_tokenizer(writer) -> None:
    """Gemma's tokenizer metadata, as llama.cpp's converter writes it, over `TOKENS`."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * len(SPECIAL) + [-float(i) for i in range(V - len(SPECIAL))])
    writer.add_token_types([3] * len(SPECIAL) + [1] * (V - len(SPECIAL)))
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(PAD)
    writer.add_unk_token_id(UNK)
    writer.add_eot_token_id(EOT)
    writer.add_chat_template(TEMPLATE)


def _answers_end_of_turn() -> rx.Policy:
    """A tiny Gemma whose every next token is <end_of_turn>: projections zero, so the last
    position's state is its token's embedding; all embeddings share one direction, the
    <end_of_turn> row ten times longer (the head is tied to the embedding)."""
    hf = {"architectures": ["GemmaForCausalLM"], "vocab_size": V, "hidden_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 8, "intermediate_size": 32}  # fmt: skip
    policy = rx.Policy(config_from_hf(hf), key=jax.random.key(0))
    zeros = jax.tree.map(jnp.zeros_like, policy.transformer.layers)
    policy = eqx.tree_at(lambda p: p.transformer.layers, policy, zeros)
    embed = jnp.ones((V, 16), jnp.float32).at[EOT].multiply(10.0)
    return eqx.tree_at(lambda p: p.transformer.embed, policy, embed)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "gemma.gguf"
    write_gguf(_answers_end_of_turn(), path, dtype="f32", metadata=_gemma_tokenizer)
    return path


def test_gguf_end_of_turn_is_a_stop_id(gemma):
    _, tok = rx.load_gguf(gemma)
    assert (tok.eos_id, tok.bos_id) == (EOS, BOS)
    assert tok.stop_ids == (EOS, EOT)


def test_sampling_stops_at_the_end_of_turn(gemma):
    """A chat prompt rendered by the file's template: the model's answer ends at its
    <end_of_turn>, as llama.cpp and transformers end it, not at the token budget."""
    policy, tok = rx.load_gguf(gemma)
    prompt = tok.jinja_chat_template().render(
        [{"role": "user", "content": "hello there"}], add_generation_prompt=True
    )
    assert prompt.endswith("<start_of_turn>model\n")
    roll = pl.runs.sample_rollout(
        policy, tok, [prompt], jax.random.key(0), group_size=2, prompt_length=48,
        max_new_tokens=6, temperature=1.0,
    )  # fmt: skip
    assert roll.completion_mask.sum(axis=1).tolist() == [1, 1]
    assert not roll.truncated.any() and roll.texts == ("", "")
    assert EOT in Server(policy, tok, port=0).scheduler.stop_ids
    assert EOT in AnimalFollowUpEnv(tok).stop_ids


def test_end_of_turn_written_back_by_save_gguf(gemma, tmp_path):
    policy, tok = rx.load_gguf(gemma)
    rx.save_gguf(policy, tmp_path / "again.gguf", tokenizer=tok, dtype="f32")
    reader = gguf.GGUFReader(tmp_path / "again.gguf")
    assert reader.fields["tokenizer.ggml.eot_token_id"].contents() == EOT
    assert rx.load_gguf(tmp_path / "again.gguf")[1].stop_ids == (EOS, EOT)


def test_hf_generation_config_list_is_read_and_written(gemma, tmp_path):
    """transformers stops at every id of `generation_config.json`'s `eos_token_id` (an
    id or a list); `save_hf` writes the list there and the directory's tokenizer reads
    it back."""
    policy, tok = rx.load_gguf(gemma)
    out = tmp_path / "hf"
    rx.save_hf(policy, out, bos_token_id=BOS, eos_token_id=list(tok.stop_ids))
    tok.save(out)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": BOS, "eos_token_id": [EOS, EOT]}
    assert data.load_tokenizer(out).stop_ids == (EOS, EOT)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOT}))
    assert data.load_tokenizer(out).stop_ids == (EOS, EOT)  # EOS first, then the model's
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 99]}))
    with pytest.raises(data.DataError, match=r"generation_config\.json: eos_token_id = "):
        data.load_tokenizer(out)


def test_built_in_tokenizers_stop_at_eos_and_bos_only():
    """The llama2.c and byte tokenizers name no end-of-turn id: the built-in pipeline's
    default stop set stays EOS and BOS."""
    policy, tok = pl.tools.load_model("builtin")
    assert tok.stop_ids == (tok.eos_id,) and data.ByteTokenizer().stop_ids == (2,)
    assert Server(policy, tok, port=0).scheduler.stop_ids == (tok.eos_id, tok.bos_id)
    assert AnimalFollowUpEnv(tok).stop_ids[:2] == (tok.eos_id, tok.bos_id)
    roll = pl.runs.dispatch_rollout(
        policy, tok, ["Once"], jax.random.key(0), prompt_length=8, max_new_tokens=2
    )
    assert roll.stop_ids == (1, 2)


def test_run_exports_and_text_environments_keep_the_end_of_turn(gemma, tmp_path):
    """A run's `<stage>/hf` export names every stop id in its `generation_config.json`
    (transformers' `generate` then stops there too), and an environment without stop ids
    of its own ends its turns where a single-turn completion stops (the tokenizer's stop
    ids and BOS, `default_stop_ids`)."""
    policy, tok = rx.load_gguf(gemma)
    pl.runs.export_policy(policy, str(tmp_path), "sft", tokenizer_file=str(gemma))
    generation = json.loads((tmp_path / "sft" / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [EOS, EOT]
    assert data.load_tokenizer(tmp_path / "sft" / "hf").stop_ids == (EOS, EOT)

    class Plain:  # an environment that names no stop ids
        stop_ids = ()

    assert pl.runs.turn_stop_ids(Plain(), tok) == (EOS, BOS, EOT)
    byte = data.ByteTokenizer()
    assert pl.runs.turn_stop_ids(Plain(), byte) == tuple(sorted({byte.eos_id, byte.bos_id}))
