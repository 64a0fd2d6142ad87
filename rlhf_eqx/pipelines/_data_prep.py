"""Data-file helpers of the single-stage runs: the held-out split, prompts through the
model's chat template, the data-quality report and filters, prompt lengths, held-out
implicit accuracy and NLL, and what the data-file stages share (the split through the
chat template, a preference file's pairs with their report, the trained policy)."""

import dataclasses
import os
import re
from collections.abc import Callable, Sequence

import equinox as eqx
import jax.numpy as jnp

import rlhf_eqx as rx
from rlhf_eqx import data

from ._config import (
    DataConfig,
)
from ._field_checks import _fail
from ._metrics import MetricsLog
from ._runs import final_policy


def split_records(
    records: Sequence, dc: DataConfig, by: Callable[[object], str] | None = None
) -> tuple[list, list]:
    """Split records into training and held-out parts as the data runs do.

    **Arguments:**

    - `records`: preference or prompt records (anything with a `.prompt`).
    - `dc`: the run's `DataConfig`; `limit` (0: all), `heldout_fraction` and `seed`
      are used.
    - `by`: the text a record is split by (default: its `.prompt`), e.g. the text of a
      language-modelling record, which has no prompt.

    **Returns:**

    `(train, heldout)`: the first `dc.limit` records split by prompt (or `by`) with
    `data.split_held_out` (seeded by `dc.seed`; no prompt on both sides).

    **Raises:** `ValueError` naming the file when the reader kept no record, and naming
    `data.heldout_fraction` when either side of the split is empty.
    """
    report = getattr(records, "report", None)
    records = list(records)[: dc.limit or None]
    if not records and report is not None:
        raise ValueError(f"{report.path}: no usable records ({report})")
    if by is None:
        train, held = data.split_held_out(records, fraction=dc.heldout_fraction, seed=dc.seed)
    else:  # a text's side is its hash's: equal texts land on one side
        texts = [by(r) for r in records]
        _, held_texts = data.split_held_out(texts, fraction=dc.heldout_fraction, seed=dc.seed)
        out = set(held_texts)
        train = [r for r, t in zip(records, texts) if t not in out]
        held = [r for r, t in zip(records, texts) if t in out]
    if not train or not held:
        n = len(records)
        where = f" of {dc.path}" if dc.path else ""
        raise ValueError(
            f"data.heldout_fraction={dc.heldout_fraction}: the split of the {n} "
            f"record{'s' if n != 1 else ''}{where} by prompt left {len(train)} for training "
            f"and {len(held)} held out; use more records, another fraction or another "
            "data.seed (it picks the prompts held out)"
        )
    return list(train), list(held)


_HH_TURN = re.compile(r"\n\n(Human|Assistant|Tool):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant", "Tool": "tool"}
_PROBE = "\x00reply\x00"


def hh_messages(prompt: str) -> list[dict[str, str]]:
    """The conversation of a prompt: an HH-RLHF transcript (`"\\n\\nHuman: …\\n\\n
    Assistant: …\\n\\nHuman: …\\n\\nAssistant:"`, as `data.load_preferences` keeps
    it, message formats included) becomes its turns, every turn before the reply (text
    before the first turn: a system message; a `Tool:` turn, a tool's result as
    `data.format_chat` writes it: a tool message; the empty last `Assistant:` dropped);
    any other text is one user message."""
    parts = _HH_TURN.split(prompt)
    if len(parts) == 1:
        return [{"role": "user", "content": prompt.strip()}]
    messages = [{"role": "system", "content": parts[0].strip()}] if parts[0].strip() else []
    for role, content in zip(parts[1::2], parts[2::2]):
        messages.append({"role": _HH_ROLES[role], "content": content.strip()})
    if messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


