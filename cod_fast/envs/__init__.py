"""CoD environments (docs/concepts.md section 6) and their registry.

Environments load lazily by name, so importing the package stays cheap and one broken
environment cannot break the others.
"""

from __future__ import annotations

import importlib

from cod_fast.envs.base import Environment, Setting, Size

# name -> "module:class"
ENVIRONMENTS = {
    "frozenlake": "cod_fast.envs.frozenlake:FrozenLakeEnv",
    "alchemy": "cod_fast.envs.alchemy:AlchemyEnv",
    "terminal": "cod_fast.envs.terminal:TerminalEnv",
    "optimal_control": "cod_fast.envs.optimal_control:OptimalControlEnv",
    "pde": "cod_fast.envs.pde:PdeEnv",
    "grid_nav": "cod_fast.envs.gridnav:GridNavEnv",
}


def env_class(name: str) -> type[Environment]:
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; choose one of {', '.join(ENVIRONMENTS)}")
    module, cls = ENVIRONMENTS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_env(name: str, setting: Setting = "train", size: Size = "full") -> Environment:
    """The environment `name` in a train or eval setting, at full or tiny size."""
    return env_class(name)(setting=setting, size=size)
