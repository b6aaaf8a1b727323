"""linear_logprobs and linear_policy_loss against float64 eager references (docs/concepts.md 4)."""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cod_fast import LossConfig
from cod_fast.ops import (
    LossInputs,
    aggregation_denominator,
    chunked,
    linear_logprobs,
    linear_loss,
    linear_policy_loss,
    torch_rows,
)
from cod_fast.ops.chunked import fused_linear_policy_loss
from cod_fast.ops.dispatch import is_available
from cod_fast.ops.eager import eager_logprobs, eager_policy_loss
from cod_fast.ops.loss_terms import PolicyLossOutput
from tests.reference import assert_within_budget


def make_case(n=37, hidden=123, vocab=507, segments=5, seed=0, dtype=torch.float32):
    """Random trainable rows with peaked logits, targets sampled from the model itself,
    segment ids that are neither contiguous nor starting at 0, and nearby old/ref/teacher."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * (4.0 / hidden**0.5)
    probs = torch.softmax(h.double() @ w.double().T, dim=-1)
    targets = torch.multinomial(probs, 1, generator=g).squeeze(1) if n else torch.zeros(0).long()
    cuts = torch.randperm(max(n - 1, 0), generator=g)[: max(segments - 1, 0)].add(1).sort().values
    seg = torch.zeros(n, dtype=torch.long)
    if n:
        seg[cuts] = 1
    seg = seg.cumsum(0) * 3 + 7
    adv_per_seg = torch.randn(int(seg.max()) + 1 if n else 1, generator=g)
    logp = probs.gather(1, targets[:, None]).log().squeeze(1).float() if n else torch.zeros(0)

    def near(scale):
        return logp + scale * torch.randn(n, generator=g)

    return dict(
        hidden=h.to(dtype),
        weight=w.to(dtype),
        targets=targets,
        advantages=adv_per_seg[seg],
        segment_ids=seg,
        old=near(0.2),
        roll=near(0.3),
        ref=near(0.3),
        teach=near(0.5),
    )


CONFIGS = [
    LossConfig(),
    LossConfig(policy="ppo", ratio_level="sequence", agg="seq-mean-token-mean"),
    LossConfig(policy="rec_one_side", eps_high=0.28, agg="seq-mean-token-sum"),
    LossConfig(
        policy="rec_one_side_is",
        ratio_level="sequence",
        agg="seq-mean-token-sum-norm",
        max_response_len=50,
    ),
    LossConfig(policy="opd", opd_coef=0.5),
    LossConfig(kl="k1", beta=0.1),
    LossConfig(kl="k2", beta=0.2, policy="rec_one_side"),
    LossConfig(kl="k3", beta=0.05, entropy_coef=0.01, agg="seq-mean-token-mean"),
    LossConfig(rollout_correction="tis", tis_cap=1.1),
    LossConfig(rollout_correction="mis_token", mis_low=0.8, mis_high=1.25),
    LossConfig(
        rollout_correction="mis_sequence", mis_low=0.9, mis_high=1.1, ratio_level="sequence"
    ),
    LossConfig(temperature=0.7, entropy_coef=0.02, policy="rec_one_side"),
]


# Triton runs compiled on a GPU (its tensors must live there) and interpreted on the CPU.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(fn, device):
    """`fn` with its tensor arguments moved to `device` and the tensors of its result (a
    PolicyLossOutput, a tensor or a tuple of them) moved back to the CPU; both moves are
    differentiable, so gradients reach the CPU leaves the tests compare."""
    if device == "cpu":
        return fn

    def move(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    def wrapped(*args, **kwargs):
        out = fn(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
        if isinstance(out, PolicyLossOutput):
            metrics = {k: v.cpu() for k, v in out.metrics.items()}
            return PolicyLossOutput(out.loss.cpu(), out.logp.cpu(), metrics)
        return out.cpu() if isinstance(out, torch.Tensor) else tuple(t.cpu() for t in out)

    return wrapped


def loss_fn(impl):
    """The public loss with `impl` (on Triton's device), or for "fused-torch" the fused chunked
    driver run with the torch row kernels (the closed-form head that the C++ and Triton kernels
    implement)."""
    if impl == "fused-torch":
        return _fused_torch
    fn = functools.partial(linear_policy_loss, impl=impl)
    return on_device(fn, TRITON_DEVICE) if impl == "triton" else fn


def _fused_torch(hidden, weight, targets, advantages, segment_ids, *, loss_config, **logps):
    inputs = LossInputs(advantages, segment_ids, **logps)
    return fused_linear_policy_loss(
        torch_rows, hidden, weight, targets, inputs, loss_config=loss_config
    )


def impls_under_test():
    """torch, the fused driver on torch rows, and every compiled implementation present here
    (Triton under its interpreter on a machine without CUDA)."""
    impls = ["torch", "fused-torch"]
    return impls + [name for name in ("cpp", "triton") if is_available(name)]


def impl_params():
    """impls_under_test as parameters; Triton under the interpreter (seconds) is `slow`."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return [
        pytest.param(name, marks=pytest.mark.slow) if name == "triton" and interpreted else name
        for name in impls_under_test()
    ]