@dataclasses.dataclass(frozen=True)
class ChatRendering:
    """Prompts and completions through a chat template: the prompt's conversation
    (`hh_messages`) with the generation prompt; a completion's text followed by the
    template's end-of-turn text `end` (what the template writes after an assistant
    message, e.g. `<|im_end|>`; its EOS text when that cannot be told). `strip_bos`: the
    BOS text the template writes at the start that the tokenizer also adds as an id
    (removed from the text, so the prompt has one BOS)."""

    template: "data.JinjaChatTemplate"
    end: str
    strip_bos: str = ""

    def prompt(self, text: str) -> str:
        """The prompt of a text (`hh_messages`): its turns rendered with the generation
        prompt (a text's last assistant turn is a turn of its own), the BOS text
        removed."""
        out = self.template.render(hh_messages(text), add_generation_prompt=True)
        return self._without_bos(out)

    def prompt_of(self, messages: Sequence) -> str:
        """The prompt of a conversation: its messages rendered with the generation
        prompt, or continuing its last message when that is the assistant's (a prefill:
        `data.render_prompt`), the BOS text removed."""
        return self._without_bos(data.render_prompt(list(messages), self.template.render))

    def _without_bos(self, text: str) -> str:
        if self.strip_bos and text.startswith(self.strip_bos):
            return text[len(self.strip_bos) :]
        return text

    def completion(self, text: str) -> str:
        return text.strip() + self.end

    def reply(self, prompt: Sequence, reply: Sequence) -> str:
        """The completion of a conversation's `reply` messages after its `prompt` ones:
        what the template writes for them after the prompt (with the generation prompt;
        a prompt ending with an assistant message is continued by the reply's first,
        `data.join_reply`), its trailing whitespace removed as `completion` removes it.
        A `DataError` when the template's text of the conversation does not start with
        the prompt's, or when it does not write an assistant message's tool calls (its
        text the same without them: the calls would be lost)."""
        prompt, reply = list(prompt), list(reply)
        for k, m in enumerate(reply):
            if m.get("tool_calls"):
                bare = {key: v for key, v in m.items() if key != "tool_calls"}
                head = prompt + reply[:k]
                if self.template.render([*head, m]) == self.template.render([*head, bare]):
                    raise data.DataError(
                        f"message {len(head)} ({m['role']}) has tool_calls, but the chat "
                        "template does not render them (its text is the same without "
                        "them); use a template that writes tool calls (data.chat_template="
                        "FILE)"
                    )
        start = self.prompt_of(prompt)
        full = self._without_bos(self.template.render(data.join_reply(prompt, reply)))
        if not full.startswith(start):
            raise data.DataError(
                "the chat template's assistant turn does not start with its generation "
                "prompt, so conversations cannot be split into prompt and completion"
            )
        return full[len(start) :].rstrip()

    def records(self, records: Sequence, source: Sequence | None = None) -> list:
        """Preference, unpaired or prompt records with their `prompt` rendered and their
        `chosen` / `rejected` / `completion` ended. A conversational record's own
        messages (`data.PromptRecord.messages`, `data.PreferenceRecord.messages`,
        `data.UnpairedRecord.messages`) are rendered as they are, not the text the reader
        rendered them to: a tool call reaches the template as a call, a message that
        quotes `\n\nAssistant:` stays one message, and a reply of several messages (a
        tool's result, another user turn) is written in the template's turns (`reply`);
        a reply of one assistant message with text alone is ended as a text is, unless
        it continues the prompt's last (assistant) message: then `reply` writes it.

        A record the template cannot render is a `DataError` that names the field and,
        when `source` (the reader's dataset the records are part of; `records` itself by
        default) says where the record is, the file and line (or row)."""
        out = []
        for r in records:
            try:
                out.append(self._record(r))
            except data.DataError as e:
                where = _location(records if source is None else source, r)
                if where is None:
                    raise
                raise data.DataError(f"{where}: {e}") from None
        return out

    def _record(self, r):
        """`records` of one record."""
        messages = getattr(r, "messages", None) or {}
        prompt_messages = messages.get("prompt")
        if prompt_messages is None:
            changes = {"prompt": self.prompt(r.prompt)}
        else:
            try:
                changes = {"prompt": self.prompt_of(prompt_messages)}
            except data.DataError as e:
                raise data.DataError(f"'prompt': {e}") from None
        for key in ("chosen", "rejected", "completion"):
            if not hasattr(r, key):
                continue
            reply = messages.get(key)
            if prompt_messages is None or reply is None or _one_text_turn(reply, prompt_messages):
                changes[key] = self.completion(getattr(r, key))
                continue
            try:
                changes[key] = self.reply(prompt_messages, reply)
            except data.DataError as e:
                raise data.DataError(f"{key!r}: {e}") from None
        return dataclasses.replace(r, **changes)


def _location(source: Sequence, record) -> str | None:
    """Where `record` is in its file, by the `locations` of the reader's dataset `source`
    it is part of (`None` when not known)."""
    locations = getattr(source, "locations", None) or ()
    return next((w for r, w in zip(source, locations) if r is record), None)


def _one_text_turn(reply: Sequence, prompt: Sequence) -> bool:
    """Whether a reply is one assistant message of text alone (no tool calls) that does
    not continue the prompt's last message (a prompt ending with the assistant's)."""
    continued = bool(prompt) and prompt[-1]["role"] == "assistant"
    one = len(reply) == 1 and reply[0]["role"] == "assistant"
    return one and not reply[0].get("tool_calls") and not continued


