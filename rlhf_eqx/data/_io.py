"""Reading JSON records from `.jsonl`, `.json` and compressed files (gzip, bzip2, xz; zstd
with `zstandard`), with a load report.

Two kinds of bad input are told apart:

- **malformed input** — a line that is not valid JSON or not valid UTF-8 (or a string
  with half of a UTF-16 pair, `"\\ud83d"`), a record that is not an object, a missing
  key, a value of the wrong type: an error
  (`DataError` naming the file and line) unless `lenient=True`, in which case the record
  is skipped and counted in the report;
- **unusable records** — well-formed, but with nothing to learn from (a preference pair
  that cannot be split into prompt and completions, identical completions, an empty
  completion or prompt): always skipped and counted, never guessed at.
"""

import bz2
import codecs
import dataclasses
import gzip
import itertools
import json
import lzma
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ClassVar, Generic, TypeVar, overload

import numpy as np

from ._arrow import open_table
from ._columns import check_columns, rename_columns, source_names
from ._errors import DataError

R = TypeVar("R")

_MAX_EXAMPLES = 20


class Malformed(Exception):
    """A record that is not well-formed (raised while parsing one record).

    `Malformed(reason, detail)`: `reason` is the report's category (e.g.
    `"missing key"`), `detail` says what exactly.
    """


class Unusable(Exception):
    """A well-formed record that is skipped (raised while parsing one record)."""


@dataclasses.dataclass
class LoadReport:
    """What a reader kept and skipped.

    - `path`: the file read; `format`: the record format used.
    - `read`: records (non-blank lines / list items) seen; `kept`: records returned.
    - `skipped`: `{reason: count}`; `examples`: the first few `"path:line: reason"`.
    - `locations`: where each kept record is in the file, in the order kept, as the
      reader's errors name it: `"path:LINE"` (the line counting blank ones), `"path:LINE:
      item N"` (a JSON list's item, 0-based, and the line it starts on), `"FILE: row N"`.
    """

    path: str
    format: str = ""
    read: int = 0
    kept: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    examples: list[str] = dataclasses.field(default_factory=list)
    locations: list[str] = dataclasses.field(default_factory=list, repr=False)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def skip(self, where: str, reason: str, detail: str = "") -> None:
        """Count one skipped record under `reason`."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(f"{where}: {reason}" + (f" ({detail})" if detail else ""))

    def __str__(self) -> str:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))
        return (
            f"{self.path} [{self.format}]: read {self.read}, kept {self.kept}, "
            f"skipped {self.num_skipped}" + (f" ({reasons})" if reasons else "")
        )


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _decompressed(path: str, data: bytes) -> bytes:
    """`data` decompressed when its first bytes say it is gzip, bzip2 or xz (as `datasets`
    reads `.gz`, `.bz2`, `.xz`); zstd with `zstandard` installed; a zip archive, or zstd
    without `zstandard`, is a `DataError` saying what to do."""
    if data[:4] == b"PK\x03\x04":
        raise DataError(f"{path}: a zip archive; extract its .jsonl / .json / .parquet file")
    if data[:4] == _ZSTD_MAGIC:
        try:
            import zstandard
        except ImportError:
            raise DataError(
                f"{path}: zstd-compressed; pip install zstandard, or decompress it (zstd -d)"
            ) from None
        try:
            return zstandard.ZstdDecompressor().decompressobj().decompress(data)
        except zstandard.ZstdError as e:
            raise DataError(f"{path}: cannot decompress: {e}") from None
    for magic, module in ((b"\x1f\x8b", gzip), (b"BZh", bz2), (b"\xfd7zXZ\x00", lzma)):
        if data.startswith(magic) or (module is gzip and path.endswith(".gz")):
            try:
                return module.decompress(data)
            except (OSError, EOFError, ValueError, lzma.LZMAError) as e:
                raise DataError(f"{path}: cannot decompress: {e}") from None
    return data


def _uncompressed_name(path: str) -> str:
    """`path` without a compression suffix (`pairs.json.gz` -> `pairs.json`)."""
    for suffix in (".gz", ".bz2", ".xz", ".zst"):
        if path.endswith(suffix):
            return path.removesuffix(suffix)
    return path


def _open_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        data = _decompressed(path, f.read())
    # A byte-order mark (files saved as "UTF-8 with BOM" by Windows editors) is not text;
    # one of UTF-16 (Windows' "Unicode", PowerShell's `>`) says how to read the text.
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return data.decode("utf-16").encode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].decode("utf-16", errors="replace").count("\n") + 1
            raise DataError(
                f"{path}:{line}: invalid UTF-16 (the file's byte-order mark): {e.reason}"
            ) from None
    return data.removeprefix(codecs.BOM_UTF8)


def _json_list(path: str, data: bytes) -> list | None:
    """The items of a file that is one JSON list: a `.json` file starting with `[` (`.json`
    files of one object per line are JSON lines), or a file of another name that is one
    JSON list as a whole (a `.jsonl` file written by `json.dump(rows, f)`, which
    `datasets`' JSON reader reads too); `None` for JSON lines (a JSON lines file of lists,
    not records, stays JSON lines, its lines refused one by one). A `.json` list that is
    not valid JSON as a whole cannot be read past the error: a `DataError`."""
    if data.lstrip()[:1] != b"[":
        return None
    base = _uncompressed_name(path)
    try:
        return _json_value(data)  # valid JSON that starts with `[`: a list
    except _InvalidJSON as e:
        if not base.endswith(".json"):
            return None
        raise DataError(f"{path}:{e.line}: {e.reason}: {e.position}: {e.message}") from None


_JSON_SPACE = " \t\n\r"


def _item_lines(data: bytes) -> Iterator[int]:
    """The 1-based line where each item of the valid JSON list `data` starts."""
    text = data.decode("utf-8")
    decoder = json.JSONDecoder()
    i, line, counted = text.index("[") + 1, 1, 0
    while True:
        while text[i] in _JSON_SPACE:
            i += 1
        if text[i] == "]":
            return
        if text[i] == ",":
            i += 1
            continue
        line += text.count("\n", counted, i)
        counted = i
        yield line
        _, i = decoder.raw_decode(text, i)


@dataclasses.dataclass
class _InvalidJSON(Exception):
    """Bytes that are not UTF-8 JSON: `reason` (`"invalid UTF-8"` or `"invalid JSON"`),
    the 1-based `line` within the bytes, the `position` within that line (`"byte N"`,
    0-based, or `"column N"`, 1-based) and the decoder's `message`."""

    reason: str
    line: int
    position: str
    message: str


