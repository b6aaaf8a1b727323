"""A run directory or model folder received from someone else runs no code and reaches no
endpoint by being read: an environment path or a judge its config names is used only when the
user names it on the command line (docs/robustness.md, "What a folder may cause")."""

from __future__ import annotations

import http.server
import json
import shutil
import threading
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from typer.testing import CliRunner

from cod_fast.cli.app import app
from cod_fast.config.io import load_config
from cod_fast.run.export import RUN_CONFIG
from tests.special_files import cli_error
from tests.train.test_trainer import FAST

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(run directory, its export): a run of a few seconds, trained and exported once."""
    root = tmp_path_factory.mktemp("received")
    run, out = root / "run", root / "model"
    sets = [a for s in [*FAST, f"runtime.run_dir={run}"] for a in ("--set", s)]
    result = runner.invoke(app, ["train", *sets])
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["export", str(run), "--out", str(out)]).exit_code == 0
    return run, out


def _planted(folder: Path) -> tuple[str, Path]:
    """(environment path, marker): a valid environment file that, when imported, creates the
    marker, as a sender's code would do anything."""
    marker = folder / "RAN"
    # Registered under a name of its own: the example's `guess` may be registered already.
    code = (ROOT / "examples" / "guess_env.py").read_text()
    code = code.replace('@register("guess")', f'@register("planted_{folder.name}")')
    source = folder / "planted_env.py"
    source.write_text(f"{code}\nopen({str(marker)!r}, 'w').write('ran')\n")
    return f"{source}:GuessEnv", marker


def _edit_yaml(path: Path, section: str, key: str, value: object) -> None:
    data = yaml.safe_load(path.read_text())
    data[section][key] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_reading_a_config_that_names_a_path_imports_nothing(tmp_path):
    """Building a config checks a path's form only; the import comes when the environment is
    made."""
    env, marker = _planted(tmp_path)
    cfg = load_config(overrides=[f"rollout.env={env}"])
    assert cfg.rollout.env == env and not marker.exists()
    mixed = load_config(overrides=["rollout.env=null", f"rollout.envs=[{{name: '{env}'}}]"])
    assert mixed.rollout.environments[0].name == env and not marker.exists()


@pytest.mark.slow  # a trained run: a few seconds
def test_export_of_a_received_run_runs_none_of_its_code(trained, tmp_path):
    """`cod-fast export` of a run whose config.yaml names an environment file writes the model
    and never imports the file."""
    run = shutil.copytree(trained[0], tmp_path / "run")
    env, marker = _planted(tmp_path)
    _edit_yaml(run / "config.yaml", "rollout", "env", env)
    result = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf" / "config.json").is_file()
    assert not marker.exists()
    # Playing the run directory itself exports it first, then refuses the path (next test).
    refused = cli_error(runner.invoke(app, ["eval", "--model", str(run)]))
    assert "a path to code" in refused and not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("in_checkpoint", [True, False])
def test_resume_of_a_received_run_runs_none_of_its_code(trained, tmp_path, in_checkpoint):
    """`--resume` continues with the run's own config, whose environment path is never
    imported unless the user names it too (whether its checkpoint holds the config or, an
    older checkpoint, only config.yaml does); with --preset the user's whole config is compared
    with the run's, and the run's path is not imported either."""
    run = shutil.copytree(trained[0], tmp_path / "run")
    env, marker = _planted(tmp_path)
    _edit_yaml(run / "config.yaml", "rollout", "env", env)
    for meta in (run / "checkpoints").glob("step-*/meta.json"):
        data = json.loads(meta.read_text())
        if in_checkpoint:
            data["extra"]["config"]["rollout.env"] = env
        else:
            del data["extra"]["config"]
        meta.write_text(json.dumps(data))
    sets = [a for s in [*FAST, f"runtime.run_dir={run}"] for a in ("--set", s)]
    refused = cli_error(runner.invoke(app, ["train", "--resume", *sets]))
    assert "a path to code" in refused and "--set rollout.env=" in refused
    compared = cli_error(runner.invoke(app, ["train", "--resume", "--preset", "tiny-cpu", *sets]))
    assert "was not trained with: rollout.env" in compared
    assert not marker.exists()


