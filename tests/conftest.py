"""Test-session set-up: without CUDA, Triton kernels run under its interpreter; the `gpu`
marker skips a test on a machine without CUDA.

TRITON_INTERPRET must be set before triton or cod_fast.kernels is imported (@triton.jit reads
it when a kernel module loads), so it is set here, before any test module is collected.

Tiers (pyproject.toml): `slow` marks tests of a second or more (training runs, benchmarks, the
real vLLM engine, several processes, statistical checks of the environments' explorers);
`python -m pytest -m "not slow"` is the quick tier for the edit loop, CI runs everything.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _numpy_compat_for_interpreter() -> None:
    """NumPy >= 2.4 refuses int() of a 1-element array, which Triton 3.6's interpreter uses for
    a kernel scalar as a loop bound (`range(0, V, BLOCK_V)`). Patch that one conversion."""
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    if not getattr(patch_tensor, "numpy_compat", False):
        patched.numpy_compat = True
        interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _numpy_compat_for_interpreter()


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A mixed-precision Trainer in the test process makes a one-rank process group; no test
    may leave one to the next."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
