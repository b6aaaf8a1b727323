"""The fused loss, its backward and the training step never wait for the device.

On a GPU a host sync (reading a value back: `int(t)`, `unique`, a boolean mask) stalls the CPU
until every queued kernel has run, so the next launches cannot overlap them. The loss takes what
the caller knows instead (segment count, target range, repeated pairs; the packer finds them on
the host), and `cod_fast.bench.dispatch_count.DispatchCounter` sees every dispatched op, so these
counts on the CPU are those of the same code on CUDA. The step's one intended wait, reading its
totals with `.tolist()`, dispatches nothing on a CPU tensor; the optimizer's own step-count reads
are of host tensors on CUDA, so the step is counted without them.
"""

from __future__ import annotations

import random

import pytest
import torch

from cod_fast import LossConfig
from cod_fast.bench.dispatch_count import DispatchCounter
from cod_fast.data.packing import build_microbatch
from cod_fast.model.policy import Policy
from cod_fast.ops import linear_policy_loss
from cod_fast.ops.linear_loss import TokenPairs
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
    """With num_segments and check_targets=False: no host sync in forward + backward, and the
    same loss and gradients as the call that finds those things out itself (which does sync)."""
    cfg = CONFIGS[name]
    args, segments, num_segments, kwargs = loss_inputs(seed=len(name))
    known = dict(num_segments=num_segments, check_targets=False)
    count, loss, grad_h, grad_w = run(impl, cfg, args, segments, kwargs, **known)
    assert count.syncs == []
    plain, loss0, grad_h0, grad_w0 = run(impl, cfg, args, segments, kwargs)
    assert "aten._unique2" in plain.syncs and "aten._local_scalar_dense" in plain.syncs
    torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_h, grad_h0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_w, grad_w0, rtol=1e-6, atol=1e-7)


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