def _json_value(raw: bytes) -> object:
    """`raw` decoded as UTF-8 and parsed as JSON (`_InvalidJSON` when it is not)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        raise _InvalidJSON(
            "invalid UTF-8",
            raw.count(b"\n", 0, e.start) + 1,
            f"byte {e.start - line_start}",
            e.reason,
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _InvalidJSON("invalid JSON", e.lineno, f"column {e.colno}", e.msg) from None


def _ends_early(e: _InvalidJSON, raw: bytes) -> bool:
    """Whether the JSON of the line `raw` failed for ending early (a string, object or
    list left open), as a line cut short does."""
    if e.reason != "invalid JSON":
        return False
    column = int(e.position.removeprefix("column "))
    text = raw.decode("utf-8").rstrip()
    return e.message.startswith("Unterminated string") or column > len(text)


def _refuse_one_object(path: str, data: bytes) -> None:
    """A `DataError` for a `.json` file that holds one object spread over several lines
    (`{"data": [...]}`, say): valid JSON, but neither a list of records nor one record
    per line, which its first line failing to parse alone would misreport as invalid."""
    base = _uncompressed_name(path)
    if not base.endswith(".json"):
        return
    try:
        value = _json_value(data)
    except _InvalidJSON:
        return
    if isinstance(value, dict):
        _refuse_by_columns(path, value)
        raise DataError(
            f"{path}: a .json file must hold a list of records or one record per line; this "
            f"one holds a single object over several lines, with the keys {sorted(value)[:10]}"
        )


def _refuse_by_columns(path: str, value: object) -> None:
    """A `DataError` for a file's first object when it is a table by columns, each column
    an object from row numbers to values (`{"prompt": {"0": ..., "1": ...}, ...}`, what
    pandas' `DataFrame.to_json(path)` writes by default): one object, not a record a row,
    which its columns' types would misreport as a record's wrong types."""
    if not isinstance(value, dict) or not value:
        return
    columns = list(value.values())
    if not all(isinstance(c, dict) and c and all(k.isdigit() for k in c) for c in columns):
        return
    if any(c.keys() != columns[0].keys() for c in columns):
        return
    raise DataError(
        f"{path}: one object of columns ({', '.join(list(value)[:10])}), each mapping the "
        f"{len(columns[0])} row numbers to values (pandas' DataFrame.to_json default), not a "
        "record a line; write records: df.to_json(path, orient='records', lines=True)"
    )


def _refuse_delimited(path: str) -> None:
    """A `DataError` for a CSV or TSV file (told by its suffix) whose first line is not
    JSON: not a format the readers take, which its first line's JSON error would not say."""
    base = _uncompressed_name(path)
    if base.lower().endswith((".csv", ".tsv")):
        raise DataError(
            f"{path}: a {base.rsplit('.', 1)[1].upper()} file is not read; give JSON lines, "
            "JSON, Parquet or Arrow (e.g. datasets.Dataset.from_csv(path).to_parquet(...))"
        )


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: object, key: str = "") -> str | None:
    """Where a string of the parsed JSON `value` holds half a UTF-16 pair (a `\\ud83d`
    escape without its other half, as text cut inside an emoji leaves it), which no
    tokenizer encodes: `"'prompt': \\ud83d at character 2 (...)"`; `None` when none does."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found is None:
            return None
        return (
            f"{key or 'a string'}: a lone surrogate \\u{ord(found[0]):04x} at character "
            f"{found.start()} (half of a UTF-16 pair: text cut inside a character)"
        )
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        found = _lone_surrogate(v, f"{key}[{k!r}]" if key else repr(k))
        if found:
            return found
    return None


def read_json_records(
    path: str | os.PathLike, report: LoadReport, *, lenient: bool
) -> Iterator[tuple[str, dict]]:
    """Yield `(location, record)` for each JSON object in the file.

    `location` is `"path:LINE"` for JSON lines and `"path:LINE: item N"` for a JSON
    list (the line where item `N`, 0-based, starts). Blank lines are ignored. Malformed
    lines raise `DataError`, or are counted in `report` when `lenient`. A `.json` list
    that is not valid JSON as a whole cannot be read past the error and always raises.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory; give the path of a .jsonl, .json or .gz file")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    data = _open_bytes(path)

    def bad(where: str, reason: str, detail: str) -> None:
        if not lenient:
            raise DataError(f"{where}: {reason}: {detail}")
        report.skip(where, reason, detail)

    escaped = _SURROGATE_ESCAPE.search(data) is not None  # a \\udXXX escape anywhere
    items = _json_list(path, data)
    if items is not None:
        for n, (line, item) in enumerate(zip(_item_lines(data), items)):
            where = f"{path}:{line}: item {n}"
            report.read += 1
            if not isinstance(item, dict):
                bad(where, "not a JSON object", type(item).__name__)
                continue
            if escaped and (half := _lone_surrogate(item)):
                bad(where, "invalid text", half)
                continue
            yield where, item
        return

    lines = data.split(b"\n")
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        report.read += 1
        try:
            item = _json_value(raw)
        except _InvalidJSON as e:
            if report.read == 1:
                _refuse_one_object(path, data)
                _refuse_delimited(path)
            # The last line without its newline: a file cut short (a copy or a write
            # interrupted), which a JSON lines writer would have ended.
            torn = ""
            if lineno == len(lines) and _ends_early(e, raw):
                torn = " (the last line, with no newline: the file looks cut short)"
            bad(where, e.reason, f"{e.position}: {e.message}{torn}")
            continue
        if not isinstance(item, dict):
            bad(where, "not a JSON object", type(item).__name__)
            continue
        if report.read == 1:
            _refuse_by_columns(path, item)
        if escaped and (half := _lone_surrogate(item)):
            bad(where, "invalid text", half)
            continue
        yield where, item


