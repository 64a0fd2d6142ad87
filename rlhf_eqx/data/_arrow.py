"""Reading records from datasets as users have them: Parquet files, Arrow IPC files and
directories written by `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk`.

Reading needs only `pyarrow` (`pip install 'rlhf_eqx[datasets]'`). What is read is
told by the path:

- a `.parquet` file (or any file starting with Parquet's magic bytes `PAR1`);
- a `.arrow` / `.feather` file in either Arrow IPC format: the stream format that
  `datasets` writes (its cache and `save_to_disk` files) or the file format (Feather
  v2, `pyarrow.ipc.new_file`);
- a directory written by `Dataset.save_to_disk` (its `state.json` lists the `.arrow`
  files, read in that order), or any directory of `.parquet` / `.arrow` files (read in
  name order; files whose names put them in several splits, as a hub dataset's
  `data/train-00000-of-00001.parquet` and `data/test-00000-of-00001.parquet`, are
  read one split at a time, chosen as for a `DatasetDict`; files named as `push_to_hub`
  names them give their own split names, `train_prefs` and `train_sft` two splits);
- a directory written by `DatasetDict.save_to_disk` (`dataset_dict.json`), with its
  split chosen as `DIR:SPLIT` or `split="SPLIT"` (a dictionary of one split needs
  neither).

Each row becomes the record a JSON line would be: a dict of its columns, with null
values left out (so a column that `datasets` filled with nulls for the rows that lack
it reads as an absent key), nested lists and structs as lists and dicts, a `float32`
column's numbers as their shortest decimals (`0.1`, as `to_json` writes it). The record
parsers of the JSON readers then apply unchanged. Rows are named `FILE: row N`
(0-based, within that file), and a malformed row's error names its column:
`data.parquet: row 17: column 'chosen' is null`.
"""

import json
import os
import re
from collections.abc import Iterator

from ._errors import DataError

TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")
_PARQUET_MAGIC = b"PAR1"
_IPC_FILE_MAGIC = b"ARROW1"
_IPC_STREAM_MAGIC = b"\xff\xff\xff\xff"
_MISSING = re.compile(r"no '([^']+)' in a record")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(
            "reading Parquet and Arrow files needs pyarrow: pip install 'rlhf_eqx[datasets]'"
        ) from None
    return pyarrow


def _magic(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(6)


def _is_table_file(path: str) -> bool:
    if path.lower().endswith(TABLE_SUFFIXES):
        return True
    head = _magic(path)
    return head.startswith((_PARQUET_MAGIC, _IPC_FILE_MAGIC, _IPC_STREAM_MAGIC))


def _split_spec(path: str, split: str | None) -> tuple[str, str | None]:
    """`(directory, split)` of a `DIR:SPLIT` path; `(path, split)` otherwise."""
    if os.path.exists(path) or ":" not in path:
        return path, split
    base, _, name = path.rpartition(":")
    if not (name and os.path.isdir(base)):
        return path, split
    if split is not None and split != name:
        raise DataError(f"{path}: the split {name!r} of the path differs from split={split!r}")
    return base, name


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object")
    return value


def _directory_files(directory: str, split: str | None, *, every_split: bool) -> list[str]:
    dict_file = os.path.join(directory, "dataset_dict.json")
    if os.path.isfile(dict_file):
        splits = _read_json(dict_file).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DataError(f"{dict_file}: 'splits' must be a list of names")
        if split is None and every_split:
            return [
                f
                for s in splits
                for f in _directory_files(os.path.join(directory, s), None, every_split=False)
            ]
        if split is None:
            if len(splits) != 1:
                raise DataError(
                    f"{directory}: a DatasetDict with the splits {splits}; choose one as "
                    f"{directory}:SPLIT (split=SPLIT; --set data.split=SPLIT in a run)"
                )
            split = splits[0]
        if split not in splits:
            raise DataError(f"{directory}: no split {split!r} (splits: {', '.join(splits)})")
        return _directory_files(os.path.join(directory, split), None, every_split=False)
    not_a_dict = DataError(
        f"{directory}: split={split!r}, but this is not a DatasetDict directory "
        "(no dataset_dict.json) nor one of files named by split (train-*.parquet, ...)"
    )
    state_file = os.path.join(directory, "state.json")
    if os.path.isfile(state_file):
        if split is not None:
            raise not_a_dict
        entries = _read_json(state_file).get("_data_files")
        if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries
        ):
            raise DataError(f"{state_file}: '_data_files' must list {{'filename': ...}} entries")
        files = [os.path.join(directory, e["filename"]) for e in entries]
        for f in files:
            if not os.path.isfile(f):
                raise DataError(f"{f}: no such file (listed in {state_file})")
        return files
    names = sorted(n for n in os.listdir(directory) if n.lower().endswith(TABLE_SUFFIXES))
    if not names:
        raise DataError(
            f"{directory}: is a directory; give the path of a .jsonl, .json, .gz, .parquet or "
            ".arrow file, or a directory written by datasets' save_to_disk" + _held(directory)
        )
    by_split: dict[str, list[str]] = {}
    for n in names:
        by_split.setdefault(_file_split(n) or "", []).append(n)
    named = _named_splits(names)
    if named and len(named) > len(by_split):  # train_prefs and train_sft: two splits
        by_split = named
    if split is not None:
        if split in named and split not in by_split:  # dev-00000-of-00001.parquet: "dev"
            by_split = {split: named[split]}
        if not split or split not in by_split:
            if len(by_split) == 1 and "" in by_split:
                raise not_a_dict
            raise DataError(
                f"{directory}: no split {split!r} (the file names give the splits: "
                f"{', '.join(sorted(s for s in by_split if s))})"
            )
        names = by_split[split]
    elif not every_split and len([s for s in by_split if s]) > 1:
        raise DataError(
            f"{directory}: files of the splits {sorted(s for s in by_split if s)} (by their "
            f"names, as datasets reads a hub dataset's data/ folder); choose one as "
            f"{directory}:SPLIT (split=SPLIT; --set data.split=SPLIT in a run)"
        )
    return [os.path.join(directory, n) for n in names]


