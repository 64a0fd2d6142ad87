"""The members of a sweep: a grid of traced hyperparameters times seeds.

A sweep runs every member of `grid × seeds` in one compiled program per step, so a grid
field must be a number the step reads as a traced array (a loss coefficient, the peak
learning rate). Fields that change shapes or control flow (`batch_size`, `steps`,
`lora.rank`, `loss_type`, `max_length`, ...) are refused, naming the field and the
traceable ones (`TRACEABLE`).
"""

import dataclasses
import itertools
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence

from ._config import ConfigError
from ._config_io import apply_overrides, near_miss

TRACEABLE: dict[str, tuple[str, ...]] = {
    "dpo": ("beta", "label_smoothing", "optim.learning_rate"),
    "sft": ("optim.learning_rate",),
    "reward": ("optim.learning_rate",),
    "kto": ("beta", "desirable_weight", "undesirable_weight", "optim.learning_rate"),
    "grpo": ("beta", "optim.learning_rate"),
    "multiturn": ("beta", "optim.learning_rate"),
    "ppo": ("kl_coef", "clip_eps", "vf_coef", "ent_coef", "optim.learning_rate"),
}
"""The fields of each stage's section a sweep may vary (`--grid <section>.<field>=...`):
the step settings that may be JAX arrays (`beta`, `label_smoothing` of
`rlhf_eqx.train.DPOSettings`; `beta` and the two weights of `rlhf_eqx.train.KTOSettings`;
`clip_eps`, `vf_coef`, `ent_coef` of `rlhf_eqx.train.PPOSettings`), PPO's `kl_coef` (the
KL-shaped rewards of `rlhf_eqx.train.prepare_ppo_batch` take it as an array) and the
optimiser's peak learning rate (`rlhf_eqx.train.make_optimizer` takes it traced)."""


@dataclasses.dataclass(frozen=True)
class Member:
    """One run of a sweep: its `name` (`beta=0.1,seed=2`), its `seed` (`ops.seed`), its
    grid point `point` (`((field, value), ...)`, the fields relative to the stage's
    section: `beta`, `optim.learning_rate`) and `cfg`, the configuration of the
    equivalent separate run (the grid values and the seed applied)."""

    name: str
    seed: int
    point: tuple[tuple[str, float], ...]
    cfg: object

    @property
    def point_name(self) -> str:
        """The grid point alone (`beta=0.1`; `-` for an empty grid)."""
        return ",".join(f"{_short(k)}={_number(v)}" for k, v in self.point) or "-"


def _short(field: str) -> str:
    """A field's name in member names: its last part (`optim.learning_rate` ->
    `learning_rate`)."""
    return field.rsplit(".", 1)[-1]


def _number(v: float) -> str:
    """`0.1`, `0.0005`, `1e+06`: `repr` of a fraction (exact), `%g` of a whole number
    where that is exact (`1234567` stays `1234567.0`: `%g` would give it the name of
    `1234568`)."""
    v = float(v)
    return f"{v:g}" if v.is_integer() and float(f"{v:g}") == v else repr(v)