def chat_rendering(tok, dc: DataConfig) -> ChatRendering | None:
    """The run's `ChatRendering` from `data.chat_template`: `auto`, the tokenizer's
    template when it has one (`None` when it has none: the text is used as it is, as
    for the built-in stories model); `none`, `None`; a `.jinja` file, its template with
    the tokenizer's BOS and EOS text."""
    if dc.chat_template == "none":
        return None
    token = getattr(tok, "token", None)  # an HFTokenizer spells its special tokens
    if dc.chat_template == "auto":
        if getattr(tok, "chat_template", None) is None:
            return None
        template = tok.jinja_chat_template()
    else:
        with open(dc.chat_template, encoding="utf-8") as f:
            source = f.read()
        special = {}
        if token is not None:
            special = dict(bos_token=token(tok.bos_id), eos_token=token(tok.eos_id))
        template = data.JinjaChatTemplate(source, **special)
    user = [{"role": "user", "content": "?"}]
    prompt = template.render(user, add_generation_prompt=True)
    full = template.render(user + [{"role": "assistant", "content": _PROBE}])
    tail = full[len(prompt) :]
    if full.startswith(prompt) and tail.startswith(_PROBE):
        end = tail[len(_PROBE) :].rstrip()
    else:
        end = template.eos_token
    bos = template.bos_token if data.wants_bos(tok) else ""
    return ChatRendering(template, end, strip_bos=bos)


def render_chat(records: Sequence, tok, dc: DataConfig) -> list:
    """`records` through the run's chat template (`chat_rendering`), or as they are when
    there is none."""
    rendering = chat_rendering(tok, dc)
    return list(records) if rendering is None else rendering.records(records)


def prompt_tokens(tok, prompt: str) -> int:
    """The length of `prompt` as the model sees it: its tokens and BOS when the
    tokenizer asks for it (what must fit `sampling.prompt_length` for the prompt to stay
    whole)."""
    return len(tok.encode(prompt)) + int(data.wants_bos(tok))


def quality_report(
    records,
    tok,
    lengths: "data.SequenceLengths",
    dc: DataConfig,
    log: MetricsLog,
    load_report: "data.LoadReport | None" = None,
):
    """`data.preference_quality` of the training `records`, written to the run log and as a
    `data_quality` event in `metrics.jsonl` (with what the reader dropped, from
    `load_report`, whose first skipped lines a `skipped_records` event names:
    `log_skipped`); with `dc.filter`, `data.filter_preferences` drops those problems
    (`long_prompt`: pairs whose prompt with BOS does not fit the prompt length of
    `lengths`, so that every prompt trained on is whole) and a `data_filter` event says
    how many of each went.

    **Returns:** `(records to train on, report)`.
    """
    report = data.preference_quality(records, tokenizer=tok, lengths=lengths, add_eos=DATA_EOS)
    counts = {
        "pairs": report.total,
        "distinct_prompts": report.distinct_prompts,
        "identical": len(report.identical),
        "empty": len(report.empty),
        "exact_duplicates": len(report.exact_duplicates),
        "duplicate_prompts": len(report.duplicate_prompts),
        "prompt_length_mean": report.prompt_lengths.mean,
        "chosen_length_mean": report.chosen_lengths.mean,
        "rejected_length_mean": report.rejected_lengths.mean,
        "distinct_1": report.distinct_1,
        "distinct_2": report.distinct_2,
        "truncation": report.truncation.summary() if report.truncation else None,
    }
    dropped = dict(load_report.skipped) if load_report is not None else {}
    log_quality(log, report.summary(), dropped, counts)
    if load_report is not None:
        log_skipped(log, load_report)
    if not dc.filter:
        return list(records), report
    records = list(records)
    kept, dropped = data.filter_preferences(
        records, drop=tuple(f for f in dc.filter if f != "long_prompt")
    )
    counts = {k: len(v) for k, v in dropped.items()}
    if "long_prompt" in dc.filter:
        limit = lengths.max_prompt_length
        fits = [r for r in kept if prompt_tokens(tok, r.prompt) <= limit]
        counts["long_prompt"] = len(kept) - len(fits)
        kept = fits
    log_filter(log, dc, counts, len(records), kept, "pairs")
    return list(kept), report


