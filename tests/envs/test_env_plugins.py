"""Environments from outside the package (cod_fast.envs.registry): registered by decorator, by
entry point, by a module path or a file path; checked by the config, the preflight and
`cod-fast envs check` (cod_fast.envs.check); trained and evaluated like the built-ins.

The example environment of docs/environments.md (examples/guess_env.py) is the plugin most tests
use; the broken ones below derive from it."""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import cod_fast.train.trainer
from cod_fast.cli.app import app
from cod_fast.config import AlgoConfig, ConfigError
from cod_fast.config.io import load_config
from cod_fast.envs import (
    Environment,
    EnvironmentLookupError,
    MissingScriptedAgent,
    env_class,
    known_environments,
    make_env,
    register,
)
from cod_fast.run.validate import validate
from cod_fast.train.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_FILE = ROOT / "examples" / "guess_env.py"
EXAMPLE = f"{EXAMPLE_FILE}:GuessEnv"
runner = CliRunner()

GuessEnv = env_class(EXAMPLE)
example = sys.modules[GuessEnv.__module__]


def _assert_one_line(excinfo: pytest.ExceptionInfo, *parts: str) -> None:
    """The error's message is one line and holds each of `parts`."""
    message = str(excinfo.value)
    assert "\n" not in message, message
    assert all(part in message for part in parts), message


# Plugins written as a package would write them, into a folder on sys.path.

MODULE = """
from cod_fast.envs import env_class

GuessEnv = env_class({example!r})


class {cls}(GuessEnv):
    name = {name!r}


def helper():
    return None
"""


def _plugin(folder: Path, module: str, cls: str, name: str) -> None:
    (folder / f"{module}.py").write_text(MODULE.format(example=EXAMPLE, cls=cls, name=name))


