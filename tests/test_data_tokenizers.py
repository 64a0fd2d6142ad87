"""Tokenizers: llama2.c (exactness against a literal port of `run.c`), sentencepiece,
Hugging Face tokenizers, bytes, and `load_tokenizer`."""

import json
import os
import random
import struct

import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import train_byte_bpe
from hypothesis import given, strategies as st

from rlhf_eqx import data

TOK512 = os.path.join("models", "stories260K", "tok512.bin")
WORDS = (
    "once upon a time there was little girl named lily she liked to play with her dog in "
    "the park sun happy big red ball ran fast and said hello"
).split()


def reference_encode(pieces: list[bytes], scores: list[float], text: str) -> list[int]:
    """llama2.c `encode` (bos=0, eos=0) transcribed line by line: dummy prefix, UTF-8
    characters or byte fallback (+3), then the quadratic best-pair merge loop."""
    lookup = {}
    for i, p in enumerate(pieces):
        lookup.setdefault(p, i)
    data_ = text.encode("utf-8")
    tokens = []
    if data_:
        tokens.append(lookup[b" "])
    buf = b""
    for k, c in enumerate(data_):
        if (c & 0xC0) != 0x80:
            buf = b""
        buf += bytes([c])
        nxt = data_[k + 1] if k + 1 < len(data_) else 0
        if (nxt & 0xC0) == 0x80 and len(buf) < 4:
            continue
        if buf in lookup:
            tokens.append(lookup[buf])
        else:
            tokens.extend(b + 3 for b in buf)
        buf = b""
    while True:
        best_score, best_id, best_idx = -1e10, -1, -1
        for i in range(len(tokens) - 1):
            merged = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]], -1)
            if merged != -1 and scores[merged] > best_score:
                best_score, best_id, best_idx = scores[merged], merged, i
        if best_idx == -1:
            break
        tokens[best_idx : best_idx + 2] = [best_id]
    return tokens


def read_tokenizer_bin(path: str) -> tuple[list[bytes], list[float]]:
    with open(path, "rb") as f:
        raw = f.read()
    offset, pieces, scores = 4, [], []
    while offset < len(raw):
        score, n = struct.unpack_from("<fi", raw, offset)
        pieces.append(raw[offset + 8 : offset + 8 + n])
        scores.append(score)
        offset += 8 + n
    return pieces, scores


@pytest.fixture(scope="module")
def tok512():
    from helpers import SHARED

    path = os.path.join(SHARED, TOK512)
    if not os.path.isfile(path):
        pytest.skip("../shared is not present")
    return data.Llama2cTokenizer.from_file(path)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A tiny BPE sentencepiece model with byte fallback, trained here in ~20 ms."""
    spm = pytest.importorskip("sentencepiece")
    d = tmp_path_factory.mktemp("spm")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) + rng.choice(".!?") for _ in range(300)]
    (d / "corpus.txt").write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"),
        model_prefix=str(d / "tiny"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return d / "tiny.model"


def export_llama2c(model_path, out_path) -> None:
    """sentencepiece model -> llama2.c tokenizer.bin, as llama2.c's `tokenizer.py` exports."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    blobs, scores = [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if i == sp.bos_id():
            piece = "\n<s>\n"
        elif i == sp.eos_id():
            piece = "\n</s>\n"
        blobs.append(piece.replace("\u2581", " ").encode("utf-8"))
        scores.append(sp.get_score(i))
    with open(out_path, "wb") as f:
        f.write(struct.pack("<i", max(len(b) for b in blobs)))
        for b, s in zip(blobs, scores):
            f.write(struct.pack("<fi", s, len(b)))
            f.write(b)


# ------------------------------------------------------------------------------ llama2.c


def test_llama2c_reads_tok512(tok512):
    assert tok512.vocab_size == 512
    assert (tok512.bos_id, tok512.eos_id, tok512.pad_id) == (1, 2, 0)
    assert tok512.pieces[3] == b"<0x00>" and tok512.pieces[258] == b"<0xFF>"
    assert isinstance(tok512, data.Tokenizer)