def run_both(case, cfg, bypass, dtype=torch.float32, impl="torch", **kw):
    """(fast loss, logp, grads) with `impl`, and the float64 / same-dtype eager ones."""
    logps = dict(
        old=None if bypass else case["old"], roll=case["roll"], ref=case["ref"], teach=case["teach"]
    )
    results = {}
    for name, dt in (("fast", dtype), ("eager", dtype), ("truth", torch.float64)):
        h = case["hidden"].to(dt, copy=True).requires_grad_()
        w = case["weight"].to(dt, copy=True).requires_grad_()
        if name == "fast":
            out = loss_fn(impl)(
                h,
                w,
                case["targets"],
                case["advantages"],
                case["segment_ids"],
                old_logp=logps["old"],
                rollout_logp=logps["roll"],
                ref_logp=logps["ref"],
                teacher_logp=logps["teach"],
                loss_config=cfg,
                **kw,
            )
            loss, logp = out.loss, out.logp
        else:
            loss, logp, magnitude = eager_policy_loss(
                h,
                w,
                case["targets"],
                case["advantages"],
                case["segment_ids"],
                cfg,
                dtype=dt,
                with_magnitude=True,
                **logps,
                **kw,
            )
            results["magnitude"] = magnitude
        loss.backward()
        results[name] = (loss, logp, h.grad, w.grad)
    return results


