"""Column mappings: reading records whose fields have other names.

A mapping `{target: source}` reads the field `target` that a reader expects (e.g.
`"chosen"`) from the column or key `source` of the file (e.g. `"response_a"`), for
every file format (JSON lines, JSON lists, Parquet, Arrow). The targets are the names
the readers know (`COLUMN_NAMES`); an unknown target is refused, so that a typo does
not pass silently. A file column that has a target's name but is not mapped is replaced
by the mapped one; mapping `chosen` to `rejected` and `rejected` to `chosen` swaps the
two. Error messages name the file's own columns, not the targets.
"""

import re
from collections.abc import Mapping

from ._errors import DataError

COLUMN_NAMES: tuple[str, ...] = (
    "prompt",
    "chosen",
    "rejected",
    "margin",
    "conversations",
    "question",
    "answer",
    "turns",
    "completion",
    "label",
    "completions",
    "labels",
    "text",
    "messages",
)
"""The field names the readers know, the targets of a column mapping: preferences
(`prompt`, `chosen`, `rejected`, `conversations`, and a pair's `margin`), prompts
(`prompt`, `question`, `answer`, `turns`), unpaired records (`prompt`, `completion`,
`label`), stepwise records (`prompt`, `completions`, `labels`) and demonstrations
(`text`, `prompt` and `completion`, `messages`)."""


def check_columns(columns: Mapping[str, str] | None) -> dict[str, str]:
    """The mapping `{target: source}` as a dict, after checking it (`DataError` naming an
    unknown target, a source that is not a non-empty string, or two targets read from
    one source)."""
    if columns is None:
        return {}
    if not isinstance(columns, Mapping):
        raise DataError(
            f"columns must map field names to column names, got {type(columns).__name__}"
        )
    out = {}
    for target, source in columns.items():
        if target not in COLUMN_NAMES:
            raise DataError(f"columns: unknown field {target!r} (known: {', '.join(COLUMN_NAMES)})")
        if not isinstance(source, str) or not source:
            raise DataError(f"columns: {target!r} must map to a column name, got {source!r}")
        other = next((t for t, s in out.items() if s == source), None)
        if other is not None:  # e.g. chosen and rejected both from one column: equal
            raise DataError(
                f"columns: {other!r} and {target!r} both read the column {source!r}; a "
                "column is read as one field"
            )
        out[target] = source
    return out


def rename_columns(record: dict, columns: dict[str, str]) -> dict:
    """`record` with each mapped `source` key renamed to its `target` (unmapped columns
    that hold a target's name are dropped; a missing source stays missing)."""
    if not columns:
        return record
    sources = set(columns.values())
    out = {k: v for k, v in record.items() if k not in columns and k not in sources}
    for target, source in columns.items():
        if source in record:
            out[target] = record[source]
    return out


def source_names(text: str, columns: dict[str, str]) -> str:
    """`text` (a reader's message) with each quoted target name (`'chosen'`) replaced by
    the quoted name of the column it is read from (`'response_a'`)."""
    if not columns:
        return text
    names = "|".join(re.escape(t) for t in columns)
    return re.sub(f"'({names})'", lambda m: repr(columns[m[1]]), text)
