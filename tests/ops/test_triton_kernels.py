"""Triton kernels (cod_fast.kernels) against float64 torch: the row kernels and the fused
LM-head log-prob kernel (docs/concepts.md section 4).

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 at small sizes; with CUDA the
same tests run compiled. The ground truth is float64 torch (log_softmax, autograd through the
per-token head written in plain Python); the error budget is twice the error of the same eager
computation in the kernel's dtype, plus a 1e-6 relative slack.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# tests/conftest.py sets TRITON_INTERPRET=1 without CUDA (and patches the interpreter for NumPy).
triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from tests.reference import assert_within_budget, report_mismatch  # noqa: E402

if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)

from cod_fast.kernels import linear_lse, row_kernels, rows  # noqa: E402

if not ON_GPU and not isinstance(
    row_kernels._rows_forward_kernel, triton.runtime.interpreter.InterpretedFunction
):
    pytest.skip(
        "cod_fast.kernels was imported before TRITON_INTERPRET=1 was set", allow_module_level=True
    )

DEVICE = "cuda" if ON_GPU else "cpu"
# Under the interpreter every kernel call runs as Python per block: seconds per test in all.
# Under the interpreter, masked lanes compute 0 * -inf or log(0) before tl.where or the store
# mask discards them; numpy warns about it.
pytestmark = [
    *([] if ON_GPU else [pytest.mark.slow]),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]


def peaked_logits(rows_, vocab, seed, scale=10.0):
    """Logits like a trained model's: a few large values per row, the rest far below."""
    g = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(rows_, vocab, generator=g)
    targets = torch.randint(0, vocab, (rows_,), generator=g)
    # Half the targets are the row's argmax (logp near 0, the cancellation-prone case).
    targets[::2] = z[::2].argmax(1)
    return z, targets


def eager_rows(z, targets, inv_temp, dtype):
    """(logp, entropy, lse) by log_softmax in `dtype`."""
    x = z.to(dtype) * inv_temp
    log_p = torch.log_softmax(x, dim=1)
    logp = log_p.gather(1, targets[:, None].long()).squeeze(1)
    return logp, -(log_p.exp() * log_p).sum(1), torch.logsumexp(x, dim=1)


def padded(z, sentinel=float("nan")):
    """z inside a wider, taller buffer filled with a sentinel: [C, V] rows with stride V + 3."""
    buf = torch.full((z.shape[0] + 1, z.shape[1] + 3), sentinel, dtype=z.dtype)
    buf[: z.shape[0], : z.shape[1]] = z
    return buf.to(DEVICE)


def assert_sentinel_intact(buf, rows_, vocab):
    """Nothing was written outside the [rows_, vocab] window of a `padded` buffer."""
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[:rows_, :vocab] = False
    assert buf[outside].isnan().all(), "a kernel wrote outside its rows"


ROW_SHAPES = [  # (C, V, temperature, BLOCK_V): one tile, many tiles, a ragged last tile
    (1, 3, 1.0, None),
    (5, 61, 0.7, 16),
    (13, 257, 0.7, 64),
    (13, 257, 1.0, None),
]


@pytest.mark.parametrize(("c", "vocab", "temperature", "block_v"), ROW_SHAPES)
def test_rows_forward(c, vocab, temperature, block_v):
    """logp, entropy and lse of every row are within budget, and z is left untouched."""
    z, targets = peaked_logits(c, vocab, seed=c * vocab)
    buf = padded(z)
    view = buf[:c, :vocab]
    inv_temp = 1.0 / temperature
    got = rows.rows_forward(view, targets.to(DEVICE), inv_temp, block_v=block_v)
    truth = eager_rows(z, targets, inv_temp, torch.float64)
    eager = eager_rows(z, targets, inv_temp, torch.float32)
    for name, g, e, t in zip(("logp", "entropy", "lse"), got, eager, truth, strict=True):
        assert g.dtype == torch.float32 and g.shape == (c,)
        assert_within_budget(name, g.cpu(), e, t)
    assert torch.equal(view.cpu(), z)
    assert_sentinel_intact(buf.cpu(), c, vocab)


