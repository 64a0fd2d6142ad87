"""Hugging Face model directories as transformers and PEFT write them: the tokenizer
files beside the weights, PEFT adapter directories."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

import rlhf_eqx as rx
from rlhf_eqx.data import load_tokenizer

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"


def _tokenizer_dir(path, **config):
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "a"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", **config}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_chat_template_jinja_file_beside_the_tokenizer(tmp_path):
    """transformers (since 4.50) saves the template as `chat_template.jinja`, not in
    `tokenizer_config.json`; that file wins over a template in the config, as in
    transformers."""
    d = _tokenizer_dir(tmp_path / "tf5")
    (d / "chat_template.jinja").write_text(TEMPLATE)
    tok = load_tokenizer(d)
    assert tok.chat_template == TEMPLATE
    rendered = tok.jinja_chat_template().render([{"role": "user", "content": "a"}])
    assert rendered == "[user] a</s>"
    both = _tokenizer_dir(tmp_path / "both", chat_template="{{ 'old' }}")
    (both / "chat_template.jinja").write_text(TEMPLATE)
    assert load_tokenizer(both).chat_template == TEMPLATE
    assert load_tokenizer(_tokenizer_dir(tmp_path / "none")).chat_template is None


def test_named_chat_templates_in_the_config(tmp_path):
    named = [
        {"name": "tool_use", "template": "{{ 'tools' }}"},
        {"name": "default", "template": TEMPLATE},
    ]
    assert load_tokenizer(_tokenizer_dir(tmp_path / "n", chat_template=named)).chat_template == (
        TEMPLATE
    )
    only_tools = named[:1]
    tok = load_tokenizer(_tokenizer_dir(tmp_path / "t", chat_template=only_tools))
    assert tok.chat_template is None


# The fields PEFT 0.21 writes in `adapter_config.json` beyond those `save_lora_adapter`
# writes (`peft.LoraConfig(...).save_pretrained`), all at their inactive values.
PEFT_021_EXTRAS = dict(
    alora_invocation_tokens=None,
    arrow_config=None,
    auto_mapping={"base_model_class": "LlamaForCausalLM", "parent_library": "transformers"},
    corda_config=None,
    ensure_weight_tying=False,
    eva_config=None,
    exclude_modules=None,
    layer_replication=None,
    layers_pattern=None,
    loftq_config={},
    lora_bias=False,
    megatron_config=None,
    megatron_core="megatron.core",
    peft_version="0.21.2",
    qalora_group_size=16,
    revision=None,
    target_parameters=None,
    trainable_token_indices=None,
    use_qalora=False,
)


@pytest.fixture
def adapter(tmp_path, getkey):
    cfg = rx.TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, d_ff=24)
    base = rx.Policy(cfg, key=getkey())
    lora = rx.apply_lora(base, rx.LoRAConfig(rank=2, alpha=4, targets=("q", "up")), key=getkey())
    rx.save_lora_adapter(lora, tmp_path / "adapter")
    return base, tmp_path / "adapter"


def _edit_config(directory, **changes):
    path = directory / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_peft_adapter_config_as_peft_writes_it_loads(adapter):
    base, directory = adapter
    _edit_config(directory, **PEFT_021_EXTRAS, lora_alpha=4, task_type=None)
    loaded = rx.load_lora_adapter(base, directory)
    assert loaded.transformer.layers.lora["q"].scale == 2.0
    toks = jnp.array([1, 2, 3])
    np.testing.assert_array_equal(loaded(toks, toks > 0), base(toks, toks > 0))


@pytest.mark.parametrize(
    "field, value",
    [
        ("layer_replication", [[0, 2], [1, 2]]),
        ("alora_invocation_tokens", [5, 6]),
        ("trainable_token_indices", [3]),
    ],
)
def test_peft_options_that_change_the_model_are_refused(adapter, field, value):
    base, directory = adapter
    _edit_config(directory, **{field: value})
    with pytest.raises(ValueError, match=f"adapter_config.json: `{field}` = .* not supported"):
        rx.load_lora_adapter(base, directory)


def test_peft_adapter_bad_files_are_named(adapter):
    base, directory = adapter
    _edit_config(directory, r=None)
    with pytest.raises(ValueError, match="adapter_config.json: `r` must be a positive number"):
        rx.load_lora_adapter(base, directory)
    (directory / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json: not valid JSON"):
        rx.load_lora_adapter(base, directory)
    (directory / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="adapter_config.json: file not found"):
        rx.load_lora_adapter(base, directory)


def test_load_hf_says_what_the_path_is_instead(adapter, tmp_path):
    """An adapter directory, a pickled-weights directory, a file and a missing path are
    each named for what they are."""
    _, directory = adapter
    with pytest.raises(FileNotFoundError, match="a PEFT adapter directory.*load_lora_adapter"):
        rx.load_hf(directory)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="required field `num_hidden_layers`"):
        rx.load_hf(pickled)  # the config is read first
    config = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=32,
    )
    (pickled / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin holds pickled PyTorch"):
        rx.load_hf(pickled)
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin: not a directory"):
        rx.load_hf(pickled / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="nowhere: no such directory"):
        rx.load_hf(tmp_path / "nowhere")


def test_add_bos_token_when_the_config_does_not_say(tmp_path):
    """transformers adds BOS where the config's `add_bos_token` says so; without it, for
    the Llama / Gemma tokenizer classes, and where the `tokenizer.json` post-processor
    puts it first (Llama 3); GPT-2-style files (Qwen, SmolLM2, and every file
    transformers 5 saves, which drops the field) get none."""
    plain = load_tokenizer(_tokenizer_dir(tmp_path / "plain"))
    assert plain.add_bos_token is False
    assert rx.data.tokenize_prompts(["a b"], plain)[0] == [(2, 3)]
    d = _tokenizer_dir(tmp_path / "template")
    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tok.save(str(d / "tokenizer.json"))
    assert load_tokenizer(d).add_bos_token is True
    assert rx.data.tokenize_prompts(["a b"], load_tokenizer(d))[0] == [(0, 2, 3)]
    llama = _tokenizer_dir(tmp_path / "llama", tokenizer_class="LlamaTokenizerFast")
    assert load_tokenizer(llama).add_bos_token is True
    said = _tokenizer_dir(tmp_path / "said", add_bos_token=True)
    assert load_tokenizer(said).add_bos_token is True
    config = {"eos_token": "</s>", "add_bos_token": False}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(d).add_bos_token is False


def test_adapter_config_lora_alpha_is_the_alpha_given(tmp_path, getkey):
    cfg = rx.TransformerConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=4, d_ff=24)
    base = rx.Policy(cfg, key=getkey())
    lora = rx.apply_lora(base, rx.LoRAConfig(rank=25, alpha=7), key=getkey())
    rx.save_lora_adapter(lora, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (25, 7.0)  # 7 / 25 * 25 is 7.000000000000001
    assert rx.load_lora_adapter(base, tmp_path).transformer.layers.lora["q"].scale == 7 / 25


def test_tokenizer_dir_with_only_slow_tokenizer_files_says_so(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(rx.data.DataError, match=r"no tokenizer.json.*vocab.json / merges.txt"):
        load_tokenizer(tmp_path)
