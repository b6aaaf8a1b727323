"""How the chunked driver sizes its chunks, that it holds one chunk's logits at a time, and that
the weight gradient is one buffer the chunks write in place."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

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
    by_budget = chunked.chunk_budget(kind) // row_bytes
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


def test_cuda_chunks_are_thousands_of_rows():
    """On CUDA a chunk holds up to 2 GiB of float32 logits and at least 4096 rows below that: at
    N=16384, V=151936 five chunks of 3277 rows (2 GiB holds 3533), and 8192 rows at V=32000
    (a quarter of the shape is under the floor) in two chunks of 4096."""
    cuda = torch.device("cuda")
    assert chunk_rows(16384, 151936, cuda, torch.float32) == 3277
    assert chunk_rows(8192, 32000, cuda, torch.float32) == 4096


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_chunk_mib_sets_the_budget(kind, monkeypatch):
    """COD_FAST_CHUNK_MIB replaces the budget of the device kind in use: 3 MiB holds 5 rows of a
    151936-token vocabulary, so 10000 rows go in 2000 chunks of 5, on the CPU as on CUDA."""
    monkeypatch.setenv(chunked.CHUNK_MIB_VAR, "3")
    assert chunked.chunk_budget(kind) == 3 * 2**20
    assert chunk_rows(10000, 151936, torch.device(kind), torch.float32) == 5


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "2GiB", "abc"])
def test_chunk_mib_rejects_bad_values(value, monkeypatch):
    """A COD_FAST_CHUNK_MIB that is not a whole number of MiB > 0 raises, naming the variable
    and what it takes, whatever the shape (also for an empty batch)."""
    monkeypatch.setenv(chunked.CHUNK_MIB_VAR, value)
    for n in (0, 100):
        with pytest.raises(ValueError, match="COD_FAST_CHUNK_MIB must be a whole number of MiB"):
            chunk_rows(n, 1000, torch.device("cpu"), torch.float32)


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
        torch_rows_module, h, w, targets, inputs, loss_config=LossConfig(policy="ppo")
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


def _loss_and_grads(n=70, hidden=13, vocab=4099, seed=3):
    """Fused loss, logp and both gradients, and log-prob/entropy gradients, in float64."""
    h, w, targets, g = _case(n=n, hidden=hidden, vocab=vocab, seed=seed)
    inputs = LossInputs(torch.randn(n, generator=g), torch.arange(n) // 9)
    config = LossConfig(policy="ppo", kl="k3", entropy_coef=0.01)
    out = fused_linear_policy_loss(torch_rows_module, h, w, targets, inputs, loss_config=config)
    out.loss.backward()
    fused = (out.loss, out.logp, h.grad, w.grad)
    h.grad = w.grad = None
    logp, entropy = linear_logprobs(h, w, targets, return_entropy=True, impl="torch")
    (logp.sum() + (entropy * torch.randn(n, generator=g, dtype=torch.float64)).sum()).backward()
    return (*fused, logp, entropy, h.grad, w.grad)


def test_chunk_mib_changes_only_the_rounding(monkeypatch):
    """The loss, log-probs and both gradients of the fused loss and of linear_logprobs agree to
    float64 rounding whether the rows run as one chunk or as three under COD_FAST_CHUNK_MIB=1
    (31 rows of V=4099 float64 logits a chunk), the weight gradient summed over chunks in place."""
    one = _loss_and_grads()
    monkeypatch.setenv(chunked.CHUNK_MIB_VAR, "1")
    assert math.ceil(70 / chunk_rows(70, 4099, torch.device("cpu"), torch.float64)) == 3
    three = _loss_and_grads()
    for a, b in zip(one, three, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


class _WeightSizedTensors(TorchDispatchMode):
    """Names the ops that make a new tensor of the weight's shape (not a view or an out= write
    of one of their inputs)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.made = tuple(shape), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and tuple(t.shape) == self.shape
                and t.untyped_storage().data_ptr() not in given
            ):
                self.made.append(str(func))
        return out


def test_weight_gradient_is_one_buffer_written_in_place(logits_watch):
    """Over several chunks, the fused loss and the log-prob backward each make one V x H tensor,
    the weight gradient's buffer (uninitialised: the first chunk writes it, later chunks add
    into it); no per-chunk product of that size is made."""
    h, w, targets, g = _case(seed=2)
    inputs = LossInputs(torch.randn(40, generator=g), torch.arange(40) // 9)
    with _WeightSizedTensors(w.shape) as seen:
        out = fused_linear_policy_loss(
            torch_rows_module, h, w, targets, inputs, loss_config=LossConfig(policy="ppo")
        )
        out.loss.backward()
    assert logits_watch["calls"] == _chunks()
    assert seen.made == ["aten.empty.memory_format"], seen.made
    w.grad = None
    logp, entropy = linear_logprobs(h, w, targets, return_entropy=True, impl="torch")
    with _WeightSizedTensors(w.shape) as seen:
        (logp.sum() + entropy.sum()).backward()
    assert seen.made == ["aten.empty.memory_format"], seen.made


def test_no_rows_give_a_zero_weight_gradient(monkeypatch):
    """With no trainable rows no chunk runs, and the weight gradient is zeros, not the content
    of an uninitialised buffer (torch.empty is poisoned with NaN here)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    h, w, targets, _ = _case(n=0)
    inputs = LossInputs(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    out = fused_linear_policy_loss(
        torch_rows_module, h, w, targets, inputs, loss_config=LossConfig(policy="ppo")
    )
    out.loss.backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    w.grad = None
    logp, entropy = linear_logprobs(h, w, targets, return_entropy=True, impl="torch")
    (logp.sum() + entropy.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.gpu
def test_triton_bf16_dz_in_place_gives_the_cast_dz_gradients(monkeypatch):
    """On CUDA with bf16 operands the Triton row kernels store dz as bf16 over the chunk's
    logits; the gradients equal those of the float32 dz cast to bf16 by the driver (the same
    bf16 dz either way), to bf16 rounding of the products."""
    triton_rows = pytest.importorskip("cod_fast.kernels.rows")
    h, w, targets, g = _case(n=300, hidden=64, vocab=1001, seed=4)
    h, w = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in (h, w))
    inputs = LossInputs(torch.randn(300, generator=g).cuda(), (torch.arange(300) // 37).cuda())
    monkeypatch.setenv(chunked.CHUNK_MIB_VAR, "1")  # 261 rows of V=1001 a chunk: two chunks

    def grads():
        out = fused_linear_policy_loss(
            triton_rows, h, w, targets.cuda(), inputs, loss_config=LossConfig(policy="ppo")
        )
        out.loss.backward()
        got = (h.grad.float(), w.grad.float())
        h.grad = w.grad = None
        return got

    narrow = grads()
    monkeypatch.delattr(triton_rows, "narrow_dz_view")
    cast = grads()
    for a, b in zip(narrow, cast, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)
