"""A per-token entropy weight (update-episode tokens' own, LossConfig.update_entropy_coef)
through every implementation of the policy loss (docs/concepts.md section 4)."""

from __future__ import annotations

import random

import pytest
import torch

from cod_fast import LossConfig
from cod_fast.bench.dispatch_count import DispatchCounter
from cod_fast.config import ConfigError
from cod_fast.data.packing import build_microbatch, with_entropy_coef
from cod_fast.model.policy import Policy
from cod_fast.ops import linear_policy_loss
from cod_fast.train.step import train_step
from tests.data.test_prefix_sharing import _group_sequences, _model
from tests.ops.test_policy_loss import (  # noqa: F401 (small_chunks is a fixture)
    check_all,
    impl_params,
    loss_fn,
    make_case,
    run_both,
    small_chunks,
)

CONFIGS = [
    LossConfig(),  # no scalar bonus at all: only the per-token weights
    LossConfig(
        policy="rec_one_side", ratio_level="sequence", agg="seq-mean-token-mean",
        entropy_coef=0.01, temperature=0.7,
    ),
    LossConfig(policy="opd", kl="k3", beta=0.1, agg="seq-mean-token-sum", max_response_len=9),
]  # fmt: skip


def update_case(seed: int, scalar: float = 0.01, update: float = 0.2):
    """`make_case` (V=507, H=123) whose last token is a segment of its own, some segments
    marked as update episodes, and the per-token entropy weights: `update` on their tokens,
    `scalar` elsewhere. Returns (case, weights, update mask)."""
    case = make_case(seed=seed)
    case["segment_ids"][-1] = 1000  # a 1-token segment
    ids = case["segment_ids"].unique()
    marked = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))[::2]]
    is_update = torch.isin(case["segment_ids"], marked)
    assert is_update.any() and not is_update.all()
    return case, torch.where(is_update, update, scalar), is_update


def outputs(impl, case, cfg, **kw):
    """(loss, logp, grad of hidden, grad of weight) of `impl` in float32."""
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    out = loss_fn(impl)(
        h,
        w,
        case["targets"],
        case["advantages"],
        case["segment_ids"],
        old_logp=case["old"],
        rollout_logp=case["roll"],
        ref_logp=case["ref"],
        teacher_logp=case["teach"],
        loss_config=cfg,
        **kw,
    )
    out.loss.backward()
    return out.loss.detach(), out.logp, h.grad, w.grad


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("impl", impl_params())
@pytest.mark.parametrize("cfg", CONFIGS, ids=["ppo", "rec-sequence", "opd-k3"])
def test_per_token_entropy_weights_match_float64(cfg, impl):
    """Loss, logp and both gradients with per-token entropy weights (a 1-token segment among
    them) stay within the float32 eager budget of the float64 reference, for every impl."""
    case, weights, _ = update_case(seed=CONFIGS.index(cfg), scalar=cfg.entropy_coef)
    check_all(run_both(case, cfg, bypass=False, impl=impl, entropy_coef=weights))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("impl", impl_params())
def test_equal_weights_are_the_scalar_path(impl):
    """Weights equal to c on every token give exactly (bit for bit) the loss, log-probs and
    gradients of entropy_coef = c."""
    case = make_case(seed=5)
    c = 0.03
    cfg = LossConfig(policy="ppo", kl="k2", beta=0.1, entropy_coef=c)
    vector = outputs(impl, case, cfg, entropy_coef=torch.full_like(case["advantages"], c))
    scalar = outputs(impl, case, cfg)
    for name, a, b in zip(
        ("loss", "logp", "grad_hidden", "grad_weight"), vector, scalar, strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("impl", impl_params())
def test_weights_on_update_tokens_move_only_their_gradients(impl):
    """Weights of 0 except on update tokens (entropy_coef 0): each solve token's hidden
    gradient is exactly that of the call without a bonus, each update token's moves, and the
    loss drops by the weighted entropies of the update tokens alone."""
    case, weights, is_update = update_case(seed=9, scalar=0.0, update=0.5)
    cfg = LossConfig(agg="seq-mean-token-sum")
    with_bonus = outputs(impl, case, cfg, entropy_coef=weights)
    without = outputs(impl, case, cfg)
    assert torch.equal(with_bonus[2][~is_update], without[2][~is_update])
    moved = (with_bonus[2][is_update] - without[2][is_update]).abs().amax(1)
    assert (moved > 0).all(), moved
    assert with_bonus[0] < without[0]


def test_no_host_sync_with_per_token_weights():
    """Per-token weights keep the loss and its backward free of host syncs (given the segment
    count and checked targets), on the torch and the C++ implementations."""
    case, weights, _ = update_case(seed=3)
    num_segments = int(case["segment_ids"].max()) + 1
    for impl in ("torch", "cpp"):
        h = case["hidden"].clone().requires_grad_()
        with DispatchCounter() as count:
            out = linear_policy_loss(
                h, case["weight"], case["targets"], case["advantages"], case["segment_ids"],
                rollout_logp=case["roll"], loss_config=LossConfig(), impl=impl,
                entropy_coef=weights, num_segments=num_segments, check_targets=False,
            )  # fmt: skip
            out.loss.backward()
        assert count.syncs == [], (impl, count.syncs)


def test_a_step_with_update_entropy_weights_never_waits_for_the_device():
    """Per-token weights built on the host and moved with the micro-batch: no host sync in a
    training step, and no extra host-to-device copy (they join the float32 tensors')."""
    mb = build_microbatch(_group_sequences(random.Random(3)), share_prefix=True)
    cfg = LossConfig(policy="rec_one_side", entropy_coef=0.01, update_entropy_coef=0.1)
    with DispatchCounter() as count:
        with_entropy_coef(mb, cfg).to("meta")
    assert count.h2d == 3  # int64, int32, float32
    policy = Policy(_model(3).float(), impl="cpp")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    train_step(policy, optimizer, [mb, mb], denominator=30.0, loss_config=cfg, grad_clip=1.0)
    optimizer.step = lambda *a, **k: None  # its step counts are host tensors on CUDA
    with DispatchCounter() as count:
        train_step(policy, optimizer, [mb, mb], denominator=30.0, loss_config=cfg, grad_clip=1.0)
    assert count.syncs == []


def test_weights_of_the_wrong_shape_are_refused():
    """One weight per token, else an error naming `entropy_coef` and the shape expected."""
    case, weights, _ = update_case(seed=1)
    with pytest.raises(ValueError, match=r"entropy_coef must have shape \[37\]"):
        linear_policy_loss(
            case["hidden"], case["weight"], case["targets"], case["advantages"],
            case["segment_ids"], loss_config=LossConfig(), entropy_coef=weights[:-1],
        )  # fmt: skip


def test_update_entropy_coef_config():
    """update_entropy_coef defaults to null (entropy_coef everywhere), takes any number >= 0,
    and a negative one is refused naming the field."""
    assert LossConfig().update_entropy_coef is None
    assert LossConfig(update_entropy_coef=0.0).update_entropy_coef == 0.0
    with pytest.raises(ConfigError, match="update_entropy_coef"):
        LossConfig(update_entropy_coef=-0.1)