def backward_truth(z, targets, inv_temp, g_logp, g_entropy):
    """float64 dL/dz by autograd of sum(g_logp logp + g_entropy H) through log_softmax."""
    z = z.double().requires_grad_()
    logp, entropy, _ = eager_rows(z, targets, inv_temp, torch.float64)
    total = (g_logp.double() * logp).sum()
    if g_entropy is not None:
        total = total + (g_entropy.double() * entropy).sum()
    total.backward()
    return z.grad


def backward_eager_float32(z, targets, inv_temp, lse, entropy, g_logp, g_entropy):
    """The same dL/dz in float32 eager torch from the same float32 lse and entropy: the budget.
    (lse rounded to float32 bounds how well p = exp(x - lse) can be known, eager or not.)"""
    log_p = z * inv_temp - lse[:, None]
    p = log_p.exp()
    dz = -p * g_logp[:, None]
    dz[torch.arange(z.shape[0]), targets.long()] += g_logp
    if g_entropy is not None:
        dz -= g_entropy[:, None] * p * (log_p + entropy[:, None])
    return dz * inv_temp


@pytest.mark.parametrize("with_entropy_grad", [True, False])
@pytest.mark.parametrize(("c", "vocab", "temperature", "block_v"), ROW_SHAPES)
def test_rows_backward_overwrites_z(c, vocab, temperature, block_v, with_entropy_grad):
    """Every element of z becomes dL/dz (within budget), nothing outside z is written."""
    z, targets = peaked_logits(c, vocab, seed=7 + c * vocab)
    g = torch.Generator().manual_seed(c)
    g_logp = torch.randn(c, generator=g)
    g_entropy = torch.randn(c, generator=g) if with_entropy_grad else None
    inv_temp = 1.0 / temperature
    _, entropy, lse = (t.float() for t in eager_rows(z, targets, inv_temp, torch.float64))
    buf = padded(z)
    view = buf[:c, :vocab]
    rows.rows_backward_(
        view,
        targets.to(torch.int32).to(DEVICE),
        lse.to(DEVICE),
        entropy.to(DEVICE),
        g_logp.to(DEVICE),
        None if g_entropy is None else g_entropy.to(DEVICE),
        inv_temp,
        block_v=block_v,
    )
    truth = backward_truth(z, targets, inv_temp, g_logp, g_entropy)
    eager = backward_eager_float32(z, targets, inv_temp, lse, entropy, g_logp, g_entropy)
    assert_within_budget("dz", view.cpu(), eager, truth)
    assert_sentinel_intact(buf.cpu(), c, vocab)


def head_inputs(logp, policy, kl, seq_level, on_policy, seed):
    """Per-token inputs near the current policy, None where the switches say so."""
    g = torch.Generator().manual_seed(seed)
    c = logp.shape[0]

    def near(scale):
        return (logp + scale * torch.randn(c, generator=g)).float()

    ref = None
    if kl:
        ref = near(0.3)
        ref[0] = logp[0].float() - 1e-3  # tiny KL: where k3 = e^-d - 1 + d cancels
    return dict(
        # opd reads no advantage; leave it out on some opd cases to cover HAS_ADV = False.
        adv=None if policy == 3 and kl % 2 else torch.randn(c, generator=g),
        old=None if on_policy else near(0.2),
        ref=ref,
        teach=near(0.5) if policy == 3 else None,
        corr=0.5 + torch.rand(c, generator=g),
        weight=(0.1 + torch.rand(c, generator=g)) / c,
        seq_ratio=(0.2 * torch.randn(c, generator=g)).exp() if seq_level else None,
        seq_grad=0.1 * torch.randn(c, generator=g) if seq_level else None,
    )


