"""The chunked driver: per chunk of tokens, GEMMs in torch and everything else in a row kernel.

For a chunk of C trainable rows the driver computes the raw logits z = h_c W^T once, in float32
(a [C, V] buffer, never [N, V]); a row-kernel backend (torch, C++ or Triton; see
cod_fast.ops.torch_rows for the contract) turns it into log-probs and entropy and, for the loss,
overwrites it in place with dL/dz; the driver then forms dh_c = dz W and dW += dz^T h_c while the
chunk is fresh. Token-level losses therefore take one pass over the vocabulary per chunk for the
forward and backward together (6 N H V flops: one GEMM forward, two backward); sequence-level
ratios (GSPO, sequence MIS) add one log-prob pre-pass, since every token's gradient depends on
its whole segment.

Both backward products write their buffers in place: the first chunk writes dW, later chunks add
into it inside the GEMM (beta = 1), so no V x H temporary exists per chunk. With bf16/fp16
operands on CUDA the Triton row kernels store dz in the operand dtype over the chunk's own
float32 buffer, so the two GEMMs read it with no separate cast pass.

The loss's gradients are formed during the forward call and scaled by the incoming gradient in
backward (the loss is a scalar), as in Liger's fused linear losses.
"""

from __future__ import annotations

import math
import os
from types import ModuleType

import torch

from cod_fast.config import LossConfig
from cod_fast.ops.loss_head import HeadInputs, kernel_switches, prepare_head
from cod_fast.ops.loss_terms import LossInputs, PolicyLossOutput, loss_metrics

# A chunk's logits are sized from the shape under a memory budget: at most CHUNK_SHARE of the
# [N, V] logits a plain implementation holds (a plain loss keeps several such buffers), but at
# least MIN_CHUNK_ROWS rows, since each chunk streams the whole LM head weight three times (the
# logits, dh = dz W, dW += dz^T h) and small chunks pay that traffic more often; and never over
# the budget, CHUNK_BYTES of the device kind or COD_FAST_CHUNK_MIB MiB when that is set. The rows
# are then split evenly, so the last chunk is not a sliver and the largest chunk is as small as
# the chunk count allows. The CPU numbers were measured with `cod-fast bench kernels` (cpp, and
# cpp-fixed64 for the rule before this one: one 64 MiB chunk after another). On CUDA the budget
# is sized for throughput: at N=16384, H=4096, V=151936 a 2 GiB chunk holds 3533 rows, so five
# chunks of 3277 rows run GEMMs of thousands of rows and pay the per-chunk passes over W and dW
# five times (a 512 MiB budget made 19 chunks of 863 rows).
CHUNK_BYTES = {"cuda": 2 * 2**30, "cpu": 64 * 2**20}
CHUNK_SHARE = 1 / 4
MIN_CHUNK_ROWS = {"cuda": 4096, "cpu": 1024}
CHUNK_MIB_VAR = "COD_FAST_CHUNK_MIB"


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any operand is float64 (the tests' ground truth), else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def chunk_budget(kind: str) -> int:
    """Bytes of logits one chunk may hold on a `kind` device: COD_FAST_CHUNK_MIB MiB when set,
    else CHUNK_BYTES[kind]."""
    value = os.environ.get(CHUNK_MIB_VAR, "").strip()
    if not value:
        return CHUNK_BYTES[kind]
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"{CHUNK_MIB_VAR} must be a whole number of MiB > 0 (the logits budget of one "
            f"chunk), got {value!r}; unset it for the default ({CHUNK_BYTES[kind] >> 20} MiB "
            f"on {kind})"
        )
    return int(value) * 2**20


def chunk_rows(num_tokens: int, vocab: int, device: torch.device, dtype: torch.dtype) -> int:
    """Rows per chunk for N = `num_tokens` rows of `vocab` logits in `dtype` (see CHUNK_SHARE)."""
    kind = device.type if device.type in CHUNK_BYTES else "cpu"
    budget = chunk_budget(kind)  # a bad COD_FAST_CHUNK_MIB fails whatever the shape
    if num_tokens < 1:
        return 1
    by_budget = budget // (vocab * torch.finfo(dtype).bits // 8)
    by_shape = max(MIN_CHUNK_ROWS[kind], math.ceil(num_tokens * CHUNK_SHARE))
    most = max(1, min(num_tokens, by_budget, by_shape))
    return math.ceil(num_tokens / math.ceil(num_tokens / most))


