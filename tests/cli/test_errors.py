"""Bad input that a new user meets first ends in one line naming the cause and the fix, never a
traceback: `runtime.tensorboard=true` without the tensorboard package, a typo in `bench seeds
--preset`, a `--model` path that does not exist or a folder that holds no model; the bench
commands' help lists what they accept; and every error class of cod-fast derives from
CodFastError beside the Python base its callers catch it by."""

from __future__ import annotations

import errno
import re
import sys

import pytest
import torch
from typer.testing import CliRunner

import cod_fast.bench.train
from cod_fast.bench import seeds as seeds_bench
from cod_fast.bench.contenders import CASES, CONTENDERS
from cod_fast.cli.app import app
from cod_fast.common.bounded_read import ReadRefused
from cod_fast.common.errors import CodFastError
from cod_fast.common.safe_write import LinkError
from cod_fast.config import ConfigError
from cod_fast.config.presets import PRESETS
from cod_fast.data.packing import SequenceTooLongError
from cod_fast.distributed.channel import RolloutWorkerError
from cod_fast.envs.base import MissingScriptedAgent
from cod_fast.envs.cases import CasesError
from cod_fast.envs.judge import JudgeError
from cod_fast.envs.registry import EnvironmentLookupError
from cod_fast.model.loading import ModelFolderError, load_model_files, model_path_problem
from cod_fast.model.tokenizer import CHATML, char_tokenizer, load_saved_tokenizer
from cod_fast.run.checkpoint import CheckpointError
from cod_fast.run.directory import RunDirError
from cod_fast.run.export import ExportError
from cod_fast.run.log import RunLog, RunLogError
from cod_fast.train.step import NonFiniteError
from tests.rollout_helpers import save_tiny_qwen3

runner = CliRunner()
PLAY = ["--env", "frozenlake", "--size", "tiny", "--tasks", "2", "--packs", "1"]


def one_error_line(result, *fixes: str) -> str:
    """The command's one `error:` line, after checking exit code 2, no traceback and that the
    line names each of `fixes`."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for fix in fixes:
        assert fix in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def no_tensorboard(monkeypatch):
    """An installation without the tensorboard package (an optional extra)."""
    for name in list(sys.modules):
        if name == "tensorboard" or name.startswith(("tensorboard.", "torch.utils.tensorboard")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A fresh working folder and no CUDA device: what is refused does not depend on either."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    """A 2-layer Qwen3 with the character tokenizer, saved as a real model folder."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("good"), char_tokenizer(CHATML))


def test_tensorboard_missing_is_a_config_error_naming_both_fixes(tmp_path, no_tensorboard):
    """RunLog with tensorboard listed but no tensorboard package raises a one-line ConfigError
    for runtime.report_to that says how to install it or turn it off (both spellings)."""
    with pytest.raises(ConfigError) as caught:
        RunLog(tmp_path / "run", trackers=["tensorboard"])
    message = str(caught.value)
    assert message.startswith("runtime.report_to: ") and "\n" not in message
    assert "pip install 'cod-fast[tensorboard]'" in message
    assert "runtime.tensorboard=false" in message
    assert RunLog(tmp_path / "other").trackers.adapters == {}  # off, it needs nothing


def test_train_with_tensorboard_but_no_package_is_one_line(here, no_tensorboard):
    """`cod-fast train --set runtime.tensorboard=true` without tensorboard: exit 2, one line."""
    args = ["train", "--set", "runtime.tensorboard=true", "--set", f"runtime.run_dir={here}/r"]
    one_error_line(
        runner.invoke(app, args), "pip install 'cod-fast[tensorboard]'", "runtime.tensorboard=false"
    )


def test_a_preset_typo_in_bench_seeds_is_one_line_with_the_closest_preset(tmp_path):
    """`bench seeds --preset tiny-cpuu` exits 2 with one line naming tiny-cpu and every preset,
    before any run starts or any folder is made."""
    out = tmp_path / "seeds"
    result = runner.invoke(app, ["bench", "seeds", "--preset", "tiny-cpuu", "--out", str(out)])
    one_error_line(result, "'tiny-cpuu'", "did you mean tiny-cpu?", ", ".join(PRESETS))
    assert not out.exists()