def log_quality(log: MetricsLog, message: str, dropped: dict, counts: dict) -> None:
    """The `data_quality` event (`message`, a quality report's summary, with the line of
    what the reader `dropped`, `{reason: count}`; then `counts`) and its lines in the
    run log."""
    if dropped:
        message += "\nDropped by the reader: " + ", ".join(f"{k}: {v}" for k, v in dropped.items())
    log.write(
        {
            "event": "data_quality",
            "message": message,
            "skipped_by_reader": sum(dropped.values()),
            **{f"skipped/{k}": v for k, v in dropped.items()},
            **counts,
        }
    )
    log.info("data quality:\n  " + message.replace("\n", "\n  "))


def log_skipped(log: MetricsLog, report) -> None:
    """A `skipped_records` event (on stderr and in `metrics.jsonl`) when the reader left
    records of the file out (`report`, the dataset's `data.LoadReport`): how many of how
    many, why, and the first few as `path:line: reason`; nothing otherwise."""
    if not report.num_skipped:
        return
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(report.skipped.items()))
    where = "; ".join(report.examples)
    log.event(
        "skipped_records",
        f"the reader left out {report.num_skipped} of the {report.read} records ({reasons}): "
        f"{where}",
        skipped=report.num_skipped,
        read=report.read,
    )


def log_truncation(
    log: MetricsLog, path, report, what: str, remedy: str, numbers: Sequence | None = None
) -> list[int]:
    """A `truncation` event (on stderr and in `metrics.jsonl`) when the tokeniser cut the
    prompt or the completion of any training record of the file `path` (`report`, a
    `data.TokenizeReport`; `what` says what befell a cut completion, `remedy` the settings that
    give the records room), or left any out (`report.dropped`: a record with nothing left
    to train on, counted by reason), so that no cut goes unsaid; nothing otherwise. The
    event names the first cut records (`report.truncated_rows`) where they are in the file
    (`numbers[row]`, from `record_numbers`): `"lines 3, 7"` of a JSON lines file (the
    line counting blank ones, as its errors name it), `"items 0, 4"` of a JSON list,
    `"rows 0, 4"` of a table (0-based within its file); a number without its location
    (a record built by hand), or every one without `numbers`, as its row among the
    records tokenised, 1-based. The list returned (empty when nothing was cut), and
    the event's `truncated_records` (comma-separated), hold those numbers."""
    cut_prompts, cut_completions = report.prompt_truncated, report.completion_truncated
    dropped = report.num_dropped
    if not (cut_prompts or cut_completions or dropped):
        return []
    parts = []
    if cut_prompts:
        parts.append(f"{cut_prompts} of {report.total} prompts cut (their end kept)")
    if cut_completions:
        parts.append(f"{cut_completions} of {report.total} {what}")
    if dropped:
        reasons = ", ".join(f"{k}: {n}" for k, n in sorted(report.dropped.items()))
        parts.append(f"{dropped} of {report.total} left out ({reasons})")
    rows = list(report.truncated_rows)
    found = [numbers[i] for i in rows] if numbers is not None else [i + 1 for i in rows]
    found = [n for n in found if n is not None]
    places = [getattr(n, "where", None) for n in found]
    named = [int(n) for n in found]
    if named and all(places):
        parts.append(f"first cut: {_places(os.fspath(path), places)}")
    elif named:
        parts.append(f"first cut: records {', '.join(map(str, named))} (of those tokenised)")
    log.event(
        "truncation",
        f"{path}: {'; '.join(parts)}; {remedy}",
        prompt_truncated=cut_prompts,
        completion_truncated=cut_completions,
        dropped=dropped,
        records=report.total,
        truncated_records=", ".join(map(str, named)),
    )
    return named


MAX_NAMED = 5
"""How many records of each reason a `prompts_left_out` event names (`log_left_out`)."""


def log_left_out(
    log: MetricsLog,
    path,
    total: int,
    left: Sequence[tuple[str, str, Sequence]],
    remedy: str,
) -> list[int]:
    """A `prompts_left_out` event (on stderr and in `metrics.jsonl`) when a stage left
    prompts of the file `path` (`total` of them, those the reader kept) out for reasons
    of its own, after the reader (whose skipped lines `log_skipped` names); nothing
    otherwise. `left`: `(key, reason, places)` of each reason, `places` the
    `FilePlace`s of the prompts left out for it (`record_numbers`; `None` for one whose
    place is not known), e.g. `("long_prompt", "longer than sampling.prompt_length=16",
    ...)`. The event says how many went for each reason and names the first
    `MAX_NAMED` of each where they are in the file (`"lines 3, 7"`, `"items 0, 4
    (0-based)"`, `"rows 0, 4 (0-based)"`, `"line 3"`), then what keeps them (`remedy`);
    its fields:
    `left_out` (all of them), `records` (`total`), each reason's count under its key, and
    `left_out_records`, the numbers named, comma-separated (also returned)."""
    left = [(key, reason, list(places)) for key, reason, places in left if places]
    if not left:
        return []
    parts, named = [], []
    for _, reason, places in left:
        first = [p for p in places if p is not None][:MAX_NAMED]
        part = f"{len(places)} {reason}"
        if first:
            where = _places(os.fspath(path), [p.where for p in first])
            if len(first) == 1:  # "line 3", not "lines 3"
                where = re.sub(r"^(line|item|row)s ", r"\1 ", where)
            part += f" ({where}"
            part += ", ...)" if len(places) > len(first) else ")"
        parts.append(part)
        named += [int(p) for p in first]
    n = sum(len(places) for _, _, places in left)
    log.event(
        "prompts_left_out",
        f"{path}: {n} of {total} prompts left out: {'; '.join(parts)}; {remedy}",
        left_out=n,
        records=total,
        **{key: len(places) for key, _, places in left},
        left_out_records=", ".join(map(str, named)),
    )
    return named


