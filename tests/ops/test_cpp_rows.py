"""The C++ row kernels (cod_fast.ops.cpp_rows) against float64 truths written here.

Every value is held to the error budget of tests.reference.assert_within_budget: no further from
the float64 truth than twice what eager float32 torch is, plus 1e-6 of the truth's scale. The
per-token loss head is re-derived below as plain Python on numpy scalars, so the same code gives
the float64 truth and the float32 eager budget.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from cod_fast.ops.cpp_rows import CPP_ERROR, HAS_CPP
from tests.reference import assert_within_budget

if not HAS_CPP:
    if os.environ.get("COD_FAST_REQUIRE_CPP") == "1":
        raise RuntimeError(f"COD_FAST_REQUIRE_CPP=1 but cod_fast._cpp is missing: {CPP_ERROR}")
    pytest.skip(f"cod_fast._cpp not built: {CPP_ERROR}", allow_module_level=True)

from cod_fast import _cpp
from cod_fast.ops.cpp_rows import rows_backward_, rows_forward, rows_fused_

SHAPES = [(c, v) for c in (1, 7, 33) for v in (3, 507, 1000)]
POLICIES = ["ppo", "rec_one_side", "rec_one_side_is", "opd"]
KLS = [None, "k1", "k2", "k3"]
EPS_LOW, EPS_HIGH = 0.2, 0.28


def make_logits(c, v, seed, scale=10.0):
    """Peaked logits: N(0, scale) plus, in every other row, one dominant token; targets drawn
    from the model itself for most rows and uniformly for the rest (very negative logp)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(c, v, generator=g) * scale
    spikes = torch.randint(0, v, (c,), generator=g)
    z[torch.arange(0, c, 2), spikes[::2]] += 3 * scale
    probs = torch.softmax(z.double(), dim=-1)
    targets = torch.multinomial(probs, 1, generator=g).squeeze(1)
    uniform = torch.randint(0, v, (c,), generator=g)
    targets[1::3] = uniform[1::3]
    return z, targets, g


def eager_stats(z, targets, temperature, dtype):
    """(logp, entropy, lse) in `dtype` the way eager torch computes them."""
    x = z.to(dtype) / temperature
    log_p = torch.log_softmax(x, dim=-1)
    logp = log_p.gather(1, targets[:, None]).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logp, entropy, torch.logsumexp(x, dim=-1)


def eager_dz(z, targets, lse, entropy, g_logp, g_entropy, temperature, dtype):
    """dL/dz = (g (onehot - p) - gH p (log p + H)) / T, with lse and H taken as given."""
    x = z.to(dtype) / temperature
    log_p = x - lse.to(dtype)[:, None]
    p = log_p.exp()
    dz = -p * g_logp.to(dtype)[:, None]
    dz.scatter_add_(1, targets[:, None], g_logp.to(dtype)[:, None])
    if g_entropy is not None:
        dz -= g_entropy.to(dtype)[:, None] * p * (log_p + entropy.to(dtype)[:, None])
    return dz / temperature


def assert_finite(name, t):
    bad = ~torch.isfinite(t)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} non-finite values, first at {bad.nonzero()[:5]}"
    )


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize(("c", "v"), SHAPES)
def test_forward_matches_float64(c, v, temperature):
    """logp, entropy and lse are within the float32 error budget; z is left untouched."""
    z, targets, _ = make_logits(c, v, seed=c * 1000 + v)
    z_before = z.clone()
    logp, entropy, lse = rows_forward(z, targets, 1.0 / temperature)
    truth = eager_stats(z, targets, temperature, torch.float64)
    eager = eager_stats(z, targets, temperature, torch.float32)
    for name, got, want, ref in zip(
        ("logp", "entropy", "lse"), (logp, entropy, lse), truth, eager, strict=True
    ):
        assert got.dtype == torch.float32 and got.shape == (c,)
        assert_within_budget(name, got, ref, want)
    assert torch.equal(z, z_before), "rows_forward modified z"


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize(("c", "v"), SHAPES)
def test_backward_matches_float64(c, v, temperature, with_entropy):
    """Every element of z is overwritten with dL/dz, within the float32 error budget."""
    z, targets, g = make_logits(c, v, seed=c * 1000 + v + 1)
    _, entropy, lse = (t.float() for t in eager_stats(z, targets, temperature, torch.float64))
    g_logp = torch.randn(c, generator=g)
    g_entropy = torch.randn(c, generator=g) if with_entropy else None
    truth = eager_dz(z, targets, lse, entropy, g_logp, g_entropy, temperature, torch.float64)
    eager = eager_dz(z, targets, lse, entropy, g_logp, g_entropy, temperature, torch.float32)
    dz = z.clone()
    rows_backward_(
        dz, targets, lse, entropy if with_entropy else None, g_logp, g_entropy, 1 / temperature
    )
    assert_finite("dz", dz)
    assert_within_budget("dz", dz, eager, truth)