@pytest.mark.slow  # a trained run: a few seconds
def test_eval_refuses_a_received_environment_path_until_the_user_names_it(trained, tmp_path):
    """`cod-fast eval --model FOLDER` whose cod_fast_run.yaml names an environment path refuses
    in one line that says how to name it; named with --env, it plays (and imports it)."""
    model = shutil.copytree(trained[1], tmp_path / "model")
    env, marker = _planted(tmp_path)
    _edit_yaml(model / RUN_CONFIG, "rollout", "env", env)
    args = ["eval", "--model", str(model), "--packs", "1", "--tasks", "1"]
    args += ["--max-response-tokens", "4", "--out", str(tmp_path / "eval")]
    for command in (args, ["rollout", *args[1:5], "--packs", "1", "--tasks", "1"]):
        refused = cli_error(runner.invoke(app, command))
        assert f"name it yourself with --env {env}" in refused
        assert not marker.exists()
    matrix = [*args, "--matrix", "--env", "frozenlake", "--strategy", "cod"]
    assert runner.invoke(app, matrix).exit_code == 0  # the run's environment is no column
    assert not marker.exists()
    named = runner.invoke(app, [*args, "--env", env])
    assert named.exit_code == 0, named.output
    assert marker.exists()


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[dict]] = []

    def do_POST(self):  # the name http.server calls
        _Recorder.seen.append(dict(self.headers))
        self.send_response(500)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    _Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.mark.slow  # a trained run: a few seconds
def test_eval_refuses_a_received_judge_until_the_user_names_it(
    trained, tmp_path, endpoint, monkeypatch
):
    """A received folder's judge endpoint is never called (nor given the user's API key) unless
    the user names a judge: `--judge rule` plays with the rule, `--judge URL` uses it."""
    monkeypatch.setenv("COD_FAST_JUDGE_API_KEY", "sk-user-secret")
    model = shutil.copytree(trained[1], tmp_path / "model")
    _edit_yaml(model / RUN_CONFIG, "rollout", "judge", endpoint)
    args = ["eval", "--model", str(model), "--packs", "1", "--tasks", "1"]
    args += ["--max-response-tokens", "4", "--out", str(tmp_path / "eval")]
    refused = cli_error(runner.invoke(app, args))
    assert f"--judge {endpoint} if you trust it, or --judge rule" in refused
    assert _Recorder.seen == []
    assert runner.invoke(app, [*args, "--judge", "rule"]).exit_code == 0
    bad = cli_error(runner.invoke(app, [*args, "--judge", str(tmp_path / "nothing")]))
    assert bad.startswith("error: --judge: ") and "no such folder" in bad
    assert _Recorder.seen == []


def test_the_end_of_a_run_names_what_its_model_folder_may_not_choose(tmp_path):
    """The command `cod-fast train` prints for evaluating the exported model passes the run's
    environment path and judge, which the folder alone may not choose."""
    from cod_fast.cli.train_display import _own_choices

    env, marker = _planted(tmp_path)
    assert _own_choices(load_config()) == ""
    cfg = load_config(overrides=[f"rollout.env={env}", "rollout.judge=http://127.0.0.1:9/v1"])
    assert _own_choices(cfg) == f" --env {env} --judge http://127.0.0.1:9/v1"
    assert not marker.exists()