_PLACE = re.compile(r"(?:: row |: item |:)(\d+)$")


class FilePlace(int):
    """The number of a record in its file (its line, counting blank ones; its item of a
    JSON list, 0-based; its row of a table, 0-based within its file) that keeps the
    reader's location of it, `where` (`"path:LINE"`, `"path:LINE: item N"`, `"FILE: row
    N"`)."""

    where: str

    def __new__(cls, where: str) -> "FilePlace":
        place = super().__new__(cls, int(_PLACE.search(where)[1]))
        place.where = where
        return place


def _places(path: str, locations: Sequence[str]) -> str:
    """Readers' locations in the file (or dataset directory) `path`, shortly: `"lines 3,
    7"`, `"items 0, 4"`, `"rows 0, 4"` when they are all of one kind in `path` itself,
    else each as a reader names it, `path/` left out (a saved dataset's files)."""
    kinds = []
    for where in locations:
        if where.startswith(f"{path}: row "):
            kinds.append("rows")
        elif where.startswith(f"{path}:") and ": item " in where[len(path) + 1 :]:
            kinds.append("items")
        elif where.startswith(f"{path}:") and where[len(path) + 1 :].isdigit():
            kinds.append("lines")
        else:
            kinds.append("")
    if kinds[0] and len(set(kinds)) == 1:
        numbers = ", ".join(str(int(FilePlace(w))) for w in locations)
        return f"{kinds[0]} {numbers}" + (" (0-based)" if kinds[0] != "lines" else "")
    prefix = path.rstrip(os.sep) + os.sep
    return ", ".join(w.removeprefix(prefix) for w in locations)


def record_numbers(records: Sequence, raw: Sequence, rendered: Sequence) -> dict[int, int]:
    """`{id(rendered[i]): place}`, the `FilePlace` of `raw[i]` (its line, item or row, with
    its location) in the file that `records` was read from (a reader's dataset, whose
    `locations` say where each record is); `raw` a part of `records`, e.g.
    `split_records`'s training side, and `rendered` the same records after
    `chat_records`, so that a later report on the rendered records can name them in the
    file (`log_truncation`). A record not in `records`, or whose location is not known
    (a dataset built by hand), is left out."""
    places = getattr(records, "locations", None) or [None] * len(records)
    at = {id(r): FilePlace(w) for r, w in zip(records, places) if w is not None}
    return {id(new): at[id(old)] for old, new in zip(raw, rendered) if id(old) in at}


def log_filter(log: MetricsLog, dc: DataConfig, counts: dict, total: int, kept, what: str):
    """The `data_filter` event of `data.filter` (how many of each kind went); a
    `ValueError` when nothing is left to train on."""
    log.event(
        "data_filter",
        f"dropped {total - len(kept)} of {total} {what} ("
        + ", ".join(f"{k}: {n}" for k, n in counts.items())
        + ")",
        kept=len(kept),
        **{f"dropped_{k}": n for k, n in counts.items()},
    )
    if not kept:
        raise ValueError(f"data.filter={dc.filter}: every training {what[:-1]} was dropped")


@eqx.filter_jit
def implicit_accuracy(policy, reference, batch, beta):
    lp = rx.train.sequence_logps
    margin = (
        lp(policy, batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask)
        - lp(reference, batch.chosen_tokens, batch.chosen_mask, batch.chosen_completion_mask)
        - lp(policy, batch.rejected_tokens, batch.rejected_mask, batch.rejected_completion_mask)
        + lp(reference, batch.rejected_tokens, batch.rejected_mask, batch.rejected_completion_mask)
    )
    return jnp.mean((beta * margin > 0).astype(jnp.float32))