def test_llama2c_once_upon_a_time(tok512, shared_dir):
    pieces, scores = read_tokenizer_bin(os.path.join(shared_dir, TOK512))
    ids = tok512.encode("Once upon a time")
    assert ids == reference_encode(pieces, scores, "Once upon a time")
    assert ids == [403, 407, 261, 378]  # " Once", " upon", " a", " time"
    assert [tok512.pieces[i] for i in ids] == [b" Once", b" upon", b" a", b" time"]
    assert tok512.decode([tok512.bos_id] + ids + [tok512.eos_id]) == "Once upon a time"


def test_llama2c_byte_fallback(tok512):
    # "\n" is not a piece of tok512: byte fallback <0x0A> = 10 + 3.
    assert b"\n" not in tok512.pieces
    assert tok512.encode("\n") == [tok512.pieces.index(b" "), 13]
    assert tok512.encode("é") == [410, 485]  # " ", "é": a piece of its own
    ids = tok512.encode("ß")  # two UTF-8 bytes, not a piece
    assert ids == [410, 0xC3 + 3, 0x9F + 3]
    assert tok512.decode(ids) == "ß"
    # An incomplete UTF-8 sequence decodes with the replacement character.
    assert tok512.decode([0xC3 + 3]) == "\ufffd"
    assert tok512.encode("") == []


@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60))
def test_llama2c_matches_reference_ascii(tok512, text):
    assert tok512.encode(text) == reference_encode(list(tok512.pieces), list(tok512.scores), text)
    assert tok512.decode(tok512.encode(text)) == text


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30))
def test_llama2c_matches_reference_unicode(tok512, text):
    ids = tok512.encode(text)
    assert ids == reference_encode(list(tok512.pieces), list(tok512.scores), text)
    assert all(0 <= i < tok512.vocab_size for i in ids)
    assert tok512.decode(ids) == text


def test_llama2c_unchunked_path_matches_reference():
    """A vocabulary with a piece crossing a space ("a b") disables per-chunk encoding;
    the whole-text merge must still equal the reference."""
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % b for b in range(256)]
    extra = [b" ", b"a", b"b", b" a", b" b", b"a b", b" a b", b"ab", b"ba"]
    pieces += extra
    scores = [0.0] * 259 + [-float(i) for i in range(len(extra))]
    tok = data.Llama2cTokenizer(pieces, scores)
    assert not tok._chunked
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(rng.choice("ab  ") for _ in range(rng.randrange(12)))
        assert tok.encode(text) == reference_encode(pieces, scores, text)
        assert tok.decode(tok.encode(text)) == text


def test_llama2c_hh_transcripts_match_reference(tok512, shared_dir):
    ds = data.load_preferences(
        os.path.join(shared_dir, "data", "hh-rlhf", "harmless-base", "test.jsonl.gz")
    )
    short = sorted((r.prompt + r.chosen for r in ds), key=len)[:5]
    for text in short:
        ids = tok512.encode(text)
        assert ids == reference_encode(list(tok512.pieces), list(tok512.scores), text)
        assert tok512.decode(ids) == text


def test_llama2c_matches_sentencepiece(spm_model, tmp_path):
    """llama2.c's encoder reproduces sentencepiece BPE on an exported model."""
    import sentencepiece as spm

    export_llama2c(spm_model, tmp_path / "tokenizer.bin")
    tok = data.load_tokenizer(tmp_path / "tokenizer.bin")
    assert isinstance(tok, data.Llama2cTokenizer)
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    rng = random.Random(1)
    texts = ["Once upon a time, héllo 😀", "the  big\tred ball!", "lily"]
    texts += [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(20)]
    for text in texts:
        assert tok.encode(text) == sp.encode(text, out_type=int), text
        assert tok.decode(tok.encode(text)) == text