def check_all(results, slack=1e-5):
    """Each output within budget; the loss's slack is relative to the sum of |per-token terms|
    (its float32 rounding scale when terms cancel), not to the loss itself."""
    for i, what in enumerate(("loss", "logp", "grad_hidden", "grad_weight")):
        scale = results["magnitude"] if what == "loss" else None
        assert_within_budget(
            what,
            results["fast"][i],
            results["eager"][i],
            results["truth"][i],
            slack=slack,
            scale=scale,
        )


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 5 rows at V=507, so the chunk loop of every implementation is exercised."""
    for kind in ("cpu", "cuda"):
        monkeypatch.setitem(chunked.CHUNK_BYTES, kind, 507 * 4 * 5)


@pytest.mark.parametrize("impl", impl_params())
@pytest.mark.parametrize("bypass", [False, True], ids=["old", "bypass"])
@pytest.mark.parametrize(
    "cfg",
    CONFIGS,
    ids=lambda c: f"{c.policy}-{c.ratio_level}-{c.agg}-{c.kl}-{c.rollout_correction}",
)
def test_policy_loss_matches_float64(cfg, bypass, impl, small_chunks):
    """Loss, logp and both gradients of every option stay within the float32 eager error budget
    of the float64 materialised-logits reference (V=507, H=123, 5 segments), for every impl."""
    case = make_case(seed=2 * CONFIGS.index(cfg) + bypass)
    results = run_both(case, cfg, bypass, impl=impl)
    assert results["fast"][0].dtype == torch.float32
    check_all(results)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(
    policy=st.sampled_from(["ppo", "rec_one_side", "rec_one_side_is", "opd"]),
    level=st.sampled_from(["token", "sequence"]),
    agg=st.sampled_from(
        ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
    ),
    kl=st.sampled_from([None, "k1", "k2", "k3"]),
    correction=st.sampled_from(["none", "tis", "mis_token", "mis_sequence"]),
    entropy_coef=st.sampled_from([0.0, 0.03]),
    temperature=st.sampled_from([1.0, 0.6, 1.3]),
    n=st.integers(1, 40),
    segments=st.integers(1, 8),
    seed=st.integers(0, 10_000),
)
def test_policy_loss_random_options(
    policy, level, agg, kl, correction, entropy_coef, temperature, n, segments, seed
):
    """Random combinations of every option on random shapes (1-token segments included)."""
    cfg = LossConfig(
        policy=policy,
        ratio_level=level,
        agg=agg,
        kl=kl,
        beta=0.1 if kl else 0.0,
        rollout_correction=correction,
        entropy_coef=entropy_coef,
        temperature=temperature,
        max_response_len=16,
        mis_low=0.7,
        mis_high=1.4,
    )
    case = make_case(n=n, hidden=19, vocab=61, segments=min(segments, n), seed=seed)
    for impl in impls_under_test():
        check_all(run_both(case, cfg, bypass=False, impl=impl))


@pytest.mark.parametrize("impl", impl_params())
def test_micro_batches_with_global_denominator_sum_to_one_call(impl):
    """Splitting a step into micro-batches of whole segments and passing the step's denominator
    gives the same summed loss and gradients as one call, for every aggregation and impl."""
    case = make_case(n=41, segments=7, seed=3)
    seg = case["segment_ids"]
    for agg in (
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    ):
        cfg = LossConfig(agg=agg, policy="rec_one_side", kl="k3", beta=0.1, max_response_len=9)

        def call(rows, denominator, h, w, cfg=cfg):
            a = {k: case[k][rows] for k in ("targets", "advantages", "segment_ids", "old", "ref")}
            return loss_fn(impl)(
                h[rows],
                w,
                a["targets"],
                a["advantages"],
                a["segment_ids"],
                old_logp=a["old"],
                ref_logp=a["ref"],
                loss_config=cfg,
                denominator=denominator,
            ).loss

        h1 = case["hidden"].clone().requires_grad_()
        w1 = case["weight"].clone().requires_grad_()
        whole = call(slice(None), None, h1, w1)
        whole.backward()
        h2 = case["hidden"].clone().requires_grad_()
        w2 = case["weight"].clone().requires_grad_()
        d = aggregation_denominator(cfg, len(seg), len(seg.unique()))
        parts = [seg < 13, (seg >= 13) & (seg < 19), seg >= 19]
        assert all(p.any() for p in parts)
        total = sum(call(p, d, h2, w2) for p in parts)
        total.backward()
        torch.testing.assert_close(total, whole, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(h2.grad, h1.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(w2.grad, w1.grad, atol=1e-6, rtol=1e-5)


def one_token(logp_old, adv, cfg, ref=None):
    """A 1-token, 2-word vocabulary where logp = log(1/2) exactly (zero hidden state)."""
    h = torch.zeros(1, 1, requires_grad=True)
    w = torch.zeros(2, 1)
    return linear_policy_loss(
        h,
        w,
        torch.tensor([0]),
        torch.tensor([adv]),
        torch.tensor([0]),
        old_logp=torch.tensor([logp_old]),
        ref_logp=None if ref is None else torch.tensor([ref]),
        loss_config=cfg,
    )


@pytest.mark.parametrize("impl", impl_params())
def test_sampler_gap_metrics_match_float64(impl, small_chunks):
    """The sampler/trainer gap metrics (mean and max |logp - roll|, the fraction of ratios
    outside the MIS bounds) equal those of float64 log-probs, for every implementation; the
    bounds are chosen so that no ratio sits on one of them."""
    case = make_case(seed=11)
    cfg = LossConfig(temperature=0.8, mis_low=0.75, mis_high=1.3)
    truth, _ = eager_logprobs(case["hidden"], case["weight"], case["targets"], temperature=0.8)
    ratio = (truth - case["roll"].double()).exp()
    assert ((ratio - 0.75).abs().min() > 1e-3) and ((ratio - 1.3).abs().min() > 1e-3)
    out = loss_fn(impl)(
        case["hidden"],
        case["weight"],
        case["targets"],
        case["advantages"],
        case["segment_ids"],
        rollout_logp=case["roll"],
        loss_config=cfg,
    )
    gap = (truth - case["roll"].double()).abs()
    m = out.metrics
    torch.testing.assert_close(m["sampler_gap_mean"].double(), gap.mean(), atol=1e-5, rtol=0)
    torch.testing.assert_close(m["sampler_gap_max"].double(), gap.max(), atol=1e-5, rtol=0)
    outside = ((ratio < 0.75) | (ratio > 1.3)).double().mean()
    assert 0 < outside < 1 and m["sampler_gap_mis_out_frac"].item() == pytest.approx(outside.item())


def test_worked_examples():
    """Hand-computed values: PPO clipping, REC's one-sided keep rule, k3, and seq-mean-token-mean."""
    half = torch.tensor(0.5).log().item()
    quarter = torch.tensor(0.25).log().item()
    # ratio = 0.5 / 0.25 = 2, A = 2: min(2 * 2, 1.2 * 2) = 2.4, loss -2.4, clipped.
    out = one_token(quarter, 2.0, LossConfig())
    assert out.loss.item() == pytest.approx(-2.4)
    assert out.metrics["clip_frac"].item() == 1.0
    # Same ratio with A = -1: -min(-2, -1.2) = 2 (unclipped branch wins).
    assert one_token(quarter, -1.0, LossConfig()).loss.item() == pytest.approx(2.0)
    # REC: A >= 0 and ratio 2 > 1.28 -> dropped; A < 0 and ratio 2 >= 0.8 -> kept, -A logp.
    rec = LossConfig(policy="rec_one_side", eps_high=0.28)
    assert one_token(quarter, 1.0, rec).loss.item() == 0.0
    assert one_token(quarter, -1.0, rec).loss.item() == pytest.approx(half)
    # k3 with ref = log 1/4, logp = log 1/2: exp(-log 2) + log 2 - 1.
    k3 = LossConfig(kl="k3", beta=1.0)
    got = one_token(half, 0.0, k3, ref=quarter).loss.item()
    assert got == pytest.approx(0.5 + torch.tensor(2.0).log().item() - 1)
    # seq-mean-token-mean: segments of 1 and 3 tokens, L_t = -A_t in bypass on ratio 1.
    cfg = LossConfig(agg="seq-mean-token-mean")
    out = linear_policy_loss(
        torch.zeros(4, 1),
        torch.zeros(2, 1),
        torch.zeros(4).long(),
        torch.tensor([1.0, 2.0, 2.0, 2.0]),
        torch.tensor([0, 1, 1, 1]),
        loss_config=cfg,
    )
    assert out.loss.item() == pytest.approx(-(1.0 + 2.0) / 2)


