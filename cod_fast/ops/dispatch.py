"""Which implementation of a kernel family runs, and why.

Every kernel family (`linear_logprobs`, `linear_policy_loss`) has one public function with an
``impl=`` switch. ``impl=None`` asks this module: the ``COD_FAST_IMPL`` environment variable wins,
then the best implementation available for the device (triton on CUDA, cpp on CPU when the
extension is built, torch everywhere). The pure-torch implementation is always available.
"""

from __future__ import annotations

import os

import torch

IMPLS = ("triton", "cuda", "cpp", "torch")
ENV_VAR = "COD_FAST_IMPL"


def available_impls() -> dict[str, str]:
    """Map every known implementation name to why it is or is not usable here."""
    return {
        "triton": "not built yet (kernels issue)",
        "cuda": "not built yet (kernels issue)",
        "cpp": "not built yet (kernels issue)",
        "torch": "available: pure-torch reference, runs on every device",
    }


def is_available(impl: str) -> bool:
    return available_impls()[impl].startswith("available")


def resolve_impl(impl: str | None, device: torch.device | str) -> tuple[str, str]:
    """Return (implementation name, reason it was chosen) for tensors on ``device``."""
    device = torch.device(device)
    if impl is None and os.environ.get(ENV_VAR):
        impl, why = os.environ[ENV_VAR], f"set by {ENV_VAR}"
    elif impl is not None:
        why = "asked for by the caller"
    else:
        preferred = ("triton", "torch") if device.type == "cuda" else ("cpp", "torch")
        impl = next(name for name in preferred if is_available(name))
        why = f"best available on {device.type}"
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation {impl!r} ({why}); choose one of {IMPLS}")
    if not is_available(impl):
        raise RuntimeError(
            f"kernel implementation {impl!r} ({why}) is not usable here: "
            f"{available_impls()[impl]}; pick 'torch' or unset {ENV_VAR}"
        )
    return impl, why