def test_bench_seeds_refuses_an_unknown_preset_beside_a_good_one(tmp_path, capsys):
    """`python -m cod_fast.bench.seeds`: an unknown --preset beside a good one is exit code 2
    and one stderr line; a name close to none gets the list alone."""
    with pytest.raises(SystemExit) as caught:
        seeds_bench.main(["--preset", "qwen9", "--preset", "tiny-cpu", "--out", str(tmp_path)])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown 'qwen9'" in err and "choose from tiny-cpu" in err


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("/no/such/folder", "/no/such/folder: no such folder (a local path that does not exist;"),
        ("./missing-model", "no such folder"),
        ("models/qwen/v1", "no such folder"),
        ("runs/missing", "runs/missing: no such folder"),  # runs/ exists here
        ("~/models/qwen", "does not expand ~"),
        ("weights.bin", "a file"),
        ("empty", "a folder without config.json and tokenizer files"),
        ("config-only", "a folder without tokenizer files (tokenizer.json"),
        ("tokenizer-only", "a folder without config.json;"),
        ("builtin:tiny-llama", "the built-in model is 'builtin:tiny-qwen3'"),
    ],
)
def test_a_local_path_that_is_no_model_folder_is_named(here, good_model, name, problem):
    """A name meant as a local folder (/, ., ~, more parts than owner/name, an existing parent)
    that is none is refused with the path and what is missing, before transformers takes it
    for a hub id or fails inside sentencepiece."""
    (here / "runs").mkdir()
    (here / "weights.bin").write_bytes(b"\0" * 8)
    (here / "empty").mkdir()
    (here / "config-only").mkdir()
    (here / "config-only" / "config.json").write_text((good_model / "config.json").read_text())
    char_tokenizer(CHATML).save_pretrained(here / "tokenizer-only")
    assert problem in (model_path_problem(name) or "")
    with pytest.raises(ModelFolderError, match=re.escape(problem)):
        load_model_files(name, "cpu", torch.float32)


@pytest.mark.parametrize("name", ["Qwen/Qwen3-0.6B", "gpt2", "my-org/my-model"])
def test_a_hub_id_is_left_to_the_hub(here, name):
    """A hub id (owner/name, or a bare name) that is no folder here is not refused as a path:
    whether it exists only the hub knows."""
    assert model_path_problem(name) is None


def test_a_model_folder_passes(good_model):
    """A real model folder has no problem, and its config and tokenizer still load."""
    assert model_path_problem(str(good_model)) is None
    config, tokenizer = load_model_files(str(good_model), "cpu", torch.float32)
    assert config.vocab_size == len(tokenizer)


@pytest.mark.parametrize(
    ("folder", "fix"),
    [
        ("missing", "no such folder (a local path that does not exist; for a hub id"),
        ("empty", "a folder without config.json and tokenizer files"),
        ("no-tokenizer", "a folder without tokenizer files"),
    ],
)
def test_eval_of_a_missing_or_empty_model_folder_is_one_line(here, good_model, folder, fix):
    """`cod-fast eval --model` on an absolute path that does not exist, an empty folder, or a
    model without its tokenizer: exit 2 with one line naming the path and what is missing."""
    (here / "empty").mkdir()
    (here / "no-tokenizer").mkdir()
    for name in ("config.json", "model.safetensors"):
        (here / "no-tokenizer" / name).write_bytes((good_model / name).read_bytes())
    result = runner.invoke(app, ["eval", "--model", str(here / folder), *PLAY])
    one_error_line(result, f"{here / folder}: ", fix)