def test_online_max_across_blocks():
    """Rows longer than the kernel's 2048-logit block whose maximum keeps rising from block to
    block (and one whose maximum sits in the first block) need the online rescaling of s and u."""
    v = 9000
    ramp = torch.linspace(-30.0, 30.0, v)
    z = torch.stack([ramp, ramp.flip(0), torch.randn(v) * 10, ramp + torch.randn(v)])
    z[2, -5] = 80.0
    targets = torch.tensor([v - 1, 3, v - 5, 4500])
    logp, entropy, lse = rows_forward(z, targets, 1.0)
    truth = eager_stats(z, targets, 1.0, torch.float64)
    eager = eager_stats(z, targets, 1.0, torch.float32)
    for name, got, want, ref in zip(
        ("logp", "entropy", "lse"), (logp, entropy, lse), truth, eager, strict=True
    ):
        assert_within_budget(name, got, ref, want)


def test_nan_row_propagates():
    """A NaN logit makes its own row's outputs NaN and leaves the other rows exact."""
    z, targets, _ = make_logits(3, 507, seed=5)
    z[1, 100] = float("nan")
    logp, entropy, lse = rows_forward(z, targets, 1.0)
    assert torch.isnan(lse[1]) and torch.isnan(logp[1]) and torch.isnan(entropy[1])
    keep = torch.tensor([0, 2])
    truth = eager_stats(z[keep], targets[keep], 1.0, torch.float64)
    eager = eager_stats(z[keep], targets[keep], 1.0, torch.float32)
    assert_within_budget("lse", lse[keep], eager[2], truth[2])


def test_masked_logits_act_as_absent():
    """-inf logits (a masked vocabulary) give the statistics of the row without them, and a zero
    gradient there; eager torch would give a NaN entropy (0 * -inf)."""
    z, targets, _ = make_logits(5, 600, seed=11)
    keep = torch.arange(600) % 3 != 1
    targets = torch.where(keep[targets], targets, targets + 1)
    masked = z.masked_fill(~keep, float("-inf"))
    got = rows_forward(masked, targets, 1 / 0.7)
    dense_targets = keep.cumsum(0)[targets] - 1
    want = rows_forward(z[:, keep].contiguous(), dense_targets, 1 / 0.7)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    _, entropy, lse = got
    g = torch.ones(5)
    rows_backward_(masked, targets, lse, entropy, g, g, 1 / 0.7)
    assert torch.all(masked[:, ~keep] == 0) and torch.isfinite(masked).all()


