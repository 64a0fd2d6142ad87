"""From a request to the prompt ids the model is given: the chat template renders
`messages`, the tokenizer encodes the text, and a later turn of an episode reuses the
ids of the turns before it.

**Continuing an episode.** Re-encoding a whole conversation each turn would not give
back the tokens the model sampled (a tokenizer may split the sampled text otherwise), and
the turns would not join into one sequence for training. So for a request tagged with
an episode id whose messages are the previous turn's messages, then the reply the server
returned, then new ones, the prompt is the previous turn's ids (prompt and completion, as
sampled) followed by the encoding of what the conversation adds after the reply: the
template's end of the assistant turn (less a stop token the model already sampled) and
the new messages up to the generation prompt. A completions request continues an
episode the same way when its prompt text starts with the previous prompt and the
returned text. A request that repeats the last turn (a client's retry) continues the
turn before it again; one that continues neither is encoded afresh.
"""

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from .. import data
from ._protocol import RequestError

_MAX_EPISODES = 65536  # episodes whose last turn is remembered (least recent dropped)
DECODE_CONTEXT = 16  # tokens a text is decoded after (its leading space, its bytes)


@dataclasses.dataclass(frozen=True)
class EpisodeContext:
    """What the next turn of an episode continues: the last turn's `messages` (chat) and
    rendered `prompt_text`, the ids of its prompt and completion, the returned `content`,
    its `tail` that no completion id covers (the start of a token a stop string began
    in, `""` if none) and the text of the stop token that ended it (`""` if none);
    `previous`: the context that turn continued (its own `previous` dropped), which a
    client's retry of the turn continues again."""

    messages: tuple[dict, ...] | None
    prompt_text: str
    ids: tuple[int, ...]
    content: str
    stop_text: str
    tail: str = ""
    previous: "EpisodeContext | None" = None


def decode_after(tokenizer, context: Sequence[int], ids: Sequence[int]) -> str:
    """The text `ids` add after the tokens `context` (`decode(ids)` when there are
    none): a SentencePiece vocabulary drops the leading space of a text's first word,
    so `" upon"` after `"Once"` decodes alone as `"upon"`."""
    if not context:
        return tokenizer.decode(list(ids))
    before = tokenizer.decode(list(context))
    text = tokenizer.decode(list(context) + list(ids))
    return text[len(before) :] if text.startswith(before) else tokenizer.decode(list(ids))


def _render_function(tokenizer, chat_template):
    """`render(messages, add_generation_prompt) -> str` for the server's template."""
    if chat_template is None:
        if getattr(tokenizer, "chat_template", None) is not None:
            chat_template = tokenizer.jinja_chat_template()
        else:
            chat_template = "hh"
    if isinstance(chat_template, data.JinjaChatTemplate):
        template = chat_template
        return lambda messages, gen: template.render(list(messages), add_generation_prompt=gen)
    if isinstance(chat_template, str | data.ChatTemplate):
        name = chat_template
        data.format_chat([], name)  # an unknown name fails here, once
        return lambda messages, gen: data.format_chat(
            list(messages), name, add_generation_prompt=gen
        )
    raise TypeError(
        "chat_template must be None (the tokenizer's own, else 'hh'), 'hh', 'chatml', a "
        f"rlhf_eqx.data.ChatTemplate or a rlhf_eqx.data.JinjaChatTemplate, got "
        f"{type(chat_template).__name__}"
    )


def _same_message(a: dict, b: dict) -> bool:
    return a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "")