@pytest.mark.parametrize(
    ("n", "hidden", "vocab", "temperature", "chunk"),
    [(37, 123, 507, 1.0, None), (37, 123, 507, 0.7, 5), (1, 8, 3, 1.3, 1), (64, 16, 1000, 1.0, 7)],
)
def test_linear_logprobs_matches_float64(n, hidden, vocab, temperature, chunk):
    """Chunked logp and entropy, and gradients through both, within the float32 eager budget of
    the float64 reference, whatever the chunking."""
    case = make_case(n=n, hidden=hidden, vocab=vocab, seed=n + vocab)
    g = torch.Generator().manual_seed(1)
    up_logp, up_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    outs = {}
    for name, dt in (("fast", torch.float32), ("eager", torch.float32), ("truth", torch.float64)):
        h = case["hidden"].to(dt, copy=True).requires_grad_()
        w = case["weight"].to(dt, copy=True).requires_grad_()
        if name == "fast":
            logp, ent = linear_logprobs(
                h,
                w,
                case["targets"],
                temperature=temperature,
                return_entropy=True,
                impl="torch",
                chunk_size=chunk,
            )
        else:
            logp, ent = eager_logprobs(h, w, case["targets"], temperature, dt)
        ((logp * up_logp.to(dt)).sum() + (ent * up_ent.to(dt)).sum()).backward()
        outs[name] = (logp, ent, h.grad, w.grad)
    for i, what in enumerate(("logp", "entropy", "grad_hidden", "grad_weight")):
        assert_within_budget(what, outs["fast"][i], outs["eager"][i], outs["truth"][i])


