"""Agreement with liger-kernel's fused linear GRPO loss on the cases it supports: one segment per
row, token-level ratios, `dapo` (token-mean) and `grpo` (seq-mean-token-mean) normalisation,
PPO clipping with asymmetric eps and the k3 KL to a reference."""

from __future__ import annotations

import pytest
import torch

from cod_fast import LossConfig
from cod_fast.ops import linear_policy_loss
from cod_fast.ops.dispatch import is_available

grpo_loss = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")

IMPLS = ["torch"] + [name for name in ("cpp", "triton") if is_available(name)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("loss_type", "agg"), [("dapo", "token-mean"), ("grpo", "seq-mean-token-mean")]
)
def test_matches_liger_grpo(loss_type, agg, impl):
    """Same loss and the same gradients for the hidden states and the LM head as liger, given a
    padded [B, T] batch that cod-fast sees as gathered trainable rows with one segment per row."""
    g = torch.Generator().manual_seed(7)
    batch, length, hidden_size, vocab = 3, 9, 24, 61
    x = torch.randn(batch, length, hidden_size, generator=g)
    w = torch.randn(vocab, hidden_size, generator=g) * 0.5
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, 6:] = 0  # padded tails of different lengths
    mask[2, 2:] = 0
    adv = torch.randn(batch, generator=g)
    with torch.no_grad():
        logp = torch.log_softmax(x @ w.T, -1).gather(-1, ids[..., None]).squeeze(-1)
    old = logp + 0.3 * torch.randn(batch, length, generator=g)
    ref = logp + 0.3 * torch.randn(batch, length, generator=g)

    x_l, w_l = x.clone().requires_grad_(), w.clone().requires_grad_()
    liger = grpo_loss.LigerFusedLinearGRPOLoss(
        beta=0.04, compiled=False, epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type
    )
    out = liger(x_l, w_l, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)
    liger_loss = out[0] if isinstance(out, tuple) else out
    liger_loss.backward()

    keep = mask.bool()
    rows = torch.arange(batch)[:, None].expand(batch, length)[keep]
    x_c, w_c = x.clone().requires_grad_(), w.clone().requires_grad_()
    cfg = LossConfig(policy="ppo", eps_low=0.2, eps_high=0.28, kl="k3", beta=0.04, agg=agg)
    ours = linear_policy_loss(
        x_c[keep],
        w_c,
        ids[keep],
        adv[rows],
        rows,
        old_logp=old[keep],
        ref_logp=ref[keep],
        loss_config=cfg,
        impl=impl,
    )
    ours.loss.backward()

    torch.testing.assert_close(ours.loss, liger_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_c.grad, x_l.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w_c.grad, w_l.grad, rtol=1e-4, atol=1e-6)
