"""The multi-turn stages' settings reach the episodes or are refused: overlong filtering
(`multiturn.mask_truncated_completions`) masks the episodes the token budget cut, not
those the turn limit ended, and an update left with nothing says why; the sampling
temperature is the episodes' and the loss's; the single-turn sampling settings that
would not reach the episodes are refused naming the field that does."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl
from rlhf_eqx.__main__ import main
from rlhf_eqx.pipelines import MultiturnConfig
from rlhf_eqx.pipelines.runs import run_multiturn


class _Endless(rx.envs.Environment):
    """Never ends an episode; each turn is rewarded its length. `stop_ids` end the turns."""

    stop_ids: tuple[int, ...] = eqx.field(static=True)
    max_observation_tokens: int = eqx.field(static=True, default=1)

    def reset(self, key, prompt, prompt_mask):
        return jnp.zeros((), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool)

    def step(self, state, completion, completion_mask):
        reward = jnp.sum(completion_mask).astype(jnp.float32)
        obs = jnp.full((1,), 13, jnp.int32)
        return state + 1, obs, jnp.ones((1,), bool), reward, state < 0


def _ctx(tmp_path, **kw):
    return pl.RunContext(
        ops=pl.OpsConfig(quiet=True, seed=1),
        log=pl.tools.MetricsLog(str(tmp_path), "multiturn", quiet=True),
        key=jax.random.key(4),
        prompt_length=8,
        **kw,
    )


def _run(tmp_path, env, **kw):
    policy, tok = pl.tools.load_model("builtin")
    cfg = MultiturnConfig(
        rollouts=1, prompts_per_rollout=2, group_size=2, turn_tokens=3, max_turns=2, **kw
    )
    prompts = ["Once upon a time", "Tom and Sue"]
    return run_multiturn(policy, tok, prompts, env, cfg=cfg, ctx=_ctx(tmp_path)), tok


def _events(tmp_path):
    return [r for r in pl.tools.read_records(str(tmp_path)) if "event" in r]


@pytest.mark.slow
def test_overlong_filtering_keeps_the_episodes_the_turn_limit_ended(tmp_path):
    """Every turn stops at a stop id (each id is one), the environment never ends an
    episode: the turn limit ends them all, whole, and none is masked."""
    vocab = pl.tools.load_model("builtin")[0].vocab_size
    env = _Endless(stop_ids=tuple(range(vocab)))
    res, _ = _run(tmp_path, env, mask_truncated_completions=True)
    (record,) = [r for r in res.history if "rollout/turns" in r]
    assert record["rollout/turn_limit"] == 1.0 and record["rollout/truncated"] == 0.0
    assert all(r.get("empty_batch", 0.0) == 0.0 for r in res.history)
    assert not [e for e in _events(tmp_path) if e["event"] in ("empty_batch", "all_truncated")]


def test_a_batch_the_token_budget_cut_whole_is_named(tmp_path):
    """Turns that never reach a stop id (the environment's is an id the model never
    samples): every episode is cut, overlong filtering masks them all, and the event
    names the cause and the settings that give the turns room."""
    res, tok = _run(tmp_path, _Endless(stop_ids=(tok_unk(),)), mask_truncated_completions=True)
    (record,) = [r for r in res.history if "rollout/turns" in r]
    assert record["rollout/truncated"] == 1.0 and record["rollout/turn_limit"] == 0.0
    (note,) = [e for e in _events(tmp_path) if e["event"] == "all_truncated"]
    assert "every episode was cut by the token budget" in note["message"]
    assert "multiturn.mask_truncated_completions=true" in note["message"]
    assert "raise multiturn.turn_tokens" in note["message"]


class _Flat(_Endless):
    """Every episode gets the same reward."""

    def step(self, state, completion, completion_mask):
        out = super().step(state, completion, completion_mask)
        return out[:3] + (jnp.zeros((), jnp.float32), out[4])


@pytest.mark.slow
def test_a_rollout_without_signal_is_named(tmp_path):
    """Equal rewards in every group: a `no_signal` event, as the GRPO stage logs."""
    res, tok = _run(tmp_path, _Flat(stop_ids=(2,)))
    (record,) = [r for r in res.history if "rollout/turns" in r]
    assert record["rollout/frac_reward_zero_std"] == 1.0
    (note,) = [e for e in _events(tmp_path) if e["event"] == "no_signal"]
    assert note["message"] == "iteration 0: every group's episodes got the same reward; " + (
        "no advantage to learn from"
    )


def tok_unk() -> int:
    """An id the shipped model never samples: `<unk>`, id 0 of llama2.c vocabularies."""
    return 0


def test_the_sampling_temperature_is_the_episodes_and_the_loss_s(tmp_path, monkeypatch):
    seen = {}
    rollout, make_step = rx.envs.rollout_multiturn, rx.train.make_grpo_step

    def spy_rollout(*a, **kw):
        seen["rollout"] = kw["temperature"]
        return rollout(*a, **kw)

    def spy_step(opt, settings, **kw):
        seen["loss"] = settings.temperature
        return make_step(opt, settings, **kw)

    monkeypatch.setattr(rx.envs, "rollout_multiturn", spy_rollout)
    monkeypatch.setattr(rx.train, "make_grpo_step", spy_step)
    policy, tok = pl.tools.load_model("builtin")
    cfg = MultiturnConfig(rollouts=1, prompts_per_rollout=2, group_size=2, turn_tokens=3)
    env = _Endless(stop_ids=(tok.eos_id,))
    ctx = _ctx(tmp_path, temperature=0.7)
    run_multiturn(policy, tok, ["Once upon a time"] * 2, env, cfg=cfg, ctx=ctx)
    assert seen == {"rollout": 0.7, "loss": 0.7}


@pytest.mark.parametrize("stage", ["multiturn", "multiturn-dpo"])
@pytest.mark.parametrize(
    ("setting", "applies"),
    [
        ("sampling.max_new_tokens=60", "{stage}.turn_tokens"),
        ("sampling.stop_strings=END", "stop_ids"),
        ("sampling.slots=4", "rollout_multiturn"),
    ],
)
def test_single_turn_sampling_settings_are_refused_for_the_episodes(
    stage, setting, applies, capsys
):
    argv = [stage, "--out", "run", "--quiet", "--show-config", "--set", setting]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    field = setting.split("=")[0]
    assert len(err) == 1 and err[0].count(field) >= 1, err
    assert applies.format(stage=stage) in err[0]
    # a run with a single-turn stage that samples with them takes them
    room = "sft.max_length=92"  # a whole sample of 32 + 60 tokens (the SFT stage trains on it)
    cfg = pl.apply_overrides(pl.animal_task_config(), [setting, room, f"stages=sft,{stage},grpo"])
    pl.config.validate_config(cfg)


def test_partial_rollouts_are_not_a_multiturn_setting():
    """Episodes roll out whole: `multiturn.partial_rollouts` is refused as unused (not
    sent to `multiturn.staleness`, which is unused too)."""
    cfg = pl.apply_overrides(pl.animal_task_config(), ["multiturn.partial_rollouts=2"])
    with pytest.raises(pl.ConfigError) as info:
        pl.config.validate_config(dataclasses.replace(cfg, stages=("multiturn",)))
    assert "multiturn.partial_rollouts=2: the multiturn stage does not use this setting" in str(
        info.value
    )