def test_llama2c_bad_file(tmp_path):
    (tmp_path / "bad.bin").write_bytes(struct.pack("<i", 4) + struct.pack("<fi", 0.0, 100) + b"ab")
    with pytest.raises(data.DataError, match="bad piece length"):
        data.Llama2cTokenizer.from_file(tmp_path / "bad.bin")


# --------------------------------------------------------------------------- sentencepiece


def test_sentencepiece(spm_model):
    import sentencepiece as spm

    tok = data.load_tokenizer(spm_model)
    assert isinstance(tok, data.SentencePieceTokenizer)
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 400)
    assert tok.pad_id == 0  # no pad piece: the unknown id
    text = "once upon a time there was a big red ball"
    ids = tok.encode(text)
    assert ids == sp.encode(text, out_type=int)
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == text


# ------------------------------------------------------------------------ HF tokenizers


def _train_hf(directory):
    return train_byte_bpe(directory, WORDS)


def test_hf_tokenizer(tmp_path):
    path = _train_hf(tmp_path)
    tok = data.load_tokenizer(tmp_path)  # a directory: finds tokenizer.json
    assert isinstance(tok, data.HFTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 300
    text = "once upon a time, the dog ran"
    ids = tok.encode(text)
    assert 1 not in ids and 2 not in ids  # no special tokens added
    assert len(ids) < len(text)  # merges were learned
    assert tok.decode([1] + ids + [2, 0, 0]) == text
    # Explicit names override the guess; tokenizer_config.json is read when present.
    assert data.HFTokenizer.from_file(path, bos_token="</s>").bos_id == 2
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<unk>"}}))
    assert data.HFTokenizer.from_file(path).eos_id == 3
    with pytest.raises(data.DataError, match="not in the vocabulary"):
        data.HFTokenizer.from_file(path, eos_token="<nope>")


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    return data.HFTokenizer.from_file(_train_hf(tmp_path_factory.mktemp("hf")))


@given(st.text(max_size=40, alphabet=st.characters(blacklist_categories=("Cs",))))
def test_hf_byte_level_round_trip(hf_tok, text):
    assert hf_tok.decode(hf_tok.encode(text)) == text


# -------------------------------------------------------------------------------- bytes


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",))))
def test_byte_tokenizer_round_trip(text):
    tok = data.ByteTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text


def test_byte_tokenizer_layout():
    tok = data.ByteTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 259)
    assert tok.encode("A\u00e9") == [65 + 3, 0xC3 + 3, 0xA9 + 3]
    assert tok.decode([0xC3 + 3]) == "\ufffd"
    assert isinstance(tok, data.Tokenizer)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(data.DataError, match="no such"):
        data.load_tokenizer(tmp_path / "missing.bin")
    (tmp_path / "vocab.txt").write_text("x")
    with pytest.raises(data.DataError, match="unknown tokenizer file type"):
        data.load_tokenizer(tmp_path / "vocab.txt")
    with pytest.raises(data.DataError, match="no tokenizer.json"):
        data.load_tokenizer(tmp_path)


def test_decode_continuation_keeps_the_leading_space(shared_dir):
    from rlhf_eqx.data import Llama2cTokenizer, decode_continuation

    tok = Llama2cTokenizer.from_file(f"{shared_dir}/models/stories260K/tok512.bin")
    prompt = tok.encode("Once upon a time, there was a")
    full = tok.encode("Once upon a time, there was a little girl")
    assert full[: len(prompt)] == prompt
    cont = decode_continuation(tok, prompt, full[len(prompt) :])
    assert cont == " little girl"
    assert tok.decode(full[len(prompt) :]) == "little girl"  # decoding alone loses the space


