"""Benchmark cases and contenders: the inputs each contender sees and its fwd+bwd step.

Used by cod_fast.bench.kernels, one (case, contender) per worker process. Every contender gets
the same values: cod-fast implementations the gathered trainable rows; eager the full packed
row (advantage 0 on untrainable positions, the denominator the trainable count); Liger a padded
[B, T] batch with mask = trainable positions; CCE the gathered rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SEED = 1234
CONTENDERS = ("eager", "torch", "cpp", "cpp-fixed64", "triton", "liger", "liger-compiled", "cce")
# Logits one chunk of the rollout-log-prob pre-pass may hold: small, so that the pre-pass (run
# after the memory baseline, like everything that touches the inputs) never sets the peak.
_REF_CHUNK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Case:
    """A benchmark shape: packed sequences (one segment each) of which a fraction is trainable."""

    seq_lens: tuple[int, ...]
    hidden: int
    vocab: int
    trainable: float = 1.0
    gpu_only: bool = False

    def lengths(self, scale: float) -> list[int]:
        return [max(1, round(length * scale)) for length in self.seq_lens]


CASES = {
    # N = 4096 trainable tokens, all of them: four 1024-token sequences.
    "dense": Case(seq_lens=(1024,) * 4, hidden=1024, vocab=32768),
    # A CoD pack: three ~5000-token sequences, 30% of positions trainable (~4500 tokens).
    "cod-packed": Case(seq_lens=(4800, 5000, 5200), hidden=1024, vocab=32768, trainable=0.3),
    # Qwen2.5-0.5B's head: H = 896, V = 151936; N = 2048.
    "wide-vocab": Case(seq_lens=(1024,) * 2, hidden=896, vocab=151936),
    # Small packed batches, 30% trainable, where fixed buffers would dominate: 2k to 6k packed
    # tokens, vocabularies 16k (small tokenizers), 32k (Llama-2/Mistral) and 152k (Qwen).
    "packed-2k-v16k": Case(seq_lens=(640, 700, 708), hidden=1024, vocab=16384, trainable=0.3),
    "packed-6k-v32k": Case(seq_lens=(1900, 2100, 2144), hidden=1024, vocab=32768, trainable=0.3),
    "packed-2k-v152k": Case(seq_lens=(640, 700, 708), hidden=896, vocab=151936, trainable=0.3),
    "packed-4k-v152k": Case(seq_lens=(1300, 1400, 1396), hidden=896, vocab=151936, trainable=0.3),
    # An 8B-class head on a GPU: N = 16384, H = 4096, V = 151936, bf16.
    "h100": Case(seq_lens=(1024,) * 16, hidden=4096, vocab=151936, gpu_only=True),
    # Smoke test only (tests/bench/test_bench.py): seconds, not a measurement.
    "tiny": Case(seq_lens=(40, 24), hidden=32, vocab=128, trainable=0.5),
}


def _reference_logp(hidden, weight, targets):
    """Per-token log-probs by the library's chunked torch path, in chunks small enough that
    this pre-pass never sets the memory peak."""
    import torch

    from cod_fast.ops import linear_logprobs

    rows = max(1, _REF_CHUNK_BYTES // (4 * weight.shape[0]))
    with torch.no_grad():
        return linear_logprobs(hidden, weight, targets, impl="torch", chunk_size=rows)


@dataclass
class Inputs:
    """One contender's view of a case; `hidden` and `weight` are the leaves that get gradients."""

    hidden: Any
    weight: Any
    targets: Any
    advantages: Any
    segment_ids: Any
    rollout_logp: Any
    mask: Any  # padded layout only: [B, T] float, 1 at trainable positions
    n_trainable: int
    n_computed: int  # positions whose logits the contender computes


