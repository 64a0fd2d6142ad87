"""Whole-word matching on the text of token ids, inside jax.

A word's ids depend on its neighbours (BPE merges across "cat", " cat", "Cat.",
"cats"), so matching id sequences misses forms. Instead, each id is mapped to the bytes
of its piece (a table built once on the host), the bytes of a completion are laid end
to end, and a word is searched in them as a regular expression `\\bword\\b` with
`re.IGNORECASE` would: case-folded ASCII, and a word boundary before and after (the
start and end of the text count as boundaries). For each byte the table also records
whether it belongs to a word character (`str.isalnum()` or `_`, as `\\w`); a lone
byte-fallback byte of a multi-byte character counts as one.
"""

import re

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from ..data import Tokenizer, decode_continuation

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


def _piece_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each id's bytes as they appear inside a text (special ids: none)."""
    special = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id}
    pieces = getattr(tokenizer, "pieces", None)
    out = []
    if pieces is not None and len(pieces) == tokenizer.vocab_size:  # llama2.c / sentencepiece
        for i, p in enumerate(pieces):
            p = p if isinstance(p, bytes) else str(p).replace("\u2581", " ").encode()
            m = _BYTE_PIECE.fullmatch(p)
            out.append(b"" if i in special else bytes([int(m.group(1), 16)]) if m else p)
        return out
    anchor = tokenizer.encode("a")
    for i in range(tokenizer.vocab_size):
        text = "" if i in special else decode_continuation(tokenizer, anchor, [i])
        out.append(text.encode("utf-8"))
    return out


def _word_flags(piece: bytes) -> list[bool]:
    """Per byte: part of a word character (`\\w`)?"""
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError:
        return [chr(b).isalnum() or b == 0x5F if b < 0x80 else True for b in piece]
    flags = []
    for ch in text:
        flags += [ch.isalnum() or ch == "_"] * len(ch.encode("utf-8"))
    return flags


class TokenText(eqx.Module):
    """The bytes of every id's piece, case-folded, and their word-character flags.

    Build it with `TokenText.from_tokenizer(tokenizer)` (on the host, once).
    """

    data: Int[Array, "V L"]
    lengths: Int[Array, " V"]
    word: Bool[Array, "V L"]

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> "TokenText":
        pieces = _piece_bytes(tokenizer)
        L = max(1, max(len(p) for p in pieces))
        data = np.zeros((len(pieces), L), np.int32)
        word = np.zeros((len(pieces), L), bool)
        for i, p in enumerate(pieces):
            data[i, : len(p)] = list(p.lower())  # ASCII case folding
            word[i, : len(p)] = _word_flags(p)
        lengths = np.asarray([len(p) for p in pieces], np.int32)
        return cls(data=jnp.asarray(data), lengths=jnp.asarray(lengths), word=jnp.asarray(word))

    def contains(
        self,
        ids: Int[Array, " C"],
        mask: Bool[Array, " C"],
        forms: Int[Array, "F W"],
        form_lengths: Int[Array, " F"],
    ) -> Bool[Array, ""]:
        """Whether the text of `ids` (where `mask`) contains one of `forms` as a whole
        word, ignoring ASCII case.

        **Arguments:**

        - `ids`, `mask`: token ids and the real ones.
        - `forms`: `[F, W]` byte values of the words (lower case), zero-padded.
        - `form_lengths`: `[F]` their lengths in bytes (0 for an unused row).
        """
        C = ids.shape[0]
        L = self.data.shape[1]
        F, W = forms.shape
        valid = (jnp.arange(L)[None, :] < self.lengths[ids][:, None]) & mask[:, None]
        order = jnp.argsort(~valid.reshape(-1), stable=True)  # real bytes first, in order
        n = jnp.sum(valid)
        M = C * L
        keep = jnp.arange(M) < n
        text = jnp.where(keep, self.data[ids].reshape(-1)[order], -1)
        word = keep & self.word[ids].reshape(-1)[order]
        # pad with W non-word positions so every window and its end stay in range
        text = jnp.concatenate([text, jnp.full((W + 1,), -1, text.dtype)])
        word = jnp.concatenate([word, jnp.zeros((W + 1,), jnp.bool_)])
        starts = jnp.arange(M)
        window = text[starts[:, None] + jnp.arange(W)[None, :]]  # [M, W]
        inside = jnp.arange(W)[None, None, :] < form_lengths[:, None, None]  # [F, 1, W]
        equal = jnp.all((window[None] == forms[:, None, :]) | ~inside, axis=-1)  # [F, M]
        before = jnp.concatenate([jnp.ones((1,), jnp.bool_), ~word[: M - 1]])  # [M]
        after = ~word[starts[None, :] + form_lengths[:, None]]  # [F, M]
        hit = equal & before[None, :] & after & (form_lengths[:, None] > 0)
        return jnp.any(hit & keep[None, :])


def word_table(words: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """`[A, F, W]` lower-case byte values and `[A, F]` lengths of the forms of each of
    `A` words (rows zero-padded to the most forms `F` and the longest form `W`)."""
    encoded = [[f.lower().encode("utf-8") for f in forms] for forms in words]
    F = max(len(forms) for forms in encoded)
    W = max(len(f) for forms in encoded for f in forms)
    table = np.zeros((len(words), F, W), np.int32)
    lengths = np.zeros((len(words), F), np.int32)
    for a, forms in enumerate(encoded):
        for f, b in enumerate(forms):
            table[a, f, : len(b)] = list(b)
            lengths[a, f] = len(b)
    return table, lengths
