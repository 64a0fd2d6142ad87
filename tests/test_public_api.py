"""Tests and examples use the public API only: no import reaches into a private module
(`rlhf_eqx._x`, `rlhf_eqx.models._y`, `from rlhf_eqx.models import _z`), and the helpers
they need are re-exported where users find them."""

import ast
import pathlib
import re

import pytest

import rlhf_eqx as rx
from rlhf_eqx import pipelines as pl

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The shape-check tests exercise the import hook that instruments the package itself
# (`rlhf_eqx._typecheck`): machinery, not API, switched by `RLHF_EQX_TYPECHECK`.
ALLOWED = {("test_shape_checks.py", "rlhf_eqx._typecheck")}
_MODULE_PATH = re.compile(r"rlhf_eqx(\.\w+)*")


def _private(module: str) -> bool:
    """`True` when a dotted path names a private part of rlhf_eqx (dunder names such as
    `__main__` are not private)."""
    parts = module.split(".")
    return parts[0] == "rlhf_eqx" and any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:]
    )


def private_imports(source: str) -> list[tuple[int, str]]:
    """`(line, dotted path)` of every private rlhf_eqx module or name that `source`
    imports, or passes as a module path to a call (`importlib.import_module(...)`,
    `monkeypatch.setattr(...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            paths = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [(node.lineno, p) for p in paths if _private(p)][:1]
        elif isinstance(node, ast.Call):
            for arg in node.args[:1]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    if _MODULE_PATH.fullmatch(arg.value) and _private(arg.value):
                        found.append((node.lineno, arg.value))
    return found


def test_the_checker_finds_private_imports():
    source = (
        "import rlhf_eqx as rx\n"
        "from rlhf_eqx.models import Policy, load_hf\n"
        "from rlhf_eqx.__main__ import main\n"
        "from rlhf_eqx.models._quant import quantize_weight_nf4\n"
        "import rlhf_eqx._sampling._token\n"
        "from rlhf_eqx.models import _transformer, Policy\n"
        "from rlhf_eqx import _memory\n"
        "mod = importlib.import_module('rlhf_eqx.pipelines._monitor')\n"
        "text = 'see rlhf_eqx._memory for the model'\n"
    )
    assert private_imports(source) == [
        (4, "rlhf_eqx.models._quant"),
        (5, "rlhf_eqx._sampling._token"),
        (6, "rlhf_eqx.models._transformer"),
        (7, "rlhf_eqx._memory"),
        (8, "rlhf_eqx.pipelines._monitor"),
    ]


@pytest.mark.parametrize(
    "path",
    sorted(ROOT.glob("tests/*.py")) + sorted(ROOT.glob("examples/*.py")),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_no_private_imports(path):
    found = [
        (line, module)
        for line, module in private_imports(path.read_text())
        if (path.name, module) not in ALLOWED
    ]
    assert not found, "\n".join(
        f"{path.relative_to(ROOT)}:{line} imports the private {module}; use (or add) "
        "a public name in the package's __init__"
        for line, module in found
    )


@pytest.mark.parametrize(
    "name",
    [
        "models.attention",
        "models.attention_layout",
        "models.activation",
        "models.gated_activation",
        "models.rms_norm",
        "models.ATTENTION_BLOCK",
        "models.permute_rotary_rows",
        "models.quantize_weight_int8",
        "models.quantize_weight_nf4",
        "filter_logits",
        "sample_token",
        "estimate_memory",
        "MemoryEstimate",
    ],
)
def test_helpers_are_public(name):
    obj = rx
    for part in name.split("."):
        obj = getattr(obj, part)
    if callable(obj) and not isinstance(obj, type):
        assert obj.__doc__ and obj.__doc__.strip(), f"rlhf_eqx.{name} has no docstring"


def test_pipeline_helpers_are_public():
    for name in ("tools.device_memory", "tools.measure_matmul_peak", "tools.model_flops"):
        sub, attr = name.split(".")
        assert callable(getattr(getattr(pl, sub), attr)), name
    assert callable(pl.runs.split_records)


def test_the_pipelines_surface_is_small():
    """`rlhf_eqx.pipelines` holds what a run is configured and started with, and its
    public submodules; everything else lives in those submodules."""
    own = [
        name
        for name in vars(pl)
        if not name.startswith("_")
        and not (isinstance(getattr(pl, name), type(pl)) and name not in _SUBMODULES)
    ]
    assert len(own) <= 40, sorted(own)
    for name in ("run_pipeline", "run_on_data", "PipelineConfig", "DPOConfig", "Stage"):
        assert name in own
    for name in ("Callback", "sweep", "trackers"):
        assert name in own


_SUBMODULES = {"config", "loop", "runs", "task", "tools", "trackers"}


_OPTIONS = " options"
_PPO = (
    "clip_eps clip_eps_high dual_clip vf_coef vf_clip_eps ent_coef mode constant "
    "policy_loss loss_kwargs"
)
_GRPO = (
    "group_size scale clip_eps clip_eps_high importance beta delta mode constant "
    "mask_truncated_completions policy_loss loss_kwargs cispo_eps_low cispo_eps_high gmpo_clip "
    "sapo_tau_pos sapo_tau_neg cov_fraction clip_cov_low clip_cov_high clip_cov_select "
    "kl_cov_coef entropy_rho rollout_correction"
)
STAGE_KEYS = {
    "sft": "steps batch_size max_length optim samples packing lora mode constant" + _OPTIONS,
    "reward": "steps batch_size max_length optim pairs_per_prompt heldout_fraction eval_every "
    "ensemble ensemble_mode ensemble_penalty center_coef margin" + _OPTIONS,
    "dpo": "steps batch_size max_length optim beta loss_type rounds samples packing lora "
    "label_smoothing reference rpo_alpha loss_kwargs missing_eos_penalty" + _OPTIONS,
    "ppo": "rollouts prompts_per_rollout epochs kl_target optim lora minibatches "
    f"gamma lam kl_coef reward_source reward_model reward_functions reward_weights {_PPO} "
    "kl_estimator whiten_rewards missing_eos_penalty" + _OPTIONS,
    "grpo": "rollouts prompts_per_rollout epochs kl_target optim lora "
    "reward_source reward_model reward_functions reward_weights staleness overlap "
    "sampler_device placement trainer_devices sampler_devices trainer_mesh sampler_mesh "
    f"dynamic_sampling partial_rollouts overlong_buffer {_GRPO}" + _OPTIONS,
    "kto": "steps batch_size max_length optim beta desirable_weight undesirable_weight "
    "loss_type samples lora" + _OPTIONS,
    "distill": "steps batch_size max_length optim beta temperature lmbda seq_kd teacher "
    "samples lora" + _OPTIONS,
    "prm": "steps batch_size max_length optim separator aggregation score"
    " train_on_last_step_only" + _OPTIONS,
    "judge": "model template yes no score",
}
OPTIM_KEYS = "learning_rate warmup_ratio weight_decay max_grad_norm schedule b1 b2 eps"
OPTIONS_KEYS = "micro_batches axis_name donate nonfinite check_token_ids"
LORA_KEYS = "rank alpha dropout targets use_rslora use_dora"  # lora.use_dora: DoRA adapters


def test_stage_config_keys_are_the_documented_ones():
    """The keys users write in config files and `--set` paths: the stages share their
    common blocks (`BatchStageConfig`, `RolloutStageConfig`) without changing them."""
    d = pl.config.config_to_dict(pl.PipelineConfig())
    for stage, keys in STAGE_KEYS.items():
        assert set(d[stage]) == set(keys.split()), stage
        if "optim" in d[stage]:
            assert set(d[stage]["optim"]) == set(OPTIM_KEYS.split()), stage
            assert set(d[stage]["options"]) == set(OPTIONS_KEYS.split()), stage
        if "lora" in d[stage]:
            assert set(d[stage]["lora"]) == set(LORA_KEYS.split()), stage
    # the stage configs are the train records (same fields, defaults and checks)
    records = {
        "sft": rx.train.SFTSettings,
        "reward": rx.train.RewardSettings,
        "dpo": rx.train.DPOSettings,
        "ppo": rx.train.PPOSettings,
        "grpo": rx.train.GRPOSettings,
    }
    for stage, record in records.items():
        assert isinstance(getattr(pl.PipelineConfig(), stage), record), stage
    for stage in ("sft", "reward", "dpo", "kto", "distill", "prm"):
        assert isinstance(getattr(pl.PipelineConfig(), stage), pl.config.BatchStageConfig)
    for stage in ("ppo", "grpo"):
        assert isinstance(getattr(pl.PipelineConfig(), stage), pl.config.RolloutStageConfig)


@pytest.mark.parametrize(
    "override, field",
    [
        ("ppo.clip_eps=-1.5", "ppo.clip_eps"),
        ("grpo.clip_eps=0", "grpo.clip_eps"),
        ("grpo.kl_target=0", "grpo.kl_target"),
        ("ppo.epochs=0", "ppo.epochs"),
        ("grpo.rollouts=0", "grpo.rollouts"),
        ("reward.steps=0", "reward.steps"),
        ("dpo.batch_size=0", "dpo.batch_size"),
        ("sft.max_length=8", "sft.max_length"),
        ("grpo.optim.learning_rate=0", "grpo.optim.learning_rate"),
        ("dpo.lora.rank=-1", "dpo.lora.rank"),
        ("ppo.options.micro_batches=0", "ppo.options.micro_batches"),
    ],
)
def test_shared_stage_fields_are_validated_per_stage(override, field):
    # the records' own fields raise when the config is built, the pipeline's when checked
    with pytest.raises(pl.ConfigError, match=rf"^{re.escape(field)}="):
        cfg = pl.apply_overrides(pl.PipelineConfig(), [override, "sampling.prompt_length=16"])
        pl.config.validate_config(cfg)


# --- step builders take one settings record and one StepOptions -------------------------
# `make_<algo>_step(optimizer, settings=None, *, options=None, **shortcuts)`: the
# hyperparameters, their defaults and their checks live in the record only.

RECORD_BUILDERS = {
    "make_sft_step": ("SFTSettings", ()),
    "make_reward_step": ("RewardSettings", ()),
    "make_dpo_step": ("DPOSettings", ()),
    "make_ppo_step": ("PPOSettings", ("value_optimizer",)),
    "make_grpo_step": ("GRPOSettings", ()),
    "make_ensemble_reward_step": ("RewardSettings", ("members",)),
    "make_kto_step": ("KTOSettings", ()),
    "make_distill_step": ("DistillSettings", ()),
    "make_onpolicy_distill_step": ("OnPolicyDistillSettings", ()),
    "make_prm_step": ("PRMSettings", ()),
}


def test_every_step_builder_takes_a_settings_record():
    builders = {n for n in dir(rx.train) if n.startswith("make_") and n.endswith("_step")}
    assert builders - {"make_step"} == set(RECORD_BUILDERS)


def _params(fn):
    import inspect

    return inspect.signature(fn).parameters


@pytest.mark.parametrize("builder", sorted(RECORD_BUILDERS))
def test_step_builders_take_their_settings_record_and_step_options(builder):
    import inspect

    record_name, own = RECORD_BUILDERS[builder]
    params = _params(getattr(rx.train, builder))
    kinds = {n: p.kind for n, p in params.items()}
    assert list(params)[:2] == ["optimizer", "settings"], builder
    assert kinds["settings"] is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert params["settings"].default is None
    assert str(params["settings"].annotation) == str(getattr(rx.train, record_name) | None)
    assert params["options"].default is None and kinds["options"] is inspect.Parameter.KEYWORD_ONLY
    assert kinds["shortcuts"] is inspect.Parameter.VAR_KEYWORD
    assert set(params) == {"optimizer", "settings", "options", "shortcuts", *own}, builder


def _literal_temperature_defaults(source: str) -> list[int]:
    """Lines where a parameter or a field named `temperature` defaults to the literal 1."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arguments):
            positional = node.posonlyargs + node.args
            pairs = list(zip(positional[len(positional) - len(node.defaults) :], node.defaults))
            pairs += list(zip(node.kwonlyargs, node.kw_defaults))
            names = [(a.arg, d) for a, d in pairs]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [(node.target.id, node.value)]
        else:
            continue
        found += [
            d.lineno
            for name, d in names
            if name == "temperature" and isinstance(d, ast.Constant) and d.value == 1
        ]
    return found


