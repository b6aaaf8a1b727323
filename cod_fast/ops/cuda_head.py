"""The CUDA loss-head and segment-reduction kernels (csrc/cuda/loss_head.cu), through ctypes.

The library has a C ABI and no torch headers, so it builds with nvcc alone, on first use, into a
per-user cache keyed by the source's hash (no build step at install time, nothing to match
against the torch build). It needs the repository's csrc/ folder (a source checkout or editable
install) and a CUDA toolkit; `cuda_head_status()` says what is missing.

This module is compiled by the test suite on any machine with nvcc; running it needs a GPU and
has not been done yet (see docs/gpu.md, "What runs where").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

from cod_fast.ops.loss_head import HeadInputs

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCE = CSRC / "cuda" / "loss_head.cu"
CACHE = Path(os.environ.get("COD_FAST_CACHE", Path.home() / ".cache" / "cod_fast"))
# Hopper first (the machines cod-fast targets), Ampere for the rest; PTX lets newer GPUs JIT.
GENCODE = (
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=compute_90",
)


def nvcc_path() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return shutil.which("nvcc") or next(
        (str(p) for p in [Path(home) / "bin" / "nvcc"] if p.exists()), None
    )


def compile_library(out_dir: Path, gencode: tuple[str, ...] = GENCODE) -> Path:
    """nvcc the kernels into a shared library in `out_dir`; returns its path."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found: install a CUDA toolkit or set CUDA_HOME")
    if not SOURCE.exists():
        raise RuntimeError(f"{SOURCE} is missing: the CUDA path needs a source checkout")
    out_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(
        SOURCE.read_bytes() + (CSRC / "loss_head.h").read_bytes() + " ".join(gencode).encode()
    ).hexdigest()[:16]
    target = out_dir / f"libcod_fast_cuda_{digest}.so"
    if not target.exists():
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        cmd = [
            nvcc,
            "-O3",
            "-std=c++17",
            "-shared",
            "-Xcompiler",
            "-fPIC",
            f"-I{CSRC}",
            *gencode,
            "-o",
            str(tmp),
            str(SOURCE),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{result.stderr}")
        tmp.replace(target)  # atomic: a concurrent process never loads a half-written library
    return target


@functools.cache
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(compile_library(CACHE)))
    f32, i64 = ctypes.c_float, ctypes.c_int64
    ptr = ctypes.c_void_p
    lib.cod_loss_head.argtypes = [
        i64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        f32,
        f32,
        ctypes.c_int,
        f32,
        f32,
        f32,
    ] + [ptr] * 16
    lib.cod_segment_sum.argtypes = [i64, ptr, ptr, ptr, ptr]
    lib.cod_segment_broadcast_mean.argtypes = [i64, ptr, ptr, ptr, ptr, ptr]
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if not (t.is_cuda and t.is_contiguous()):
        raise ValueError("CUDA head kernels take contiguous CUDA tensors")
    return t.data_ptr()


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} launch failed with cudaError {code}")


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def loss_head(logp: torch.Tensor, entropy: torch.Tensor, head: HeadInputs, switches: dict):
    """The CUDA `token_head`: (loss, g_logp, g_entropy, clipped), float32 [N] each."""
    outs = [torch.empty_like(logp) for _ in range(4)]
    s = switches
    args = [
        logp,
        entropy,
        head.adv,
        head.old,
        head.ref,
        head.teach,
        head.corr,
        head.weight,
        head.seq_ratio,
        head.seq_grad,
        head.ent_coef,
        *outs,
    ]
    _check(
        _library().cod_loss_head(
            logp.numel(),
            s["policy"],
            s["seq_level"],
            s["on_policy"],
            s["eps_low"],
            s["eps_high"],
            s["kl"],
            s["beta"],
            s["entropy_coef"],
            s["opd_coef"],
            *map(_ptr, args),
            _stream(),
        ),
        "cod_loss_head",
    )
    return tuple(outs)


def segment_mean(values: torch.Tensor, seg: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over each segment, broadcast back to its tokens (float32)."""
    sums = torch.zeros(counts.shape[0], dtype=torch.float32, device=values.device)
    out = torch.empty_like(values)
    lib, n = _library(), values.numel()
    _check(
        lib.cod_segment_sum(n, _ptr(values), _ptr(seg), _ptr(sums), _stream()), "cod_segment_sum"
    )
    _check(
        lib.cod_segment_broadcast_mean(
            n, _ptr(sums), _ptr(counts), _ptr(seg), _ptr(out), _stream()
        ),
        "cod_segment_broadcast_mean",
    )
    return out
