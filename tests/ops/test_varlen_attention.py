"""Varlen attention over packed blocks (cod_fast.ops.varlen_attention): the C++ kernels and the
per-block SDPA path against a float64 reference, with shared-prefix key indices, grouped heads,
odd head sizes and degenerate blocks."""

from __future__ import annotations

import math

import pytest
import torch

from cod_fast.ops.cpp_rows import HAS_CPP
from cod_fast.ops.varlen_attention import varlen_attention

IMPLS = ["torch"] + (["cpp"] if HAS_CPP else [])
EPS32 = torch.finfo(torch.float32).eps


def reference(q, k, v, cu_q, cu_k, kv_index, scale):
    """float64 attention, block by block, with explicit masks."""
    if kv_index is not None:
        k, v = k[kv_index], v[kv_index]
    group = q.shape[1] // k.shape[1]
    outs = []
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)  # [H, lq, d]
        kb = k[cu_k[b] : cu_k[b + 1]].repeat_interleave(group, 1).transpose(0, 1)
        vb = v[cu_k[b] : cu_k[b + 1]].repeat_interleave(group, 1).transpose(0, 1)
        lq, lk = qb.shape[1], kb.shape[1]
        allowed = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        s = (scale * qb @ kb.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        outs.append((torch.softmax(s, -1) @ vb).transpose(0, 1))
    return torch.cat(outs)


def layout(shared: bool, g: torch.Generator):
    """(cu_q, cu_k, kv_index or None, number of key rows): blocks of 1-9 queries; with `shared`,
    blocks 1.. of each group see a shared prefix block's rows before their own (a tree)."""
    q_lengths = [1, 7, 3, 9, 1, 5, 2]
    if not shared:
        cu = torch.tensor([0, *q_lengths]).cumsum(0)
        return cu, cu, None, int(cu[-1])
    # block 0 is a prefix (its queries see only themselves); blocks 1-3 extend it, block 4 is a
    # new prefix, blocks 5-6 extend that.
    starts = torch.tensor([0, *q_lengths]).cumsum(0).tolist()
    rows = [list(range(starts[i], starts[i + 1])) for i in range(len(q_lengths))]
    keys = [rows[0], rows[0] + rows[1], rows[0] + rows[2], rows[0] + rows[3], rows[4]]
    keys += [rows[4] + rows[5], rows[4] + rows[6]]
    cu_k = torch.tensor([0, *map(len, keys)]).cumsum(0)
    index = torch.tensor([r for block in keys for r in block])
    return torch.tensor(starts), cu_k, index, starts[-1]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shared", [False, True], ids=["flat", "tree"])
@pytest.mark.parametrize("heads, kv_heads, d", [(1, 1, 1), (3, 3, 32), (4, 2, 13), (6, 1, 24)])
def test_forward_and_gradients_match_float64(impl, shared, heads, kv_heads, d):
    """Output, dq, dk and dv in float32 are within twice the per-block float32 SDPA's distance
    from float64 (plus a few ulps), for flat blocks and a shared-prefix tree."""
    g = torch.Generator().manual_seed(heads * 31 + d + shared)
    cu_q, cu_k, index, rows = layout(shared, g)
    q64 = 2 * torch.randn(rows, heads, d, generator=g, dtype=torch.float64)
    k64 = 2 * torch.randn(rows, kv_heads, d, generator=g, dtype=torch.float64)
    v64 = torch.randn(rows, kv_heads, d, generator=g, dtype=torch.float64)
    up = torch.randn(rows, heads, d, generator=g, dtype=torch.float64)
    scale = 1 / math.sqrt(d)

    def run(fn, dtype):
        ins = [t.to(dtype, copy=True).requires_grad_() for t in (q64, k64, v64)]
        out = fn(*ins)
        (out * up.to(dtype)).sum().backward()
        return (out.detach(), *(t.grad for t in ins))

    exact = run(lambda q, k, v: reference(q, k, v, cu_q, cu_k, index, scale), torch.float64)
    eager = run(
        lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, index, scale, "torch"),
        torch.float32,
    )
    got = run(
        lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, index, scale, impl), torch.float32
    )
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, eager, exact, strict=True):
        err = (a.double() - c).abs().max().item()
        budget = 2 * (b.double() - c).abs().max().item() + 8 * EPS32 * c.abs().max().item()
        assert err <= budget, f"{name}: error {err:.3e} > budget {budget:.3e}"


