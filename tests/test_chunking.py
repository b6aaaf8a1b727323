"""How the chunked driver sizes its chunks, and that it holds one chunk's logits at a time."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cod_fast import LossConfig
from cod_fast.ops import LossInputs, chunked, linear_logprobs
from cod_fast.ops import torch_rows as torch_rows_module
from cod_fast.ops.chunked import chunk_rows, fused_linear_policy_loss


@given(
    n=st.integers(1, 300_000),
    vocab=st.integers(1, 300_000),
    kind=st.sampled_from(["cpu", "cuda"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_chunk_rows_respects_budget_share_and_splits_evenly(n, vocab, kind, dtype):
    rows = chunk_rows(n, vocab, torch.device(kind), dtype)
    row_bytes = vocab * torch.finfo(dtype).bits // 8
    by_budget = chunked.CHUNK_BYTES[kind] // row_bytes
    assert 1 <= rows <= n
    # Never over the budget (unless one row alone exceeds it), never over the shape's share
    # of the logits unless that is under the minimum row count.
    assert rows <= max(1, by_budget)
    assert rows <= max(chunked.MIN_CHUNK_ROWS[kind], math.ceil(n * chunked.CHUNK_SHARE))
    # As few chunks as those caps allow, and of even sizes: the largest is the ceiling share.
    share = math.ceil(n * chunked.CHUNK_SHARE)
    most = max(1, min(n, by_budget, max(chunked.MIN_CHUNK_ROWS[kind], share)))
    chunks = math.ceil(n / rows)
    assert chunks == math.ceil(n / most)
    assert rows == math.ceil(n / chunks)


def test_chunks_split_evenly_under_the_budget_and_the_share():
    cpu = torch.device("cpu")
    # 3000 rows at V=16k fit one 64 MiB chunk's budget; a quarter of the shape is 750 rows,
    # under the 1024-row floor, so three chunks of 1000 (not 1024 + 1024 + 952).
    assert chunk_rows(3000, 16384, cpu, torch.float32) == 1000
    # At V=152k the 64 MiB budget holds 110 rows: 600 rows in 6 chunks of 100, not 5 x 110 + 50.
    assert chunk_rows(600, 151936, cpu, torch.float32) == 100
    assert chunk_rows(645, 16384, cpu, torch.float32) == 645


@pytest.fixture
def logits_watch(monkeypatch):
    """Several chunks at V=61 (at most 7 rows each), and a check on every chunk's logits: when the driver
    asks for the next chunk's, the previous chunk's must already be freed."""
    monkeypatch.setitem(chunked.CHUNK_BYTES, "cpu", 61 * 8 * 7)
    monkeypatch.setitem(chunked.MIN_CHUNK_ROWS, "cpu", 1)
    made = {"calls": 0, "last": None}
    original = chunked._Gemms.logits

    def logits(self, rows):
        previous = made["last"]
        assert previous is None or previous() is None, "two chunks' logits alive at once"
        z = original(self, rows)
        made["last"], made["calls"] = weakref.ref(z), made["calls"] + 1
        return z

    monkeypatch.setattr(chunked._Gemms, "logits", logits)

    def reset():
        made["last"] = None

    made["reset"] = reset
    return made


def _chunks(n=40, vocab=61) -> int:
    count = math.ceil(n / chunk_rows(n, vocab, torch.device("cpu"), torch.float64))
    assert count > 1
    return count


def _case(n=40, hidden=13, vocab=61, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    return h, w, targets, g


def test_fused_loss_frees_each_chunks_logits_before_the_next(logits_watch):
    h, w, targets, g = _case()
    inputs = LossInputs(torch.randn(40, generator=g), torch.arange(40) // 9)
    out = fused_linear_policy_loss(
        torch_rows_module, h, w, targets, inputs, config=LossConfig(policy="ppo")
    )
    out.loss.backward()
    assert logits_watch["calls"] == _chunks()
    assert h.grad is not None and w.grad is not None


def test_chunked_logprobs_backward_frees_each_chunks_logits_before_the_next(logits_watch):
    h, w, targets, _ = _case(seed=1)
    logp, entropy = linear_logprobs(h, w, targets, return_entropy=True, impl="torch")
    logits_watch["reset"]()  # the forward's last chunk is gone; watch the backward's
    (logp.sum() + entropy.sum()).backward()
    assert logits_watch["calls"] == 2 * _chunks()