def _distribution(folder: Path, entry_points: dict[str, str]) -> None:
    """An installed distribution's metadata with `entry_points` in cod_fast.environments."""
    info = folder / "cod_fast_plugin_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: cod-fast-plugin-demo\nVersion: 0.1\n"
    )
    lines = [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("[cod_fast.environments]\n" + "\n".join(lines) + "\n")


def test_register_by_decorator():
    """`@register(name)` makes the name resolve everywhere a name is taken (env_class; make_env,
    whose environment answers to that name; the known names); it refuses a built-in's name, a
    name with a colon, a class that is not an Environment, and a second class under a taken
    name (the same class again is fine)."""

    @register("my_guess")
    class MyGuess(GuessEnv):
        pass

    assert env_class("my_guess") is MyGuess
    made = make_env("my_guess", "eval", "tiny")
    assert isinstance(made, MyGuess) and (made.name, MyGuess.name) == ("my_guess", "guess")
    assert known_environments()[-1] == "my_guess"
    assert register("my_guess")(MyGuess) is MyGuess  # a module imported twice
    with pytest.raises(ValueError, match="already registered"):

        @register("my_guess")
        class Other(GuessEnv):
            pass

    with pytest.raises(ValueError, match="built-in"):
        register("frozenlake")
    with pytest.raises(ValueError, match="without ':'"):
        register("mine:Env")
    with pytest.raises(ValueError, match="not a subclass of"):
        register("thing")(dict)


def test_register_by_entry_point(tmp_path, monkeypatch, installed_plugins):
    """An installed distribution's entry point in group cod_fast.environments resolves by its
    name (read when the name is none of the built-in or registered ones) and is listed; one
    that does not import is one line naming the entry point and the error, and `envs list`
    still lists the others."""
    _plugin(tmp_path, "cod_plugin_entry", "DemoEnv", "demo")
    _distribution(tmp_path, {"demo": "cod_plugin_entry:DemoEnv", "broken": "cod_plugin_gone:Env"})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert env_class("demo").__name__ == "DemoEnv"
    assert make_env("demo").name == "demo"
    assert {"demo", "broken"} <= set(known_environments())
    with pytest.raises(EnvironmentLookupError) as excinfo:
        env_class("broken")
    _assert_one_line(excinfo, "'broken'", "cod_plugin_gone:Env", "ModuleNotFoundError")
    listed = runner.invoke(app, ["envs", "list"], terminal_width=400)
    assert listed.exit_code == 0, listed.output
    assert "demo" in listed.output and "cod_plugin_gone" in listed.output


def test_register_by_module_path(tmp_path, monkeypatch):
    """`module:Class` imports the module; a module that fails to import, a missing attribute,
    something that is not an Environment, or an abstract one is one line naming the path."""
    _plugin(tmp_path, "cod_plugin_dotted", "DottedEnv", "dotted")
    (tmp_path / "cod_plugin_raises.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    (tmp_path / "cod_plugin_abstract.py").write_text(
        "from cod_fast.envs import Environment\n\nclass Half(Environment):\n    name = 'half'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert env_class("cod_plugin_dotted:DottedEnv").name == "dotted"
    failures = {
        "cod_plugin_raises:Env": ["importing cod_plugin_raises failed", "boom second line"],
        "cod_plugin_nowhere:Env": ["ModuleNotFoundError", "is its package installed?"],
        "cod_plugin_dotted:Nope": ["defines no 'Nope'"],
        "cod_plugin_dotted:helper": ["not a subclass of cod_fast.envs.Environment"],
        "cod_plugin_abstract:Half": ["Half does not define task()"],
    }
    for path, parts in failures.items():
        with pytest.raises(EnvironmentLookupError) as excinfo:
            env_class(path)
        _assert_one_line(excinfo, f"environment {path!r}", *parts)


def test_register_by_file_path(tmp_path, monkeypatch):
    """`path/to/file.py:Class` imports a lone file (relative to the working directory), once:
    the same file by another spelling is the same class. A missing file, a file that does not
    compile, and a path without its class are one line each."""
    _plugin(tmp_path, "lone_env", "LoneEnv", "lone")
    (tmp_path / "bad_env.py").write_text("def broken(:\n")
    monkeypatch.chdir(tmp_path)
    lone = env_class("lone_env.py:LoneEnv")
    assert lone.name == "lone" and env_class(f"{tmp_path}/lone_env.py:LoneEnv") is lone
    assert make_env("lone_env.py:LoneEnv").name == "lone_env.py:LoneEnv"  # as the run names it
    with pytest.raises(EnvironmentLookupError) as excinfo:
        env_class("missing_env.py:Env")
    _assert_one_line(excinfo, "no file missing_env.py", "relative to the working directory")
    with pytest.raises(EnvironmentLookupError) as excinfo:
        env_class("bad_env.py:Env")
    _assert_one_line(excinfo, "importing bad_env.py failed: SyntaxError")
    with pytest.raises(EnvironmentLookupError) as excinfo:
        env_class("lone_env.py")
    _assert_one_line(excinfo, "a path names its class too: lone_env.py:CLASS")


def test_unknown_name_is_one_line_with_the_known_names():
    """An unknown name: one line with the closest name, every known one and how to register."""
    with pytest.raises(EnvironmentLookupError) as excinfo:
        env_class("frozenlak")
    _assert_one_line(
        excinfo,
        "unknown environment 'frozenlak' (did you mean frozenlake?)",
        "'grid_nav'",
        "@cod_fast.envs.register, an entry point in group cod_fast.environments, or a path",
    )


def test_config_accepts_plugins_and_names_the_key_of_an_unknown_one(tmp_path):
    """rollout.env, rollout.envs[].name (and so the keys of algo.teachers, which must be the
    run's environments) take a registered name or a path; an unknown name is refused with the
    key that holds it."""
    register("my_guess")(GuessEnv)
    assert load_config(overrides=["rollout.env=my_guess"]).rollout.env == "my_guess"
    mixed = load_config(overrides=["rollout.env=null", f"rollout.envs=[{{name: {EXAMPLE}}}]"])
    assert mixed.rollout.environments[0].name == EXAMPLE
    assert AlgoConfig(teachers={EXAMPLE: "t"}).teachers == {EXAMPLE: "t"}
    refused = {
        "rollout.env": ["rollout.env=nope"],
        "rollout.envs[1].name": [
            "rollout.env=null",
            "rollout.envs=[{name: frozenlake}, {name: nope}]",
        ],
    }
    for key, overrides in refused.items():
        cfg = load_config(overrides=overrides)  # building a config looks nothing up
        with pytest.raises(ConfigError) as excinfo:
            validate(cfg)
        assert str(excinfo.value).startswith(f"{key}: unknown environment 'nope'")
    # A path is checked for its form, and imported only when the environment is made: by
    # `train`'s preflight, before anything is written.
    assert runner.invoke(app, ["config", "show", "--set", "rollout.env=nope:Env"]).exit_code == 0
    for path, problem in [
        ("not a module:Env", "is neither a module (package.module) nor a file"),
        ("nope:not-a-class", "is not a class name"),
        ("nope.py:Env", "no file nope.py"),
    ]:
        with pytest.raises(
            ConfigError, match=f"^rollout.env: environment .*: .*{re.escape(problem)}"
        ):
            validate(load_config(overrides=[f"rollout.env={path}"]))
    run_dir = tmp_path / "run"
    result = runner.invoke(
        app, ["train", "--set", "rollout.env=nope:Env", "--set", f"runtime.run_dir={run_dir}"]
    )
    assert result.exit_code == 2
    assert result.stderr.startswith("error: rollout.env: environment 'nope:Env': importing nope")
    assert result.stderr.count("\n") == 1
    assert not (run_dir / "config.yaml").exists()  # refused before the run wrote anything


# Environments that break the contract, each in one way.


class _Nondeterministic(GuessEnv):
    """Every task drawn gets another x: the same (pack seed, task index) is another task."""

    drawn = itertools.count()

    def task(self, pack_seed, task_index):
        task = super().task(pack_seed, task_index)
        task.x = 1 + next(self.drawn) % 9
        return task


class _RaisesOnNul(example.GuessTask):
    def step(self, action):
        if "\x00" in action:
            raise ValueError("NUL byte")
        return super().step(action)


class _Raises(GuessEnv):
    def task(self, pack_seed, task_index):
        return _RaisesOnNul(pack_seed, task_index, top_x=9, top_a=4)


class _Narrow(GuessEnv):
    """Declares rewards up to 0.5, while a right first answer scores 1."""

    reward_range = (0.0, 0.5)


class _NoEval(GuessEnv):
    def __init__(self, setting="train", size="full"):
        if setting == "eval":
            raise RuntimeError("no eval setting")
        super().__init__(setting, size)


class _Undescribed(GuessEnv):
    description = ""


def _check(*args: str):
    return runner.invoke(app, ["envs", "check", *args])


def _lines(output: str) -> dict[str, str]:
    """The check lines of `envs check`'s output, by check name."""
    checks = "class|settings|determinism|fuzz|solver|explorer|hints"
    return dict(re.findall(rf"^({checks}) +(.*)$", output, re.MULTILINE))


def test_envs_check_passes_on_the_example_and_a_builtin():
    """`envs check` on the example (by its file path) and on a built-in: every line ok, exit 0;
    the example has no solver and no hint entries, and says so."""
    result = _check(EXAMPLE, "--packs", "4")
    assert result.exit_code == 0, result.output
    lines = _lines(result.output)
    assert lines["solver"].startswith("skipped: no solver()")
    assert lines["hints"].startswith("skipped: no hint entries")
    for check in ("class", "settings", "determinism", "fuzz", "explorer"):
        assert lines[check].startswith("ok"), result.output
    builtin = _check("frozenlake", "--size", "tiny", "--packs", "2")
    assert builtin.exit_code == 0, builtin.output
    lines = _lines(builtin.output)
    assert len(lines) == 7 and all(line.startswith("ok: ") for line in lines.values())


@pytest.mark.parametrize(
    ("cls", "check", "says"),
    [
        (_Nondeterministic, "determinism", "a fresh environment gave another observation 0"),
        (_Raises, "fuzz", "raised ValueError: NUL byte"),
        (_Narrow, None, "outside reward_range (0.0, 0.5)"),
        (_NoEval, "settings", "raised RuntimeError: no eval setting"),
        (_Undescribed, "class", "description is ''; expected text"),
    ],
    ids=["nondeterministic", "raises", "reward-range", "settings", "class"],
)
def test_envs_check_fails_on_a_broken_environment(cls, check, says):
    """A broken environment fails `envs check` with exit code 1, on a line that names the check
    and why (a reward outside the declared range fails whichever check meets it first); after
    a failed class or settings check the others are not run."""
    register("broken")(cls)
    result = _check("broken", "--packs", "4")
    assert result.exit_code == 1, result.output
    failed = {name: line for name, line in _lines(result.output).items() if "FAILED" in line}
    assert failed and all(says in line for line in failed.values()), result.output
    if check is not None:
        assert list(failed) == [check], result.output
    if check in ("class", "settings"):
        later = ("determinism", "fuzz", "explorer")
        assert all(_lines(result.output)[c].startswith("skipped: not run") for c in later)


def test_envs_check_unknown_name_is_one_line():
    """A name or path that means no environment: one `error:` line, exit code 2 (bad input)."""
    result = _check("nope.py:Env")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: environment 'nope.py:Env': no file nope.py")


class _Silent(GuessEnv):
    explorer = Environment.explorer  # neither a solver nor an explorer


def test_scripted_agents_are_optional():
    """Without a solver or an explorer an environment still builds; asking for one is a
    MissingScriptedAgent naming the environment and the agent; `envs solve` shows the agents
    there are and refuses in one line when there are none."""
    assert not GuessEnv.has_solver() and GuessEnv.has_explorer()
    assert not _Silent.has_explorer()
    with pytest.raises(MissingScriptedAgent, match="environment guess has no scripted solver"):
        GuessEnv().solver()
    register("silent")(_Silent)
    with pytest.raises(MissingScriptedAgent, match="no scripted explorer, which the warm start"):
        make_env("silent").explorer()
    solved = runner.invoke(app, ["envs", "solve", EXAMPLE, "--packs", "10", "--size", "tiny"])
    assert solved.exit_code == 0, solved.output
    assert "explorer, hints" in solved.output and "has no scripted solver" in solved.stderr
    refused = runner.invoke(app, ["envs", "solve", "silent"])
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1
    assert "silent has neither a scripted solver nor an explorer" in refused.stderr


@pytest.fixture
def no_trainer(monkeypatch, tmp_path):
    """One CPU process in a fresh folder, whose `train` fails the test if it builds a Trainer."""
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)

    def trainer(*args, **kwargs):
        raise AssertionError("the Trainer was built: the refusal came after compute began")

    monkeypatch.setattr(cod_fast.train.trainer, "Trainer", trainer)


def test_preflight_refuses_a_run_that_needs_a_missing_explorer(no_trainer):
    """A warm start, or a bpe tokenizer the run would train, on an environment without an
    explorer: one line naming the environment's key, what needs the explorer and the fix, from
    `train` before any Trainer; without either the preflight lets the run through."""
    register("silent")(_Silent)
    warm = ["rollout.env=silent", "model.tokenizer=char", "train.warm_start_steps=5"]
    result = runner.invoke(app, ["train", *(a for s in warm for a in ("--set", s))])
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        "error: rollout.env: silent has no scripted explorer, which train.warm_start_steps=5 "
        "needs (demonstrations); set train.warm_start_steps=0 or give the environment an "
        "explorer()\n"
    )
    bpe = ["rollout.env=null", "rollout.envs=[{name: frozenlake}, {name: silent}]"]
    bpe += ["train.warm_start_steps=0", "model.tokenizer=bpe"]
    with pytest.raises(ConfigError, match=r"^rollout.envs\[1\].name: silent .* model.tokenizer="):
        preflight(load_config(overrides=bpe))
    preflight(load_config(overrides=[*warm[:2], "train.warm_start_steps=0"]))