def parse_records(
    records: Iterator[tuple[str, dict]],
    parse,
    report: LoadReport,
    *,
    lenient: bool,
    columns: dict[str, str] | None = None,
    explain: Callable[[str, str], str] | None = None,
) -> list:
    """Apply `parse(record)` to each record, sorting failures into errors and skips.

    `columns`: the column mapping the records were renamed with (messages name the
    file's columns); `explain(reason, detail)`: the message of a malformed record
    (default `"reason: detail"`; a table's names the column)."""
    out = []
    for where, item in records:
        try:
            out.append(parse(item))
            report.locations.append(where)
        except Malformed as e:
            reason, detail = e.args[0], (e.args[1] if len(e.args) > 1 else "")
            detail = source_names(detail, columns or {})
            if explain is not None:
                detail = explain(reason, detail)
            if not lenient:
                raise DataError(
                    f"{where}: {detail if explain is not None else f'{reason}: {detail}'}"
                ) from None
            report.skip(where, reason, detail)
        except Unusable as e:
            report.skip(where, str(e))
        except DataError as e:  # e.g. an unknown chat role inside a message list
            if not lenient:
                raise DataError(f"{where}: {e}") from None
            report.skip(where, "malformed record", str(e))
    report.kept = len(out)
    return out


def load_records(
    path: str | os.PathLike,
    format: str,
    *,
    kind: str,
    formats: tuple[str, ...],
    detect: Callable[[dict], str | None],
    expected: str,
    make_parser: Callable[[str], Callable[[dict], R]],
    lenient: bool,
    columns: Mapping[str, str] | None = None,
    split: str | None = None,
) -> tuple[list[R], LoadReport]:
    """Read a file of `kind` records in `format` (`"auto"`: `detect` it from the keys of
    the first record) and parse each with `make_parser(format)`.

    JSON files are read by `read_json_records`; Parquet and Arrow files and saved
    `datasets` directories (`split`: one of a `DatasetDict`'s) row by row by the table
    reader, whose rows are the same records. `columns` maps the readers' field names to
    the file's (`check_columns`). `expected` describes the keys of the known formats,
    for the error when none fits. A file without a record (empty, blank lines only)
    raises `DataError` (`"FILE: no records"`), as a directory without a dataset does
    (`"FILE: is a directory"`).
    """
    path = os.fspath(path)
    if format != "auto" and format not in formats:
        raise DataError(f"unknown {kind} format {format!r}; use 'auto' or one of {formats}")
    columns = check_columns(columns)
    report = LoadReport(path=path, format=format)
    table = open_table(path, split)
    if table is None:
        records = read_json_records(path, report, lenient=lenient)
    else:
        missing = [t for t, c in columns.items() if c not in table.columns]
        if missing:
            source = columns[missing[0]]
            raise DataError(
                f"{path}: column {source!r} (read as {missing[0]!r}) is missing "
                f"(columns: {', '.join(table.columns)})"
            )
        records = table.records(report)
    first = next(records, None)
    if first is None:  # an empty file, blank lines only, or (lenient) nothing readable
        skipped = f" (read {report.read}, skipped {report.num_skipped})" if report.read else ""
        raise DataError(f"{path}: no records{skipped}")
    # A table's first row with its null columns, whose names say the layout as a JSON
    # line's null keys would (a null value is then refused by its column).
    shape = table.with_nulls(first[1]) if table is not None else first[1]
    if columns:
        shape = rename_columns(shape, columns)
        where, item = first
        missing = [t for t, c in columns.items() if isinstance(item, dict) and c not in item]
        if table is None and missing:  # JSON records: judged by the first one
            raise DataError(
                f"{where}: column {columns[missing[0]]!r} (read as {missing[0]!r}) is "
                f"missing (keys: {', '.join(sorted(item))})"
            )
        first = (where, rename_columns(item, columns) if isinstance(item, dict) else item)
        records = ((where, rename_columns(item, columns)) for where, item in records)
    if format == "auto":
        # The layout of the row with its null columns, as of the JSON line with its
        # nulls: a null `prompt` beside `chosen` / `rejected` is a pair with a null
        # prompt (refused by its column), not an implicit-prompt pair; a null `label` is
        # an unpaired record's, not a prompt-completion demonstration.
        detected = detect(shape)
        if detected is None:
            keys = source_names(str(sorted(shape)), columns)
            mapped = f" (columns read as: {columns})" if columns else ""
            raise DataError(
                f"{first[0]}: cannot tell the {kind} format from the keys {keys}{mapped}; "
                f"expected {expected}"
            )
        format = detected
    report.format = format
    parse = make_parser(format)
    rows = parse_records(
        itertools.chain([first], records),
        parse,
        report,
        lenient=lenient,
        columns=columns,
        explain=None if table is None else table.message,
    )
    return rows, report


