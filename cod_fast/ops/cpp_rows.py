"""Torch-facing wrapper of the C++ row kernels (`cod_fast._cpp`, built from csrc/cpu/rows.cpp).

The fused CPU loss works per chunk of C tokens: torch does the GEMMs, and these kernels do all the
per-row work on the chunk's float32 logits z = h W^T [C, V] (before the temperature), in place:

- `rows_forward`: lse, logp = x_y - lse and entropy H = -sum p log p of x = z / T (docs/concepts.md
  section 4), z untouched;
- `rows_backward_`: z <- dL/dz given dL/dlogp and dL/dH;
- `rows_fused_`: both, with the per-token loss head of csrc/loss_head.h in between, so each row
  is read once for its statistics and once for its gradient.

Inputs are CPU float32 contiguous tensors (targets any integer dtype); they reach C++ as
zero-copy numpy views and the kernels run with the GIL released, on `torch.get_num_threads()`
OpenMP threads. `HAS_CPP` says whether the extension was built; `CPP_ERROR` says why not.
"""

from __future__ import annotations

import torch

from cod_fast.ops.loss_terms import KL_CODES, POLICY_CODES

try:
    from cod_fast import _cpp
except ImportError as exc:  # the build is optional: the torch implementation covers this case
    _cpp = None
    CPP_ERROR: str | None = f"{type(exc).__name__}: {exc}"
else:
    CPP_ERROR = None

HAS_CPP = _cpp is not None


def _module():
    if _cpp is None:
        raise RuntimeError(f"the C++ extension cod_fast._cpp is not built here: {CPP_ERROR}")
    return _cpp


def np_view(t: torch.Tensor | None):
    """Zero-copy numpy view for the C++ kernels that check dtype, shape and contiguity
    themselves (None passes through): the decode step calls them too often for `_array`'s
    Python checks. Activations and fresh outputs only: sharing a storage with numpy makes it
    non-resizable for good, and FSDP2 frees a gathered parameter by resizing its storage to 0,
    so parameters go through `np_copy`."""
    return None if t is None else t.detach().numpy()


def np_copy(weight: torch.Tensor | None):
    """A numpy copy of a parameter (see `np_view`; a norm weight is H floats)."""
    return None if weight is None else weight.detach().clone().numpy()


def _array(t: torch.Tensor | None, name: str, *, ndim: int = 1):
    """Zero-copy numpy view of a CPU float32 contiguous tensor (None passes through)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-d, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return t.detach().numpy()


def _targets(t: torch.Tensor):
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"targets must be an integer torch.Tensor, got {getattr(t, 'dtype', t)}")
    if t.device.type != "cpu":
        raise ValueError(f"targets must be on the CPU, got device {t.device}")
    return t.detach().to(torch.int64).contiguous().numpy()


def _code(value: int | str | None, table: dict, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value in table.values():
        return value
    if isinstance(value, str | None) and value in table:
        return table[value]
    raise ValueError(f"{name} must be one of {list(table)} or their codes, got {value!r}")


def _outputs(n: int, count: int) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=torch.float32) for _ in range(count)]


def rows_forward(
    z: torch.Tensor, targets: torch.Tensor, inv_temp: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) [C] of x = inv_temp * z for raw logits z [C, V]; z is not modified."""
    cpp = _module()
    z_np = _array(z, "z", ndim=2)
    logp, entropy, lse = _outputs(z.shape[0], 3)
    cpp.forward(
        z_np,
        _targets(targets),
        float(inv_temp),
        logp.numpy(),
        entropy.numpy(),
        lse.numpy(),
        num_threads=torch.get_num_threads(),
    )
    return logp, entropy, lse


def rows_backward_(
    z: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    g_logp: torch.Tensor,
    g_entropy: torch.Tensor | None,
    inv_temp: float,
) -> None:
    """Overwrite z [C, V] with dL/dz = inv_temp (g_logp (onehot - p) - g_entropy p (log p + H)).

    `lse` and `entropy` are `rows_forward`'s; `g_entropy` None means zero (and `entropy` may then
    be None too).
    """
    cpp = _module()
    cpp.backward_(
        _array(z, "z", ndim=2),
        _targets(targets),
        _array(lse, "lse"),
        _array(entropy, "entropy"),
        _array(g_logp, "g_logp"),
        _array(g_entropy, "g_entropy"),
        float(inv_temp),
        num_threads=torch.get_num_threads(),
    )


def rows_fused_(
    z: torch.Tensor,
    targets: torch.Tensor,
    inv_temp: float,
    *,
    adv: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    teach: torch.Tensor | None,
    corr: torch.Tensor | None,
    weight: torch.Tensor,
    seq_ratio: torch.Tensor | None,
    seq_grad: torch.Tensor | None,
    ent_coef: torch.Tensor | None = None,
    policy: int | str,
    seq_level: bool,
    on_policy: bool,
    eps_low: float,
    eps_high: float,
    kl: int | str | None,
    beta: float,
    entropy_coef: float,
    opd_coef: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row statistics, the loss head (csrc/loss_head.h) and dL/dz, in one sweep over z [C, V].

    Per-token tensors are [C] float32: `adv` the advantage, `old` the log-prob the ratio is taken
    against (None iff `on_policy`, unused at sequence level), `ref` (None iff kl is none), `teach`
    (opd only), `corr` the rollout-correction weight (None = 1), `weight` the aggregation weight
    w_t / D, and at sequence level `seq_ratio` (the segment's geometric-mean ratio) and
    `seq_grad` (dL/dlogp_t through that ratio), and `ent_coef` the entropy bonus's weight per
    token (None: `entropy_coef` on every token). `policy`: 0 ppo, 1 rec_one_side,
    2 rec_one_side_is, 3 opd (or the names); `kl`: 0 none, 1 k1, 2 k2, 3 k3 (or None / names).

    Returns (logp, entropy, loss, clipped) [C]: loss is the token's weighted loss (sum it for the
    chunk's share of the total), clipped a bool. z is overwritten with dL/dz.
    """
    cpp = _module()
    z_np = _array(z, "z", ndim=2)
    n = z.shape[0]
    logp, entropy, loss = _outputs(n, 3)
    clipped = torch.empty(n, dtype=torch.bool)
    cpp.fused_(
        z_np,
        _targets(targets),
        float(inv_temp),
        _array(adv, "adv"),
        _array(old, "old"),
        _array(ref, "ref"),
        _array(teach, "teach"),
        _array(corr, "corr"),
        _array(weight, "weight"),
        _array(seq_ratio, "seq_ratio"),
        _array(seq_grad, "seq_grad"),
        _array(ent_coef, "ent_coef"),
        _code(policy, POLICY_CODES, "policy"),
        bool(seq_level),
        bool(on_policy),
        float(eps_low),
        float(eps_high),
        _code(kl, KL_CODES, "kl"),
        float(beta),
        float(entropy_coef),
        float(opd_coef),
        logp.numpy(),
        entropy.numpy(),
        loss.numpy(),
        clipped.numpy(),
        num_threads=torch.get_num_threads(),
    )
    return logp, entropy, loss, clipped