@pytest.mark.skipif(not is_available("triton"), reason="triton not available")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_no_grad_logprobs_use_fused_lse(dtype):
    """Without gradients, impl='triton' takes the fused GEMM + online-LSE kernel; its log-probs
    and entropy stay within the eager budget of float64 in the operands' dtype."""
    case = make_case(n=21, hidden=40, vocab=97, dtype=dtype, seed=5)
    args = (case["hidden"], case["weight"], case["targets"])
    with torch.no_grad():
        logp, ent = on_device(linear_logprobs, TRITON_DEVICE)(
            *args, temperature=0.7, return_entropy=True, impl="triton"
        )
    truth = eager_logprobs(*args, temperature=0.7, dtype=torch.float64)
    eager = eager_logprobs(*args, temperature=0.7, dtype=dtype)
    assert logp.dtype == torch.float32
    assert_within_budget("logp", logp, eager[0], truth[0])
    assert_within_budget("entropy", ent, eager[1], truth[1])


def test_linear_logprobs_bf16_operands_give_float32():
    """bf16 operands: float32 outputs, within the bf16 eager budget of float64."""
    case = make_case(n=16, hidden=32, vocab=64, dtype=torch.bfloat16)
    args = (case["hidden"], case["weight"], case["targets"])
    fast = linear_logprobs(*args)
    assert fast.dtype == torch.float32
    truth, _ = eager_logprobs(*args, dtype=torch.float64)
    eager = torch.log_softmax((case["hidden"] @ case["weight"].T).float(), -1)
    eager = eager.gather(1, case["targets"][:, None]).squeeze(1)
    assert_within_budget("logp", fast, eager, truth)


