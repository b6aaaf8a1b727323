"""The fused loss, its backward and the training step never wait for the device.

On a GPU a host sync (reading a value back: `int(t)`, `unique`, a boolean mask) stalls the CPU
until every queued kernel has run, so the next launches cannot overlap them. The loss takes what
the caller knows instead (segment count, target range, repeated pairs; the packer finds them on
the host), and `cod_fast.bench.dispatch_count.DispatchCounter` sees every dispatched op, so these
counts on the CPU are those of the same code on CUDA. The step's one intended wait, reading its
totals with `.tolist()`, dispatches nothing on a CPU tensor; the optimizer's own step-count reads
are of host tensors on CUDA, so the step is counted without them. Since a CPU tensor's `.tolist()`
escapes the count, packed attention is also run on the meta device, whose tensors cannot be read
back at all. The targets' range check is a device assert (`aten._assert_async`): a kernel on CUDA,
no wait.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from cod_fast import LossConfig
from cod_fast.bench.dispatch_count import DispatchCounter
from cod_fast.data.packing import build_microbatch
from cod_fast.data.sequence_split import with_sequence_shard
from cod_fast.distributed.context import init_distributed, shutdown
from cod_fast.model.attention import packed_attention_kwargs
from cod_fast.model.loading import packed_hidden_states
from cod_fast.model.policy import Policy
from cod_fast.ops import linear_policy_loss
from cod_fast.ops.dispatch import is_available
from cod_fast.ops.linear_loss import TokenPairs
from cod_fast.ops.sequence_parallel import SequenceGroup
from cod_fast.train.step import train_step
from tests.data.test_prefix_sharing import _group_sequences, _model

CONFIGS = {
    "ppo-tis-k3": LossConfig(policy="ppo", rollout_correction="tis", kl="k3", beta=0.1),
    "rec-is-sequence-mis": LossConfig(
        policy="rec_one_side_is",
        ratio_level="sequence",
        rollout_correction="mis_sequence",
        agg="seq-mean-token-mean",
    ),
    "opd-entropy": LossConfig(policy="opd", entropy_coef=0.01),
}

INTERPRETED_TRITON = os.environ.get("TRITON_INTERPRET") == "1" and is_available("triton")
TARGET_CHECK_IMPLS = [
    "torch",
    "cpp",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not INTERPRETED_TRITON, reason="counted on the CPU: needs TRITON_INTERPRET=1"
        ),
    ),
]


def loss_inputs(seed: int, n: int = 41, h: int = 24, v: int = 67):
    """Random float32 operands; segments compact 0..S-1 in order, of uneven lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g).tolist()
    segments = torch.repeat_interleave(torch.arange(n), torch.tensor(lengths))[:n]
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (0.3 * torch.randn(v, h, generator=g)).requires_grad_()
    logps = {k: -torch.rand(n, generator=g) for k in ("old", "roll", "ref", "teach")}
    args = (hidden, weight, torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g))
    kwargs = dict(
        old_logp=logps["old"],
        rollout_logp=logps["roll"],
        ref_logp=logps["ref"],
        teacher_logp=logps["teach"],
    )
    return args, segments, int(segments.max()) + 1, kwargs


