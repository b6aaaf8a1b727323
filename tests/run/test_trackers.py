"""Experiment trackers (cod_fast/run/trackers.py, `runtime.report_to`): each library in its
local mode gets the run's scalars at their steps and the resolved config, read back from what
the library stored; a resumed run continues the same tracker run; a missing library is one
ConfigError line; the config key and its older spelling."""

from __future__ import annotations

import importlib.util
import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.common.errors import CodFastError
from cod_fast.config import Config, ConfigError
from cod_fast.config.io import dump_yaml, from_dict, load_config, to_dict
from cod_fast.data.metrics import PositionSummary
from cod_fast.run.log import RunLog
from cod_fast.run.trackers import (
    PACKAGES,
    STATE,
    TrackerError,
    _mlflow_name,
    check_trackers,
    read_state,
    run_config,
    scalars,
)

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """The log's plots (a second each) are not what these tests check."""
    monkeypatch.setattr(RunLog, "plot", lambda self: None)


def needs(module: str):
    """Skip where the tracker's package is not installed (the `dev` extra brings each)."""
    missing = importlib.util.find_spec(module) is None
    return pytest.mark.skipif(missing, reason=f"needs the {module} package (the dev extra)")


def _records(rng: random.Random, steps: range) -> list[dict]:
    """Step records as the trainer writes them: numbers, a phase string, a boolean, a null, and
    the per-position rewards."""
    return [
        {
            "step": s,
            "phase": "rl",
            "loss": rng.uniform(-1, 1),
            "tokens": rng.randrange(1, 10_000),
            "kl": None,
            "skipped": False,
            "reward_by_position": [rng.random() for _ in range(3)],
        }
        for s in steps
    ]


def _summary(rng: random.Random) -> PositionSummary:
    return PositionSummary(
        mean_reward=[rng.random() for _ in range(3)], success_rate=None, num_packs=2
    )


def _expected(records: list[dict]) -> dict[str, dict[int, float]]:
    """{scalar name: {step: value}} a tracker should hold after `records`."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        out.setdefault("loss", {})[r["step"]] = r["loss"]
        out.setdefault("tokens", {})[r["step"]] = r["tokens"]
        for k, v in enumerate(r["reward_by_position"]):
            out.setdefault(f"reward_by_position/{k}", {})[r["step"]] = v
    return out


def _log_run(run: Path, trackers: list[str], records: list[dict], resumed: int = -1, evals=()):
    """A RunLog as the trainer drives it: truncate (the start or the resume), steps,
    evaluations (env, step, summary), close."""
    log = RunLog(run, trackers=trackers, config=load_config("tiny-cpu"))
    log.truncate(resumed)
    for record in records:
        log.step(record)
    for env, step, summary in evals:
        log.evaluation("rl step", step, summary, env=env)
    log.close()


# --- the config key -----------------------------------------------------------------------


def test_report_to_takes_the_four_trackers_once_each_and_tensorboard_true_still_counts():
    """`runtime.report_to` takes tensorboard, wandb, mlflow, trackio, each once; the older
    `runtime.tensorboard: true` adds tensorboard (once, listed or not); both survive YAML."""
    cfg = load_config("tiny-cpu", overrides=["runtime.report_to=[wandb, mlflow]"])
    assert cfg.runtime.trackers == ["wandb", "mlflow"]
    both = load_config(
        "tiny-cpu", overrides=["runtime.tensorboard=true", "runtime.report_to=[wandb]"]
    )
    assert both.runtime.trackers == ["tensorboard", "wandb"]
    listed = load_config(
        "tiny-cpu", overrides=["runtime.tensorboard=true", "runtime.report_to=[tensorboard]"]
    )
    assert listed.runtime.trackers == ["tensorboard"]
    assert load_config("tiny-cpu").runtime.trackers == []
    assert from_dict(Config, to_dict(both)) == both and "report_to" in dump_yaml(both)
    for bad, why in [("[wandb, wandb]", "at most once"), ("[comet]", "'trackio'")]:
        with pytest.raises(ConfigError) as caught:
            load_config("tiny-cpu", overrides=[f"runtime.report_to={bad}"])
        assert str(caught.value).startswith("runtime.report_to: ") and why in str(caught.value)


def test_scalars_are_the_numbers_of_a_record_with_rewards_per_position():
    """A tracker gets the numeric fields (not booleans, not null, not strings) and one scalar
    per pack position of each `...reward_by_position` list."""
    rng = random.Random(0)
    record = _records(rng, range(7, 8))[0] | {"ENV/reward_by_position": [0.5, None]}
    got = scalars(record)
    assert got == {
        "step": 7,
        "loss": record["loss"],
        "tokens": record["tokens"],
        **{f"reward_by_position/{k}": v for k, v in enumerate(record["reward_by_position"])},
        "ENV/reward_by_position/0": 0.5,
    }


def test_run_config_is_flat_with_dotted_keys():
    """The tracker run's config: every key of the resolved config, dotted, with its value."""
    cfg = load_config("tiny-cpu", overrides=["runtime.report_to=[wandb]"])
    flat = run_config(cfg)
    assert flat["algo.loss.policy"] == cfg.algo.loss.policy
    assert flat["runtime.report_to"] == ["wandb"] and flat["train.lr"] == cfg.train.lr
    assert not any(isinstance(v, dict) and v for v in flat.values())


