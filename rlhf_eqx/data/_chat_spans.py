"""Where the assistant's text lies in a rendered chat: the `{% generation %}` jinja2
extension and the character spans it marks, the fallback search for assistant contents,
and token offsets that carry a character mask over to tokens.
"""

import math
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ._errors import DataError
from ._tokenizer import Tokenizer

# Unique markers written around generation blocks while rendering, removed afterwards:
# robust to output that jinja2 buffers (macros, `set` blocks) before it is emitted.
_OPEN = f"\x00<generation {uuid.uuid4().hex}>\x00"
_CLOSE = f"\x00</generation {uuid.uuid4().hex}>\x00"
_MARKERS = re.compile(f"({re.escape(_OPEN)}|{re.escape(_CLOSE)})")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _generation_extension(jinja2):
    """A jinja2 extension for `{% generation %}...{% endgeneration %}`: renders the body
    between the two markers, from which `render_with_assistant_mask` reads the spans."""

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_mark", [])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _OPEN + caller() + _CLOSE

    return Generation


def _spans_from_markers(raw: str) -> tuple[str, list[tuple[int, int]]]:
    parts, spans, depth, start, length = [], [], 0, 0, 0
    for piece in _MARKERS.split(raw):
        if piece == _OPEN:
            if depth == 0:
                start = length
            depth += 1
        elif piece == _CLOSE:
            depth -= 1
            if depth == 0 and length > start:
                spans.append((start, length))
        else:
            parts.append(piece)
            length += len(piece)
    if depth != 0:
        raise DataError("chat template: unbalanced {% generation %} blocks")
    return "".join(parts), spans


def _spans_from_contents(
    text: str, messages: Sequence[Mapping[str, Any]], eos: str, *, include_eos: bool = True
) -> list[tuple[int, int]]:
    """The `(start, end)` of each assistant message's content in `text`, searched in
    message order, each after the previous message's; over an `eos` that follows it when
    `include_eos` (`eos` also tells the turn's text from the template's markup)."""
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():  # nothing to find
            continue
        at = text.find(content, cursor)
        if at < 0 and content.strip():
            content = content.strip()
            at = text.find(content, cursor)
        if at < 0:
            if m.get("role") == "assistant":
                raise DataError(
                    f"message {i} (assistant): its content is not in the rendered text after "
                    "the previous messages (the template rewrites it); use a template with "
                    "{% generation %} blocks"
                )
            continue  # a system / user message the template rewrote: skip it
        if m.get("role") == "assistant" and eos:
            at = _ending_turn(text, content, at, eos)
        end = at + len(content)
        if m.get("role") == "assistant":
            if include_eos and eos and text.startswith(eos, end):
                end += len(eos)
            spans.append((at, end))
        cursor = end
    return spans


def _ending_turn(text: str, content: str, at: int, eos: str) -> int:
    """Where the assistant's `content` is in `text`, its first occurrence being at `at`:
    the occurrence that ends at the first `eos` after `at` when there is one (the turn's
    text, not a match inside the template's own markup before it: `"a"` in
    `<|im_start|>assistant`, `"A"` in `<｜Assistant｜>`), else `at`."""
    stop = text.find(eos, at)
    start = stop - len(content)
    if stop >= 0 and start >= at and text.startswith(content, start):
        return start
    return at


def token_offsets(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """`tokenizer.encode(text)` and each id's `(start, end)` character range in `text`.

    An `HFTokenizer` gives its offsets; for any other tokenizer they come from decoding
    growing prefixes of the ids (the end of token `k` is the length of the decoded first
    `k + 1` ids), which needs `decode(encode(text)) == text`.
    """
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "encode"):
        encoding = inner.encode(text, add_special_tokens=False)
        ids = [int(i) for i in encoding.ids]
        if ids == list(tokenizer.encode(text)):
            return ids, [(int(s), int(e)) for s, e in encoding.offsets]
    ids = [int(i) for i in tokenizer.encode(text)]
    if tokenizer.decode(ids) != text:
        raise DataError(
            f"{type(tokenizer).__name__} does not decode the rendered text back exactly "
            "(special tokens skipped, or normalisation), so its tokens cannot be aligned "
            "with characters; use a tokenizer with offsets (HFTokenizer)"
        )
    offsets, prev = [], 0
    for length in _prefix_lengths(tokenizer, ids):
        end = min(max(length, prev), len(text))
        offsets.append((prev, end))
        prev = end
    return ids, offsets


def _prefix_lengths(tokenizer: Tokenizer, ids: list[int], context: int = 8) -> list[int]:
    """`len(tokenizer.decode(ids[: k + 1]))` for each `k`, without decoding every prefix
    (quadratic: minutes for a long conversation). In blocks of about `sqrt(len(ids))` ids,
    each length is the block's start (a prefix decoded whole) plus what the ids from it
    add, decoded after `context` ids before it (a SentencePiece piece's space, a character
    split over byte tokens); the block's last is checked against its prefix decoded whole,
    and a block that does not agree is decoded prefix by prefix."""
    block = max(32, math.isqrt(len(ids)))
    lengths: list[int] = []
    start_length = 0  # len(decode(ids[:start]))
    for start in range(0, len(ids), block):
        stop = min(start + block, len(ids))
        before = max(start - context, 0)
        head = len(tokenizer.decode(ids[before:start])) if start > before else 0
        guess = [
            start_length + len(tokenizer.decode(ids[before : k + 1])) - head
            for k in range(start, stop)
        ]
        stop_length = len(tokenizer.decode(ids[:stop]))
        if guess[-1] != stop_length:
            guess = [len(tokenizer.decode(ids[: k + 1])) for k in range(start, stop)]
        lengths += guess
        start_length = stop_length
    return lengths
