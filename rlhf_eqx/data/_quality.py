"""Data-quality reports for preference pairs and demonstrations, and filters that drop
the bad records.

Run it before training: a pair whose two completions are identical carries no
preference (the DPO gradient is exactly zero and the reward-model loss is ln 2); an
empty completion teaches to stop at once; a prompt that repeats many times weighs more
than intended; responses that repeat the same few phrases (low distinct-n) make a
narrow training signal; and a high truncation rate means `max_prompt_length` /
`max_length` cut most of what the model would learn from.

```python
report = data.preference_quality(pairs, tokenizer=tok, lengths=lengths)
print(report.summary())
kept, dropped = data.filter_preferences(pairs)  # identical, empty, exact duplicates
```

`demonstration_quality` does the same for supervised fine-tuning records (`.prompt`,
`.completion`): empty completions, exact duplicates, repeated prompts, prompts too long
for `max_prompt_length`, lengths in tokens and the completions' distinct-n;
`DemonstrationQuality.select` drops the records with the problems asked for.

**Distinct-n** (J. Li et al., "A Diversity-Promoting Objective Function for Neural
Conversation Models", NAACL 2016): the number of distinct word n-grams over all
responses (chosen and rejected) divided by the number of n-grams; 1 when no n-gram
repeats, near 0 when the responses say the same thing over and over.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from ._errors import DataError
from ._io import RecordDataset
from ._tokenize import tokenize_preferences, wants_bos
from ._tokenized import SequenceLengths, TokenizeReport
from ._tokenizer import Tokenizer

_FILTERS = ("identical", "empty", "exact_duplicate", "duplicate_prompt")
DEMONSTRATION_PROBLEMS = ("empty", "exact_duplicate", "duplicate_prompt", "long_prompt")
"""The problems `demonstration_quality` counts and `DemonstrationQuality.select` drops
(`identical` is a pair's)."""


@dataclasses.dataclass(frozen=True)
class LengthStats:
    """Summary of a list of lengths (all 0 for an empty list)."""

    mean: float
    median: float
    p95: float
    max: int

    @classmethod
    def of(cls, lengths: Sequence[int]) -> "LengthStats":
        if not lengths:
            return cls(0.0, 0.0, 0.0, 0)
        a = np.asarray(lengths, dtype=np.float64)
        return cls(float(a.mean()), float(np.median(a)), float(np.percentile(a, 95)), int(a.max()))

    def __str__(self) -> str:
        return f"mean {self.mean:.1f}, median {self.median:.0f}, p95 {self.p95:.0f}, max {self.max}"


@dataclasses.dataclass(frozen=True)
class PreferenceQuality:
    """What `preference_quality` found. Index lists point into the records given.

    - `total`: records examined.
    - `identical`: pairs whose chosen and rejected completions are the same text.
    - `empty`: pairs with an empty (or blank) prompt, chosen or rejected completion.
    - `exact_duplicates`: records equal to an earlier record (all three texts).
    - `duplicate_prompts`: records whose prompt appeared in an earlier record;
      `distinct_prompts`: the number of different prompts.
    - `prompt_lengths`, `chosen_lengths`, `rejected_lengths`: `LengthStats` in `unit`
      (`"tokens"` with a tokenizer, else `"characters"`).
    - `distinct_1`, `distinct_2`: distinct-n of the responses (module docstring).
    - `truncation`: the `TokenizeReport` of tokenising with `lengths` (`None` without a
      tokenizer).
    """

    total: int
    identical: tuple[int, ...]
    empty: tuple[int, ...]
    exact_duplicates: tuple[int, ...]
    duplicate_prompts: tuple[int, ...]
    distinct_prompts: int
    unit: str
    prompt_lengths: LengthStats
    chosen_lengths: LengthStats
    rejected_lengths: LengthStats
    distinct_1: float
    distinct_2: float
    truncation: TokenizeReport | None = None

    def summary(self) -> str:
        """A few lines for a run log."""

        def count(indices: Sequence[int]) -> str:
            share = 100 * len(indices) / self.total if self.total else 0.0
            return f"{len(indices)} ({share:.1f}%)"

        lines = [
            f"{self.total} preference pairs, {self.distinct_prompts} distinct prompts",
            f"identical chosen/rejected: {count(self.identical)}; empty: {count(self.empty)}; "
            f"exact duplicates: {count(self.exact_duplicates)}; "
            f"repeated prompts: {count(self.duplicate_prompts)}",
            f"prompt length ({self.unit}): {self.prompt_lengths}",
            f"chosen length ({self.unit}): {self.chosen_lengths}",
            f"rejected length ({self.unit}): {self.rejected_lengths}",
            f"responses: distinct-1 {self.distinct_1:.3f}, distinct-2 {self.distinct_2:.3f}",
        ]
        if self.truncation is not None:
            lines.append(f"truncation: {self.truncation.summary()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct word n-grams over all `texts` divided by all their n-grams (0 if none).

    Words are whitespace-separated; n-grams do not cross from one text to the next.
    """
    if n < 1:
        raise DataError(f"n must be positive, got {n}")
    seen: set[tuple[str, ...]] = set()
    total = 0
    for text in texts:
        words = text.split()
        for i in range(len(words) - n + 1):
            seen.add(tuple(words[i : i + n]))
            total += 1
    return len(seen) / total if total else 0.0


def _fields(record: object, i: int) -> tuple[str, str, str]:
    values = tuple(getattr(record, k, None) for k in ("prompt", "chosen", "rejected"))
    if not all(isinstance(v, str) for v in values):
        raise DataError(
            f"record {i}: preference records need string .prompt, .chosen and .rejected, "
            f"got {type(record).__name__}"
        )
    return values


def _first_reasons(found: dict[str, Sequence[int]], drop: Sequence[str]) -> dict[int, str]:
    """`{record index: the first problem of drop it has}` of the records with any."""
    reason_of: dict[int, str] = {}
    for name in drop:
        for i in found[name]:
            reason_of.setdefault(i, name)
    return reason_of


def _problems(records: Sequence) -> dict[str, list[int]]:
    """Indices of the records with each problem (a record can have several)."""
    found: dict[str, list[int]] = {name: [] for name in _FILTERS}
    seen_records: set[tuple[str, str, str]] = set()
    seen_prompts: set[str] = set()
    for i, record in enumerate(records):
        prompt, chosen, rejected = key = _fields(record, i)
        if chosen == rejected:
            found["identical"].append(i)
        if not (prompt.strip() and chosen.strip() and rejected.strip()):
            found["empty"].append(i)
        if key in seen_records:
            found["exact_duplicate"].append(i)
        if prompt in seen_prompts:
            found["duplicate_prompt"].append(i)
        seen_records.add(key)
        seen_prompts.add(prompt)
    return found


def preference_quality(
    records: Sequence,
    *,
    tokenizer: Tokenizer | None = None,
    lengths: SequenceLengths | None = None,
    add_eos: bool | str = True,
) -> PreferenceQuality:
    """Examine preference records before training (see the module docstring).

    **Arguments:**

    - `records`: objects with `.prompt`, `.chosen`, `.rejected` strings (e.g. a
      `PreferenceDataset`, or pairs built by hand).
    - `tokenizer`: when given, lengths are counted in tokens and the records are
      tokenised with `lengths` to measure the truncation rate.
    - `lengths`: the `SequenceLengths` training will use (default `SequenceLengths()`).
    - `add_eos`: how training ends the completions (`tokenize_preferences`'s `add_eos`:
      `True`, `False` or `"auto"`, EOS unless the completion ends its turn already), so
      that the truncation rate is that of the training sequences.

    **Returns:** a `PreferenceQuality`; `print(report.summary())` for a run log.
    """
    found = _problems(records)
    fields = [_fields(r, i) for i, r in enumerate(records)]
    if tokenizer is not None:
        unit = "tokens"

        def size(text: str) -> int:
            return len(tokenizer.encode(text))
    else:
        unit = "characters"
        size = len
    prompts = {p for p, _, _ in fields}
    responses = [t for _, c, r in fields for t in (c, r)]
    truncation = None
    if tokenizer is not None:
        _, truncation = tokenize_preferences(records, tokenizer, lengths=lengths, add_eos=add_eos)
    return PreferenceQuality(
        total=len(fields),
        identical=tuple(found["identical"]),
        empty=tuple(found["empty"]),
        exact_duplicates=tuple(found["exact_duplicate"]),
        duplicate_prompts=tuple(found["duplicate_prompt"]),
        distinct_prompts=len(prompts),
        unit=unit,
        prompt_lengths=LengthStats.of([size(p) for p, _, _ in fields]),
        chosen_lengths=LengthStats.of([size(c) for _, c, _ in fields]),
        rejected_lengths=LengthStats.of([size(r) for _, _, r in fields]),
        distinct_1=distinct_n(responses, 1),
        distinct_2=distinct_n(responses, 2),
        truncation=truncation,
    )


def filter_preferences(
    records: Sequence,
    *,
    drop: Sequence[str] = ("identical", "empty", "exact_duplicate"),
) -> tuple[Sequence, dict[str, list]]:
    """Drop the bad pairs, returning what was dropped and why.

    **Arguments:**

    - `records`: as for `preference_quality`.
    - `drop`: the problems to drop, among `"identical"` (chosen == rejected),
      `"empty"` (an empty or blank prompt or completion), `"exact_duplicate"` (a
      repeat of an earlier record; the first is kept) and `"duplicate_prompt"` (a
      repeat of an earlier record's prompt; the first is kept).

    **Returns:** `(kept, dropped)`: the kept records in their order (a dataset of the
    same class when `records` is a `PreferenceDataset`, else a list), and
    `{problem: [records dropped for it]}`; a record with several problems is listed
    under the first of `drop` that applies.
    """
    unknown = [d for d in drop if d not in _FILTERS]
    if unknown:
        raise DataError(f"unknown filters {unknown}; use any of {_FILTERS}")
    reason_of = _first_reasons(_problems(records), drop)
    dropped: dict[str, list] = {name: [] for name in drop}
    for i in sorted(reason_of):
        dropped[reason_of[i]].append(records[i])
    keep = [i for i in range(len(records)) if i not in reason_of]
    if isinstance(records, RecordDataset):
        return records.select(keep), dropped
    return [records[i] for i in keep], dropped


@dataclasses.dataclass(frozen=True)
class DemonstrationQuality:
    """What `demonstration_quality` found. Index lists point into the records given.

    - `total`: records examined; `format`: their layout (`"messages"`, ...), as named in
      the summary.
    - `problems`: `{problem: indices}` for each of `DEMONSTRATION_PROBLEMS` — `empty`
      (a blank completion), `exact_duplicate` (the same prompt and completion as an
      earlier record), `duplicate_prompt` (an earlier record's prompt; a text's empty
      prompt repeats nothing), `long_prompt` (the prompt with BOS longer than
      `max_prompt_length`).
    - `distinct_prompts`: the number of different prompts.
    - `prompt_lengths`, `completion_lengths`: `LengthStats` in tokens.
    - `distinct_1`, `distinct_2`: distinct-n of the completions.

    Of a record with `spans` (a conversation trained on every assistant turn), the
    completion's length and distinct-n are those of the trained text, its assistant
    turns (n-grams do not cross from one turn to the next), not of the user and tool
    turns between.
    """

    total: int
    format: str
    problems: dict[str, tuple[int, ...]]
    distinct_prompts: int
    prompt_lengths: LengthStats
    completion_lengths: LengthStats
    distinct_1: float
    distinct_2: float

    def summary(self) -> str:
        """A few lines for a run log."""
        return "\n".join(
            [
                f"{self.total} demonstrations ({self.format}), "
                f"{self.distinct_prompts} distinct prompts",
                "; ".join(f"{n.replace('_', ' ')}: {len(v)}" for n, v in self.problems.items()),
                f"prompt length (tokens): {self.prompt_lengths}",
                f"completion length (tokens): {self.completion_lengths}",
                f"completions: distinct-1 {self.distinct_1:.3f}, distinct-2 {self.distinct_2:.3f}",
            ]
        )

    def __str__(self) -> str:
        return self.summary()

    def select(self, records: Sequence, drop: Sequence[str]) -> tuple[list, dict[str, int]]:
        """`(kept, counts)`: the `records` (those examined) without the ones with a
        problem of `drop`, in order, and how many went for each problem (a record with
        several is counted under the first of `drop` that applies)."""
        unknown = [d for d in drop if d not in DEMONSTRATION_PROBLEMS]
        if unknown:
            raise DataError(f"unknown filters {unknown}; use any of {DEMONSTRATION_PROBLEMS}")
        reason_of = _first_reasons(self.problems, drop)
        kept = [r for i, r in enumerate(records) if i not in reason_of]
        return kept, {name: sum(v == name for v in reason_of.values()) for name in drop}


def demonstration_quality(
    records: Sequence,
    *,
    tokenizer: Tokenizer,
    lengths: SequenceLengths,
    format: str = "",
) -> DemonstrationQuality:
    """Examine supervised fine-tuning records before training.

    **Arguments:**

    - `records`: objects with `.prompt` and `.completion` strings (e.g. a
      `DemonstrationDataset`), and `.spans` where only parts of the completion are
      trained (`DemonstrationQuality`: their lengths and distinct-n).
    - `tokenizer`: lengths are counted in its tokens (a prompt's with BOS when it asks
      for one, `wants_bos`, for `long_prompt`).
    - `lengths`: the `SequenceLengths` training will use (`max_prompt_length`).
    - `format`: the records' layout, named in the summary.

    **Returns:** a `DemonstrationQuality`; `print(report.summary())` for a run log.
    """
    bos = int(wants_bos(tokenizer))
    problem: dict[str, list[int]] = {n: [] for n in DEMONSTRATION_PROBLEMS}
    seen: set[tuple[str, str]] = set()
    prompts: set[str] = set()
    prompt_sizes, completion_sizes = [], []
    responses = []
    for i, r in enumerate(records):
        trained = _trained_texts(r)
        responses.extend(trained)
        prompt_sizes.append(len(tokenizer.encode(r.prompt)))
        completion_sizes.append(len(tokenizer.encode("".join(trained))))
        for name, found in (
            ("empty", not r.completion.strip()),
            ("exact_duplicate", (r.prompt, r.completion) in seen),
            ("duplicate_prompt", r.prompt in prompts),
            ("long_prompt", prompt_sizes[-1] + bos > lengths.max_prompt_length),
        ):
            if found:
                problem[name].append(i)
        seen.add((r.prompt, r.completion))
        if r.prompt:  # a text's empty prompt repeats nothing
            prompts.add(r.prompt)
    return DemonstrationQuality(
        total=len(prompt_sizes),
        format=format,
        problems={n: tuple(v) for n, v in problem.items()},
        distinct_prompts=len({r.prompt for r in records}),
        prompt_lengths=LengthStats.of(prompt_sizes),
        completion_lengths=LengthStats.of(completion_sizes),
        distinct_1=distinct_n(responses, 1),
        distinct_2=distinct_n(responses, 2),
    )


def _trained_texts(record) -> list[str]:
    """The trained texts of a demonstration: its completion, or the pieces of it its
    `spans` mark (a conversation's assistant turns, without the user and tool turns
    between)."""
    spans = getattr(record, "spans", None)
    if spans is None:
        return [record.completion]
    return [record.completion[a:b] for a, b in spans]