class PromptBuilder:
    """Renders and encodes prompts, and remembers each episode's last turn.

    **Arguments:**

    - `tokenizer`: the model's tokenizer.
    - `chat_template`: `None` (the tokenizer's own template, else `"hh"`), a built-in
      name, a `rlhf_eqx.data.ChatTemplate` or a `rlhf_eqx.data.JinjaChatTemplate`.
    """

    def __init__(self, tokenizer, chat_template: Any = None):
        self.tokenizer = tokenizer
        self.render = _render_function(tokenizer, chat_template)
        self.bos = [tokenizer.bos_id] if data.wants_bos(tokenizer) else []
        self._episodes: collections.OrderedDict[str, EpisodeContext] = collections.OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """A prompt's ids: BOS when the tokenizer asks for it, then the text's."""
        return self.bos + list(self.tokenizer.encode(text))

    def stop_text(self, stop_id: int | None) -> str:
        """The text of a stop token as a template writes it (`""` when it has none)."""
        if stop_id is None:
            return ""
        token = getattr(self.tokenizer, "token", None)
        return token(stop_id) if token is not None else self.tokenizer.decode([stop_id])

    def contexts(self, episode_id: str | None) -> tuple[EpisodeContext, ...]:
        """What a request of the episode may continue: its last turn, then the turn
        before that (a retry of the last turn, whose answer the client did not get)."""
        with self._lock:
            ctx = None if episode_id is None else self._episodes.get(episode_id)
        return tuple(c for c in (ctx, ctx and ctx.previous) if c is not None)

    def remember(self, episode_id: str, context: EpisodeContext) -> None:
        """Keep `context` as the episode's last turn, with the remembered turn it
        continued (its ids begin with that turn's, and go on) as its `previous`."""
        with self._lock:
            old = self._episodes.get(episode_id)
            bases = () if old is None else (old, old.previous)
            base = next(
                (
                    c
                    for c in bases
                    if c is not None
                    and len(c.ids) < len(context.ids)
                    and context.ids[: len(c.ids)] == c.ids
                ),
                None,
            )
            previous = None if base is None else dataclasses.replace(base, previous=None)
            self._episodes[episode_id] = dataclasses.replace(context, previous=previous)
            self._episodes.move_to_end(episode_id)
            while len(self._episodes) > _MAX_EPISODES:
                self._episodes.popitem(last=False)

    def chat(self, messages: Sequence[dict], episode_id: str | None) -> tuple[str, list[int]]:
        """`(rendered text, prompt ids)` of a chat request (continuing its episode when
        it can). Raises `RequestError` naming `messages` when the template refuses them."""
        try:
            text = self.render(messages, True)
        except data.DataError as e:
            raise RequestError(f"messages: {e}", param="messages") from None
        for ctx in self.contexts(episode_id):
            if ctx.messages is not None:
                ids = self._continue_chat(ctx, messages, text)
                if ids is not None:
                    return text, ids
        return text, self.encode(text)

    def _continue_chat(
        self, ctx: EpisodeContext, messages: Sequence[dict], text: str
    ) -> list[int] | None:
        prev = [*ctx.messages, {"role": "assistant", "content": ctx.content}]
        if len(messages) <= len(prev) or not all(
            _same_message(m, p) for m, p in zip(messages, prev)
        ):
            return None
        try:
            before = self.render(prev, False)
        except data.DataError:
            return None
        if not (text.startswith(before) and before.startswith(ctx.prompt_text)):
            return None
        turn = before[len(ctx.prompt_text) :]  # the template's rendering of the reply
        at = turn.find(ctx.content) if ctx.content else 0
        if at < 0:
            return None
        tail = turn[at + len(ctx.content) :] if ctx.content else turn
        if ctx.stop_text and tail.startswith(ctx.stop_text):
            tail = tail[len(ctx.stop_text) :]
        return self._extend(ctx.ids, ctx.tail + tail + text[len(before) :])

    def _extend(self, ids: Sequence[int], text: str) -> list[int]:
        """`ids` followed by the encoding of `text`, less a first token that only
        holds a SentencePiece dummy prefix (the space its encoder puts before a text,
        which after `ids` would be a space the conversation does not have)."""
        new = list(self.tokenizer.encode(text))
        context = list(ids[-DECODE_CONTEXT:])
        if new and decode_after(self.tokenizer, context, new) != text:
            if decode_after(self.tokenizer, context, new[1:]) == text:
                new = new[1:]
        return list(ids) + new

    def completion(self, prompt: str | tuple[int, ...], episode_id: str | None) -> list[int]:
        """The prompt ids of a completions request's prompt (continuing its episode when
        the text starts with the previous prompt and the returned text)."""
        if not isinstance(prompt, str):
            return list(prompt)
        for ctx in self.contexts(episode_id):
            before = ctx.prompt_text + ctx.content
            if ctx.messages is None and prompt.startswith(before):
                rest = prompt[len(before) :]
                if ctx.stop_text and rest.startswith(ctx.stop_text):
                    rest = rest[len(ctx.stop_text) :]
                return self._extend(ctx.ids, ctx.tail + rest)
        return self.encode(prompt)
