"""The limits and results of tokenising: `SequenceLengths`, the tokenised sequences and
pairs, and the `TokenizeReport` of what a pass kept, cut and dropped.

**Lengths.** `SequenceLengths` states the limits once — `max_length` (prompt +
completion), `max_prompt_length`, `max_completion_length` — with TRL's defaults
(`DPOConfig`: 1024, 512, no completion limit); the tokenising functions take it (or
override single numbers), and the collate functions take it for the row length.
"""

import dataclasses

from ._errors import DataError


@dataclasses.dataclass(frozen=True)
class SequenceLengths:
    """The length limits of tokenised sequences, stated once for tokenising and collating.

    - `max_length`: the most tokens of a sequence, prompt + completion (TRL 1024); also
      the row length of collated batches.
    - `max_prompt_length`: the most prompt tokens, BOS included (TRL 512;
      `< max_length`).
    - `max_completion_length`: the most completion tokens, EOS included (`None`, TRL's
      default: whatever room `max_length` leaves).

    A `DataError` names the field that is out of range.
    """

    max_length: int = 1024
    max_prompt_length: int = 512
    max_completion_length: int | None = None

    def __post_init__(self):
        for name in ("max_length", "max_prompt_length", "max_completion_length"):
            value = getattr(self, name)
            if value is None and name == "max_completion_length":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataError(f"SequenceLengths.{name} must be a positive int, got {value!r}")
        if self.max_prompt_length >= self.max_length:
            raise DataError(
                "need max_prompt_length < max_length, got "
                f"max_prompt_length={self.max_prompt_length} and max_length={self.max_length}"
            )

    def completion_room(self, prompt_length: int) -> int:
        """The most completion tokens that fit after a prompt of `prompt_length` tokens."""
        room = self.max_length - prompt_length
        if self.max_completion_length is not None:
            room = min(room, self.max_completion_length)
        return room


def resolve_lengths(
    lengths: SequenceLengths | None,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
) -> SequenceLengths:
    """`lengths` (default `SequenceLengths()`) with the numbers given here replacing its own."""
    base = SequenceLengths() if lengths is None else lengths
    changes = {
        k: v
        for k, v in (
            ("max_length", max_length),
            ("max_prompt_length", max_prompt_length),
            ("max_completion_length", max_completion_length),
        )
        if v is not None
    }
    return dataclasses.replace(base, **changes) if changes else base


@dataclasses.dataclass(frozen=True)
class TokenizedSequence:
    """Prompt ids (with BOS when added) and completion ids (with EOS when added and kept).

    `completion_mask`: which completion tokens the loss is on, one flag each (`None`, the
    default: all of them). A conversation trained on every assistant turn has one
    completion from its first assistant turn to its last, the user and tool turns in
    between unmasked (`tokenize_demonstrations`).
    """

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    completion_mask: tuple[bool, ...] | None = None

    def __post_init__(self):
        mask = self.completion_mask
        if mask is not None and len(mask) != len(self.completion):
            raise DataError(
                f"completion_mask has {len(mask)} flags for {len(self.completion)} "
                "completion tokens"
            )

    def __len__(self) -> int:
        return len(self.prompt) + len(self.completion)

    @property
    def trained(self) -> int:
        """The number of completion tokens the loss is on."""
        mask = self.completion_mask
        return len(self.completion) if mask is None else sum(mask)


@dataclasses.dataclass(frozen=True)
class TokenizedPair:
    """The two sequences of a preference pair (their prompts are equal unless a token
    merged across the prompt/completion boundary), and the pair's own reward margin
    (`PreferenceRecord.margin`; `None`: none)."""

    chosen: TokenizedSequence
    rejected: TokenizedSequence
    margin: float | None = None


MAX_TRUNCATED_ROWS = 5
"""How many cut records a `TokenizeReport` names (`truncated_rows`)."""


@dataclasses.dataclass
class TokenizeReport:
    """What a tokenisation pass kept, cut and dropped (records, not sequences: a pair
    counts once), and under which limits.

    - `total`: records seen; `kept`: records returned.
    - `prompt_truncated` / `completion_truncated`: kept records with a truncated prompt /
      completion (`truncation="keep_end"`).
    - `dropped`: `{reason: count}` (`"too long"` under `truncation="drop"`,
      `"empty completion"` when nothing of a completion is left).
    - `boundary_merged`: records where a token spans the prompt/completion boundary.
    - `lengths`, `truncation`: the limits and policy applied; `eos`: whether completions
      end with EOS (a cut one loses it; else it loses its end, e.g. a template's
      end-of-turn text).
    - `truncated_rows`: the indices (in the records tokenised, from 0) of the first
      `MAX_TRUNCATED_ROWS` records with a cut prompt or completion, so that a log can
      name them: a pass counts a record (`total += 1`) before its cuts (`note_cut`).

    `summary()` (also `str(report)`) puts the policy and the rates in one line, e.g.
    `"67% of prompts (2/3) were cut to 128 tokens (kept the end); ..."`.
    """

    total: int = 0
    kept: int = 0
    prompt_truncated: int = 0
    completion_truncated: int = 0
    boundary_merged: int = 0
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    lengths: SequenceLengths | None = None
    truncation: str = "keep_end"
    eos: bool = True
    truncated_rows: list[int] = dataclasses.field(default_factory=list)

    def note_cut(self, prompt: bool = False, completion: bool = False) -> None:
        """Count a cut `prompt` and / or `completion` of the record counted last
        (`total - 1`), and name that record in `truncated_rows` (the first
        `MAX_TRUNCATED_ROWS` cut records)."""
        self.prompt_truncated += bool(prompt)
        self.completion_truncated += bool(completion)
        row, rows = self.total - 1, self.truncated_rows
        if (prompt or completion) and row >= 0 and row not in rows:
            if len(rows) < MAX_TRUNCATED_ROWS:
                rows.append(row)

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    @property
    def prompt_truncation_rate(self) -> float:
        """The share of records seen whose prompt was cut (0 when none were seen)."""
        return self.prompt_truncated / self.total if self.total else 0.0

    @property
    def completion_truncation_rate(self) -> float:
        """The share of records seen whose completion was cut (0 when none were seen)."""
        return self.completion_truncated / self.total if self.total else 0.0

    def summary(self) -> str:
        """One line for a run log: the truncation policy and how often it applied."""
        if not self.total:
            return "no records tokenised"

        def share(n: int) -> str:
            return f"{100 * n / self.total:.0f}% ({n}/{self.total})"

        parts = []
        lengths = self.lengths
        if self.truncation == "keep_end":
            limit = f" to {lengths.max_prompt_length} tokens" if lengths else ""
            parts.append(
                f"{share(self.prompt_truncated)} of prompts were cut{limit} (kept the end)"
            )
            if lengths is not None:
                room = f"{lengths.max_length} tokens in all"
                if lengths.max_completion_length is not None:
                    room += f", {lengths.max_completion_length} for the completion"
                room = f" to fit {room}"
            else:
                room = ""
            parts.append(
                f"{share(self.completion_truncated)} of records had a completion cut{room} "
                f"(kept the start, lost {'the EOS' if self.eos else 'its end'})"
            )
        if self.dropped:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items()))
            parts.append(f"{share(self.num_dropped)} dropped ({reasons})")
        parts.append(f"kept {self.kept} of {self.total}")
        return "; ".join(parts)

    def __str__(self) -> str:
        return self.summary()