def test_the_default_temperature_is_written_once():
    """Above the sampling layer every default temperature is `DEFAULT_TEMPERATURE`, never a
    restated literal. (The layers below it, `models` and `ops`, cannot import it: there a
    temperature of 1 means the unscaled logits.)"""
    assert _literal_temperature_defaults("def f(*, temperature=1.0): ...") == [1]
    assert _literal_temperature_defaults("class C:\n    temperature: float = 1\n") == [2]
    assert _literal_temperature_defaults("def f(temperature=DEFAULT_TEMPERATURE): ...") == []
    below = ("rlhf_eqx/ops.py", "rlhf_eqx/models/")
    found = [
        f"{rel}:{line}"
        for p in sorted((ROOT / "rlhf_eqx").rglob("*.py"))
        if not (rel := str(p.relative_to(ROOT))).startswith(below)
        for line in _literal_temperature_defaults(p.read_text())
    ]
    assert not found, f"temperature defaults restating DEFAULT_TEMPERATURE: {found}"
    assert rx.DEFAULT_TEMPERATURE == 1.0


def _unit(parts: list[str]) -> str:
    """The unit of a dotted rlhf_eqx path: its first name under `rlhf_eqx` (`""`: the
    package root itself)."""
    return parts[1] if len(parts) > 1 else ""


