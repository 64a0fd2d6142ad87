"""A run directory written before a setting existed resumes while that setting holds its
default (the run that wrote it had that behaviour), and is refused naming the setting
when it is given another value."""

import pytest

from rlhf_eqx import pipelines as pl


def _without(d: dict, dotted: str) -> dict:
    """`d` (a config dict) without the field `dotted`, as an older version wrote it."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    *path, last = dotted.split(".")
    node = out
    for part in path:
        node[part] = dict(node[part])
        node = node[part]
    del node[last]
    return out


ADDED = ("multiturn.episode_reward", "dpo.lora.use_rslora")


def test_a_setting_the_stored_config_lacks_resumes_at_its_default():
    new = pl.config.config_to_dict(pl.animal_task_config())
    old = new
    for field in ADDED:
        old = _without(old, field)
    assert pl.loop.check_resumable(old, new, where="run") == []


@pytest.mark.parametrize(
    ("field", "value"), [("multiturn.episode_reward", "last"), ("dpo.lora.use_rslora", "true")]
)
def test_a_setting_the_stored_config_lacks_is_refused_away_from_its_default(field, value):
    new = pl.config.config_to_dict(
        pl.apply_overrides(pl.animal_task_config(), [f"{field}={value}"])
    )
    old = _without(new, field)
    with pytest.raises(pl.loop.RunDirError, match=f"{field}: None -> "):
        pl.loop.check_resumable(old, new, where="run")


def test_a_changed_setting_is_still_refused():
    old = pl.config.config_to_dict(pl.animal_task_config())
    new = pl.config.config_to_dict(pl.apply_overrides(pl.animal_task_config(), ["dpo.beta=0.3"]))
    with pytest.raises(pl.loop.RunDirError, match=r"dpo.beta: 0.1 -> 0.3"):
        pl.loop.check_resumable(old, new, where="run")
