"""Experiment trackers behind a run's metrics log: the `Tracker` protocol (`start`, `log`,
`summary`, `finish`; `identity` and `resume` continue a run when it resumes), the
TensorBoard, Weights & Biases, MLflow and trackio backends (each an optional extra,
local unless configured otherwise), the registry that `ops.trackers` names, and the set
a run opens (`Trackers`, `open_trackers`). See the "Experiment trackers" section of
`docs/pipelines.md`."""

from ._tracker_backends import (
    MLflowTracker as MLflowTracker,
    TensorBoardTracker as TensorBoardTracker,
    TrackioTracker as TrackioTracker,
    WandbTracker as WandbTracker,
    wandb_records as wandb_records,
)
from ._trackers import (
    Tracker as Tracker,
    Trackers as Trackers,
    active_trackers as active_trackers,
    open_trackers as open_trackers,
    recorded_runs as recorded_runs,
    register_tracker as register_tracker,
    run_trackers as run_trackers,
    tracker_names as tracker_names,
)