def make_inputs(case: Case, scale: float, layout: str, device, dtype) -> Inputs:
    """The case's tensors from a fixed seed, in one of three layouts.

    The model produces hidden states for the whole packed row; which rows a contender gets is
    the point of the `cod-packed` case:
    - `gathered` (cod-fast impls, CCE): only the trainable rows, as cod-fast's trainer passes.
    - `full` (eager): every position of the packed row. Untrainable positions get advantage 0
      and the token-mean denominator is the trainable count, so they add exactly nothing to the
      loss or the gradients, but their logits are computed, as a plain implementation would.
    - `padded` (Liger): Liger's GRPO loss takes [B, T, H] with an attention mask and one
      advantage per sequence, so each packed sequence becomes a row of a batch padded to the
      longest, and the mask marks the trainable positions (padding and untrainable positions
      are 0); its chunks are whole sequences, so it computes logits for all B x T positions.
    Peaked logits as in a trained model: weight entries ~ N(0, 16/H), so logits have std ~4.
    """
    import torch

    g = torch.Generator(device=device).manual_seed(SEED)
    lens = case.lengths(scale)
    total, h, v = sum(lens), case.hidden, case.vocab
    weight = torch.randn(v, h, generator=g, device=device, dtype=dtype).mul_(4 / math.sqrt(h))
    hidden = torch.randn(total, h, generator=g, device=device, dtype=dtype)
    targets = torch.randint(0, v, (total,), generator=g, device=device)
    lens_t = torch.tensor(lens, device=device)
    segment_ids = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t)
    seq_adv = torch.randn(len(lens), generator=g, device=device)
    trainable = torch.rand(total, generator=g, device=device) < case.trainable
    idx = trainable.nonzero().squeeze(1)
    n = idx.numel()
    all_trainable = n == total
    hidden_t = hidden if all_trainable else hidden[idx]
    # Rollout log-probs near the current policy's (sampler noise of ~0.1 nats): the clip is
    # active on some tokens and not others, as in training.
    roll = _reference_logp(hidden_t, weight, targets[idx])
    roll += 0.1 * torch.randn(n, generator=g, device=device)

    if layout == "gathered":
        if not all_trainable:
            del hidden
        return Inputs(
            hidden=hidden_t.requires_grad_(),
            weight=weight.requires_grad_(),
            targets=targets[idx],
            advantages=seq_adv[segment_ids[idx]],
            segment_ids=segment_ids[idx],
            rollout_logp=roll,
            mask=None,
            n_trainable=n,
            n_computed=n,
        )
    del hidden_t
    if layout == "full":
        full_roll = torch.zeros(total, device=device).index_copy_(0, idx, roll)
        return Inputs(
            hidden=hidden.requires_grad_(),
            weight=weight.requires_grad_(),
            targets=targets,
            advantages=torch.where(trainable, seq_adv[segment_ids], 0.0),
            segment_ids=segment_ids,
            rollout_logp=full_roll,
            mask=None,
            n_trainable=n,
            n_computed=total,
        )
    if layout != "padded":
        raise ValueError(f"unknown layout {layout!r}")
    b, t = len(lens), max(lens)
    pad_hidden = hidden.new_zeros(b, t, h)
    pad_targets = targets.new_zeros(b, t)
    pad_mask = torch.zeros(b, t, device=device)
    pad_roll = torch.zeros(b, t, device=device)
    full_roll = torch.zeros(total, device=device).index_copy_(0, idx, roll)
    start = 0
    for row, length in enumerate(lens):
        rows = slice(start, start + length)
        pad_hidden[row, :length] = hidden[rows]
        pad_targets[row, :length] = targets[rows]
        pad_mask[row, :length] = trainable[rows].float()
        pad_roll[row, :length] = full_roll[rows]
        start += length
    del hidden, full_roll
    return Inputs(
        hidden=pad_hidden.requires_grad_(),
        weight=weight.requires_grad_(),
        targets=pad_targets,
        advantages=seq_adv,
        segment_ids=None,
        rollout_logp=pad_roll,
        mask=pad_mask,
        n_trainable=n,
        n_computed=b * t,
    )


def _loss_config():
    from cod_fast.config import LossConfig

    return LossConfig(policy="ppo", ratio_level="token", agg="token-mean")


def make_step(contender: str):
    """(layout, step): step(inputs) runs one forward and backward and returns the loss."""
    cfg = _loss_config()

    if contender == "eager":
        from cod_fast.ops.eager import eager_policy_loss

        def step(x: Inputs):
            loss, _ = eager_policy_loss(
                x.hidden,
                x.weight,
                x.targets,
                x.advantages,
                x.segment_ids,
                cfg,
                roll=x.rollout_logp,
                denominator=x.n_trainable,
                dtype=x.hidden.dtype,
            )
            loss.backward()
            return loss

        return "full", step

    if contender in ("torch", "cpp", "cpp-fixed64", "triton"):
        from cod_fast.ops import chunked
        from cod_fast.ops.linear_loss import linear_policy_loss

        if contender == "cpp-fixed64":  # the chunk rule before shape-sized chunks: 64 MiB each
            chunked.CHUNK_SHARE = 1.0
        impl = contender.removesuffix("-fixed64")

        def step(x: Inputs):
            out = linear_policy_loss(
                x.hidden,
                x.weight,
                x.targets,
                x.advantages,
                x.segment_ids,
                rollout_logp=x.rollout_logp,
                loss_config=cfg,
                impl=impl,
            )
            out.loss.backward()
            return out.loss

        return "gathered", step

    if contender in ("liger", "liger-compiled"):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        # loss_type="dapo" normalises by the mask's sum: token-mean over trainable positions.
        # beta=0 and no reference model: no KL term. old_per_token_logps = the rollout's
        # log-probs, which is cod-fast's bypass mode. `compiled` compiles only Liger's loss
        # math (its log-prob chunks are a custom autograd.Function outside torch.compile).
        liger_loss = LigerFusedLinearGRPOLoss(
            beta=0.0,
            compiled=contender == "liger-compiled",
            use_ref_model=False,
            epsilon_low=cfg.eps_low,
            epsilon_high=cfg.eps_high,
            loss_type="dapo",
            temperature=cfg.temperature,
        )

        def step(x: Inputs):
            loss, _metrics = liger_loss(
                x.hidden,
                x.weight,
                x.targets,
                x.mask,
                x.advantages,
                old_per_token_logps=x.rollout_logp,
            )
            loss.backward()
            return loss

        return "padded", step

    if contender == "cce":
        from cut_cross_entropy import linear_cross_entropy

        from cod_fast.ops import LossInputs, policy_loss_from_logp

        # CCE is a cross-entropy kernel: its per-token losses are -logp, and cod-fast's
        # policy_loss_from_logp (differentiated by autograd) turns them into the loss. It takes
        # any [N, H] rows, so it gets the gathered trainable rows like cod-fast (its own
        # ignore_index path would drop the same rows). CCE's default gradient filtering stays on.
        def step(x: Inputs):
            logp = -linear_cross_entropy(x.hidden, x.weight, x.targets, reduction="none").float()
            inputs = LossInputs(
                x.advantages,
                x.segment_ids,
                rollout_logp=x.rollout_logp,
                denominator=x.n_trainable,
            )
            loss, _ = policy_loss_from_logp(logp, inputs, loss_config=cfg)
            loss.backward()
            return loss

        return "gathered", step

    raise ValueError(f"unknown contender {contender!r}; choose from {CONTENDERS}")
