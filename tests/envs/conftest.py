"""The environment tests see the built-in environments and those they register themselves.

A plugin package installed on the machine (an entry point in group cod_fast.environments)
would otherwise join every list of known names and change what these tests see, so every test
here starts from an empty table of registered names and no entry points; a test of the
discovery itself asks for `installed_plugins`, which reads the installed packages again.
"""

from __future__ import annotations

import pytest

from cod_fast.envs import registry

DISCOVER = registry._entry_points
"""The registry's own reading of the installed packages' entry points."""


def no_entry_points() -> dict:
    """No installed package's environment: what the isolated registry discovers."""
    return {}


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    """The registry as a fresh install sees it: the built-ins, the names this test registers
    (an empty table of its own) and no entry points."""
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.setattr(registry, "_entry_points", no_entry_points)


@pytest.fixture
def installed_plugins(isolated_registry, monkeypatch):
    """Entry points discovered as the product discovers them, from the installed packages (a
    test's own distribution on sys.path among them)."""
    monkeypatch.setattr(registry, "_entry_points", DISCOVER)