def record_field(record: dict, key: str) -> object:
    """`record[key]` (`Malformed("missing key")` naming the key and the record's keys when
    the record has no such key)."""
    if key not in record:
        raise Malformed("missing key", f"no {key!r} in a record with keys {sorted(record)}")
    return record[key]


def string_field(record: dict, key: str) -> str:
    """`record[key]`, which must be a string (`Malformed` naming the key otherwise)."""
    value = record_field(record, key)
    if not isinstance(value, str):
        raise Malformed("wrong type", f"{key!r} must be a string, got {type(value).__name__}")
    return value


def boolean_value(value: object, name: str) -> bool:
    """`value` as a bool: a JSON boolean, or `0` / `1` as an integer or a float (`1.0`, as
    a Parquet or pandas column with a missing value holds its labels) or a NumPy scalar
    (`Malformed` naming `name`, such as `'label'`, otherwise)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, float, np.integer, np.floating)) and value in (0, 1):
        return bool(value)
    raise Malformed(
        "wrong type",
        f"{name} must be a boolean (true/false, or 0/1), got {type(value).__name__} {value!r}",
    )


def boolean_field(record: dict, key: str) -> bool:
    """`record[key]`, which must be a boolean or `0` / `1` (`Malformed` naming the key
    otherwise)."""
    return boolean_value(record_field(record, key), repr(key))


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """The number of leading items `a` and `b` share."""
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


class RecordDataset(Sequence, Generic[R]):
    """An immutable sequence of records with the `LoadReport` of the file they came from.

    Indexing with an int gives a record; with a slice, a dataset of the same class (and
    report). `select(indices)` takes any rows, in the order given. `locations[i]` says
    where record `i` is in the file (`"path:LINE"`, `"path:LINE: item N"`, `"FILE: row N"`:
    what an error about it would name; `None` when not known, as for records given
    without their `locations`): a reader gives them (`LoadReport.locations`), slices
    and selections keep them with their records.
    """

    noun: ClassVar[str] = "records"

    def __init__(
        self,
        records: Sequence[R],
        report: LoadReport,
        locations: Sequence[str | None] | None = None,
    ):
        self._records: tuple[R, ...] = tuple(records)
        self.report: LoadReport = report
        if locations is None or len(locations) != len(self._records):
            locations = [None] * len(self._records)
        self.locations: tuple[str | None, ...] = tuple(locations)

    @overload
    def __getitem__(self, index: int) -> R: ...

    @overload
    def __getitem__(self, index: slice) -> "RecordDataset[R]": ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return type(self)(self._records[index], self.report, self.locations[index])
        return self._records[index]

    def select(self, indices: Sequence[int]) -> "RecordDataset[R]":
        """The records at `indices` (in that order), as a dataset of the same class."""
        picked = [int(i) for i in indices]
        return type(self)(
            [self._records[i] for i in picked],
            self.report,
            [self.locations[i] for i in picked],
        )

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} {self.noun}; {self.report})"