def token_loss(t, logp, entropy, inputs, sw):
    """The loss head of one token in plain Python over 0-dim tensors: (w L_t, clipped_t).

    At sequence level the ratio is a constant (its gradient arrives through seq_grad), on policy
    it is exp(logp - logp.detach()), so autograd reproduces the head's closed-form gradients.
    """
    lp, h = logp[t], entropy[t]

    def x(name):
        return inputs[name][t].to(logp.dtype)

    if sw["seq_level"]:
        r = x("seq_ratio")
    elif sw["on_policy"]:
        r = torch.exp(lp - lp.detach())
    else:
        r = torch.exp(lp - x("old"))
    el, eh = sw["eps_low"], sw["eps_high"]
    if sw["policy"] == 0:
        unclipped = -x("adv") * r
        clipped_term = -x("adv") * torch.clamp(r, 1 - el, 1 + eh)
        pol = torch.maximum(unclipped, clipped_term)
        clipped = bool(clipped_term > unclipped)
    elif sw["policy"] in (1, 2):
        a, rr = float(x("adv")), float(r.detach())
        keep = (a >= 0 and rr <= 1 + eh) or (a < 0 and rr >= 1 - el)
        pol = -x("adv") * (lp if sw["policy"] == 1 else r) * float(keep)
        clipped = not keep
    else:
        a = sw["opd_coef"] * (x("teach") - lp.detach())
        pol = -a * lp
        clipped = False
    loss = x("corr") * pol
    if sw["kl"]:
        d = lp - x("ref")
        k = {1: d, 2: d * d / 2, 3: torch.expm1(-d) + d}[sw["kl"]]
        loss = loss + sw["beta"] * k
    alpha = sw["entropy_coef"] if inputs.get("ent_coef") is None else x("ent_coef")
    loss = loss - alpha * h
    return x("weight") * loss, clipped


def fused_truth(z, targets, inv_temp, inputs, sw, dtype):
    """(logp, entropy, loss, clipped, dz, |d loss / d logp| * |logp|) of the head over
    log_softmax, by autograd in `dtype`. The last is each token's loss change per unit relative
    error of its logp: the scale at which logp's rounding reaches the loss."""
    z = z.to(dtype).requires_grad_()
    logp, entropy, _ = eager_rows(z, targets, inv_temp, dtype)
    per_token = [token_loss(t, logp, entropy, inputs, sw) for t in range(z.shape[0])]
    loss = torch.stack([value for value, _ in per_token])
    (dloss_dlogp,) = torch.autograd.grad(
        loss.sum(), logp, retain_graph=True, allow_unused=True, materialize_grads=True
    )  # unused: a sequence-level ratio reads logp through seq_grad only
    total = loss.sum()
    if sw["seq_level"]:
        total = total + (inputs["seq_grad"].to(dtype) * logp).sum()
    total.backward()
    clipped = torch.tensor([float(c) for _, c in per_token])
    sensitivity = (dloss_dlogp * logp).detach().abs()
    return logp.detach(), entropy.detach(), loss.detach(), clipped, z.grad, sensitivity


def head_switches(policy, kl, seq_level, on_policy, entropy_coef) -> dict:
    """The scalar arguments of rows_fused_ for a case (the clip range and coefficients fixed)."""
    return dict(
        policy=policy,
        seq_level=seq_level,
        on_policy=on_policy,
        eps_low=0.2,
        eps_high=0.28,
        kl=kl,
        beta=0.1,
        entropy_coef=entropy_coef,
        opd_coef=0.5,
    )


