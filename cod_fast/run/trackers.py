"""Experiment trackers beside the run directory's own logs (`runtime.report_to`).

TRL's `report_to` and verl's `trainer.logger` in cod-fast: each step's numbers (the numeric
fields of metrics.jsonl, each `...reward_by_position` as one scalar per position,
`reward_by_position/0` ..) and each evaluation's CoD gain and last-position reward
(`eval/ENV/cod_gain`, `eval/ENV/last_position`) go to every tracker the run lists, at the run's
step, with the resolved config (flat: `algo.loss.policy`) as the tracker run's config:

- `tensorboard`: event files in RUN_DIR/tb (torch's SummaryWriter);
- `wandb`: a Weights & Biases run, project WANDB_PROJECT (else `cod-fast`), its local files in
  RUN_DIR/wandb unless WANDB_DIR names another folder; every value is plotted against the run's
  `step` (wandb's own counter only counts calls);
- `mlflow`: an MLflow run in the experiment and store MLflow's variables name
  (MLFLOW_EXPERIMENT_NAME, MLFLOW_TRACKING_URI); the config as its parameters;
- `trackio`: a trackio run in project `cod-fast`, in trackio's local store (TRACKIO_DIR) or the
  Space its variables name.

Each run is named after the run directory. Where the libraries connect and with what key is
theirs to read from their own environment variables (WANDB_MODE=offline, WANDB_API_KEY,
MLFLOW_TRACKING_URI, HF_TOKEN): cod-fast passes none and stores none. Each library is imported
only by a run that lists it; a missing one is a ConfigError naming its extra.

A resumed run continues the same tracker runs: RUN_DIR/trackers.json keeps what names each one
(wandb's run id, MLflow's run id, trackio's run name), written when the run starts and read
back on `--resume`. TensorBoard hides the events past the resumed checkpoint (its
`purge_step`); wandb, MLflow and trackio keep the steps the crashed run logged past it, and get
the redone steps beside them. An id is drawn for each new run rather than derived from the
folder's path: a path such as `runs/latest` is reused by later runs and other machines, and
wandb would append those to the first run that had it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from cod_fast.common.bounded_read import ReadRefused, read_bounded
from cod_fast.common.errors import CodFastError
from cod_fast.common.safe_write import make_folder, write_atomic
from cod_fast.common.values import first_words
from cod_fast.config import Config, ConfigError, shown
from cod_fast.config.io import to_dict

STATE = "trackers.json"
"""What names each tracker's run, for a resumed run to continue it."""
MAX_STATE_BYTES = 2**16
"""The largest trackers.json read back (a few hundred bytes are written)."""
PROJECT = "cod-fast"
"""The wandb project (unless WANDB_PROJECT names one) and the trackio project."""
PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow-skinny",
    "trackio": "trackio",
}
"""The package each tracker needs (the extra of the same name brings it)."""


class TrackerError(ValueError, CodFastError):
    """A trackers.json that names no tracker run, or a tracker that cannot start; the message
    names the file or the tracker, and the fix."""


@dataclasses.dataclass(frozen=True)
class TrackedRun:
    """What a tracker starts with."""

    dir: Path
    """The run directory."""
    name: str
    """The run's name in the tracker: the run directory's."""
    config: dict[str, Any]
    """The resolved config, flat (run_config)."""
    resumed: int | None
    """The checkpoint step a resumed run continues from; None: a new run."""
    saved: dict[str, str]
    """What this tracker kept in trackers.json when the run began (empty for a new run)."""


class Tracker(Protocol):
    """One tracker library as the run log drives it: start once, log each step and evaluation,
    close at the end."""

    def start(self, run: TrackedRun) -> dict[str, str]:
        """Open the tracker run (a new one, or `run.saved`'s); returns what names it, for
        trackers.json."""
        ...

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record `metrics` at the run's `step`."""
        ...

    def close(self) -> None: ...


@contextlib.contextmanager
def _needs(tracker: str) -> Iterator[None]:
    """Turn the ImportError of a tracker's library into the one-line ConfigError that says how
    to install it or drop the tracker."""
    try:
        yield
    except ImportError as e:
        fix = f"pip install 'cod-fast[{tracker}]' or remove it from runtime.report_to"
        if tracker == "tensorboard":
            fix += " (and set runtime.tensorboard=false, its older spelling)"
        raise ConfigError(
            "runtime.report_to",
            f"{tracker} needs the {PACKAGES[tracker]} package ({first_words(e)}); {fix}",
        ) from None