def test_leading_masked_blocks():
    """A row whose first kernel blocks (2048 logits each) are entirely -inf still gets the
    statistics of its unmasked tail."""
    z, targets, _ = make_logits(3, 6000, seed=12)
    targets = targets.clamp(min=4500)
    masked = z.clone()
    masked[:, :4500] = float("-inf")
    got = rows_forward(masked, targets, 1.0)
    want = rows_forward(z[:, 4500:].contiguous(), targets - 4500, 1.0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# ---- the fused kernel and its loss head ----


def head_ref(tok, *, policy, seq_level, on_policy, kl, beta, entropy_coef, opd_coef, f):
    """The per-token head as plain Python on numpy scalars of type `f`: (loss, g_logp, g_H,
    clipped), with g_* the derivatives of the loss in logp and H. A token's own entropy weight
    (`ent_coef`) replaces `entropy_coef`."""
    logp, h, a = f(tok["logp"]), f(tok["entropy"]), f(tok["adv"])
    if seq_level:
        r = f(tok["seq_ratio"])
    elif on_policy:
        r = f(1.0)
    else:
        r = np.exp(logp - f(tok["old"]))
    clipped = False
    if policy == "ppo":
        unc = -a * r
        clp = -a * min(max(r, f(1 - EPS_LOW)), f(1 + EPS_HIGH))
        clipped = bool(clp > unc)
        pol = max(unc, clp)
        g = f(0.0) if clipped or seq_level else -a * r
    elif policy in ("rec_one_side", "rec_one_side_is"):
        keep = (a >= 0 and r <= f(1 + EPS_HIGH)) or (a < 0 and r >= f(1 - EPS_LOW))
        clipped = not keep
        k = f(1.0 if keep else 0.0)
        if policy == "rec_one_side":
            pol, g = -a * logp * k, -a * k
        else:
            pol, g = -a * r * k, (f(0.0) if seq_level else -a * r * k)
    else:
        adv = f(opd_coef) * (f(tok["teach"]) - logp)
        pol, g = -adv * logp, -adv
    corr = f(tok["corr"])
    loss, g = corr * pol, corr * g
    if kl is not None:
        d = logp - f(tok["ref"])
        k, dk = {
            "k1": (d, f(1.0)),
            "k2": (d * d / f(2.0), d),
            "k3": (np.expm1(-d) + d, -np.expm1(-d)),
        }[kl]
        loss, g = loss + f(beta) * k, g + f(beta) * dk
    alpha = f(entropy_coef if tok.get("ent_coef") is None else tok["ent_coef"])
    loss = loss - alpha * h
    w = f(tok["weight"])
    g_logp = w * g + (f(tok["seq_grad"]) if seq_level else f(0.0))
    return w * loss, g_logp, -w * alpha, clipped


def away_from_edges(r):
    """Ratios nudged at least 1% away from the clip edges, where the head is discontinuous."""
    for edge in (1 - EPS_LOW, 1 + EPS_HIGH):
        near = (r - edge).abs() < 0.01
        r = torch.where(near, edge + 0.02 * torch.sign(r - edge + 1e-9), r)
    return r


def fused_case(
    c, v, temperature, seed, *, policy, seq_level, on_policy, kl, entropy_coef, own_entropy=False
):
    """Logits, targets, the per-token inputs and the switches of one fused call; `own_entropy`
    adds each token's own entropy weight (`ent_coef`: 0, 0.1 or 0.2)."""
    z, targets, g = make_logits(c, v, seed)
    logp64 = eager_stats(z, targets, temperature, torch.float64)[0]

    def per_token(scale=1.0, shift=0.0):
        return (torch.randn(c, generator=g, dtype=torch.float64) * scale + shift).float()

    ratio = away_from_edges(torch.rand(c, generator=g, dtype=torch.float64) * 0.9 + 0.6)
    adv = per_token()
    adv[0] = 0.0  # A = 0 takes the A >= 0 branch of rec_one_side
    inputs = dict(
        adv=adv,
        old=None if on_policy else (logp64 - ratio.log()).float(),
        ref=None if kl is None else (logp64 + 0.3 * per_token().double()).float(),
        teach=(logp64 + 0.5 * per_token().double()).float() if policy == "opd" else None,
        corr=(torch.rand(c, generator=g) + 0.5),
        weight=(torch.rand(c, generator=g) + 0.1) / c,
        seq_ratio=away_from_edges(ratio.flip(0)).float() if seq_level else None,
        seq_grad=per_token(0.1) if seq_level else None,
        ent_coef=(torch.rand(c, generator=g) * 0.2).round(decimals=1) if own_entropy else None,
    )
    params = dict(
        policy=policy,
        seq_level=seq_level,
        on_policy=on_policy,
        kl=kl,
        beta=0.05 if kl is not None else 0.0,
        entropy_coef=entropy_coef,
        opd_coef=0.7,
    )
    return z, targets, inputs, params


def reference_fused(z, targets, temperature, inputs, params, dtype):
    """(logp, entropy, loss, clipped, dz) of the whole fused step in `dtype`."""
    f = np.float64 if dtype == torch.float64 else np.float32
    logp, entropy, lse = eager_stats(z, targets, temperature, dtype)
    rows = []
    for t in range(z.shape[0]):
        tok = {k: (float(x[t]) if x is not None else None) for k, x in inputs.items()}
        tok.update(logp=logp[t].item(), entropy=entropy[t].item())
        rows.append(head_ref(tok, f=f, **params))
    loss, g_logp, g_entropy, clipped = zip(*rows, strict=True) if rows else ((),) * 4
    g_logp = torch.tensor([float(x) for x in g_logp], dtype=dtype)
    g_entropy = torch.tensor([float(x) for x in g_entropy], dtype=dtype)
    dz = eager_dz(z, targets, lse, entropy, g_logp, g_entropy, temperature, dtype)
    loss = torch.tensor([float(x) for x in loss], dtype=dtype)
    return logp, entropy, loss, torch.tensor(clipped, dtype=torch.bool), dz


def run_fused(z, targets, temperature, inputs, params):
    dz = z.clone()
    out = rows_fused_(
        dz, targets, 1 / temperature, eps_low=EPS_LOW, eps_high=EPS_HIGH, **inputs, **params
    )
    return (*out, dz)


def check_fused(z, targets, temperature, inputs, params):
    got = run_fused(z, targets, temperature, inputs, params)
    truth = reference_fused(z, targets, temperature, inputs, params, torch.float64)
    eager = reference_fused(z, targets, temperature, inputs, params, torch.float32)
    for name, g, e, t in zip(
        ("logp", "entropy", "loss", "clipped", "dz"), got, eager, truth, strict=True
    ):
        if name == "clipped":
            assert g.dtype == torch.bool and torch.equal(g, t), f"clipped: got {g}, want {t}"
        else:
            assert g.dtype == torch.float32 and g.shape == t.shape
            assert_finite(name, g)
            assert_within_budget(name, g, e, t)


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("seq_level", [False, True])
@pytest.mark.parametrize("kl", KLS)
@pytest.mark.parametrize("policy", POLICIES)
def test_fused_head_every_combination(policy, kl, seq_level, on_policy):
    """logp, entropy, per-token loss, clip flags and dL/dz of the fused kernel match the float64
    head for every policy x KL x ratio level x on-policy combination."""
    params = dict(policy=policy, seq_level=seq_level, on_policy=on_policy, kl=kl)
    seed = 100 * POLICIES.index(policy) + 10 * KLS.index(kl) + 2 * seq_level + on_policy
    z, targets, inputs, params = fused_case(33, 507, 0.7, seed, entropy_coef=0.01, **params)
    check_fused(z, targets, 0.7, inputs, params)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize(("c", "v"), SHAPES)
def test_fused_shapes(c, v, temperature, entropy_coef):
    """The fused kernel on odd shapes and both temperatures, with and without the entropy term
    (which the kernel skips when its gradient is zero)."""
    z, targets, inputs, params = fused_case(
        c,
        v,
        temperature,
        c * 1000 + v,
        policy="ppo",
        seq_level=False,
        on_policy=False,
        kl="k3",
        entropy_coef=entropy_coef,
    )
    check_fused(z, targets, temperature, inputs, params)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("c", "v"), SHAPES)
