"""cod-fast as a user installs it: an sdist and a wheel built from a clean copy of the tree, the
wheel installed into a fresh virtual environment outside the tree, every module imported from
there, and every subcommand run in a quick form from a folder that is not the checkout.

The dependencies (torch, transformers, ...) are not installed again: the fresh environment sees
this environment's site-packages through a path file (the checkout's editable install is not
among them: a path entry does not run an editable install's finder), and the test checks that
the installed package's requirements are met there. Everything of cod-fast itself comes from
the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENV.pop("PYTHONPATH", None)


def _run(args: list, cwd: Path, timeout: int = 300) -> str:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=ENV
    )
    said = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(map(str, args))} failed:\n{said[-4000:]}"
    return said


def _clean_copy(dest: Path) -> None:
    """The tree as git sees it (tracked files and new ones not ignored): no build folders, no
    compiled extension, no egg-info of an editable install."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _source_packages() -> set[str]:
    """Every package folder of the tree, under the name it installs as."""
    names = set()
    for top, installed in (("cod_fast", "cod_fast"), ("kernels", "cod_fast.kernels")):
        for init in (ROOT / top).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / top).parts
            names.add(".".join([installed, *parts]))
    for init in (ROOT / "bench").rglob("__init__.py"):
        if "results" not in init.parts:
            parts = init.parent.relative_to(ROOT / "bench").parts
            names.add(".".join(["cod_fast.bench", *parts]))
    return names


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the fresh environment's python, a work folder outside the tree, the wheel)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to copy the tree from")
    base = tmp_path_factory.mktemp("install")
    _clean_copy(base / "src")
    # --sdist --wheel builds the wheel from the sdist, so a file the sdist leaves out fails here.
    _run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "-o", base / "dist", "."],
        base / "src",
        600,
    )
    (wheel,) = (base / "dist").glob("cod_fast-*.whl")
    assert len(list((base / "dist").glob("cod_fast-*.tar.gz"))) == 1
    _run([sys.executable, "-m", "venv", base / "venv"], base)
    python = base / "venv" / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], base)
    Path(purelib.strip(), "outer-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], base)
    work = base / "work"
    work.mkdir()
    return python, work, wheel


def test_the_wheel_holds_every_package_of_the_tree(installed):
    """Every folder with an __init__.py (cod_fast/, kernels/, bench/) is a package of the wheel,
    and the compiled C++ extension is in it."""
    _, _, wheel = installed
    names = zipfile.ZipFile(wheel).namelist()
    packages = {
        n.removesuffix("/__init__.py").replace("/", ".")
        for n in names
        if n.endswith("/__init__.py")
    }
    assert packages == _source_packages()
    assert any(n.startswith("cod_fast/_cpp.") and n.endswith(".so") for n in names)


IMPORT_ALL = """
import importlib, json, pathlib, sys
import cod_fast
root = pathlib.Path(cod_fast.__file__).parent
modules = sorted(
    ".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in root.rglob("*.py")
)
for name in modules:
    importlib.import_module(name)
from importlib.metadata import distribution, version
from packaging.requirements import Requirement
unmet = []
for text in distribution("cod-fast").requires or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if not req.specifier.contains(version(req.name), prereleases=True):
        unmet.append(text)
import cod_fast._cpp
print(json.dumps({"file": cod_fast.__file__, "modules": len(modules), "unmet": unmet}))
"""


def test_every_module_imports_from_the_installed_wheel(installed, tmp_path):
    """From a folder outside the checkout, every module of the installed package imports (the
    C++ extension too), the package is the installed one, not the source tree, and the
    requirements the wheel declares are met."""
    python, work, _ = installed
    said = _run([python, "-c", IMPORT_ALL], work)
    report = json.loads(said.strip().splitlines()[-1])
    assert Path(report["file"]).is_relative_to(python.parents[1]), report
    assert not Path(report["file"]).is_relative_to(ROOT)
    assert report["modules"] > 80 and report["unmet"] == []


def test_every_subcommand_runs_from_the_installed_wheel(installed):
    """The main job's quick form (train, export, eval, rollout: README's quickstart) and a quick
    form of every other subcommand run with the installed `cod-fast` from outside the tree."""
    python, work, _ = installed
    cli = python.parent / "cod-fast"
    quick = ["--set", "train.warm_start_steps=1", "--set", "train.steps=1"]
    quick += ["--set", "rollout.eval_packs=1", "--set", "runtime.run_dir=runs/demo"]
    said = _run([cli, "train", *quick], work)
    assert (work / "runs/demo/checkpoints/latest").exists(), said[-2000:]
    _run([cli, "export", "runs/demo", "--out", "runs/demo-hf"], work)
    _run([cli, "eval", "--model", "runs/demo-hf", "--packs", "1", "--out", "runs/eval"], work)
    assert json.loads((work / "runs/eval/eval.json").read_text())["packs"] == 1
    _run([cli, "rollout", "--model", "runs/demo-hf", "--packs", "1"], work)
    assert "cod-fast" in _run([cli, "info"], work)
    assert "rollout:" in _run([cli, "config", "show"], work)
    assert "frozenlake" in _run([cli, "envs", "list"], work)
    _run([cli, "envs", "solve", "frozenlake", "--packs", "2"], work)
    _run([cli, "bench", "launches", "--check"], work)
    tiny = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2"]
    tiny += ["model.intermediate_size=64", "rollout.eval_packs=1", "train.warm_start_steps=1"]
    tiny += ["train.steps=1", "rollout.packs_per_step=1", "rollout.group_size=2"]
    tiny += ["train.warm_start_packs=1"]
    teachers = "{frozenlake: teachers/frozenlake, terminal: teachers/terminal}"
    distill = [cli, "distill", "--set", "runtime.run_dir=runs/student"]
    distill += ["--set", f"algo.teachers={teachers}"]
    for override in tiny:
        distill += ["--set", override, "--teacher-set", override]
    _run(distill, work)
    assert (work / "teachers/terminal/config.json").exists()