class TensorBoard:
    """Event files in RUN_DIR/tb; a resumed run hides the events past its checkpoint."""

    def __init__(self) -> None:
        with _needs("tensorboard"):
            from torch.utils.tensorboard import SummaryWriter
        self.writer_class = SummaryWriter
        self.writer: Any = None

    def start(self, run: TrackedRun) -> dict[str, str]:
        folder = make_folder(run.dir, run.dir / "tb")
        # Steps after the checkpoint are redone: the crashed run's events for them are hidden
        # (torch/utils/tensorboard/writer.py, `purge_step`).
        purge = None if run.resumed is None else run.resumed + 1
        self.writer = self.writer_class(str(folder), purge_step=purge)
        return {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A Weights & Biases run; its id is kept, so a resumed run continues it."""

    def __init__(self) -> None:
        with _needs("wandb"):
            import wandb
        self.wandb = wandb
        self.run: Any = None

    def start(self, run: TrackedRun) -> dict[str, str]:
        run_id = run.saved.get("id") or _new_id()
        if "WANDB_DIR" not in os.environ:
            make_folder(run.dir, run.dir / "wandb")  # where wandb.init(dir=RUN_DIR) writes
        try:
            self.run = self.wandb.init(
                project=os.environ.get("WANDB_PROJECT", PROJECT),
                name=run.name,
                id=run_id,
                resume="allow",
                config=run.config,
                dir=None if "WANDB_DIR" in os.environ else str(run.dir),
            )
        except self.wandb.Error as e:  # no login, a refused key, a project not found
            raise TrackerError(
                f"wandb could not start its run ({first_words(e)}); log in (wandb login, or "
                "WANDB_API_KEY), or set WANDB_MODE=offline, or remove wandb from "
                "runtime.report_to"
            ) from None
        # Plotted against the run's step: a resumed run logs steps again that wandb's own
        # counter has passed, and wandb drops those (transformers' WandbCallback does the same).
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step", step_sync=True)
        return {"id": run_id}

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, "step": step})

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run: the config as its parameters, a resumed run continues it."""

    def __init__(self) -> None:
        with _needs("mlflow"):
            import mlflow
            from mlflow.entities import Metric, Param
            from mlflow.exceptions import MlflowException
        self.mlflow, self.metric, self.param, self.failure = mlflow, Metric, Param, MlflowException
        self.client: Any = None
        self.run_id = ""

    def start(self, run: TrackedRun) -> dict[str, str]:
        try:
            self.client = self.mlflow.MlflowClient()  # the store MLFLOW_TRACKING_URI names
            self.run_id = self._open(run)
        except self.failure as e:
            raise TrackerError(
                f"mlflow could not start its run ({first_words(e)}); set MLFLOW_TRACKING_URI to "
                "a tracking server (http://...) or to file:FOLDER with MLFLOW_ALLOW_FILE_STORE="
                "true, or pip install mlflow for its own local store, or remove mlflow from "
                "runtime.report_to"
            ) from None
        return {"run_id": self.run_id}

    def _open(self, run: TrackedRun) -> str:
        """The id of the run `run.saved` names, reopened, or of a new one with the config as
        its parameters."""
        nested = self.mlflow.active_run() is not None  # a caller's own run: ours goes under it
        saved = run.saved.get("run_id")
        if saved is not None:
            try:
                return self.mlflow.start_run(run_id=saved, nested=nested).info.run_id
            except self.failure as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                warnings.warn(
                    f"{run.dir / STATE}: mlflow run {saved} is not in the tracking store "
                    f"{self.mlflow.get_tracking_uri()}; the resumed run logs to a new one",
                    RuntimeWarning,
                    stacklevel=2,
                )
        tags = {"cod_fast.run_dir": str(run.dir.resolve())}
        new = self.mlflow.start_run(run_name=run.name, tags=tags, nested=nested)
        params = [self.param(_mlflow_name(k), _text(v)) for k, v in run.config.items()]
        self.client.log_batch(new.info.run_id, params=params)
        return new.info.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        rows = [self.metric(_mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=rows)

    def close(self) -> None:
        active = self.mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            self.mlflow.end_run()
        else:
            self.client.set_terminated(self.run_id)


class Trackio:
    """A trackio run, named after the run directory; a resumed run continues it by name."""

    def __init__(self) -> None:
        with _needs("trackio"):
            import trackio
        self.trackio = trackio
        self.run: Any = None

    def start(self, run: TrackedRun) -> dict[str, str]:
        # Only a run trackers.json names is continued: another folder of the same name (a
        # second `runs/latest`) gets a run of its own.
        name = run.saved.get("name") or run.name
        resume = "allow" if run.saved else "never"
        self.run = self.trackio.init(project=PROJECT, name=name, config=run.config, resume=resume)
        return {"name": name}

    def log(self, metrics: dict[str, float], step: int) -> None:
        # `step` is a name trackio keeps for itself (trackio/utils.py RESERVED_KEYS).
        self.run.log({k: v for k, v in metrics.items() if k != "step"}, step=step)

    def close(self) -> None:
        self.trackio.finish()  # the current run, ours: trackio's exit hook then has none left


TRACKERS: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoard,
    "wandb": WandB,
    "mlflow": MLflow,
    "trackio": Trackio,
}
"""Each name runtime.report_to takes, and its adapter."""


def check_trackers(names: Sequence[str]) -> None:
    """ConfigError (one line) for a listed tracker whose library does not import here: the
    preflight's check, before the run writes anything."""
    for name in names:
        TRACKERS[name]()


class Trackers:
    """The run's trackers, started once the run knows whether it resumes (RunLog.truncate) or
    at its first record."""

    def __init__(self, names: Sequence[str], config: Config | None = None):
        self.adapters = {name: TRACKERS[name]() for name in names}  # each imports its library
        self.config = config
        self.started = False

    def start(self, run_dir: Path, resumed: int | None) -> None:
        """Open every tracker run: new ones (`resumed` None), or those trackers.json names."""
        if self.started or not self.adapters:
            return
        self.started = True
        path = run_dir / STATE
        saved = read_state(path) if resumed is not None else {}
        config = run_config(self.config) if self.config is not None else {}
        name = run_dir.resolve().name or PROJECT
        state = dict(saved)
        for tracker, adapter in self.adapters.items():
            run = TrackedRun(run_dir, name, config, resumed, saved.get(tracker, {}))
            state[tracker] = adapter.start(run)
        state = {tracker: kept for tracker, kept in state.items() if kept}
        if state or path.exists():
            write_atomic(path, json.dumps(state, indent=1, sort_keys=True) + "\n")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for adapter in self.adapters.values():
            adapter.log(metrics, step)

    def close(self) -> None:
        if self.started:
            for adapter in self.adapters.values():
                adapter.close()
        self.started = False


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a step's record a tracker plots: its numeric fields (not booleans, not
    null) and each position of a `...reward_by_position` list (`reward_by_position/0` ..)."""
    out: dict[str, float] = {}
    for name, value in record.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
        elif isinstance(value, list) and name.endswith("reward_by_position"):
            for k, v in enumerate(value):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{name}/{k}"] = v
    return out


def run_config(cfg: Config) -> dict[str, Any]:
    """The config as a tracker run's config: {dotted key: value}, sections flattened
    (`algo.loss.policy`), lists kept as values; an empty mapping stays one value."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: dict[str, Any]) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(f"{prefix}{key}.", value)
            else:
                out[prefix + key] = value

    walk("", to_dict(cfg))
    return out


