"""The CUDA loss-head sources: they compile with nvcc here; on a GPU they match the torch head."""

from __future__ import annotations

import pytest
import torch

from cod_fast.ops import cuda_head
from cod_fast.ops.loss_head import HeadInputs, token_head


@pytest.mark.slow  # 0.5-1 s: left to the full suite
@pytest.mark.skipif(cuda_head.nvcc_path() is None, reason="nvcc not installed")
def test_cuda_kernels_compile(tmp_path):
    """csrc/cuda/loss_head.cu (with the shared csrc/loss_head.h) builds for Hopper with nvcc,
    and the library exports the three C entry points the ctypes wrapper binds."""
    lib = cuda_head.compile_library(tmp_path, gencode=("-gencode=arch=compute_90,code=sm_90",))
    assert lib.stat().st_size > 0
    symbols = lib.read_bytes()
    for name in (b"cod_loss_head", b"cod_segment_sum", b"cod_segment_broadcast_mean"):
        assert name in symbols
    assert (
        cuda_head.compile_library(tmp_path, gencode=("-gencode=arch=compute_90,code=sm_90",)) == lib
    )  # cached by content hash


@pytest.mark.gpu
@pytest.mark.parametrize("policy", [0, 1, 2, 3])
@pytest.mark.parametrize("kl", [0, 3])
@pytest.mark.parametrize("own_entropy", [False, True], ids=["one-weight", "weight-per-token"])
def test_cuda_head_matches_torch_head(policy, kl, own_entropy):
    """Every output of the CUDA head equals the torch closed-form head (float32 rounding), with
    one entropy weight or each token's own (`ent_coef`)."""
    g = torch.Generator(device="cuda").manual_seed(policy * 10 + kl)
    n = 1000

    def rand(scale=1.0):
        return scale * torch.randn(n, device="cuda", generator=g)

    logp = -rand().abs()
    head = HeadInputs(
        adv=rand(),
        corr=torch.rand(n, device="cuda", generator=g),
        weight=torch.full((n,), 1 / n, device="cuda"),
        old=logp + rand(0.2),
        ref=logp + rand(0.3) if kl else None,
        teach=logp + rand(0.5),
        ent_coef=rand(0.1).abs() if own_entropy else None,
    )
    switches = dict(
        policy=policy,
        seq_level=0,
        on_policy=0,
        eps_low=0.2,
        eps_high=0.28,
        kl=kl,
        beta=0.1,
        entropy_coef=0.01,
        opd_coef=0.5,
    )
    entropy = rand().abs()
    got = cuda_head.loss_head(logp, entropy, head, switches)
    want = token_head(logp, entropy, **head.kernel_args(), **switches)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype).expand_as(a), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cuda_segment_mean_matches_torch():
    """Segment sums over warp-crossing, unsorted and single-token runs equal index_add."""
    seg = torch.tensor([0] * 45 + [2] * 1 + [1] * 70 + [0] * 3 + [3] * 33, device="cuda")
    _, inv, counts = torch.unique(seg, return_inverse=True, return_counts=True)
    values = torch.randn(seg.numel(), device="cuda")
    want = (torch.zeros(4, device="cuda").index_add(0, inv, values) / counts)[inv]
    torch.testing.assert_close(cuda_head.segment_mean(values, inv, counts), want)
