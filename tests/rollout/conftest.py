"""Fixtures of the rollout tests: scripted OpenAI-compatible endpoints on the loopback address
(tests/endpoint_server.py), for the judge and the API-model player."""

from __future__ import annotations

import contextlib

import pytest

from tests.endpoint_server import Server, serving


@pytest.fixture
def start_server():
    """Starts scripted endpoints, as many as a test asks for; all shut down after it."""
    with contextlib.ExitStack() as stack:
        yield lambda: stack.enter_context(serving(Server()))


@pytest.fixture
def server(start_server):
    """One scripted endpoint."""
    return start_server()