def test_mlflow_names_keep_what_mlflow_takes():
    """Metric names MLflow refuses (characters outside its set, `.`/`..`/empty path parts, as a
    plugin environment's path gives them) become names it takes; others stay as they are."""
    assert _mlflow_name("eval/frozenlake/cod_gain") == "eval/frozenlake/cod_gain"
    assert _mlflow_name("eval/./envs/mine.py:Mine/cod_gain") == "eval/_/envs/mine.py:Mine/cod_gain"
    assert _mlflow_name("eval/a+b//c/..") == "eval/a_b/_/c/_"


# --- TensorBoard --------------------------------------------------------------------------


def _tensorboard(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@needs("tensorboard")
def test_tensorboard_holds_every_scalar_at_its_step_and_a_resume_hides_the_redone_steps(tmp_path):
    """RUN_DIR/tb holds each scalar of each step and the evaluation's CoD gain; a run resumed
    from step 2 logs steps 3.. again, and TensorBoard shows the new values, not the crashed
    run's."""
    rng, run = random.Random(1), tmp_path / "run"
    first, summary = _records(rng, range(1, 5)), _summary(rng)
    _log_run(run, ["tensorboard"], first, evals=[("frozenlake", 4, summary)])
    redone = _records(rng, range(3, 6))
    _log_run(run, ["tensorboard"], redone, resumed=2)
    got, want = _tensorboard(run / "tb"), _expected(first[:2] + redone)
    for name, values in want.items():
        assert got[name] == pytest.approx(values), name
    assert not got.get("eval/frozenlake/cod_gain")  # step 4: past the checkpoint, hidden
    assert not (run / STATE).exists()  # TensorBoard keeps no id


# --- Weights & Biases ---------------------------------------------------------------------


def _wandb_records(path: Path) -> list:
    """The records of an offline wandb run's `.wandb` file: a LevelDB-style log of protobuf
    `Record`s (32 KiB blocks, each chunk behind a 7-byte header: crc32, length, kind)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length, kind) == (0, 0):  # a block's zero padding
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def _wandb_run(run: Path) -> tuple[set[str], dict[str, object], dict[str, dict[int, float]]]:
    """The run ids, the config and {scalar: {step: value}} of every offline wandb run under
    RUN_DIR/wandb (a resumed run writes a second folder for the same id)."""
    import wandb

    # run.finish() can return before wandb's service has written the last records of the
    # file; stopping the service waits for them (the next wandb.init starts a new one).
    wandb.teardown()
    ids, config, history = set(), {}, {}
    for path in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                config |= {u.key: json.loads(u.value_json) for u in record.run.config.update}
            elif kind == "history":
                row = {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                    for i in record.history.item
                }
                for name, value in row.items():
                    history.setdefault(name, {})[row["step"]] = value
    return ids, config, history


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb with no network: offline files only, its console left alone, its own logs and
    settings in the test's folder rather than the home folder."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


@pytest.mark.slow
@needs("wandb")
def test_wandb_offline_run_holds_the_scalars_config_and_a_resume_continues_its_id(
    tmp_path, wandb_offline
):
    """RUN_DIR/wandb holds an offline run with the flat config, every scalar at its step and
    the evaluation's; a run resumed from step 2 reopens the same run id (kept in trackers.json)
    and logs the redone steps."""
    rng, run = random.Random(2), tmp_path / "run"
    first, summary = _records(rng, range(1, 4)), _summary(rng)
    _log_run(run, ["wandb"], first, evals=[(None, 3, summary)])
    (kept,) = read_state(run / STATE)["wandb"].values()
    ids, config, history = _wandb_run(run)
    assert ids == {kept}
    assert config["algo.loss.policy"] == load_config("tiny-cpu").algo.loss.policy
    for name, values in _expected(first).items():
        assert history[name] == pytest.approx(values), name
    assert history["eval/cod_gain"] == pytest.approx({3: summary.cod_gain})
    redone = _records(rng, range(3, 5))
    _log_run(run, ["wandb"], redone, resumed=2)
    ids, _, history = _wandb_run(run)
    assert ids == {kept} and read_state(run / STATE)["wandb"]["id"] == kept
    assert history["loss"][4] == pytest.approx(redone[1]["loss"])


@needs("wandb")
def test_wandb_that_cannot_start_is_one_line_naming_the_ways_on(tmp_path, monkeypatch):
    """wandb.init's own error (no login) becomes one TrackerError line naming the ways on."""
    import wandb

    def refuse(**_):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(TrackerError) as caught:
        RunLog(tmp_path, trackers=["wandb"]).truncate(-1)
    message = str(caught.value)
    assert message.startswith("wandb could not start its run (No API key configured")
    assert "WANDB_MODE=offline" in message and "\n" not in message


# --- MLflow -------------------------------------------------------------------------------


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """MLflow's file store in a temporary folder (no server, no telemetry)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # no usage reports from a test
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    from mlflow import MlflowClient

    return MlflowClient()


def _mlflow_history(client, run_id: str, names) -> dict[str, dict[int, float]]:
    return {
        name: {m.step: m.value for m in client.get_metric_history(run_id, name)} for name in names
    }


@pytest.mark.slow
@needs("mlflow")
def test_mlflow_run_holds_the_scalars_params_and_a_resume_continues_it(tmp_path, mlflow_store):
    """An MLflow run named after the run directory, finished, with the flat config as params,
    every scalar at its step and the evaluation's; a resumed run reopens the same run id and
    adds the redone steps."""
    rng, run = random.Random(3), tmp_path / "my-run"
    first, summary = _records(rng, range(1, 4)), _summary(rng)
    _log_run(run, ["mlflow"], first, evals=[("frozenlake", 3, summary)])
    run_id = read_state(run / STATE)["mlflow"]["run_id"]
    stored = mlflow_store.get_run(run_id)
    assert stored.info.run_name == "my-run" and stored.info.status == "FINISHED"
    assert stored.data.params["algo.loss.policy"] == load_config("tiny-cpu").algo.loss.policy
    assert stored.data.params["runtime.report_to"] == "[]"
    want = _expected(first)
    for name, values in _mlflow_history(mlflow_store, run_id, want).items():
        assert values == pytest.approx(want[name]), name
    gain = _mlflow_history(mlflow_store, run_id, ["eval/frozenlake/cod_gain"])
    assert gain == {"eval/frozenlake/cod_gain": pytest.approx({3: summary.cod_gain})}
    redone = _records(rng, range(3, 5))
    _log_run(run, ["mlflow"], redone, resumed=2)
    assert read_state(run / STATE)["mlflow"]["run_id"] == run_id
    assert len(mlflow_store.search_runs([stored.info.experiment_id])) == 1
    loss = _mlflow_history(mlflow_store, run_id, ["loss"])["loss"]
    assert loss[4] == pytest.approx(redone[1]["loss"])


@pytest.mark.slow
@needs("mlflow")
def test_mlflow_resume_whose_run_is_not_in_the_store_starts_a_new_one(tmp_path, mlflow_store):
    """A trackers.json naming an MLflow run the store does not hold (another
    MLFLOW_TRACKING_URI): a warning naming it, and a new run."""
    run = tmp_path / "run"
    run.mkdir()
    (run / STATE).write_text(json.dumps({"mlflow": {"run_id": "0" * 32}}))
    with pytest.warns(RuntimeWarning, match="is not in the tracking store"):
        _log_run(run, ["mlflow"], _records(random.Random(4), range(3, 4)), resumed=2)
    run_id = read_state(run / STATE)["mlflow"]["run_id"]
    assert run_id != "0" * 32 and mlflow_store.get_run(run_id).info.status == "FINISHED"


@pytest.mark.slow
@needs("mlflow")
def test_mlflow_without_a_usable_store_is_one_line_naming_the_ways_on(tmp_path, mlflow_store):
    """A tracking URI MLflow cannot use: one TrackerError line naming MLFLOW_TRACKING_URI."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", "nosuch://store")
        with pytest.raises(TrackerError) as caught:
            RunLog(tmp_path / "run", trackers=["mlflow"]).truncate(-1)
    message = str(caught.value)
    assert message.startswith("mlflow could not start its run (") and "\n" not in message
    assert "nosuch://store" in message and "MLFLOW_TRACKING_URI" in message