def _held(directory: str) -> str:
    """What a directory without a dataset holds that a reader reads, as a hint: its JSON
    files (each read alone), or the `data/` folder of a hub dataset's clone."""
    found = sorted(
        n
        for n in os.listdir(directory)
        if n.lower().endswith((".jsonl", ".json", ".gz", ".bz2", ".xz", ".zst"))
    )
    if found:
        more = f", ... ({len(found)} files)" if len(found) > 3 else ""
        return f" (it holds {', '.join(found[:3])}{more}: give one)"
    data = os.path.join(directory, "data")
    if os.path.isdir(data) and any(n.lower().endswith(TABLE_SUFFIXES) for n in os.listdir(data)):
        return f" (its data/ folder holds a dataset's files: give {data})"
    return ""


_SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
"""The words of a data file's name that put it in a split, as `datasets` reads a
directory of data files (its `SPLIT_KEYWORDS`)."""


_SHARD_NAME = re.compile(r"^(.+?)-\d{5}-of-\d{5}(?:-[0-9a-f]+)?\.(?:parquet|arrow)$")
"""The name `push_to_hub` gives a split's file: `SPLIT-00000-of-00002.parquet` (with a
hash before the suffix in older versions)."""


def _named_splits(names: list[str]) -> dict[str, list[str]]:
    """The files of each split by the split names in the files' own names, when every
    file is named as `push_to_hub` names them (`train_prefs-00000-of-00001.parquet`,
    `test_prefs-...`: the splits `train_prefs` and `test_prefs`, which `datasets` reads
    from the dataset card where its split words alone would make both `train_prefs` and
    `train_sft` part of `train`); `{}` otherwise, or when a name holds no split word
    (`data-00000-of-00002.arrow`: one dataset's shards)."""
    found = [_SHARD_NAME.match(n.lower()) for n in names]
    if not all(found) or not all(_file_split(m[1] + "-") for m in found):
        return {}
    named: dict[str, list[str]] = {}
    for n, m in zip(names, found):
        named.setdefault(n[: len(m[1])], []).append(n)
    return named


def _file_split(name: str) -> str | None:
    """The split (`"train"`, `"validation"` or `"test"`) of a data file by its name, as
    `datasets` tells it: one of the split's words (`train`, `dev`, `eval`, ...) at the
    start of the name or after a separator (`-`, `.`, `_`, a space or a digit) and
    followed by one (`train-00000-of-00001.parquet`, `my_test.arrow`); `None` when the
    name holds none."""
    for split, words in _SPLIT_WORDS.items():
        for word in words:
            if re.search(rf"(^|[-._ 0-9]){word}[-._ 0-9]", name.lower()):
                return split
    return None


def dataset_files(
    path: str | os.PathLike, split: str | None = None, *, all_splits: bool = False
) -> list[str]:
    """The files a reader (`load_preferences`, `load_prompts`, ...) reads for `path`.

    **Arguments:**

    - `path`: a `.jsonl` / `.json` / `.gz` file, a `.parquet` / `.arrow` file, a
      directory written by `datasets`' `save_to_disk`, or `DIR:SPLIT` for one split of
      a `DatasetDict` directory.
    - `split`: the split of a `DatasetDict` directory (as `DIR:SPLIT` does).
    - `all_splits`: for a `DatasetDict` directory without a split, the files of every
      split (what a run's data fingerprint covers) instead of an error when it has
      several.

    **Returns:** the paths, in reading order: `[path]` for a file, the Arrow files of a
    saved dataset (of its only split, or of `split`).

    **Raises:** `DataError` naming the path when it does not exist, when a directory
    holds no dataset, when a `DatasetDict` has several splits and none is chosen, or
    when a split is unknown or given for a file.
    """
    path = os.fspath(path)
    base, split = _split_spec(path, split)
    if os.path.isdir(base):
        return _directory_files(base, split, every_split=all_splits)
    if not os.path.isfile(base):
        raise DataError(f"{path}: no such file")
    if split is not None:
        raise DataError(
            f"{path}: split={split!r} needs a directory written by DatasetDict.save_to_disk"
        )
    return [base]