def check_fused(
    c, vocab, temperature, block_v, policy, kl, seq_level, on_policy, entropy_coef,
    own_entropy=False,
):  # fmt: skip
    """rows_fused_ against autograd through the head in float64, within the float32 budget;
    `own_entropy` gives every token its own entropy weight (`ent_coef`, 0 on every third)."""
    seed = 1000 * policy + 100 * kl + 10 * seq_level + on_policy
    z, targets = peaked_logits(c, vocab, seed=seed)
    inv_temp = 1.0 / temperature
    logp64, _, _ = eager_rows(z, targets, inv_temp, torch.float64)
    inputs = head_inputs(logp64, policy, kl, seq_level, on_policy, seed)
    if own_entropy:
        inputs["ent_coef"] = torch.linspace(0.0, 0.3, c) * (torch.arange(c) % 3 != 0)
    sw = head_switches(policy, kl, seq_level, on_policy, entropy_coef)
    buf = padded(z)
    view = buf[:c, :vocab]
    got = rows.rows_fused_(
        view,
        targets.to(DEVICE),
        inv_temp,
        **{k: None if v is None else v.to(DEVICE) for k, v in inputs.items()},
        **sw,
        block_v=block_v,
    )
    truth = fused_truth(z, targets, inv_temp, inputs, sw, torch.float64)
    eager = fused_truth(z, targets, inv_temp, inputs, sw, torch.float32)
    # The loss inherits logp's relative rounding through d loss / d logp (|logp| reaches 68
    # here): its slack scale includes that, so a logp within its own budget (rounded as a GPU's
    # approximate exp2/log2 round it, say) passes on the loss too.
    loss_scale = max(float(truth[2].abs().max()), float(truth[5].max()))
    for name, g, e, t, scale in zip(
        ("logp", "entropy", "loss"), got[:3], eager[:3], truth[:3], (None, None, loss_scale),
        strict=True,
    ):  # fmt: skip
        assert_within_budget(name, g.cpu(), e, t, scale=scale)
    assert torch.equal(got[3].cpu(), truth[3]), f"clipped {got[3].tolist()} != {truth[3].tolist()}"
    assert_within_budget("dz", view.cpu(), eager[4], truth[4])
    assert_sentinel_intact(buf.cpu(), c, vocab)


@pytest.mark.parametrize(
    ("policy", "kl", "seq_level", "on_policy"),
    list(itertools.product(range(4), range(4), (0, 1), (0, 1))),
)
def test_rows_fused_every_switch(policy, kl, seq_level, on_policy):
    """Every policy x KL x ratio level x on/off-policy: loss, logp, H, clipped and dz in z."""
    check_fused(
        c=5,
        vocab=61,
        temperature=0.7 if (policy + kl) % 2 else 1.0,
        block_v=16,
        policy=policy,
        kl=kl,
        seq_level=seq_level,
        on_policy=on_policy,
        entropy_coef=0.0 if kl == 2 else 0.02,  # 0 compiles the entropy term of dz out
    )


@pytest.mark.parametrize(
    ("c", "vocab", "temperature", "block_v", "policy", "kl"),
    [
        (1, 3, 1.0, None, 0, 3),
        (13, 257, 0.7, 64, 1, 0),
        (13, 257, 1.0, None, 2, 3),
        (13, 257, 0.7, 32, 3, 1),
    ],
)
def test_rows_fused_shapes(c, vocab, temperature, block_v, policy, kl):
    """The fused row kernel on a 1-token chunk, ragged tiles and single-tile rows."""
    check_fused(c, vocab, temperature, block_v, policy, kl, 0, 0, entropy_coef=0.01)


@pytest.mark.parametrize(
    ("c", "vocab", "block_v", "policy", "kl", "seq_level"),
    [(1, 3, None, 0, 3, 0), (7, 61, 16, 1, 0, 1), (7, 61, 16, 3, 2, 0)],
)
def test_rows_fused_per_token_entropy_weights(c, vocab, block_v, policy, kl, seq_level):
    """Each token's own entropy weight (HAS_ENT_VEC) replaces the scalar in the loss and dz, on
    a 1-token chunk and ragged tiles; with a scalar of 0 the entropy term of dz still runs."""
    check_fused(c, vocab, 0.7, block_v, policy, kl, seq_level, 0, 0.0, own_entropy=True)


NARROW_SHAPES = [  # (C, V, temperature, BLOCK_V): several tiles, an odd V, a one-tile row
    (5, 300, 0.7, 64),
    (4, 301, 1.0, 32),
    (1, 3, 1.0, None),
]


