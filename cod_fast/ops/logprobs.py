"""Per-token log-probs (and entropy) straight from hidden states and the LM head.

`linear_logprobs` is the public entry of this kernel family. The pure-torch implementation here is
the reference every faster one is compared with: it walks the tokens in chunks, so at most one
chunk's [chunk x V] logits exist at a time, and its backward recomputes each chunk's logits
instead of storing them (only lse and entropy, O(N), are saved).

Numerics (SPEC.md section 4): logits are divided by the temperature, and log-sum-exp, log-probs
and entropy are computed in float32 whatever the operand dtype, or in float64 when an operand is
float64 (the ground-truth mode of the tests). NaN or inf in the inputs propagate to the outputs of
the affected rows; they are not masked.
"""

from __future__ import annotations

import torch

from cod_fast.ops.dispatch import resolve_impl

# Bytes of float32 logits one chunk may hold; 64 MiB keeps a 150k vocabulary at ~110 tokens/chunk.
CHUNK_BYTES = 64 * 2**20


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any operand is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def default_chunk_size(vocab: int, dtype: torch.dtype) -> int:
    return max(1, CHUNK_BYTES // (vocab * torch.finfo(dtype).bits // 8))


def check_logprob_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    """Shape, dtype and range checks shared by every implementation."""
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
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= weight.shape[0]):
        raise ValueError(
            f"target ids must lie in [0, {weight.shape[0]}) (the LM head's "
            f"vocabulary); got min {int(targets.min())}, max {int(targets.max())}"
        )


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = hidden @ weight.T
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """logp_t = z_t[y_t] - lse(z_t) and H_t = -sum_v p_tv log p_tv, z = h W^T / T."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, chunk_size):
        dtype = compute_dtype(hidden, weight)
        h, w = hidden.to(dtype), weight.to(dtype)
        n = h.shape[0]
        logp = torch.empty(n, dtype=dtype, device=h.device)
        lse = torch.empty(n, dtype=dtype, device=h.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=dtype, device=h.device)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            z = _chunk_logits(h[rows], w, temperature)
            lse[rows] = torch.logsumexp(z, dim=1)
            logp[rows] = z.gather(1, targets[rows, None].long()).squeeze(1) - lse[rows]
            if with_entropy:
                # -sum p log p, not lse - sum p z: the latter cancels badly for peaked rows.
                log_p = z - lse[rows, None]
                entropy[rows] = -(log_p.exp() * log_p).sum(dim=1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        dtype = lse.dtype
        h, w = hidden.to(dtype), weight.to(dtype)
        grad_h = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        if grad_entropy is not None and grad_entropy.numel() == 0:
            grad_entropy = None
        for start in range(0, h.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            z = _chunk_logits(h[rows], w, ctx.temperature)
            log_p = z - lse[rows, None]
            p = log_p.exp()
            # d logp_t / d z_v = onehot_v - p_v ;  d H_t / d z_v = -p_v (log p_v + H_t)
            dz = torch.zeros_like(z)
            if grad_logp is not None:
                dz -= p * grad_logp[rows, None]
                dz.scatter_add_(1, targets[rows, None].long(), grad_logp[rows, None])
            if grad_entropy is not None:
                dz -= p * (log_p + entropy[rows, None]) * grad_entropy[rows, None]
            if ctx.temperature != 1.0:
                dz /= ctx.temperature
            if grad_h is not None:
                grad_h[rows] = dz @ w
            if grad_w is not None:
                grad_w += dz.T @ h[rows]
        grad_h = grad_h.to(hidden.dtype) if grad_h is not None else None
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None


def linear_logprobs_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
):
    """The chunked pure-torch implementation; see `linear_logprobs`."""
    check_logprob_inputs(hidden, weight, targets)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk_size or default_chunk_size(weight.shape[0], compute_dtype(hidden, weight))
    logp, entropy = _ChunkedLinearLogprobs.apply(
        hidden, weight, targets, float(temperature), return_entropy, chunk
    )
    return (logp, entropy) if return_entropy else logp


_IMPLS = {"torch": linear_logprobs_torch}


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    impl: str | None = None,
):
    """Log-prob of each target token under softmax(hidden @ weight.T / temperature).

    hidden [N, H] (the trainable positions only), weight [V, H], targets [N] -> float32 logp [N]
    (float64 when an operand is float64), and entropy [N] when ``return_entropy``. Differentiable
    in hidden and weight; the [N, V] logits are never materialised.
    """
    name, _ = resolve_impl(impl, hidden.device)
    return _IMPLS[name](
        hidden, weight, targets, temperature=temperature, return_entropy=return_entropy
    )
