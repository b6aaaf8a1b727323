"""CoD environments (docs/concepts.md section 6) and their registry (cod_fast.envs.registry).

Environments load lazily by name, so importing the package stays cheap and one broken
environment cannot break the others.
"""

from __future__ import annotations

from cod_fast.envs.base import Environment, MissingScriptedAgent, Setting, Size
from cod_fast.envs.registry import (
    ENTRY_POINT_GROUP,
    ENVIRONMENTS,
    EnvironmentLookupError,
    env_class,
    environment_problem,
    known_environments,
    make_env,
    make_envs,
    register,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENVIRONMENTS",
    "Environment",
    "EnvironmentLookupError",
    "MissingScriptedAgent",
    "Setting",
    "Size",
    "env_class",
    "environment_problem",
    "known_environments",
    "make_env",
    "make_envs",
    "register",
]