def parse_grid(specs: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """`["dpo.beta=0.05,0.1"]` -> `{"dpo.beta": (0.05, 0.1)}`; a spec without `=`, an
    empty or non-numeric value, a value given twice, or a field given twice is a
    `ConfigError` naming it."""
    grid: dict[str, tuple[float, ...]] = {}
    for spec in specs:
        if "=" not in spec:
            raise ConfigError(f"--grid {spec!r}: expected FIELD=V1,V2,..., e.g. dpo.beta=0.05,0.1")
        path, values = (s.strip() for s in spec.split("=", 1))
        if path in grid:
            raise ConfigError(f"--grid {path}: given twice")
        parts = [v.strip() for v in values.split(",")]
        if values.strip() and not all(parts):  # `1,,2`, `0.1,0.2,`: a value left out
            raise ConfigError(f"--grid {path}={values}: an empty value between commas")
        try:
            grid[path] = tuple(float(v) for v in parts if v)
        except ValueError:
            raise ConfigError(f"--grid {path}={values}: values must be numbers") from None
        grid[path] = _grid_values(path, grid[path])
    return grid


def _grid_values(path: str, values) -> tuple[float, ...]:
    """The values of grid field `path` as floats: a non-empty sequence of distinct,
    finite real numbers (not strings, not bools), else a `ConfigError` naming it."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ConfigError(f"--grid {path}={values!r}: expected a list of numbers, e.g. [0.05, 0.1]")
    values = list(values)  # a tuple, a NumPy array, a range ...
    if not values:
        raise ConfigError(f"--grid {path}: no values")
    out: list[float] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ConfigError(f"--grid {path}: value {v!r} is not a number")
        if not math.isfinite(float(v)):
            raise ConfigError(f"--grid {path}: value {v} is not finite")
        if float(v) in out:  # two members of one name, writing the same directory
            raise ConfigError(f"--grid {path}: value {_number(v)} given twice")
        out.append(float(v))
    return tuple(out)


def grid_values(grid: Mapping[str, Iterable[float]] | None) -> dict[str, tuple[float, ...]]:
    """`grid` with each field's values as a tuple of floats (`{"dpo.beta":
    np.array([0.05, 0.1])}` -> `{"dpo.beta": (0.05, 0.1)}`); values that are not a
    non-empty list of distinct finite numbers are a `ConfigError` naming the field."""
    return {path: _grid_values(path, values) for path, values in (grid or {}).items()}


def _is_field(cfg, path: str) -> bool:
    """Whether the dotted `path` names a setting of the configuration `cfg` (a section's
    field, not a method)."""
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part, _MISSING) if not part.startswith("_") else _MISSING
        if obj is _MISSING or callable(obj):
            return False
    return True


_MISSING = object()


def _grid_hint(path: str, section: str, allowed: Sequence[str], cfg) -> str:
    """`"; did you mean dpo.beta?"` for an unknown grid field `path` close to a traceable
    one of `section` (`allowed`), or TRL's name of one (`dpo.lr`, `dpo.learning_rate`:
    `dpo.optim.learning_rate`), as `--set` suggests (`near_miss`); `""` when none is."""
    head, _, rest = path.partition(".")
    settings = getattr(cfg, section, None)
    if head == section and rest and dataclasses.is_dataclass(settings):
        return near_miss(rest, allowed, type(settings), prefix=section + ".")
    return near_miss(path, [f"{section}.{f}" for f in allowed])


def check_grid(stage: str, section: str, grid: Mapping[str, Sequence[float]], cfg=None) -> None:
    """Refuse (`ConfigError`) a grid field outside the stage's traceable fields, naming
    it (an unknown one as such when `cfg`, the configuration, is given, with the
    traceable field it is close to: `_grid_hint`) and listing those the sweep can vary;
    and values that are not a non-empty list of distinct finite numbers."""
    allowed = TRACEABLE.get(stage)
    if allowed is None:
        known = ", ".join(TRACEABLE)
        raise ConfigError(f"sweep {stage}: not supported (stages that sweep: {known})")
    for path, values in grid.items():
        field = path[len(section) + 1 :] if path.startswith(section + ".") else None
        if field not in allowed:
            listed = ", ".join(f"{section}.{f}" for f in allowed)
            if cfg is not None and not _is_field(cfg, path):
                hint = _grid_hint(path, section, allowed, cfg)
                raise ConfigError(f"--grid {path}: unknown field{hint} (traceable: {listed})")
            raise ConfigError(
                f"--grid {path}: not traceable in a sweep of {stage} (a field that changes "
                f"shapes or control flow, or of another section); traceable: {listed}"
            )
        _grid_values(path, values)


def make_members(
    cfg, stage: str, section: str, grid: Mapping[str, Sequence[float]], seeds: int
) -> list[Member]:
    """The members of `grid × seeds` in grid-major order (every seed of the first grid
    point first); seeds `ops.seed, ops.seed + 1, ...`. Each member's configuration is
    `cfg` with its values applied by `apply_overrides` (so they are validated as
    `--set` values are)."""
    check_grid(stage, section, grid, cfg)
    grid = grid_values(grid)
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"seeds={seeds!r}: must be an int >= 1 (the number of seeds)")
    paths = list(grid)
    first = cfg.ops.seed
    members = []
    for values in itertools.product(*(grid[p] for p in paths)):
        point = tuple((p[len(section) + 1 :], float(v)) for p, v in zip(paths, values))
        sets = [f"{p}={v!r}" for p, v in zip(paths, values)]
        for seed in range(first, first + seeds):
            one = apply_overrides(cfg, [*sets, f"ops.seed={seed}"])
            label = ",".join([*(f"{_short(k)}={_number(v)}" for k, v in point), f"seed={seed}"])
            members.append(Member(label, seed, point, one))
    return members