def test_fused_per_token_entropy_weights(c, v, policy):
    """Each token's own entropy weight (`ent_coef`, 0 on some) replaces entropy_coef in
    its loss and its dL/dz, on odd shapes and every policy."""
    z, targets, inputs, params = fused_case(
        c, v, 0.7, c * 1000 + v + 7, policy=policy, seq_level=False, on_policy=False,
        kl="k1", entropy_coef=0.05, own_entropy=True,
    )  # fmt: skip
    check_fused(z, targets, 0.7, inputs, params)


def test_fused_integer_codes_and_defaults():
    """Integer policy / kl codes act like their names, and corr=None means a weight of 1."""
    z, targets, inputs, params = fused_case(
        7,
        507,
        1.0,
        3,
        policy="rec_one_side",
        seq_level=False,
        on_policy=False,
        kl="k2",
        entropy_coef=0.0,
    )
    by_name = run_fused(z, targets, 1.0, inputs, params)
    by_code = run_fused(z, targets, 1.0, inputs, {**params, "policy": 1, "kl": 2})
    for a, b in zip(by_name, by_code, strict=True):
        assert torch.equal(a, b)
    ones = run_fused(z, targets, 1.0, {**inputs, "corr": torch.ones(7)}, params)
    none = run_fused(z, targets, 1.0, {**inputs, "corr": None}, params)
    for a, b in zip(ones, none, strict=True):
        assert torch.equal(a, b)


def test_empty_chunk():
    """C = 0 rows is a no-op that returns empty outputs."""
    z = torch.zeros(0, 50)
    targets = torch.zeros(0, dtype=torch.long)
    logp, entropy, lse = rows_forward(z, targets, 1.0)
    assert logp.shape == entropy.shape == lse.shape == (0,)
    e = torch.zeros(0)
    rows_backward_(z, targets, e, e, e, None, 1.0)


# ---- argument errors ----


