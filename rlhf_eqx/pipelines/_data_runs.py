"""Single-stage runs on a data file (`rlhf_eqx STAGE --data FILE`): the stage's `data`
function of the registry (each stage module's, e.g. `_dpo_stage.dpo_on_data`), in a run
directory of its own."""

import os
import sys
from collections.abc import Sequence
from typing import Any

import jax

from ._callbacks import after_evaluation
from ._config import (
    ConfigError,
)
from ._metrics import json_text
from ._monitor import measure_matmul_peak
from ._pipeline_config import (
    PipelineConfig,
)
from ._registry import get_stage, stage_config, stages
from ._run_checks import check_loaded_context
from ._rundir import check_data, open_run_dir, removed_if_nothing_ran, write_json_atomic
from ._runs import export_policy
from ._trackers import run_trackers
from ._validation import validate_config


def data_stages() -> tuple[str, ...]:
    """The registered stages that run on a data file."""
    return tuple(s.name for s in stages() if s.data is not None)


def check_data_reward_model(key: str, c) -> None:
    """A `ConfigError` when the stage section `c` (named `key`) scores with a reward model
    or PRM on a data file without the directory of one (`<key>.reward_model`): on a
    data file no earlier stage trains it."""
    if getattr(c, "reward_source", None) in ("reward_model", "prm") and not c.reward_model:
        raise ConfigError(
            f"{key}.reward_model='': {key}.reward_source={c.reward_source} on a data "
            "file needs the directory of an exported model (<run>/reward/hf, "
            "<run>/reward/ensemble or <run>/prm/hf)"
            + (
                f"; or score with your own functions: {key}.reward_source=task "
                f"{key}.reward_functions=MODULE:NAME"
                if hasattr(c, "reward_functions")
                else ""
            )
        )


def run_on_data(
    cfg: PipelineConfig,
    stage: str,
    *,
    resume: bool = False,
    overwrite: bool = False,
    callbacks: Sequence[Any] = (),
) -> dict:
    """Run `stage` (one of `data_stages()`: `sft` on demonstrations or preferences,
    `reward`, `dpo` on preferences, `grpo` on prompts with answers, `ppo` on prompts
    (scored by an exported reward model, a judge or the user's reward functions),
    `kto`, `distill`, `prm` on a stepwise file, and any
    registered stage with a `data` function) on `cfg.data.path`; write `summary.json`,
    `metrics.jsonl`, `config.json` and the trained model in `cfg.out` (`<stage>/hf/`
    with its tokenizer; a reward model as `...ForSequenceClassification` in
    `reward/hf/`, an ensemble in `reward/ensemble/`, a PRM in `prm/hf/`; LoRA adapters
    alone in the PEFT layout in `<stage>/adapter/`); return the summary.

    The configuration is validated first (every length the stage reads within the
    model's context, a GGUF model's read from its header) and the run
    directory taken as `run_pipeline` does (`open_run_dir`); a run that fails before its
    first metrics (a bad record, say) removes the directory it created
    (`removed_if_nothing_ran`).
    The data file's fingerprint (path, size, SHA-256) is recorded in `data.json`, the
    model's in `model.json`, and a resume on a changed file is refused (`check_data`,
    `check_model`). Pairs the reader dropped
    (identical or empty completions, unsplittable transcripts) are counted in the
    data-quality report and `summary["data_quality"]["skipped_by_reader"]`;
    `summary["stopped"]` is `"done"`, `"kl_guard"`, `"diverged"` or `"callback"` (a
    stop a callback requested: `summary["stop_reason"]` says why). `callbacks`
    (`Callback`s) are called by the stage's loop and, with the stage's summary entry,
    after its held-out evaluation."""
    from ._pipeline import check_model as _check_model

    st = get_stage(stage)
    if st.data is None:
        raise ConfigError(
            f"stage {stage!r} does not run on a data file (choices: {', '.join(data_stages())})"
        )
    if cfg.data.path is None:
        raise ConfigError("data.path=None: a data file is needed (--data FILE)")
    validate_config(cfg, stage=stage)  # this stage and the sections it uses
    check_data_reward_model(st.key, stage_config(cfg, st))
    run_dir = cfg.out or os.path.join("runs", stage)
    with (
        removed_if_nothing_ran(run_dir),
        open_run_dir(cfg, run_dir, resume=resume, overwrite=overwrite) as rd,
        run_trackers(cfg, run_dir, resume=rd.resume),
    ):
        print(f"run directory: {run_dir}")
        for note in rd.notes:
            print(f"note: {note}", file=sys.stderr)
        check_data(run_dir, cfg.data.path, resume=rd.resume)
        _check_model(run_dir, cfg.model.source, cfg.model.tokenizer, resume=rd.resume)
        return _run_on_data(cfg, st, run_dir, rd.resume, tuple(callbacks))


def _hf_base(source: str) -> str | None:
    """The absolute path of the Hugging Face directory `source` names (a run directory
    stands for its policy export), the base a PEFT adapter trained on it records; `None`
    for the built-in model, a GGUF file and a PEFT adapter directory (loaded merged into
    its base: no directory holds that model)."""
    from ._pipeline import model_path

    if source == "builtin":
        return None
    path = model_path(source)
    hf = os.path.isfile(os.path.join(path, "config.json"))  # not a GGUF file, nor an adapter
    return os.path.abspath(path) if hf else None


def _run_on_data(
    cfg: PipelineConfig, st, run_dir: str, resume: bool, callbacks: tuple = ()
) -> dict:
    from ._pipeline import _ctx, _stage_env, load_configured_model, tokenizer_file

    policy, tok = load_configured_model(cfg)
    check_loaded_context(cfg, policy, (st.name,))
    tok_file = tokenizer_file(cfg.model.source, cfg.model.tokenizer)
    key = jax.random.key(cfg.ops.seed)
    peak = measure_matmul_peak() if cfg.ops.monitor else None
    ctx = _ctx(cfg, run_dir, st.name, key, resume, peak_flops=peak, callbacks=callbacks)
    say = (lambda *a: None) if cfg.ops.quiet else print
    env = _stage_env(
        cfg,
        policy,
        tok,
        run_dir,
        key,
        lambda stage, periodic=True: ctx,
        resume=resume,
        say=say,
        tok_file=tok_file,
        summary={"data": cfg.data.path},
        stage=st.name,
        callbacks=callbacks,
    )
    out = st.data(env, stage_config(cfg, st))
    summary = env.summary
    summary["stopped"] = out.result.loop.stopped
    if out.result.loop.stop_reason:
        summary["stop_reason"] = out.result.loop.stop_reason
    held = summary.get(st.summary_key or st.name)
    if isinstance(held, dict):
        after_evaluation(callbacks, out.result.loop, held)
    if out.policy is not None:
        adapted = out.adapted if out.adapted is not None else out.result.state.model
        export_policy(
            out.policy,
            run_dir,
            st.name,
            adapted=adapted,
            tokenizer_file=tok_file,
            base_model=_hf_base(cfg.model.source),
        )
    write_json_atomic(os.path.join(run_dir, "summary.json"), summary)
    try:
        from ._plots import plot_run

        plot_run(run_dir)
    except ImportError:
        pass
    say(json_text(summary, indent=1))
    return summary
