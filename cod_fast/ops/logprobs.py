"""Per-token log-probs (and entropy) straight from hidden states and the LM head.

`linear_logprobs` is the public entry of this kernel family. Every implementation walks the
tokens in chunks (cod_fast.ops.chunked), so at most one chunk's [chunk x V] logits exist at a
time, and the backward recomputes each chunk's logits instead of storing them (only lse and
entropy, O(N), are saved). Implementations differ in their row kernels: torch, C++ or Triton.

Numerics (docs/concepts.md section 4): logits are divided by the temperature, and log-sum-exp,
log-probs and entropy are computed in float32 whatever the operand dtype, or in float64 when an
operand is float64 (the ground-truth mode of the tests; torch implementation only). NaN or inf in
the inputs propagate to the outputs of the affected rows; they are not masked.
"""

from __future__ import annotations

import torch

from cod_fast.ops.chunked import ChunkedLinearLogprobs, chunk_rows, compute_dtype
from cod_fast.ops.dispatch import resolve_impl, row_kernels


def check_logprob_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    check_targets: bool = True,
) -> None:
    """Shape, dtype and range checks shared by every implementation; the targets' range (see
    `check_target_range`) unless `check_targets` is False."""
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            f"expected hidden [N, H], weight [V, H], targets [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight "
            f"{tuple(weight.shape)}, targets {tuple(targets.shape)}"
        )
    if targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"targets must be int32 or int64 token ids, got {targets.dtype}")
    if check_targets:
        check_target_range(targets, weight.shape[0])
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def check_target_range(targets: torch.Tensor, vocab: int) -> None:
    """Every target id lies in [0, vocab), checked without waiting for the device.

    The check is a device-side assert, `torch._assert_async` (torch/_torch_docs.py; the kernels
    are aten/src/ATen/native/TensorCompare.cpp and native/cuda/TensorCompare.cu), on one bool
    computed on the targets' device. On the CPU it runs at once: an id outside raises a
    ValueError here. On CUDA it queues a one-thread kernel and the host goes on; an id outside
    fails that kernel's assert, and torch reports it asynchronously: a RuntimeError "CUDA error:
    device-side assert triggered" from a later call that waits for the device (reading the step's
    totals, say), not from this one, after which the process's CUDA context is unusable and the
    process must restart (CUDA_LAUNCH_BLOCKING=1 makes the failing call raise). A caller that
    knows the largest id from packing checks it on the host instead and passes
    check_targets=False (cod_fast.model.policy).
    """
    if not targets.numel():
        return
    low, high = torch.aminmax(targets)
    in_range = (low >= 0) & (high < vocab)
    message = f"target ids must lie in [0, {vocab}) (the LM head's vocabulary)"
    try:
        torch._assert_async(in_range, message)
    except RuntimeError:
        if targets.device.type != "cpu":  # a launch error: not this check's to explain
            raise
        raise ValueError(f"{message}; got min {int(low)}, max {int(high)}") from None


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    impl: str | None = None,
    chunk_size: int | None = None,
    check_targets: bool = True,
):
    """Log-prob of each target token under softmax(hidden @ weight.T / temperature).

    hidden [N, H] (the trainable positions only), weight [V, H], targets [N] -> float32 logp [N]
    (float64 when an operand is float64), and entropy [N] when ``return_entropy``. Differentiable
    in hidden and weight; the [N, V] logits are never materialised. ``chunk_size`` overrides the
    number of rows per chunk (tests use it to exercise the chunk loop). ``check_targets=False``
    skips the check that every target lies in [0, V), for a caller that has made sure of it
    (cod_fast.data.packing's micro-batches carry their largest target). The check waits for
    nothing: on CUDA an id outside is a device-side assert, reported asynchronously (see
    `check_target_range`).
    """
    check_logprob_inputs(hidden, weight, targets, temperature, check_targets)
    dtype = compute_dtype(hidden, weight)
    name, _ = resolve_impl(impl, hidden.device, dtype)
    if name == "triton" and not (
        torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    ):
        # No gradient wanted (old / reference log-probs, evaluation): the fused GEMM + online
        # log-sum-exp kernel needs no [chunk, V] buffer at all.
        from cod_fast.kernels.linear_lse import linear_logprobs_fwd

        logp, entropy, _ = linear_logprobs_fwd(
            hidden, weight, targets, temperature, with_entropy=return_entropy
        )
        return (logp, entropy) if return_entropy else logp
    chunk = chunk_size or chunk_rows(targets.shape[0], weight.shape[0], hidden.device, dtype)
    logp, entropy = ChunkedLinearLogprobs.apply(
        hidden, weight, targets.long(), 1.0 / temperature, row_kernels(name, dtype), chunk
    )
    return (logp, entropy) if return_entropy else logp