def test_llama2c_truncated_on_a_piece_boundary_is_refused(shared_dir, tmp_path):
    with open(os.path.join(shared_dir, TOK512), "rb") as f:
        raw = f.read()
    offset, ends = 4, []
    while offset < len(raw):
        (length,) = struct.unpack_from("<i", raw, offset + 4)
        offset += 8 + length
        ends.append(offset)
    cut = tmp_path / "tok301.bin"
    cut.write_bytes(raw[: ends[300]])  # 301 whole pieces
    promise = r"tok301.bin: the header promises pieces of up to 7 .*301 pieces"
    with pytest.raises(data.DataError, match=promise):
        data.Llama2cTokenizer.from_file(cut)
    late = tmp_path / "tok400.bin"
    late.write_bytes(raw[: ends[399]])  # the longest pieces survive: the count tells
    assert data.Llama2cTokenizer.from_file(late).vocab_size == 400
    with pytest.raises(data.DataError, match="tok400.bin: 400 pieces read but .* has 512"):
        data.Llama2cTokenizer.from_file(late, vocab_size=512)
    full = data.Llama2cTokenizer.from_file(os.path.join(shared_dir, TOK512), vocab_size=512)
    assert full.vocab_size == 512
    long_piece = tmp_path / "long.bin"
    long_piece.write_bytes(struct.pack("<i", 2) + struct.pack("<fi", 0.0, 3) + b"abc")
    with pytest.raises(data.DataError, match="piece 0 has 3 bytes, more than .*=2"):
        data.Llama2cTokenizer.from_file(long_piece)
    with pytest.raises(data.DataError, match="is a directory"):
        data.Llama2cTokenizer.from_file(tmp_path)


@pytest.mark.parametrize(
    "ids, message",
    [
        ([5, -1], "token id -1 at position 1 is outside the vocabulary"),
        ([5, 3.7], "must be integers, got 3.7 at position 1"),
        (np.array([5.0, 6.0]), "must be integers, got dtype float64"),
        ([259], "token id 259 at position 0 is outside"),
        ([True], "must be integers, got True"),
    ],
)
def test_decode_refuses_bad_ids(ids, message):
    # Shape checks (on in these tests, off for users) would refuse some of these first.
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        _decode_refuses(ids, message)
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def _decode_refuses(ids, message):
    with pytest.raises(data.DataError, match=message):
        data.ByteTokenizer().decode(ids)


def test_decode_accepts_arrays():
    tok = data.ByteTokenizer()
    ids = tok.encode("hi")
    assert tok.decode(np.array(ids, np.int32)) == "hi" == tok.decode(jnp.asarray(ids, jnp.int32))
    assert tok.decode(tuple(ids)) == "hi"


def test_every_tokenizer_refuses_ids_outside_its_vocabulary(tok512, hf_tok):
    for tok in (tok512, hf_tok, data.ByteTokenizer()):
        with pytest.raises(data.DataError, match="token id -1 at position 0"):
            tok.decode([-1, 5])
        with pytest.raises(data.DataError, match=f"token id {tok.vocab_size} at position 1"):
            tok.decode([5, tok.vocab_size])


def test_sentencepiece_reads_the_hugging_face_files_beside_it(spm_model, tmp_path):
    """A Llama-2-style directory (`tokenizer.model` with `tokenizer_config.json`): the
    chat template and `add_bos_token` are the directory's, as transformers reads them;
    `chat_template.jinja` comes first; without the files, no template and BOS first."""
    import shutil

    shutil.copyfile(spm_model, tmp_path / "tokenizer.model")
    plain = data.load_tokenizer(tmp_path)
    assert plain.chat_template is None and plain.add_bos_token and data.wants_bos(plain)
    template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    config = {"chat_template": template, "add_bos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = data.load_tokenizer(tmp_path)
    assert not data.wants_bos(tok)
    rendered = tok.jinja_chat_template().render([{"role": "user", "content": "hi"}])
    assert rendered == f"{tok.token(tok.bos_id)}[hi]" == "<s>[hi]"
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")
    assert data.load_tokenizer(tmp_path).jinja_chat_template().render([]) == "</s>"
