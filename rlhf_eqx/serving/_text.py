"""Completion text as it grows: the text a streamed row may send so far (never a
character cut in two, never the start of a stop string), and each token's own bytes
for the log-probabilities' `bytes` field.

A token may hold part of a UTF-8 character (the byte pieces of a SentencePiece
vocabulary, the byte-level pieces of a GPT-2-style one): the text decoded so far then
ends with U+FFFD until the tokens that complete the character arrive. That text is held
back, as Hugging Face's `TextStreamer` and vLLM's detokenizer do, so the pieces a stream
sends join into exactly the text of the whole completion.
"""

import functools
import re
from collections.abc import Sequence

from ..data import byte_alphabet
from ._prompts import decode_after

REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet (`rlhf_eqx.data.byte_alphabet`), reversed."""
    return {c: b for b, c in byte_alphabet().items()}


def _lossy(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The bytes token `token_id` adds to a text (its leading space included), or
    `None` when the tokenizer does not tell: a `token_bytes(id)` method; llama2.c
    `pieces` (`<0xHH>` a byte); else the vocabulary's spelling (`token(id)`) read as
    GPT-2 byte-level characters, a `<0xHH>` byte piece or SentencePiece text (`▁` a
    space), whichever decodes as the tokenizer decodes the token."""
    own = getattr(tokenizer, "token_bytes", None)
    if callable(own):
        return bytes(own(token_id))
    pieces = getattr(tokenizer, "pieces", None)
    if isinstance(pieces, Sequence) and pieces and isinstance(pieces[0], bytes | bytearray):
        m = _BYTE_PIECE.fullmatch(pieces[token_id].decode("latin-1"))
        return bytes([int(m.group(1), 16)]) if m else bytes(pieces[token_id])
    spell = getattr(tokenizer, "token", None)
    if not callable(spell):
        return None
    try:
        text = spell(token_id)
    except Exception:  # noqa: BLE001 - an id the vocabulary cannot spell
        return None
    if not isinstance(text, str):
        return None
    m = _BYTE_PIECE.fullmatch(text)
    if m:
        return bytes([int(m.group(1), 16)])
    alone = tokenizer.decode([token_id])
    chars = _byte_of_char()
    candidates = [text.replace("\u2581", " ").encode("utf-8")]
    if all(c in chars for c in text):
        candidates.insert(0, bytes(chars[c] for c in text))
    for raw in candidates:
        if _lossy(raw) == alone or _lossy(raw).lstrip(" ") == alone:
            return raw
    return None


def piece_entry(text: str, raw: bytes | None) -> tuple[str, list[int]]:
    """`(token, bytes)` of a log-probability entry: the token's text (a token that is
    part of a character spelled by its bytes, `\\xe2\\x80`) and its bytes as ints."""
    if raw is None or (REPLACEMENT not in text and _lossy(raw) != text):
        raw = text.encode("utf-8")  # what the token adds here (a leading space dropped)
    elif REPLACEMENT in text:
        if raw.startswith(b" ") and not text.startswith(" "):
            raw = raw[1:]
        text = raw.decode("utf-8", errors="backslashreplace")
    return text, list(raw)


def sendable(text: str, stop: Sequence[str]) -> str:
    """The part of a growing completion's `text` that no later token can change: less
    a character still incomplete (trailing U+FFFD) and an end that may be the start of a
    stop string."""
    text = text.rstrip(REPLACEMENT)
    held = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return text[: len(text) - held]


class StreamedRow:
    """What a streamed row has sent: `text` and the first `tokens` of its ids (those
    whose text is all within it). `advance(ids, text)` returns the new text and the
    number of new tokens to send after the row's ids so far (`ids`, no stop id, whose
    text is `text`: `decode_after(tokenizer, context, ids)`, decoded once by the caller).
    When nothing is held back every token is sent; else the tokens whose text fits are
    found one at a time."""

    def __init__(self, tokenizer, context: Sequence[int], stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.context = list(context)
        self.stop = tuple(stop)
        self.text = ""
        self.tokens = 0

    def advance(self, ids: Sequence[int], text: str) -> tuple[str, int]:
        full, text = text, sendable(text, self.stop)
        if not text.startswith(self.text):  # a decoding that changed its past: wait
            return "", 0
        new, self.text = text[len(self.text) :], text
        start = self.tokens
        if text == full:  # nothing held back: every token's text is in it
            self.tokens = len(ids)
        while self.tokens < len(ids):
            upto = decode_after(self.tokenizer, self.context, ids[: self.tokens + 1])
            if len(upto) > len(text):
                break
            self.tokens += 1
        return new, self.tokens - start