def cross_unit_private_imports(source: str, module: str, is_package: bool = False):
    """`(line, dotted path)` of every import in the library module `module` (dotted, e.g.
    `rlhf_eqx.train._dpo`; `is_package` for an `__init__.py`) that reaches a private part
    of another unit: a private module below the other unit's own name, or a private name
    (see `test_no_private_names_across_subpackages` for the rule)."""
    here = module.split(".")
    package = here if is_package else here[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            base = base + (node.module.split(".") if node.module else [])
            targets = [base + [a.name] for a in node.names]
        else:
            continue
        for t in targets:
            if t[0] != "rlhf_eqx" or len(t) < 2 or _unit(t) == _unit(here):
                continue
            if _private(".".join(["rlhf_eqx", *t[2:]])):  # below the other unit's name
                found.append((node.lineno, ".".join(t)))
    return sorted(found)


def test_the_cross_unit_checker_finds_private_names():
    source = (
        "from ..models import Policy, AbstractDecoder\n"
        "from .._batches import PreferenceBatch\n"
        "from .. import _sampling, data\n"
        "from ._accumulate import _helper\n"
        "from ..models._protocols import AbstractDecoder\n"
        "from .._batches import _validate\n"
        "from ..data._errors import DataError\n"
        "def f():\n"
        "    from ..losses._ppo import LOG_RATIO_CLAMP\n"
        "import rlhf_eqx.models._quant\n"
        "from rlhf_eqx.models import _transformer\n"
    )
    assert cross_unit_private_imports(source, "rlhf_eqx.train._dpo") == [
        (5, "rlhf_eqx.models._protocols.AbstractDecoder"),
        (6, "rlhf_eqx._batches._validate"),
        (7, "rlhf_eqx.data._errors.DataError"),
        (9, "rlhf_eqx.losses._ppo.LOG_RATIO_CLAMP"),
        (10, "rlhf_eqx.models._quant"),
        (11, "rlhf_eqx.models._transformer"),
    ]
    # inside one unit anything goes; the root package is a unit of its own
    assert cross_unit_private_imports(source, "rlhf_eqx.models._heads") == [
        (6, "rlhf_eqx._batches._validate"),
        (7, "rlhf_eqx.data._errors.DataError"),
        (9, "rlhf_eqx.losses._ppo.LOG_RATIO_CLAMP"),
    ]
    root = "from .distributed._memory import estimate_memory\nfrom .models import Policy\n"
    assert cross_unit_private_imports(root, "rlhf_eqx", is_package=True) == [
        (1, "rlhf_eqx.distributed._memory.estimate_memory")
    ]
    init = "from ._x import y\nfrom .._sampling._options import DEFAULT_TEMPERATURE\n"
    assert cross_unit_private_imports(init, "rlhf_eqx.losses", is_package=True) == [
        (2, "rlhf_eqx._sampling._options.DEFAULT_TEMPERATURE")
    ]


def test_no_private_names_across_subpackages():
    """No library module imports a private part of another subpackage.

    Every module of the library belongs to one *unit*: the first name under `rlhf_eqx`,
    a subpackage (`rlhf_eqx.train`, `rlhf_eqx._sampling`) or a top-level module
    (`rlhf_eqx.ops`, `rlhf_eqx._pretrained`); the package root `rlhf_eqx/__init__.py` is
    a unit of its own. Inside a unit any import is fine (`from ._accumulate import
    vmap_model` in `train`). Across units an import names the other unit and then only
    public names: its `__init__`'s names or the top-level module's own public names —
    never a private module below it (`rlhf_eqx.models._protocols`) nor a private name
    (`from rlhf_eqx._sampling import _check_decoder`). A unit's own name may begin with an
    underscore (`rlhf_eqx._sampling`, `rlhf_eqx._typecheck`): it is kept out of the
    users' namespace, and its public names are what the rest of the library builds on.
    So a helper that another subpackage needs is public where it lives (exported from
    its `__init__` and documented), or it moves to the unit that uses it.
    """
    found = []
    for path in sorted((ROOT / "rlhf_eqx").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        found += [
            f"{path.relative_to(ROOT)}:{line} imports {target}"
            for line, target in cross_unit_private_imports(path.read_text(), module, is_package)
        ]
    assert not found, "private names imported across subpackages:\n" + "\n".join(found)