def _fused_kwargs(c):
    t = torch.zeros(c)
    return dict(
        adv=t,
        old=t,
        ref=None,
        teach=None,
        corr=None,
        weight=t,
        seq_ratio=None,
        seq_grad=None,
        policy="ppo",
        seq_level=False,
        on_policy=False,
        eps_low=0.2,
        eps_high=0.2,
        kl=None,
        beta=0.0,
        entropy_coef=0.0,
        opd_coef=1.0,
    )


def test_bad_arguments_raise_clear_errors():
    """Wrong dtype, non-contiguous or mismatched shapes, bad target ids and missing optional
    inputs are refused with a message that names the argument."""
    z = torch.randn(4, 10)
    y = torch.tensor([0, 1, 2, 3])
    with pytest.raises(TypeError, match="z must be float32"):
        rows_forward(z.double(), y, 1.0)
    with pytest.raises(ValueError, match="z must be contiguous"):
        rows_forward(torch.randn(10, 4).T, y, 1.0)
    with pytest.raises(ValueError, match="z must be 2-d"):
        rows_forward(torch.randn(40), y, 1.0)
    with pytest.raises(ValueError, match=r"targets must have shape \[4\]"):
        rows_forward(z, torch.tensor([0, 1, 2]), 1.0)
    with pytest.raises(ValueError, match=r"targets\[2\] = 10 is outside \[0, 10\)"):
        rows_forward(z, torch.tensor([0, 1, 10, 3]), 1.0)
    with pytest.raises(ValueError, match="inv_temp must be"):
        rows_forward(z, y, 0.0)
    with pytest.raises(TypeError, match="targets must be an integer"):
        rows_forward(z, y.float(), 1.0)
    e = torch.zeros(4)
    with pytest.raises(ValueError, match=r"g_logp must have shape \[4\]"):
        rows_backward_(z, y, e, e, torch.zeros(5), None, 1.0)
    with pytest.raises(ValueError, match="entropy is required"):
        rows_backward_(z, y, e, None, e, e, 1.0)
    with pytest.raises(ValueError, match="lse must be contiguous"):
        rows_backward_(z, y, torch.zeros(8)[::2], e, e, None, 1.0)
    with pytest.raises(ValueError, match="old is required"):
        rows_fused_(z, y, 1.0, **{**_fused_kwargs(4), "old": None})
    with pytest.raises(ValueError, match="ref is required"):
        rows_fused_(z, y, 1.0, **{**_fused_kwargs(4), "kl": "k3"})
    with pytest.raises(ValueError, match="teach is required"):
        rows_fused_(z, y, 1.0, **{**_fused_kwargs(4), "policy": "opd"})
    with pytest.raises(ValueError, match="seq_ratio is required"):
        rows_fused_(z, y, 1.0, **{**_fused_kwargs(4), "seq_level": True})
    with pytest.raises(ValueError, match="policy must be one of"):
        rows_fused_(z, y, 1.0, **{**_fused_kwargs(4), "policy": "grpo"})
    with pytest.raises(ValueError, match=r"weight must have shape \[4\]"):
        rows_fused_(z, y, 1.0, **{**_fused_kwargs(4), "weight": torch.zeros(3)})


def test_extension_checks_numpy_inputs_itself():
    """The C++ entry points refuse non-contiguous, read-only or wrongly typed arrays rather than
    silently working on a copy (which would lose the in-place gradient)."""
    z = np.zeros((4, 10), dtype=np.float32)
    y = np.arange(4, dtype=np.int64)
    out = [np.zeros(4, dtype=np.float32) for _ in range(3)]
    with pytest.raises(ValueError, match="z must be C-contiguous"):
        _cpp.forward(np.zeros((10, 4), dtype=np.float32).T, y, 1.0, *out)
    with pytest.raises(ValueError, match="z must have dtype float32"):
        _cpp.forward(z.astype(np.float64), y, 1.0, *out)
    with pytest.raises(ValueError, match="targets must have dtype int64"):
        _cpp.forward(z, y.astype(np.int32), 1.0, *out)
    read_only = z.copy()
    read_only.flags.writeable = False
    e = np.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match="z is read-only"):
        _cpp.backward_(read_only, y, e, e, e, None, 1.0)
    with pytest.raises(ValueError, match="z must be a 2-d"):
        _cpp.forward([[0.0]], y, 1.0, *out)
    assert math.isfinite(float(out[0].sum()))