@eqx.filter_jit
def nll(model, batch):
    logps = rx.train.sequence_logps(model, batch.tokens, batch.mask, batch.completion_mask)
    return -jnp.sum(logps) / jnp.sum(batch.completion_mask & batch.mask).astype(jnp.float32)


def is_preference_file(path: str, **options) -> bool:
    """Whether `path` holds preference pairs (`options`: the readers' `format`,
    `columns`, `split`, `DataConfig.read_options`): its first record is in a preference
    layout (`format="auto"`) or some record reads as the `format` given, even when
    another record is malformed, so that reading it as pairs then names that record
    rather than a mismatch of layouts at its first line."""
    try:
        records = data.load_preferences(path, lenient=True, **options)
    except (ValueError, OSError):
        return False
    return options.get("format", "auto") == "auto" or len(records) > 0


# --- what the data-file stages share ---------------------------------------------------


DATA_EOS = "auto"
"""How a data file's completions end (`data.tokenize_sft`'s `add_eos`): with EOS, as
TRL's trainers append it to each completion (`SFTTrainer`, `DPOTrainer`, `KTOTrainer`,
`RewardTrainer`), unless the chat template ended the turn with its end-of-turn token
already (ChatML's `<|im_end|>`), so that each completion ends exactly once and the model
learns to stop."""


def data_ctx(env):
    """The `RunContext` of a data-file stage: `env.ctx("")` with its completions ended
    (`add_eos=DATA_EOS`)."""
    return dataclasses.replace(env.ctx(""), add_eos=DATA_EOS)


def trained_policy(env, model):
    """`final_policy` (adapters merged, a quantised base decoded first: the merged
    policy is dense) of a data-file stage's trained model; `env`, the stage's, is the
    stage functions' calling convention."""
    del env
    return final_policy(model)


def chat_records(env, records, source: Sequence | None = None) -> list:
    """`records` through the model's chat template (`chat_rendering` of
    `data.chat_template`; recorded in the summary), or as they are. `source`: the
    reader's dataset the records are part of, whose locations name a record the
    template cannot render (`ChatRendering.records`)."""
    rendering = chat_rendering(env.tok, env.cfg.data)
    if rendering is None:
        return list(records)
    env.summary["chat_template"] = env.cfg.data.chat_template
    return rendering.records(records, source)


def chat_split(env, records) -> tuple[list, list]:
    """`split_records`, then both sides through the model's chat template
    (`chat_records`; the split is that of the file's text)."""
    train, held = split_records(records, env.cfg.data)
    return chat_records(env, train, records), chat_records(env, held, records)


def preference_split(env, c) -> tuple[list, list]:
    """The preference file's training and held-out pairs for the stage settings `c`
    (`max_length`): the quality report logged, `data.filter` applied, the truncation
    and the quality in the summary."""
    train, held, _ = located_preference_split(env, c)
    return train, held


def located_preference_split(env, c, *, log_cuts: bool = True) -> tuple[list, list, list]:
    """`preference_split`, and where each training pair is in the file (its
    `FilePlace`, `record_numbers`; `None` when not known), in the order of the pairs.
    `log_cuts=False`: no `truncation` event (a stage that leaves records out afterwards
    reports the cuts of those it keeps: `report_cuts`)."""
    cfg, tok = env.cfg, env.tok
    log = env.ctx("").log
    fmt = "auto" if cfg.data.format == "preference" else cfg.data.format  # sft's name
    records = data.load_preferences(cfg.data.path, fmt, **cfg.data.read_options())
    raw, held = split_records(records, cfg.data)
    train, held = chat_records(env, raw, records), chat_records(env, held, records)
    places = record_numbers(records, raw, train)
    lengths = _lengths(env, c)
    train, quality = quality_report(train, tok, lengths, cfg.data, log, records.report)
    _, report = data.tokenize_preferences(train, tok, lengths=lengths, add_eos=DATA_EOS)
    numbers = [places.get(id(r)) for r in train]
    if log_cuts:
        _log_cuts(env, c, report, "pairs", numbers)
    quality_counts = {
        "identical": len(quality.identical),
        "empty": len(quality.empty),
        "exact_duplicates": len(quality.exact_duplicates),
        "duplicate_prompts": len(quality.duplicate_prompts),
        "distinct_2": quality.distinct_2,
    }
    _summarise_split(env, records.report, train, held, report, quality_counts)
    return train, held, numbers