def test_a_saved_tokenizer_folder_without_tokenizer_json_is_named(tmp_path):
    """load_saved_tokenizer on an empty or missing folder: a ValueError naming the folder and
    tokenizer.json, not sentencepiece's conversion error."""
    (tmp_path / "tokenizer").mkdir()
    with pytest.raises(ValueError, match=r"tokenizer: no tokenizer.json there; expected a"):
        load_saved_tokenizer(tmp_path / "tokenizer")
    with pytest.raises(ValueError, match=r"gone: no such folder"):
        load_saved_tokenizer(tmp_path / "gone")


def help_words(*command: str) -> set[str]:
    """The words of a command's --help, wide enough that no name is wrapped."""
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return set(re.split(r"[\s,;()│]+", result.output))


def test_bench_kernels_help_lists_every_case_and_contender():
    """`bench kernels --help` names each case of cod_fast.bench.contenders.CASES and each
    contender, as the benchmark accepts them."""
    words = help_words("bench", "kernels")
    assert set(CASES) <= words and set(CONTENDERS) <= words


def test_bench_seeds_help_lists_the_presets():
    """`bench seeds --help` names each preset it accepts."""
    assert set(PRESETS) <= help_words("bench", "seeds")


def test_bench_train_takes_plain_modules(monkeypatch):
    """`bench train --plain-modules` (documented in the README) is in its help and reaches the
    benchmark's own --plain-modules."""
    assert "--plain-modules" in help_words("bench", "train")
    argv = []
    monkeypatch.setattr(cod_fast.bench.train, "main", argv.extend)
    result = runner.invoke(app, ["bench", "train", "--plain-modules", "--tiny"])
    assert result.exit_code == 0, result.output
    assert "--plain-modules" in argv and "--tiny" in argv


@pytest.mark.parametrize(
    "command",
    [["eval", *PLAY], ["rollout", *PLAY], ["eval", "--matrix", "--env", "frozenlake"]],
    ids=["eval", "rollout", "eval --matrix"],
)
def test_a_relative_model_path_that_does_not_exist_is_one_line_as_typed(here, command):
    """`--model ./missing` keeps its `./` (a Path option would drop it and leave a name that
    reads as a hub id, which transformers answered with the hub's complaint)."""
    result = runner.invoke(app, [*command, "--model", "./missing-model"])
    one_error_line(result, "./missing-model: no such folder")


ERRORS = {
    ConfigError: ValueError,
    ReadRefused: ValueError,
    LinkError: OSError,
    ModelFolderError: ValueError,
    RolloutWorkerError: RuntimeError,
    EnvironmentLookupError: ValueError,
    JudgeError: RuntimeError,
    CasesError: ValueError,
    MissingScriptedAgent: ValueError,
    SequenceTooLongError: ValueError,
    RunLogError: ValueError,
    ExportError: OSError,
    CheckpointError: RuntimeError,
    RunDirError: RuntimeError,
    NonFiniteError: FloatingPointError,
}
"""Each error class a user can act on, and the Python base its callers catch it by."""


@pytest.mark.parametrize("error, base", ERRORS.items(), ids=[e.__name__ for e in ERRORS])
def test_every_error_class_is_a_cod_fast_error_and_keeps_its_base(error, base):
    """A cod-fast error is a CodFastError, and its Python base comes first: an `except
    ValueError` (or OSError, ...) still catches it, before anything else would."""
    assert issubclass(error, CodFastError) and issubclass(error, base)
    assert error.__mro__[1] is base


@pytest.mark.parametrize("error", [LinkError, ExportError])
@pytest.mark.parametrize("args", [("a.txt is a symbolic link",), (errno.ENOSPC, "full", "a.txt")])
def test_an_os_error_with_a_second_base_is_still_an_os_error(error, args):
    """An OSError class that is also a CodFastError takes OSError's arguments and reads as an
    OSError made with them would (its text, errno and file name)."""
    made, plain = error(*args), OSError(*args)
    assert (str(made), made.args, made.errno, made.filename) == (
        str(plain),
        plain.args,
        plain.errno,
        plain.filename,
    )