# --- trackio ------------------------------------------------------------------------------


@pytest.fixture
def trackio_store(tmp_path, monkeypatch):
    """trackio's local store in a temporary folder: its modules read TRACKIO_DIR once, at
    import, so each module's copy is pointed there."""
    import trackio  # noqa: F401  (its modules, loaded)

    store = tmp_path / "trackio"
    store.mkdir()
    for name, module in list(sys.modules.items()):
        if name.startswith("trackio") and isinstance(getattr(module, "TRACKIO_DIR", None), Path):
            monkeypatch.setattr(module, "TRACKIO_DIR", store)
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage


@needs("trackio")
def test_trackio_run_holds_the_scalars_config_and_a_resume_continues_it(tmp_path, trackio_store):
    """A trackio run in project cod-fast, named after the run directory, with the flat config
    and every scalar at its step; a resumed run continues the same run (one run id)."""
    rng, run = random.Random(5), tmp_path / "my-run"
    first, summary = _records(rng, range(1, 4)), _summary(rng)
    _log_run(run, ["trackio"], first, evals=[(None, 3, summary)])
    assert read_state(run / STATE) == {"trackio": {"name": "my-run"}}
    config = trackio_store.get_run_config("cod-fast", "my-run")
    assert config["algo.loss.policy"] == load_config("tiny-cpu").algo.loss.policy
    redone = _records(rng, range(3, 5))
    _log_run(run, ["trackio"], redone, resumed=2)
    assert len(trackio_store.get_run_records("cod-fast")) == 1
    history: dict[str, dict[int, float]] = {}
    for row in trackio_store.get_logs("cod-fast", "my-run"):
        for name, value in row.items():
            if name not in ("step", "timestamp"):
                history.setdefault(name, {})[row["step"]] = value
    for name, values in _expected(first[:2] + redone).items():
        assert history[name][4] == pytest.approx(values[4]), name
        assert history[name][1] == pytest.approx(values[1]), name
    assert history["eval/cod_gain"] == pytest.approx({3: summary.cod_gain})
    # Another folder of the same name, resumed without a trackers.json: a run of its own.
    _log_run(tmp_path / "other" / "my-run", ["trackio"], redone, resumed=2)
    assert len(trackio_store.get_run_records("cod-fast")) == 2