@pytest.mark.slow  # a trained run: a few seconds
def test_eval_reads_no_template_file_a_received_folder_names(trained, tmp_path):
    """A model folder whose config names a chat template file (a file of the user's, say) is
    refused in one line: an export carries its template in its tokenizer."""
    secret = tmp_path / "secret.txt"
    secret.write_text("{{ 'the user file' }}")
    model = shutil.copytree(trained[1], tmp_path / "model")
    _edit_yaml(model / RUN_CONFIG, "model", "chat_template", str(secret))
    args = ["eval", "--model", str(model), "--packs", "1", "--tasks", "1"]
    refused = cli_error(runner.invoke(app, [*args, "--out", str(tmp_path / "eval")]))
    assert f"names the chat template file '{secret}'" in refused
    assert "delete model.chat_template" in refused and not (tmp_path / "eval").exists()


@pytest.mark.slow  # a trained run: a few seconds
def test_eval_names_an_out_folder_it_cannot_write(trained, tmp_path):
    """`--out` that is a file, or holds a link where eval writes, is one line, not a traceback."""
    args = ["eval", "--model", str(trained[1]), "--packs", "1", "--tasks", "1"]
    args += ["--max-response-tokens", "4"]
    blocked = tmp_path / "a-file"
    blocked.write_text("mine")
    refused = cli_error(runner.invoke(app, [*args, "--out", str(blocked / "eval")]))
    assert refused.startswith(f"error: --out {blocked / 'eval'}: ")
    out, target = tmp_path / "eval", tmp_path / "elsewhere"
    out.mkdir()
    target.write_text("mine")
    (out / ".eval.json.tmp").symlink_to(target)
    refused = cli_error(runner.invoke(app, [*args, "--out", str(out)]))
    assert "is a symbolic link" in refused and target.read_text() == "mine"
    assert blocked.read_text() == "mine"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A 2-layer Qwen3 saved as its own save_pretrained writes it (no cod-fast run config)."""
    from cod_fast.model.tokenizer import CHATML, char_tokenizer
    from tests.rollout_helpers import save_tiny_qwen3

    return save_tiny_qwen3(tmp_path_factory.mktemp("hf"), char_tokenizer(CHATML))


class _Runs:
    """A pickle that, if loaded, would create a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def _eval_refusal(model: Path, tmp_path: Path) -> str:
    args = ["eval", "--model", str(model), "--packs", "1", "--tasks", "1"]
    return cli_error(runner.invoke(app, [*args, "--out", str(tmp_path / "eval")]))


def test_a_model_folder_with_pickled_weights_that_call_code_is_one_line(hf_folder, tmp_path):
    """Weights as a pytorch_model.bin whose pickle would call a function: refused in one line
    (never the advice to load it unsafely), the function never runs."""
    import torch
    from safetensors.torch import load_file

    model = shutil.copytree(hf_folder, tmp_path / "model")
    state = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    marker = tmp_path / "RAN"
    torch.save({**state, "extra": _Runs(marker)}, model / "pytorch_model.bin")
    refused = _eval_refusal(model, tmp_path)
    assert "do not load as plain data" in refused and "weights_only=False" not in refused
    assert not marker.exists()


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_a_model_folder_with_a_huge_settings_file_is_refused_unread(hf_folder, tmp_path, file):
    """A config.json or generation_config.json of gigabytes (sparse here: no disk used) is
    refused by its size, before transformers reads it whole."""
    model = shutil.copytree(hf_folder, tmp_path / "model")
    with open(model / file, "a") as f:
        f.truncate(3 * 2**30)
    refused = _eval_refusal(model, tmp_path)
    assert f"its {file} is over 16777216 bytes" in refused


def test_a_model_folder_with_a_deeply_nested_config_is_one_line(hf_folder, tmp_path):
    """JSON nested 200,000 deep in config.json is one line naming the folder, not a
    RecursionError."""
    model = shutil.copytree(hf_folder, tmp_path / "model")
    (model / "config.json").write_text('{"a":' * 200_000 + "1" + "}" * 200_000)
    refused = _eval_refusal(model, tmp_path)
    assert f"{model}: its config.json does not load" in refused