def _log_cuts(env, c, report, what: str, numbers: Sequence) -> None:
    """`log_truncation` of the training records of a data-file stage whose settings `c`
    cut their completions to `c.max_length` (`report` their `TokenizeReport`, `what` the
    records' noun, `numbers` where each is in the file, `record_numbers`)."""
    stage, limit = env.stage or "the stage", env.cfg.sampling.prompt_length
    log_truncation(
        env.ctx("").log,
        env.cfg.data.path,
        report,
        f"{what} had a completion cut (its end lost, to fit {stage}.max_length={c.max_length})",
        f"raise sampling.prompt_length={limit} or {stage}.max_length, or leave the long "
        "prompts out with data.filter=long_prompt",
        numbers,
    )


def report_cuts(env, c, records: Sequence, numbers: Sequence, what: str) -> None:
    """The `truncation` event (`log_truncation`) and `summary["truncation"]` of the
    `(prompt, completion)` records a data-file stage with settings `c` trains on, after
    it left some out (`located_preference_split(log_cuts=False)`), tokenised as it
    trains on them; `numbers`: where each is in the file, `what` their noun."""
    _, report = data.tokenize_sft(
        list(records), env.tok, lengths=_lengths(env, c), add_eos=DATA_EOS
    )
    _log_cuts(env, c, report, what, numbers)
    env.summary["truncation"] = {
        "records": report.total,
        "prompt_truncated": report.prompt_truncated,
        "completion_truncated": report.completion_truncated,
        "policy": report.summary(),
    }


def _lengths(env, c) -> "data.SequenceLengths":
    """The lengths of a data-file stage: `c.max_length`, prompts `sampling.prompt_length`."""
    return data.SequenceLengths(
        max_length=c.max_length, max_prompt_length=env.cfg.sampling.prompt_length
    )


def _summarise_split(env, load_report, train, held, report, quality: dict) -> None:
    """`summary["truncation"]` (the `TokenizeReport` `report` of the training records),
    `summary["data_quality"]` (what the reader dropped, then `quality`) and the line that
    says how many records each side has."""
    env.summary["truncation"] = {
        "records": report.total,
        "prompt_truncated": report.prompt_truncated,
        "completion_truncated": report.completion_truncated,
        "policy": report.summary(),
    }
    env.summary["data_quality"] = {"skipped_by_reader": dict(load_report.skipped), **quality}
    skipped = load_report.num_skipped
    env.say(
        f"{env.stage}: {len(train)} training / {len(held)} held-out records"
        + (f" ({skipped} dropped by the reader: {load_report})" if skipped else "")
    )


# --- demonstrations (the sft stage's files) ---------------------------------------------


_PAIR_FORMATS = ("preference", "hh", "sharegpt", "plain")
"""The `data.format`s of sft that name preference pairs (besides `messages`, which is a
conversation file's name first and a preference file's when its records are pairs)."""


def demonstrations(env) -> "tuple[data.DemonstrationDataset | None, bool]":
    """The data file's demonstrations (`data.load_demonstrations` in `data.format`, the
    assistant turns of `data.assistant_turns`), and whether they are rendered through the
    model's chat template already; `(None, False)` when the file holds preference pairs
    (`data.format` a preference layout, or detected as one), which `preference_split`
    reads as pairs.

    Conversations (`messages`, and conversational prompt-completion records) are
    rendered with the model's template itself (`chat_rendering`'s, its BOS text removed
    as there), each trained turn where that template puts it, with their tool calls and
    tool messages as given; the other records are read with the HH template and go
    through `chat_records` afterwards (`demonstration_split`)."""
    dc = env.cfg.data
    if dc.format in _PAIR_FORMATS:
        return None, False
    options = dict(dc.read_options(), assistant_turns=dc.assistant_turns)
    rendering = chat_rendering(env.tok, dc)
    read = dict(options, assistant_turns="last") if rendering is not None else options
    try:
        records = data.load_demonstrations(dc.path, dc.format, **read)
    except data.DataError:  # data.format=messages on preference pairs of messages
        if dc.format != "messages" or not is_preference_file(
            dc.path, format="messages", **dc.read_options()
        ):
            raise
        return None, False
    if records.report.format == "preference":
        return None, False
    if rendering is not None and records.report.format in ("messages", "prompt_completion"):
        own = data.load_demonstrations(dc.path, dc.format, template=rendering.template, **options)
        # Text prompt-completion records read the same with either template (their
        # text as given) and go through `chat_records`; conversations differ.
        if own.report.format == "messages" or list(own) != list(records):
            return _without_bos(own, rendering.strip_bos), True
    return records, False