# --- what a run without a library, or with a damaged trackers.json, gets -------------------

MODULES = {
    "tensorboard": ("tensorboard", "torch.utils.tensorboard"),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "trackio": ("trackio",),
}


@pytest.mark.parametrize("tracker", list(MODULES))
def test_a_missing_library_is_one_config_error_line_naming_its_extra(
    tmp_path, monkeypatch, tracker
):
    """With the tracker's package not importable, RunLog and the preflight's check raise one
    ConfigError line for runtime.report_to naming the package and `cod-fast[TRACKER]`; a log
    without trackers imports nothing."""
    for name in list(sys.modules):
        if name.startswith(MODULES[tracker]):
            monkeypatch.delitem(sys.modules, name)
    for module in MODULES[tracker]:
        monkeypatch.setitem(sys.modules, module, None)
    for attempt in (
        lambda: RunLog(tmp_path, trackers=[tracker]),
        lambda: check_trackers([tracker]),
    ):
        with pytest.raises(ConfigError) as caught:
            attempt()
        message = str(caught.value)
        assert message.startswith("runtime.report_to: ") and "\n" not in message
        assert f"needs the {PACKAGES[tracker]} package" in message
        assert f"pip install 'cod-fast[{tracker}]'" in message
    RunLog(tmp_path).step({"step": 1})  # no trackers: nothing imported