def run(impl, cfg, args, segments, kwargs, **known):
    hidden, weight = args[0], args[1]
    hidden.grad = weight.grad = None
    with DispatchCounter() as count:
        out = linear_policy_loss(*args, segments, loss_config=cfg, impl=impl, **kwargs, **known)
        out.loss.backward()
    return count, out.loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("impl", ["torch", "cpp"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_loss_and_its_backward_never_wait_given_what_the_caller_knows(impl, name):
    """With num_segments (and the default target check): no host sync in forward + backward,
    and the same loss and gradients as the call that counts the segments itself (which syncs)."""
    cfg = CONFIGS[name]
    args, segments, num_segments, kwargs = loss_inputs(seed=len(name))
    count, loss, grad_h, grad_w = run(impl, cfg, args, segments, kwargs, num_segments=num_segments)
    assert count.syncs == []
    plain, loss0, grad_h0, grad_w0 = run(impl, cfg, args, segments, kwargs)
    assert plain.syncs == ["aten._unique2"]
    torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_h, grad_h0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_w, grad_w0, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", TARGET_CHECK_IMPLS)
def test_the_default_target_check_waits_for_nothing(impl):
    """The default check that targets lie in [0, V) reads nothing back in forward + backward
    (on a CPU `_local_scalar_dense` is dispatched even where it does not wait, so none is seen
    here means none on CUDA) and is still made, as a device assert (`aten._assert_async`, a
    kernel on CUDA, no wait); the loss and gradients are those of check_targets=False."""
    cfg = CONFIGS["ppo-tis-k3"]
    args, segments, num_segments, kwargs = loss_inputs(seed=11, n=19, h=16, v=37)
    checked = run(impl, cfg, args, segments, kwargs, num_segments=num_segments)
    unchecked = run(
        impl, cfg, args, segments, kwargs, num_segments=num_segments, check_targets=False
    )
    assert checked[0].syncs == [] and checked[0].ops["aten._local_scalar_dense"] == 0
    assert checked[0].ops["aten._assert_async"] == 1 and unchecked[0].ops["aten._assert_async"] == 0
    for a, b in zip(checked[1:], unchecked[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("impl", TARGET_CHECK_IMPLS)
@pytest.mark.parametrize("bad", [-1, 37])
def test_a_target_outside_the_vocabulary_raises_at_once_on_the_cpu(impl, bad):
    """On the CPU the device assert fails in the call itself: a ValueError naming the range and
    the ids found, before any kernel runs."""
    args, segments, num_segments, kwargs = loss_inputs(seed=12, n=19, h=16, v=37)
    targets = args[2].clone()
    targets[5] = bad
    low, high = min(bad, int(targets.min())), max(bad, int(targets.max()))
    with pytest.raises(ValueError, match=rf"in \[0, 37\) .*; got min {low}, max {high}$"):
        linear_policy_loss(
            args[0], args[1], targets, args[3], segments, loss_config=CONFIGS["ppo-tis-k3"],
            impl=impl, num_segments=num_segments, **kwargs,
        )  # fmt: skip


def _decoder_on_meta(seed: int, share: bool, **lengths):
    """Forward + backward of the tiny decoder with per-sequence attention over a packed
    micro-batch, all on the meta device: tensors with no data, so any read of one back to the
    host raises, `.tolist()` too (which on a CPU tensor dispatches nothing a counter could see),
    as a read of a GPU's tensor would wait. Returns the dispatch count."""
    mb = build_microbatch(_group_sequences(random.Random(seed)), share_prefix=share)
    assert list(mb.seqlens) == mb.cu_seqlens.diff().tolist()
    if share:
        assert list(mb.seqlens_k) == mb.cu_seqlens_k.diff().tolist()
    mb = mb.to("meta")
    model = _model(seed).float().to("meta")
    attention = packed_attention_kwargs(
        mb.cu_seqlens, mb.max_seqlen, mb.kv_index, mb.cu_seqlens_k, mb.max_seqlen_k,
        **{k: getattr(mb, k) for k in lengths if lengths[k]},
    )  # fmt: skip
    with DispatchCounter() as count:
        out = model.get_decoder()(
            input_ids=mb.input_ids[None],
            position_ids=mb.position_ids[None],
            use_cache=False,
            **attention,
        )
        out.last_hidden_state.sum().backward()
    assert out.last_hidden_state.shape == (1, mb.num_tokens, model.config.hidden_size)
    return count


@pytest.mark.parametrize("share", [False, True], ids=["flat", "shared-prefix"])
def test_packed_attention_never_reads_its_offsets_back(share):
    """Given the sequence lengths the packer kept on the host, every layer's per-sequence
    attention cuts the row by them: cu_seqlens on the device is never read (no host sync, on
    meta tensors that cannot be read at all). Without them it reads the offsets, and fails so."""
    count = _decoder_on_meta(7, share, seqlens=True, seqlens_k=share)
    assert count.syncs == []
    with pytest.raises(NotImplementedError, match="meta tensor"):
        _decoder_on_meta(7, share)


def test_the_policy_decoder_never_reads_the_offsets_back():
    """packed_hidden_states (the trainer's forward) on a micro-batch moved to the device runs
    without reading its cu_seqlens back (meta tensors: any read raises)."""
    mb = build_microbatch(_group_sequences(random.Random(8)), share_prefix=True).to("meta")
    packed_hidden_states(_model(8).float().to("meta"), mb).sum().backward()


def test_pairs_found_on_the_host_equal_those_found_on_the_device():
    rng = random.Random(5)
    rows = [rng.randrange(9) for _ in range(60)]
    targets = [rows[i] % 4 if i % 3 else rng.randrange(30) for i in range(60)]
    host = TokenPairs.from_lists(rows, targets)
    device = TokenPairs.from_tensors(torch.tensor(rows), torch.tensor(targets), vocab=30)
    for field in ("rows", "targets", "repeat"):
        assert torch.equal(getattr(host, field), getattr(device, field)), field
    assert torch.equal(host.rows[host.repeat], torch.tensor(rows))
    assert torch.equal(host.targets[host.repeat], torch.tensor(targets))


@pytest.mark.parametrize("share", [False, True], ids=["flat", "shared-prefix"])
def test_a_training_step_never_waits_for_the_device(share):
    """Policy forward (decoder, fused loss with repeated pairs scored once) + backward over two
    micro-batches, clipping and the metric sums: no host sync before the totals are read."""
    sequences = _group_sequences(random.Random(3))
    mb = build_microbatch(sequences, share_prefix=share)
    assert (mb.pairs is not None) == share  # the tree repeats some (row, target) pairs
    policy = Policy(_model(3).float(), impl="cpp")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    cfg = LossConfig(policy="ppo", kl="k3", beta=0.05)
    mb.ref_logp = -torch.rand(mb.num_trainable)
    train_step(policy, optimizer, [mb, mb], denominator=30.0, loss_config=cfg, grad_clip=1.0)
    optimizer.step = lambda *a, **k: None  # its step counts are host tensors on CUDA
    with DispatchCounter() as count:
        result = train_step(
            policy, optimizer, [mb, mb], denominator=30.0, loss_config=cfg, grad_clip=1.0
        )
    assert count.syncs == []
    assert result.trainable_tokens == 2 * mb.num_trainable and result.metrics["kl"] >= 0


@pytest.mark.parametrize("share", [False, True], ids=["flat", "shared-prefix"])
def test_a_sequence_parallel_step_never_waits_for_the_device(share):
    """The same under sequence parallelism (a group of one rank, the collectives of any size
    alike): with each micro-batch's shard cut on the host, the all-to-alls, the scoring of the
    rank's tokens (the fused driver, or log-probs for repeated pairs), the gathers and the loss
    read nothing back."""
    mb = build_microbatch(_group_sequences(random.Random(4)), share_prefix=share)
    mb = with_sequence_shard(mb, 0, 1)
    ctx = init_distributed("cpu", one_rank_mesh=True)
    try:
        policy = Policy(_model(4).float(), impl="cpp", sequence_group=SequenceGroup(None, 0, 1))
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        cfg = CONFIGS["rec-is-sequence-mis"]
        train_step(policy, optimizer, [mb, mb], denominator=30.0, loss_config=cfg, grad_clip=1.0)
        optimizer.step = lambda *a, **k: None  # its step counts are host tensors on CUDA
        with DispatchCounter() as count:
            result = train_step(
                policy, optimizer, [mb, mb], denominator=30.0, loss_config=cfg, grad_clip=1.0
            )
        layers = _model(4).config.num_hidden_layers  # q/k/v and the output, both ways
        assert count.ops["aten.alltoall_base_"] == 2 * 2 * 2 * layers
        # Flat: the fused driver over the rank's tokens, its pre-pass log-probs gathered for
        # the sequence-level ratio, then the values; shared (repeated pairs): the log-probs.
        assert count.ops["aten.allgather_"] == (2 if share else 4)
    finally:
        shutdown(ctx)
    assert count.syncs == []
    assert result.trainable_tokens == 2 * mb.num_trainable


def test_a_microbatch_moves_in_one_copy_per_dtype():
    """9+ tensors, 3 dtypes: 3 host-to-device copies (counted on the meta device), and the
    split views hold each tensor's own values (checked with the copy kept on the host)."""
    from cod_fast.data.packing import _copy_together

    mb = build_microbatch(_group_sequences(random.Random(4)), share_prefix=True)
    tensors = {k: v for k, v in vars(mb).items() if isinstance(v, torch.Tensor)}
    with DispatchCounter() as count:
        moved = mb.to("meta")
    assert count.h2d == len({t.dtype for t in tensors.values()}) == 3 < len(tensors)
    for k, t in tensors.items():
        assert getattr(moved, k).device.type == "meta" and getattr(moved, k).shape == t.shape
    int64 = {k: t for k, t in tensors.items() if t.dtype == torch.int64}
    for k, part in _copy_together(int64, torch.device("cpu"), False).items():
        assert torch.equal(part, int64[k]), k


def test_a_target_outside_the_vocabulary_is_refused_from_the_packed_maximum():
    mb = build_microbatch(_group_sequences(random.Random(6)))
    model = _model(6).float()
    mb.max_target = model.config.vocab_size
    with pytest.raises(ValueError, match="outside the LM head's vocabulary"):
        Policy(model, impl="cpp")(mb, loss_config=LossConfig())