def _gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out = a b, or out += a b, written in place in out's dtype.

    For bf16/fp16 operands and a float32 `out` (CUDA only) this is torch's out_dtype GEMM with
    out=: mm writes `out` with beta = 0, and addmm with self = out reads and writes it in the
    GEMM epilogue (beta = 1, the float32 sum of the product and out rounded once), so no
    product-sized temporary is made. (torch >= 2.10 accepts a float32 self there.)
    """
    mixed = {} if a.dtype == out.dtype else {"out_dtype": out.dtype}
    if accumulate:
        torch.addmm(out, a, b, out=out, **mixed)
    else:
        torch.mm(a, b, out=out, **mixed)


class _Gemms:
    """The three products of a chunk, with float32 (or float64) logits whatever the operands.

    On the CPU low-precision operands are upcast once per call (the BLAS has no fast bf16 path
    here); on CUDA bf16/fp16 operands stay native and the logits come out in float32. A row
    kernel module that offers `narrow_dz_view` (the Triton one) is asked for dz in the operand
    dtype, stored over the chunk's float32 logits; otherwise dz is cast for the GEMMs here.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, rows_impl=None):
        self.dtype = compute_dtype(hidden, weight)
        native = hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
        self.operand = hidden.dtype if native else self.dtype
        self.hidden = hidden.detach().to(self.operand)
        self.weight = weight.detach().to(self.operand)
        self.narrow_view = None
        if self.operand != self.dtype:
            self.narrow_view = getattr(rows_impl, "narrow_dz_view", None)

    def logits(self, rows: slice) -> torch.Tensor:
        h = self.hidden[rows]
        if self.operand == self.dtype:
            return h @ self.weight.T
        return torch.mm(h, self.weight.T, out_dtype=self.dtype)

    def dz_args(self) -> dict:
        """Extra arguments of the row kernel's rows_backward_ / rows_fused_: the dtype to store
        dz in, where the kernel stores it narrow itself."""
        return {} if self.narrow_view is None else {"dz_dtype": self.operand}

    def backward(
        self,
        z: torch.Tensor,
        rows: slice,
        grad_h: torch.Tensor | None,
        grad_w: torch.Tensor | None,
    ) -> None:
        """grad_h[rows] = dz W and grad_w += dz^T h_c from the dz the row kernel left in z.

        Both products write their buffers in place (float32+ whatever the operands); the chunk
        at row 0 writes grad_w, every later chunk adds into it.
        """
        narrow = self.narrow_view
        dz = z.to(self.operand) if narrow is None else narrow(z, self.operand)
        if grad_h is not None:
            _gemm_into(grad_h[rows], dz, self.weight, accumulate=False)
        if grad_w is not None:
            _gemm_into(grad_w, dz.T, self.hidden[rows], accumulate=rows.start > 0)


def _grad_buffers(ctx_needs: tuple[bool, bool], hidden, weight, dtype):
    """Uninitialised gradient buffers, which the chunks overwrite; grad_w is zeros when there
    are no rows (no chunk then writes it)."""
    grad_h = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if ctx_needs[0] else None
    new_w = torch.empty if hidden.shape[0] else torch.zeros
    grad_w = new_w(weight.shape, dtype=dtype, device=weight.device) if ctx_needs[1] else None
    return grad_h, grad_w