@pytest.mark.slow
def test_a_run_without_trackers_imports_none_of_their_libraries(tmp_path):
    """The command, the trainer, the preflight and a log without trackers (a fresh process):
    none of the four libraries is imported."""
    code = f"""
import sys
import cod_fast.cli.app, cod_fast.train.trainer, cod_fast.train.preflight
from cod_fast.run.log import RunLog
from cod_fast.run.trackers import check_trackers
check_trackers([])
log = RunLog({str(tmp_path / "run")!r})
log.truncate(-1)
log.step({{"step": 1, "loss": 0.5, "reward_by_position": [0.1]}})
print(sorted(m for m in sys.modules if m.split(".")[0] in ("wandb", "mlflow", "trackio", "tensorboard")))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_train_listing_a_missing_tracker_stops_before_anything_is_written(tmp_path, monkeypatch):
    """`cod-fast train --set runtime.report_to=[wandb]` without wandb: exit 2, one line, and no
    run directory."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    run = tmp_path / "run"
    args = ["train", "--set", "runtime.report_to=[wandb]", "--set", f"runtime.run_dir={run}"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pip install 'cod-fast[wandb]'" in errors[0], result.stderr
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "text, why",
    [
        ("{not json", "is not JSON"),
        ('{"wandb": "abc"}', "not tracker run ids"),
        ('{"comet": {"id": "abc"}}', "not tracker run ids"),
        ('{"wandb": {"id": "a\\nb"}}', "not tracker run ids"),
        ('{"wandb": {"id": ""}}', "not tracker run ids"),
    ],
)
def test_a_damaged_trackers_json_is_one_line_naming_the_file_and_the_fix(tmp_path, text, why):
    """A resumed run reads trackers.json back checked: one TrackerError line (a ValueError and
    a CodFastError) naming the file and how to go on."""
    path = tmp_path / STATE
    path.write_text(text)
    with pytest.raises(TrackerError) as caught:
        read_state(path)
    message = str(caught.value)
    assert str(path) in message and why in message and "\n" not in message
    assert f"delete {path}" in message
    assert TrackerError.__mro__[1:3] == (ValueError, CodFastError)


def test_an_oversized_trackers_json_is_refused_unread(tmp_path):
    """trackers.json over its cap (a few hundred bytes are written): refused, not parsed."""
    path = tmp_path / STATE
    path.write_text(json.dumps({"wandb": {"id": "x" * 100_000}}))
    with pytest.raises(TrackerError, match="more than"):
        read_state(path)


# --- a whole run ----------------------------------------------------------------------------


@pytest.mark.slow
@needs("wandb")
@needs("tensorboard")
def test_train_reports_to_tensorboard_and_wandb_and_resume_continues_them(tmp_path, wandb_offline):
    """`cod-fast train --set runtime.report_to=[tensorboard,wandb]`, 2 warm-start and 1 RL
    steps: the offline wandb run and the event files hold each step's loss as metrics.jsonl has
    it, and the evaluations; `--resume` with one more RL step logs step 4 to the same wandb run
    and the same event folder."""
    from tests.train.test_trainer import FAST

    run = tmp_path / "run"
    args = ["train", "--preset", "tiny-cpu"]
    for override in [*FAST, "runtime.report_to=[tensorboard,wandb]", f"runtime.run_dir={run}"]:
        args += ["--set", override]
    result = runner.invoke(app, [*args, "--set", "train.steps=1"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in lines}
    assert sorted(loss) == [1, 2, 3]
    ids, config, history = _wandb_run(run)
    assert ids == {read_state(run / STATE)["wandb"]["id"]}
    assert config["runtime.report_to"] == ["tensorboard", "wandb"]
    assert history["loss"] == pytest.approx(loss)
    assert set(history["eval/frozenlake/cod_gain"]) == {0, 2, 3}  # start, after warm start, end
    assert _tensorboard(run / "tb")["loss"] == pytest.approx(loss)
    resumed = runner.invoke(app, [*args, "--set", "train.steps=2", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in lines}
    assert sorted(loss) == [1, 2, 3, 4]
    assert len(list((run / "wandb").glob("offline-run-*"))) == 2
    ids, _, history = _wandb_run(run)
    assert ids == {read_state(run / STATE)["wandb"]["id"]}
    assert history["loss"][4] == pytest.approx(loss[4])
    assert _tensorboard(run / "tb")["loss"] == pytest.approx(loss)