class Table:
    """The Arrow files of one dataset and their column names (those of the first file)."""

    def __init__(self, path: str, split: str | None):
        base, split = _split_spec(path, split)
        self.path = path
        self.files = (
            _directory_files(base, split, every_split=False)
            if os.path.isdir(base)
            else dataset_files(base, split)
        )
        if not self.files:  # `save_to_disk` of an empty dataset lists no data file
            raise DataError(f"{path}: no records")
        self.columns: tuple[str, ...] = tuple(_schema(self.files[0]).names)
        self._file_columns = self.columns  # those of the file being read

    def records(self, report) -> Iterator[tuple[str, dict]]:
        """Yield `("FILE: row N", record)` for every row, counting them in `report.read`
        (`message` then names the columns of the file of the last row yielded)."""
        for file in self.files:
            self._file_columns = tuple(_schema(file).names)
            n = 0
            try:
                for batch in _batches(file):
                    for row in _as_written(batch).to_pylist():
                        report.read += 1
                        yield f"{file}: row {n}", _without_nulls(row)
                        n += 1
            except _Unreadable as e:  # damaged after its first rows: say where
                if not n:
                    raise
                raise DataError(f"{file}: row {n}: {e.reason} (from this row on)") from None

    def with_nulls(self, row: dict) -> dict:
        """`row` (the last row yielded) with the columns of its file that are null in it
        given as `None`: what the row is before `records` leaves its nulls out, for telling
        a dataset's layout from its columns."""
        return {**{c: None for c in self._file_columns}, **row}

    def message(self, reason: str, detail: str) -> str:
        """A record parser's complaint in terms of this table's columns: a missing key is
        a column that is missing (from the file) or null (in this row), a wrong type is
        that column's."""
        found = _MISSING.match(detail)
        if reason == "missing key" and found:
            name = found[1]
            if name in self._file_columns:
                return f"column {name!r} is null"
            return f"column {name!r} is missing (columns: {', '.join(self._file_columns)})"
        if detail.startswith("'"):
            return f"column {detail}"
        return f"{reason}: {detail}"


def _as_written(batch):
    """`batch` with its `float32` columns as the `float64` of their shortest decimals (a
    `float32` column's `0.1` reads as `0.1`, as a JSON file of it says, not as
    `0.10000000149011612`: an answer compared by its text, a column a reward function
    receives)."""
    pa = _pyarrow()
    for i, field in enumerate(batch.schema):
        if pa.types.is_float32(field.type):
            shortest = pa.compute.cast(pa.compute.cast(batch.column(i), pa.string()), pa.float64())
            batch = batch.set_column(i, field.with_type(pa.float64()), shortest)
    return batch


def _without_nulls(value):
    """A row with its null fields left out, in nested objects too: an Arrow struct column
    has every key of every row's object, null where a row's object lacks it (two tool
    calls with other argument names), which a JSON lines file would not have written.
    Lists keep their items (a null item stays null)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


class _Unreadable(DataError):
    """A file that pyarrow cannot read: `reason` without the path."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.reason = reason


def _unreadable(path: str, e: Exception) -> DataError:
    kind = "Parquet" if path.lower().endswith(".parquet") else "Arrow"
    return _Unreadable(path, f"not a readable {kind} file: {' '.join(str(e).split())}")


def _schema(path: str):
    pa = _pyarrow()
    try:
        if _magic(path).startswith(_PARQUET_MAGIC) or path.lower().endswith(".parquet"):
            return pa.parquet.read_schema(path)
        with pa.memory_map(path) as source:
            return _ipc_reader(pa, path, source).schema
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None


def _ipc_reader(pa, path: str, source):
    if _magic(path).startswith(_IPC_FILE_MAGIC):
        return pa.ipc.open_file(source)
    return pa.ipc.open_stream(source)


def _batches(path: str) -> Iterator:
    pa = _pyarrow()
    try:
        if _magic(path).startswith(_PARQUET_MAGIC) or path.lower().endswith(".parquet"):
            with pa.parquet.ParquetFile(path) as f:
                yield from f.iter_batches(batch_size=1024)
            return
        with pa.memory_map(path) as source:
            reader = _ipc_reader(pa, path, source)
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)
            else:
                yield from reader
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None


def open_table(path: str, split: str | None) -> Table | None:
    """The `Table` at `path` (a Parquet or Arrow file, a saved dataset's directory, a
    `DIR:SPLIT`), or `None` for a JSON file (read by the JSON reader). A directory that
    holds no dataset, a missing split or a split given for a JSON file is a `DataError`."""
    base, split = _split_spec(path, split)
    if os.path.isdir(base) or split is not None:
        return Table(path, split)
    if os.path.isfile(base) and _is_table_file(base):
        return Table(path, None)
    return None