def _cast_back(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if grad is None else grad.to(like.dtype)


def logprobs_forward(
    rows_impl: ModuleType, gemms: _Gemms, targets: torch.Tensor, inv_temp: float, chunk: int
):
    """(logp, entropy, lse) [N] of every row, chunk by chunk, nothing kept of the logits."""
    n = targets.shape[0]
    out = [torch.empty(n, dtype=gemms.dtype, device=targets.device) for _ in range(3)]
    for start in range(0, n, chunk):
        rows = slice(start, start + chunk)
        for buf, value in zip(
            out, rows_impl.rows_forward(gemms.logits(rows), targets[rows], inv_temp), strict=True
        ):
            buf[rows] = value
    return tuple(out)


class ChunkedLinearLogprobs(torch.autograd.Function):
    """logp_t = log softmax(h_t W^T / T)[y_t] and H_t; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, rows_impl, chunk):
        gemms = _Gemms(hidden, weight)
        logp, entropy, lse = logprobs_forward(rows_impl, gemms, targets, inv_temp, chunk)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_temp, ctx.rows_impl, ctx.chunk = inv_temp, rows_impl, chunk
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        gemms = _Gemms(hidden, weight, ctx.rows_impl)
        grad_h, grad_w = _grad_buffers(ctx.needs_input_grad[:2], hidden, weight, gemms.dtype)
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        # The row kernels read dense vectors; a caller that stacked logp and entropy (the
        # sequence-parallel gather) hands back strided columns.
        grad_logp = grad_logp.contiguous()
        grad_entropy = None if grad_entropy is None else grad_entropy.contiguous()
        for start in range(0, targets.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            z = gemms.logits(rows)
            ctx.rows_impl.rows_backward_(
                z,
                targets[rows],
                lse[rows],
                entropy[rows],
                grad_logp[rows].to(z.dtype),
                None if grad_entropy is None else grad_entropy[rows].to(z.dtype),
                ctx.inv_temp,
                **gemms.dz_args(),
            )
            gemms.backward(z, rows, grad_h, grad_w)
            del z  # free this chunk's logits before the next chunk's exist
        return _cast_back(grad_h, hidden), _cast_back(grad_w, weight), None, None, None, None


class _FusedLinearPolicyLoss(torch.autograd.Function):
    """Scalar loss; its gradients for hidden and weight are formed in forward, chunk by chunk."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        head: HeadInputs,
        switches: dict,
        inv_temp: float,
        rows_impl: ModuleType,
        chunk: int,
        needs: tuple[bool, bool],
    ):
        gemms = _Gemms(hidden, weight, rows_impl)
        grad_h, grad_w = _grad_buffers(needs, hidden, weight, gemms.dtype)
        n = targets.shape[0]
        outs = [torch.empty(n, dtype=gemms.dtype, device=targets.device) for _ in range(4)]
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            z = gemms.logits(rows)
            values = rows_impl.rows_fused_(
                z,
                targets[rows],
                inv_temp,
                **head.rows(rows).kernel_args(),
                **switches,
                **gemms.dz_args(),
            )
            for buf, value in zip(outs, values, strict=True):
                buf[rows] = value
            gemms.backward(z, rows, grad_h, grad_w)
            del z, values  # free this chunk's logits before the next chunk's exist
        ctx.grads = (_cast_back(grad_h, hidden), _cast_back(grad_w, weight))
        logp, entropy, loss, clipped = outs
        ctx.mark_non_differentiable(logp, entropy, clipped)
        return loss.sum(), logp, entropy, clipped

    @staticmethod
    def backward(ctx, grad_loss, *_):
        # Scale the stored gradients in place and drop the context's reference, so autograd can
        # take the buffers as .grad without copying them (dW alone is V x H float32).
        grads, ctx.grads = ctx.grads, None
        grad_h, grad_w = (None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads)
        return grad_h, grad_w, None, None, None, None, None, None, None


def fused_linear_policy_loss(
    rows_impl: ModuleType,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inputs: LossInputs,
    *,
    loss_config: LossConfig,
) -> PolicyLossOutput:
    """`linear_policy_loss` through the chunked driver and the given row-kernel backend."""
    inv_temp, chunk = 1.0 / loss_config.temperature, fused_chunk(hidden, weight, targets)
    prepass = None
    if loss_config.ratio_level == "sequence":
        prepass = prepass_logprobs(rows_impl, hidden, weight, targets, inv_temp, chunk)
    head = prepare_head(
        inputs, loss_config, prepass_logp=prepass, dtype=compute_dtype(hidden, weight)
    )
    loss, logp, entropy, clipped = fused_rows(
        rows_impl, hidden, weight, targets, head, loss_config, chunk
    )
    metrics = fused_metrics(loss_config, inputs, head, logp, entropy, clipped)
    return PolicyLossOutput(loss=loss, logp=logp, metrics=metrics)


def fused_chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> int:
    """Rows per chunk of the fused driver for these operands (`chunk_rows`)."""
    dtype = compute_dtype(hidden, weight)
    return chunk_rows(targets.shape[0], weight.shape[0], hidden.device, dtype)


def prepass_logprobs(rows_impl, hidden, weight, targets, inv_temp: float, chunk: int):
    """The current log-probs [N], detached: what sequence-level ratios need before the loss."""
    return logprobs_forward(rows_impl, _Gemms(hidden, weight), targets, inv_temp, chunk)[0]


def fused_rows(
    rows_impl: ModuleType,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    head: HeadInputs,
    loss_config: LossConfig,
    chunk: int,
):
    """(loss, logp, entropy, clipped) of the tokens `head` describes: the scalar loss
    differentiable in hidden and weight (its gradients formed chunk by chunk in the forward),
    the rest per token and detached."""
    switches = kernel_switches(loss_config, on_policy=head.old is None)
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    inv_temp = 1.0 / loss_config.temperature
    return _FusedLinearPolicyLoss.apply(
        hidden, weight, targets, head, switches, inv_temp, rows_impl, chunk, needs
    )


def fused_metrics(
    loss_config: LossConfig,
    inputs: LossInputs,
    head: HeadInputs,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    clipped: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The loss's metrics from the fused driver's per-token values (`loss_metrics`)."""
    if head.seq_ratio is not None:
        ratio = head.seq_ratio
    elif head.old is None:
        ratio = torch.ones_like(logp)
    else:
        ratio = (logp - head.old).exp()
    return loss_metrics(
        loss_config,
        inputs,
        ratio=ratio,
        clipped=clipped,
        corr=head.corr,
        logp=logp,
        entropy=entropy,
    )
