"""Which implementation of a kernel family runs, and why.

Every kernel family (`linear_logprobs`, `linear_policy_loss`) has one public function with an
``impl=`` switch. ``impl=None`` asks this module: the ``COD_FAST_IMPL`` environment variable wins,
then the best implementation available for the device (triton on CUDA, cpp on CPU when the
extension is built, torch everywhere). The pure-torch implementation is always available.
Implementations differ in their row kernels (see cod_fast.ops.torch_rows for the contract).
The CUDA loss head of csrc/cuda (cod_fast.ops.cuda_head) is not one of them yet: its sources
compile and match the torch head in the tests where a GPU exists, but no driver calls it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import warnings
from types import ModuleType

import torch

IMPLS = ("triton", "cpp", "torch")
ENV_VAR = "COD_FAST_IMPL"
_ROW_MODULES = {
    "torch": "cod_fast.ops.torch_rows",
    "cpp": "cod_fast.ops.cpp_rows",
    "triton": "cod_fast.kernels.rows",
}


def _triton_status() -> str:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if torch.cuda.is_available():
        return "available: Triton kernels on CUDA"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "available: Triton interpreter on the CPU (TRITON_INTERPRET=1; slow, for tests)"
    return "no CUDA device (set TRITON_INTERPRET=1 to interpret the kernels on the CPU)"


def _cpp_status() -> str:
    from cod_fast.ops import cpp_rows

    if cpp_rows.HAS_CPP:
        return "available: C++ row kernels (OpenMP) with BLAS GEMMs"
    return f"C++ extension not built ({cpp_rows.CPP_ERROR}); reinstall with a C++17 compiler"


_STATUS = {
    "triton": _triton_status,
    "cpp": _cpp_status,
    "torch": lambda: "available: pure-torch reference, runs on every device",
}


def available_impls() -> dict[str, str]:
    """Map every known implementation name to why it is or is not usable here."""
    return {name: status() for name, status in _STATUS.items()}


def is_available(impl: str) -> bool:
    return _STATUS[impl]().startswith("available")


def impl_problem(impl: str) -> str | None:
    """Why `impl` cannot run here, or None when it can: the rule `resolve_impl` applies to a
    name it is given, which the preflight applies to COD_FAST_IMPL and runtime.kernel_impl
    before the run starts."""
    if impl not in IMPLS:
        return f"unknown kernel implementation {impl!r}: expected one of {', '.join(IMPLS)}"
    if not is_available(impl):
        return f"kernel implementation {impl!r} is not usable here: {_STATUS[impl]()}"
    return None


@functools.cache
def _warn_cpp_missing() -> None:
    warnings.warn(
        f"cod-fast: {available_impls()['cpp']}; using the slower torch kernels",
        RuntimeWarning,
        stacklevel=3,
    )


def resolve_impl(
    impl: str | None, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> tuple[str, str]:
    """Return (implementation name, reason it was chosen) for `dtype` operands on ``device``."""
    device = torch.device(device)
    if impl is None and os.environ.get(ENV_VAR):
        impl, why = os.environ[ENV_VAR], f"set by {ENV_VAR}"
    elif impl is not None:
        why = "asked for by the caller"
    else:
        preferred = ("triton", "torch") if device.type == "cuda" else ("cpp", "torch")
        if dtype == torch.float64:
            preferred = ("torch",)  # the float64 ground-truth mode is the torch path's alone
        impl = next(name for name in preferred if is_available(name))
        why = f"best available on {device.type} for {dtype}"
        if device.type == "cpu" and impl == "torch" and dtype != torch.float64:
            _warn_cpp_missing()
    if problem := impl_problem(impl):
        # An unknown name is a bad value; a known one that cannot run here, a bad machine.
        error = ValueError if impl not in IMPLS else RuntimeError
        raise error(f"{problem} ({why}); pick 'torch' or unset {ENV_VAR}")
    return impl, why


def row_kernels(impl: str, dtype: torch.dtype) -> ModuleType:
    """The row-kernel module of an implementation, for logits of `dtype`."""
    if impl != "torch" and dtype != torch.float32:
        raise TypeError(
            f"impl {impl!r} computes in float32 (float32, bfloat16 or float16 "
            f"operands); got {dtype} operands, which only impl='torch' takes"
        )
    return importlib.import_module(_ROW_MODULES[impl])