def _without_bos(records, bos: str):
    """The records with the BOS text `bos` removed from the start of their prompts."""
    if not bos:
        return records
    kept = [
        dataclasses.replace(r, prompt=r.prompt[len(bos) :]) if r.prompt.startswith(bos) else r
        for r in records
    ]
    return type(records)(kept, records.report, records.locations)


def demonstration_split(env, c, records, rendered: bool = False) -> tuple[list, list]:
    """The training and held-out demonstrations of `records` (from `demonstrations`) for
    the stage settings `c` (`max_length`): split by prompt, a text (which has no
    prompt) by its text; through the model's chat template unless `rendered` already or
    a text, which is language modelling, not a chat turn; the quality report logged
    (`demo_quality`), `data.filter` applied, the truncation and the quality in the
    summary."""
    train, held, _ = located_demonstration_split(env, c, records, rendered)
    return train, held


def located_demonstration_split(
    env, c, records, rendered: bool = False, *, log_cuts: bool = True
) -> tuple[list, list, list]:
    """`demonstration_split`, and where each training demonstration is in the file (its
    `FilePlace`, `record_numbers`; `None` when not known), in their order; `log_cuts` as
    in `located_preference_split`."""
    text = records.report.format == "text"
    by = (lambda r: r.completion) if text else None
    raw, held = split_records(records, env.cfg.data, by)
    train = raw
    if rendered:
        env.summary["chat_template"] = env.cfg.data.chat_template
    elif not text:
        train, held = chat_records(env, raw, records), chat_records(env, held, records)
    places = record_numbers(records, raw, train)
    lengths = _lengths(env, c)
    train, quality = demo_quality(train, env, lengths, records.report)
    _, report = data.tokenize_demonstrations(train, env.tok, lengths=lengths, add_eos=DATA_EOS)
    numbers = [places.get(id(r)) for r in train]
    if log_cuts:
        _log_cuts(env, c, report, "demonstrations", numbers)
    _summarise_split(env, records.report, train, held, report, quality)
    return train, held, numbers


def refuse_other_filters(dc: DataConfig, applies: Sequence[str], why: str) -> None:
    """Refuse (`ConfigError` naming `data.filter`) the problems of `dc.filter` outside
    `applies`, those the records at hand cannot have: `"<problems>: <why>"`."""
    other = [f for f in dc.filter if f not in applies]
    if other:
        _fail("data.filter", dc.filter, f"{', '.join(other)}: {why}")


DEMONSTRATION_FILTERS: tuple[str, ...] = (
    "empty",
    "exact_duplicate",
    "duplicate_prompt",
    "long_prompt",
)
"""The `data.filter` problems that apply to demonstrations (`DemonstrationQuality.select`
drops them; `identical` is a preference pair's)."""


def demo_quality(records: Sequence, env, lengths, load_report) -> tuple[list, dict]:
    """`data.demonstration_quality` of the training demonstrations `records`, written to
    the run log and as a `data_quality` event (with what the reader dropped, and a
    `skipped_records` event naming the first lines it dropped: `log_skipped`); with
    `data.filter`, its `empty`, `exact_duplicate`, `duplicate_prompt` and `long_prompt`
    drop those (`DemonstrationQuality.select`) and a `data_filter` event says how many of
    each went; `identical`, a pair's problem (chosen = rejected), is refused naming the
    field rather than ignored.

    **Returns:** `(records to train on, summary["data_quality"]: the layout read and the
    counts)`."""
    tok, dc, log = env.tok, env.cfg.data, env.ctx("").log
    refuse_other_filters(
        dc,
        DEMONSTRATION_FILTERS,
        "a preference pair's problem, not a demonstration's (one completion per prompt); on a "
        f"{load_report.format or 'demonstration'} file {', '.join(DEMONSTRATION_FILTERS)} "
        "apply",
    )
    report = data.demonstration_quality(
        records, tokenizer=tok, lengths=lengths, format=load_report.format
    )
    counts = {
        "demonstrations": report.total,
        "distinct_prompts": report.distinct_prompts,
        **{f"{n}s" if n != "empty" else n: len(v) for n, v in report.problems.items()},
        "distinct_2": report.distinct_2,
    }
    log_quality(log, report.summary(), dict(load_report.skipped), counts)
    log_skipped(log, load_report)
    quality = {"format": load_report.format}
    quality.update(
        (k, v) for k, v in counts.items() if k not in ("demonstrations", "distinct_prompts")
    )
    filters = [f for f in dc.filter if f in report.problems]
    if not filters:
        return list(records), quality
    kept, tally = report.select(records, filters)
    log_filter(log, dc, tally, len(records), kept, "demonstrations")
    return kept, quality