def _kept(value: Any) -> bool:
    """An id or name trackers.json may hold: one short printable line (wandb's and MLflow's run
    ids, a folder's name)."""
    return isinstance(value, str) and 0 < len(value) <= 256 and value.isprintable()


def read_state(path: Path) -> dict[str, dict[str, str]]:
    """trackers.json, checked: {tracker: {field: id}}; {} where it does not exist."""
    if not path.exists():
        return {}
    fix = f"delete {path} to start new tracker runs, or restore it"
    try:
        data = json.loads(read_bounded(path, MAX_STATE_BYTES))
    except ReadRefused as e:
        raise TrackerError(f"{path} is {e}, not what cod-fast writes there; {fix}") from None
    except (ValueError, RecursionError):
        raise TrackerError(f"{path} is not JSON; {fix}") from None
    ok = isinstance(data, dict) and all(
        tracker in TRACKERS
        and isinstance(kept, dict)
        and all(isinstance(k, str) and _kept(v) for k, v in kept.items())
        for tracker, kept in data.items()
    )
    if not ok:
        raise TrackerError(
            f"{path} holds {shown(data)}, not tracker run ids ({{tracker: {{field: id}}}}); {fix}"
        )
    return data


def _new_id() -> str:
    """A new wandb run id: 12 characters of [a-z0-9], as wandb's own are."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(12))


def _mlflow_name(key: str) -> str:
    """`key` as MLflow takes a metric or parameter name: characters outside letters, digits,
    `_ - . / : space` become `_`, and so does a path part `.` or `..` or an empty one (MLflow
    stores names as file paths; mlflow/utils/validation.py)."""
    key = re.sub(r"[^\w.\-/: ]", "_", key)
    return "/".join(part if part not in ("", ".", "..") else "_" for part in key.split("/"))


def _text(value: Any) -> str:
    """A config value as an MLflow parameter: strings as they are, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)