TINY_RUN = [
    "model.tokenizer=char",
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.intermediate_size=64",
    "rollout.env_size=tiny",
    "rollout.packs_per_step=2",
    "rollout.group_size=2",
    "rollout.tasks_per_pack=2",
    "rollout.eval_packs=2",
    "rollout.max_response_tokens=12",
    "algo.loss.max_response_len=12",
    "train.warm_start_steps=2",
    "train.warm_start_packs=2",
    "train.warm_start_warmup=1",
    "train.steps=2",
]


@pytest.mark.slow
def test_train_and_eval_on_the_example_by_its_path(tmp_path, monkeypatch):
    """`cod-fast train` on the example environment named by its file path (a warm start on its
    explorer, then RL) writes metrics and evaluations; `cod-fast eval` of the run directory on
    the same path plays it and writes eval.json."""
    monkeypatch.chdir(ROOT)  # the path relative to the working directory, as a user writes it
    name = f"{EXAMPLE_FILE.relative_to(ROOT)}:GuessEnv"
    run, out = tmp_path / "run", tmp_path / "eval"
    sets = [f"rollout.env={name}", *TINY_RUN, f"runtime.run_dir={run}"]
    trained = runner.invoke(app, ["train", *(a for s in sets for a in ("--set", s))])
    assert trained.exit_code == 0, trained.output
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 4 and all("loss" in step for step in steps)
    assert (run / "eval.jsonl").read_text().strip()
    args = ["eval", "--model", str(run), "--env", name, "--packs", "2", "--out", str(out)]
    evaluated = runner.invoke(app, args)
    assert evaluated.exit_code == 0, evaluated.output
    assert set(json.loads((out / "eval.json").read_text())["results"]) == {name}


def test_docs_walk_through_the_example_file():
    """docs/environments.md shows examples/guess_env.py verbatim (its first python block)."""
    doc = (ROOT / "docs" / "environments.md").read_text()
    section = doc[doc.index("## Writing an environment") :]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None and block[1] == EXAMPLE_FILE.read_text()