def test_empty_input():
    """N = 0 trainable tokens: zero loss, zero gradients, no NaN."""
    case = make_case(n=0, segments=0)
    h = case["hidden"].requires_grad_()
    w = case["weight"].requires_grad_()
    out = linear_policy_loss(
        h,
        w,
        case["targets"],
        case["advantages"],
        case["segment_ids"],
        loss_config=LossConfig(agg="seq-mean-token-mean"),
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.isfinite(torch.stack(list(out.metrics.values()))).all()
    assert torch.count_nonzero(w.grad) == 0


def test_errors_name_the_cause():
    """Missing inputs an option needs, bad shapes and out-of-vocabulary targets are clear errors."""
    case = make_case(n=6, hidden=4, vocab=9, segments=2)
    base = (
        case["hidden"],
        case["weight"],
        case["targets"],
        case["advantages"],
        case["segment_ids"],
    )
    with pytest.raises(ValueError, match="ref_logp"):
        linear_policy_loss(*base, loss_config=LossConfig(kl="k1", beta=0.1))
    with pytest.raises(ValueError, match="teacher_logp"):
        linear_policy_loss(*base, loss_config=LossConfig(policy="opd"))
    with pytest.raises(ValueError, match="rollout_logp"):
        linear_policy_loss(
            *base, old_logp=case["old"], loss_config=LossConfig(rollout_correction="tis")
        )
    with pytest.raises(ValueError, match=r"advantages must have shape \[6\]"):
        linear_policy_loss(*base[:3], case["advantages"][:2], base[4], loss_config=LossConfig())
    with pytest.raises(ValueError, match=r"\[0, 9\)"):
        linear_logprobs(case["hidden"], case["weight"], case["targets"] + 9)


def test_dispatch_env_override(monkeypatch):
    """COD_FAST_IMPL picks the implementation; an unusable one is an error naming the fix."""
    case = make_case(n=3, hidden=4, vocab=5, segments=1)
    monkeypatch.setenv("COD_FAST_IMPL", "torch")
    linear_logprobs(case["hidden"], case["weight"], case["targets"])
    monkeypatch.setenv("COD_FAST_IMPL", "nonsense")
    with pytest.raises(ValueError, match="unknown kernel implementation 'nonsense'"):
        linear_logprobs(case["hidden"], case["weight"], case["targets"])


def test_loss_config_is_frozen_in_results():
    """The config passed in is not modified by a call (configs are shared across steps)."""
    cfg = LossConfig(policy="rec_one_side")
    before = dataclasses.asdict(cfg)
    case = make_case(n=5, hidden=4, vocab=7, segments=2)
    linear_policy_loss(
        case["hidden"],
        case["weight"],
        case["targets"],
        case["advantages"],
        case["segment_ids"],
        loss_config=cfg,
    )
    assert dataclasses.asdict(cfg) == before


@pytest.mark.parametrize("impl", impl_params())
def test_nan_input_rows_give_nan_not_numbers(impl, small_chunks):
    """A NaN in one hidden row (documented behaviour): that row's log-prob is NaN, the other
    rows are untouched, and the loss is NaN, so a NaN is never turned into a plausible number."""
    case = make_case(n=12, segments=3, seed=11)
    hidden = case["hidden"].clone()
    hidden[4, 7] = float("nan")
    out = loss_fn(impl)(
        hidden,
        case["weight"],
        case["targets"],
        case["advantages"],
        case["segment_ids"],
        rollout_logp=case["roll"],
        loss_config=LossConfig(),
    )
    clean = loss_fn(impl)(
        case["hidden"],
        case["weight"],
        case["targets"],
        case["advantages"],
        case["segment_ids"],
        rollout_logp=case["roll"],
        loss_config=LossConfig(),
    )
    assert torch.isnan(out.logp[4])
    rest = torch.arange(12) != 4
    torch.testing.assert_close(out.logp[rest], clean.logp[rest])
    assert torch.isnan(out.loss)


@pytest.mark.slow
def test_opd_steps_on_own_samples_move_the_student_to_its_teacher():
    """SGD on the `opd` loss over tokens the student samples itself lowers the exact reverse KL
    KL(student || teacher) on every row: A = teach - logp points the student at the teacher
    (a flipped sign or a missing detach would raise or stall it). Fused and torch paths alike."""
    g = torch.Generator().manual_seed(3)
    n, hidden, vocab = 48, 8, 13
    h = torch.randn(n, hidden, generator=g)
    teacher = torch.randn(vocab, hidden, generator=g)
    segments = torch.arange(n) // 5

    def reverse_kl(w):
        student = torch.log_softmax(h.double() @ w.double().T, dim=-1)
        target = torch.log_softmax(h.double() @ teacher.double().T, dim=-1)
        return (student.exp() * (student - target)).sum(-1)

    for impl in ("torch", None):
        weight = torch.randn(vocab, hidden, generator=g).requires_grad_()
        before = reverse_kl(weight.detach())
        optimizer = torch.optim.SGD([weight], lr=0.5)
        for _ in range(300):
            with torch.no_grad():
                targets = torch.multinomial(torch.softmax(h @ weight.T, -1), 4, True, generator=g)
            rows = torch.arange(n).repeat_interleave(4)
            targets = targets.flatten()
            teach = torch.log_softmax(h @ teacher.T, -1)[rows, targets]
            out = linear_policy_loss(
                h[rows], weight, targets, torch.zeros(rows.numel()), segments[rows],
                teacher_logp=teach, loss_config=LossConfig(policy="opd"), impl=impl,
            )  # fmt: skip
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
        after = reverse_kl(weight.detach())
        assert after.mean() < 0.2 * before.mean(), (impl, before.mean(), after.mean())
        assert (after < before).float().mean() > 0.9, impl


@pytest.mark.parametrize("impl", [name for name in impl_params() if name != "fused-torch"])
@pytest.mark.parametrize("share", [linear_loss.DEDUPE_SHARE, 0.0], ids=["scored-once", "gathered"])
@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(),
        LossConfig(
            policy="rec_one_side", kl="k3", beta=0.1, entropy_coef=0.01,
            agg="seq-mean-token-sum", max_response_len=20,
        ),
        LossConfig(ratio_level="sequence", agg="seq-mean-token-mean", temperature=0.8),
    ],
    ids=["ppo", "rec-k3-entropy", "sequence"],
)  # fmt: skip
@pytest.mark.parametrize("per_token", [False, True], ids=["one-weight", "weight-per-token"])
def test_rows_given_match_the_gathered_rows(cfg, share, impl, per_token, monkeypatch, small_chunks):
    """`rows` (a shared-prefix tree's trainable rows): 48 tokens read 12 of 19 hidden rows, most
    pairs repeated (members with equal responses), some rows with two targets (a branch point).
    Scored once per distinct (row, target) pair, or gathered per token when the pairs are too
    many (share 0): loss, log-probs and the gradients of all rows and of W within the float32
    eager budget of float64 over the gathered rows. With `per_token`, every token has its own
    entropy weight, so members that share a pair weigh its entropy differently."""
    monkeypatch.setattr(linear_loss, "DEDUPE_SHARE", share)
    g = torch.Generator().manual_seed(4)
    n_rows, n, width, vocab = 19, 48, 40, 97
    hidden = torch.randn(n_rows, width, generator=g)
    weight = torch.randn(vocab, width, generator=g) * (4.0 / width**0.5)
    rows = torch.randint(0, 12, (n,), generator=g)
    targets = torch.randint(0, vocab, (n_rows,), generator=g)[rows]
    targets[::7] = torch.randint(0, vocab, (len(targets[::7]),), generator=g)
    assert torch.unique(rows * vocab + targets).numel() <= n / 2  # most pairs repeated
    seg = torch.arange(n) // 8 * 3 + 1
    adv = torch.randn(int(seg.max()) + 1, generator=g)[seg]
    with torch.no_grad():
        base = eager_logprobs(hidden[rows], weight, targets, cfg.temperature, torch.float64)[0]
    old, roll, ref = (base.float() + s * torch.randn(n, generator=g) for s in (0.2, 0.3, 0.3))
    weights = {"entropy_coef": 0.3 * torch.rand(n, generator=g)} if per_token else {}
    results = {}
    for name, dt in (("fast", torch.float32), ("eager", torch.float32), ("truth", torch.float64)):
        h = hidden.to(dt, copy=True).requires_grad_()
        w = weight.to(dt, copy=True).requires_grad_()
        if name == "fast":
            fn = loss_fn(impl)
            out = fn(h, w, targets, adv, seg, old_logp=old, rollout_logp=roll, ref_logp=ref,
                     loss_config=cfg, rows=rows, **weights)  # fmt: skip
            loss, logp = out.loss, out.logp
        else:
            loss, logp, magnitude = eager_policy_loss(
                h[rows], w, targets, adv, seg, cfg, old=old, roll=roll, ref=ref, dtype=dt,
                with_magnitude=True, **weights,
            )  # fmt: skip
            results["magnitude"] = magnitude
        loss.backward()
        results[name] = (loss, logp, h.grad, w.grad)
    check_all(results)
