"""The row-kernel contract, stated in torch: what the C++ and Triton row kernels compute.

A row kernel works on one chunk of raw logits z [C, V] (h @ W^T before the temperature), row by
row: log-sum-exp, the target's log-prob and the entropy; in the backward (or fused) call it
overwrites z with dL/dz. These functions are the `torch` backend of the chunked driver
(cod_fast.ops.chunked) and run in any float dtype, float64 included.
"""

from __future__ import annotations

import torch

from cod_fast.ops.loss_head import token_head


def rows_forward(z: torch.Tensor, targets: torch.Tensor, inv_temp: float):
    """(logp, entropy, lse) of each row of softmax(inv_temp * z)."""
    x = z * inv_temp
    lse = torch.logsumexp(x, dim=1)
    log_p = x - lse[:, None]
    logp = log_p.gather(1, targets[:, None].long()).squeeze(1)
    # -sum p log p, not lse - sum p x: the latter cancels badly for peaked rows.
    entropy = -(log_p.exp() * log_p).sum(dim=1)
    return logp, entropy, lse


def rows_backward_(z, targets, lse, entropy, g_logp, g_entropy, inv_temp: float) -> None:
    """Overwrite z with dL/dz = inv_temp (g_logp (onehot - p) - g_H p (log p + H))."""
    log_p = z * inv_temp - lse[:, None]
    p = log_p.exp()
    dz = -p * g_logp[:, None]
    dz.scatter_add_(1, targets[:, None].long(), g_logp[:, None])
    if g_entropy is not None:
        dz -= p * (log_p + entropy[:, None]) * g_entropy[:, None]
    z.copy_(dz * inv_temp)


def rows_fused_(z, targets, inv_temp: float, **head):
    """Stats, the loss head (`token_head`), then dL/dz into z: (logp, entropy, loss, clipped)."""
    logp, entropy, lse = rows_forward(z, targets, inv_temp)
    loss, g_logp, g_entropy, clipped = token_head(logp, entropy, **head)
    rows_backward_(z, targets, lse, entropy, g_logp, g_entropy, inv_temp)
    return logp, entropy, loss, clipped
