"""Hugging Face model directories as transformers writes them: the tokenizer files
beside the weights."""

import json

import tokenizers

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