@pytest.mark.skipif(not HAS_CPP, reason="cod_fast._cpp not built")
def test_cpp_refuses_malformed_layouts_by_name():
    """Offsets that do not cover the rows, a block with fewer keys than queries and an index
    outside the key rows are refused with the cause."""
    q = torch.randn(4, 2, 8)
    kv = torch.randn(4, 2, 8)
    bad_cover = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="cu_q must run from 0"):
        varlen_attention(q, kv, kv, bad_cover, bad_cover, impl="cpp")
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        varlen_attention(q, kv, kv, torch.tensor([0, 4]), torch.tensor([0, 3]),
                         torch.tensor([0, 1, 2]), impl="cpp")  # fmt: skip
    with pytest.raises(ValueError, match=r"kv_index\[1\] = 9 is outside"):
        varlen_attention(q, kv, kv, torch.tensor([0, 4]), torch.tensor([0, 4]),
                         torch.tensor([0, 9, 2, 3]), impl="cpp")  # fmt: skip


def test_empty_block_and_single_token_blocks():
    """A block with no queries is skipped; a 1-token block returns its own value row."""
    q, k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    cu = torch.tensor([0, 1, 1, 2, 3])
    for impl in IMPLS:
        out = varlen_attention(q, k, v, cu, cu, impl=impl)
        torch.testing.assert_close(out, v, rtol=0, atol=0)


def host_lengths(cu_q, cu_k):
    return cu_q.diff().tolist(), cu_k.diff().tolist()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shared", [False, True], ids=["flat", "tree"])
def test_lengths_given_on_the_host_change_nothing(impl, shared):
    """The blocks' lengths passed as host ints give the same output and gradients, bit for bit,
    as lengths read from cu_q and cu_k."""
    g = torch.Generator().manual_seed(40 + shared)
    cu_q, cu_k, index, rows = layout(shared, g)
    ins = [torch.randn(rows, h, 8, generator=g) for h in (4, 2, 2)]
    up = torch.randn(rows, 4, 8, generator=g)

    def run(**lengths):
        q, k, v = (t.clone().requires_grad_() for t in ins)
        out = varlen_attention(q, k, v, cu_q, cu_k, index, impl=impl, **lengths)
        (out * up).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    given = run(lengths=host_lengths(cu_q, cu_k))
    for name, a, b in zip(("out", "dq", "dk", "dv"), given, run(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("shared", [False, True], ids=["flat", "tree"])
def test_given_lengths_the_offsets_on_a_device_are_never_read(shared):
    """With `lengths`, forward and backward on the meta device (tensors with no data, which
    cannot be read back: as a GPU's, whose read would wait for it) run without reading cu_q or
    cu_k, and give [T, Hq, d]; without them the offsets are read, which fails there."""
    g = torch.Generator().manual_seed(50 + shared)
    cu_q, cu_k, index, rows = layout(shared, g)
    lengths = host_lengths(cu_q, cu_k)
    cu_q, cu_k = cu_q.to("meta"), cu_k.to("meta")
    index = None if index is None else index.to("meta")
    q = torch.empty(rows, 4, 8, device="meta", requires_grad=True)
    k, v = (torch.empty(rows, 2, 8, device="meta", requires_grad=True) for _ in range(2))
    out = varlen_attention(q, k, v, cu_q, cu_k, index, lengths=lengths)
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == k.shape
    with pytest.raises(NotImplementedError, match="meta tensor"):
        varlen_attention(q, k, v, cu_q, cu_k, index)