def assert_rounded(name, got, want):
    """Every 16-bit value of `got` is the float32 `want` rounded to its dtype: to nearest even
    (torch's and a GPU's conversion), or, under the interpreter, which truncates float32 to
    bf16, toward zero (one ulp of the dtype at most). The interpreter also garbles float32
    subnormals on that conversion: there they need only stay below the smallest normal."""
    nearest = want.to(got.dtype)
    if ON_GPU:
        report_mismatch(name, got.cpu().view(torch.int16), nearest.view(torch.int16), 0, 0)
        return
    over = nearest.float().abs() > want.abs()
    toward_zero = torch.where(over, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    got = got.cpu()
    tiny = torch.finfo(torch.float32).tiny
    bad = (got.view(torch.int16) != nearest.view(torch.int16)) & (
        got.view(torch.int16) != toward_zero.view(torch.int16)
    )
    bad &= ~((want.abs() < tiny) & (got.float().abs() < tiny))
    assert not bad.any(), (
        f"{name}: {int(bad.sum())}/{bad.numel()} values neither rounding of the float32 dz; "
        f"first at {bad.nonzero()[:5].tolist()}"
    )


def check_narrow_dz(run, z, dz_dtype):
    """Run `run(view, **kw)` on two padded copies of z, one storing float32 dz and one 16-bit dz
    over z's bytes; the 16-bit dz is the float32 one rounded, the bytes past each row's first V
    16-bit values and the rows past C keep their values, and the other outputs are the same."""
    c, vocab = z.shape
    wide_buf, buf = padded(z), padded(z)
    wide = wide_buf[:c, :vocab]
    view = buf[:c, :vocab]
    want = run(wide)
    got = run(view, dz_dtype=dz_dtype)
    assert_rounded("dz", rows.narrow_dz_view(view, dz_dtype), wide.cpu())
    before = padded(z).cpu().view(dz_dtype)
    after = buf.cpu().view(dz_dtype)
    assert torch.equal(after[:c, vocab:].view(torch.int16), before[:c, vocab:].view(torch.int16))
    assert buf[c:].isnan().all().item(), "a kernel wrote past its rows"
    for g, w in zip(got or (), want or (), strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dz_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("c", "vocab", "temperature", "block_v"), NARROW_SHAPES)
def test_rows_backward_narrow_dz(c, vocab, temperature, block_v, dz_dtype):
    """rows_backward_ with a 16-bit dz_dtype stores its float32 dz rounded to that dtype over
    the first V 16-bit values of each row of z, in place, and touches nothing else."""
    z, targets = peaked_logits(c, vocab, seed=11 + c * vocab)
    g = torch.Generator().manual_seed(c)
    g_logp, g_entropy = torch.randn(c, generator=g), torch.randn(c, generator=g)
    inv_temp = 1.0 / temperature
    _, entropy, lse = (t.float() for t in eager_rows(z, targets, inv_temp, torch.float64))
    args = (targets.to(DEVICE), lse, entropy, g_logp, g_entropy)
    args = tuple(t.to(DEVICE) for t in args)

    def run(view, **kw):
        rows.rows_backward_(view, *args, inv_temp, block_v=block_v, **kw)

    check_narrow_dz(run, z, dz_dtype)


@pytest.mark.parametrize("dz_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("c", "vocab", "temperature", "block_v", "policy", "kl"),
    [(5, 300, 0.7, 64, 0, 3), (4, 301, 1.0, 32, 3, 1), (1, 3, 1.0, None, 1, 0)],
)
def test_rows_fused_narrow_dz(c, vocab, temperature, block_v, policy, kl, dz_dtype):
    """rows_fused_ with a 16-bit dz_dtype returns the same logp, entropy, loss and clipped as
    with float32 dz, and stores its dz rounded over the first V 16-bit values of each row."""
    z, targets = peaked_logits(c, vocab, seed=17 + c * vocab)
    inv_temp = 1.0 / temperature
    logp64, _, _ = eager_rows(z, targets, inv_temp, torch.float64)
    inputs = head_inputs(logp64, policy, kl, 0, 0, seed=c + vocab)
    inputs = {k: None if v is None else v.to(DEVICE) for k, v in inputs.items()}
    sw = head_switches(policy, kl, seq_level=0, on_policy=0, entropy_coef=0.02)

    def run(view, **kw):
        return rows.rows_fused_(
            view, targets.to(DEVICE), inv_temp, **inputs, **sw, block_v=block_v, **kw
        )

    check_narrow_dz(run, z, dz_dtype)


def test_rows_reject_bad_dz_dtype():
    """A dz_dtype other than float32, bfloat16 or float16 raises before any launch."""
    z = torch.zeros(2, 9, device=DEVICE)
    y = torch.zeros(2, dtype=torch.long, device=DEVICE)
    ones = torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match="dz_dtype"):
        rows.rows_backward_(z, y, ones, ones, ones, None, 1.0, dz_dtype=torch.float64)


