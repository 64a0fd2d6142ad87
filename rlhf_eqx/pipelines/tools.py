"""What the command line does besides training, and what a run leaves behind: loading a
model (`load_model`, short names), sampling and scoring one (`sample_model`,
`evaluate_model`), several seeds of a run (`run_seeds`), the result table, the metrics
log and its plots, checkpoints and the run directory, and the monitor's measurements."""

from ._checkpoints import (
    latest_checkpoint as latest_checkpoint,
    restore_checkpoint as restore_checkpoint,
    save_checkpoint as save_checkpoint,
)
from ._metrics import MetricsLog as MetricsLog
from ._model_commands import (
    evaluate_model as evaluate_model,
    load_configured_model as load_configured_model,
    render_prompts as render_prompts,
    sample_model as sample_model,
)
from ._monitor import (
    device_memory as device_memory,
    measure_matmul_peak as measure_matmul_peak,
    model_flops as model_flops,
)
from ._pipeline import (
    MODEL_NAMES as MODEL_NAMES,
    check_model as check_model,
    format_table as format_table,
    load_model as load_model,
    model_files as model_files,
    resolve_model_names as resolve_model_names,
    tokenizer_file as tokenizer_file,
)
from ._plots import plot_run as plot_run, read_metrics as read_metrics, read_records as read_records
from ._rundir import check_data as check_data, open_run_dir as open_run_dir
from ._seeds import (
    check_seeds as check_seeds,
    format_seeds_table as format_seeds_table,
    run_seeds as run_seeds,
    seeds_command as seeds_command,
    summarize_seeds as summarize_seeds,
)
from ._sweep import sweep_command as sweep_command