@triton.jit
def _k3_probe_kernel(d_ptr, k_ptr, dk_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    k, dk = row_kernels._k3_and_grad(tl.load(d_ptr + offs))
    tl.store(k_ptr + offs, k)
    tl.store(dk_ptr + offs, dk)


def test_k3_without_cancellation():
    """k3 = e^-d - 1 + d and 1 - e^-d keep float32 relative accuracy from |d| = 1e-6 (where the
    direct formula cancels) through the series / direct switch at |d| = 1 to |d| = 20."""
    mags = torch.tensor([1e-6, 1e-4, 1e-2, 0.3, 0.99, 1.0, 1.01, 3.0, 20.0], dtype=torch.float64)
    d64 = torch.cat([mags, -mags, torch.zeros(14, dtype=torch.float64)])  # 32 lanes
    d = d64.float()
    k, dk = torch.empty_like(d), torch.empty_like(d)
    k, dk, d_dev = (t.to(DEVICE) for t in (k, dk, d))
    _k3_probe_kernel[(1,)](d_dev, k, dk, BLOCK=32)
    d64 = d.double()  # the truth at the float32 input
    report_mismatch("k3", k.cpu(), torch.expm1(-d64) + d64, atol=0.0, rtol=4e-6)
    report_mismatch("dk3", dk.cpu(), -torch.expm1(-d64), atol=0.0, rtol=4e-6)


def test_rows_empty_chunk():
    """A chunk of zero rows launches nothing and returns empty outputs."""
    z = torch.empty(0, 7, device=DEVICE)
    targets = torch.empty(0, dtype=torch.long, device=DEVICE)
    assert all(t.shape == (0,) for t in rows.rows_forward(z, targets, 1.0))


def test_rows_reject_bad_inputs():
    """Wrong dtypes, layouts and inconsistent optional inputs raise before any launch."""
    z = torch.zeros(4, 9, device=DEVICE)
    y = torch.zeros(4, dtype=torch.long, device=DEVICE)
    ones = torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        rows.rows_forward(z.double(), y, 1.0)
    with pytest.raises(ValueError, match="contiguous rows"):
        rows.rows_forward(z.T, torch.zeros(9, dtype=torch.long, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="targets"):
        rows.rows_forward(z, y.float(), 1.0)
    sw = dict(
        policy=0,
        seq_level=0,
        on_policy=0,
        eps_low=0.2,
        eps_high=0.2,
        kl=0,
        beta=0.0,
        entropy_coef=0.0,
        opd_coef=1.0,
    )
    head = dict(adv=ones, old=ones, ref=None, teach=None, corr=ones, weight=ones)
    with pytest.raises(ValueError, match="`old` is required"):
        rows.rows_fused_(z, y, 1.0, **{**head, "old": None}, seq_ratio=None, seq_grad=None, **sw)
    with pytest.raises(ValueError, match="`ref` must be None"):
        rows.rows_fused_(z, y, 1.0, **{**head, "ref": ones}, seq_ratio=None, seq_grad=None, **sw)
    with pytest.raises(ValueError, match="adv"):
        rows.rows_fused_(
            z, y, 1.0, **{**head, "adv": ones[:3]}, seq_ratio=None, seq_grad=None, **sw
        )


def eager_linear(hidden, weight, targets, temperature, dtype):
    """(logp, entropy, lse) with the logits materialised, products and softmax in `dtype`."""
    logits = (hidden.to(dtype) @ weight.to(dtype).T) / temperature
    log_p = torch.log_softmax(logits, dim=1)
    logp = log_p.gather(1, targets[:, None].long()).squeeze(1)
    return logp, -(log_p.exp() * log_p).sum(1), torch.logsumexp(logits, dim=1)


LINEAR_CASES = [  # (N, H, V, dtype, temperature, block_sizes, num_splits)
    (1, 19, 3, torch.float32, 1.0, None, None),
    (5, 19, 61, torch.float32, 0.7, (16, 16, 16), 3),  # 3 splits of 4 tiles -> 2 splits
    (13, 40, 257, torch.float32, 0.7, (16, 32, 32), None),  # ragged K (40 = 32 + 8)
    (150, 40, 61, torch.float32, 1.0, (16, 16, 16), 2),  # 10 token blocks: a partial group
    (37, 40, 300, torch.bfloat16, 0.7, None, None),
    (13, 64, 257, torch.bfloat16, 1.0, (16, 64, 32), 2),  # EVEN_K
    (13, 40, 257, torch.float16, 0.7, (16, 32, 16), None),
]


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize(
    ("n", "dim", "vocab", "dtype", "temperature", "blocks", "splits"), LINEAR_CASES
)
def test_linear_logprobs_fwd(n, dim, vocab, dtype, temperature, blocks, splits, with_entropy):
    """logp, entropy and lse of the fused GEMM + online LSE kernel are within the eager budget
    of their operand dtype (float32 eager for fp32 operands, eager bf16/fp16 otherwise)."""
    g = torch.Generator().manual_seed(n * dim + vocab)
    hidden = torch.randn(n, dim, generator=g).to(dtype)
    weight = (torch.randn(vocab, dim, generator=g) * (10.0 / dim**0.5)).to(dtype)  # peaked
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[::3] = (hidden.double() @ weight.double().T).argmax(1)[::3]
    if n == 13:
        targets = targets.to(torch.int32)
    logp, entropy, lse = linear_lse.linear_logprobs_fwd(
        hidden.to(DEVICE),
        weight.to(DEVICE),
        targets.to(DEVICE),
        temperature,
        with_entropy,
        block_sizes=blocks,
        num_splits=splits,
    )
    truth = eager_linear(hidden, weight, targets, temperature, torch.float64)
    eager = eager_linear(hidden, weight, targets, temperature, dtype)
    assert (entropy is not None) == with_entropy
    got = (logp, entropy, lse)
    for i in (0, 1, 2) if with_entropy else (0, 2):
        name = ("logp", "entropy", "lse")[i]
        assert got[i].dtype == torch.float32 and got[i].shape == (n,), name
        assert_within_budget(name, got[i].cpu(), eager[i], truth[i])


def test_linear_logprobs_fwd_rejects_bad_inputs():
    """Mixed operand dtypes, float64 operands and shape mismatches raise."""
    h = torch.zeros(3, 8, device=DEVICE)
    w = torch.zeros(5, 8, device=DEVICE)
    y = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="share"):
        linear_lse.linear_logprobs_fwd(h, w.bfloat16(), y)
    with pytest.raises(ValueError, match="share"):
        linear_lse.linear_logprobs_fwd(h.double(), w.double(), y)
    with pytest.raises(ValueError, match="mismatch"):
        linear_lse.linear_logprobs_fwd(h[:, :7], w, y)
    with pytest.raises(ValueError, match="temperature"):
        linear_lse.linear_logprobs_fwd(h, w, y, temperature=0.0)
    empty = linear_lse.linear_logprobs_fwd(h[:0], w, y[:0], with_entropy=True)
    assert all(t.shape == (0,) for t in empty)
