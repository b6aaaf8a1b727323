"""Ulysses sequence parallelism (train.sequence_parallel) against one process, in float64.

Groups of 2 and 4 gloo ranks (and two groups of 2: data and sequence parallel together) train
the tiny Qwen3 on packed, shared-prefix and multi-segment micro-batches with a
token-level loss, a sequence-level one, and one with recomputed old log-probs and a KL term
(forwards in `logprobs` mode); the loss, every gradient and the parameters after the optimizer
step equal one process's run of the same micro-batches: to 1e-10 relative in float64 (the torch
kernels), and to float32 rounding through the C++ kernels' fused loss.
"""

from __future__ import annotations

import os

import pytest
import torch

from cod_fast import LossConfig
from cod_fast.config import ModelConfig
from cod_fast.data.packing import pack_microbatches, rollout_sequences, step_totals
from cod_fast.distributed.context import init_distributed, shutdown
from cod_fast.distributed.fsdp import full_parameters, shard_policy
from cod_fast.model.loading import load_policy
from cod_fast.model.policy import Policy
from cod_fast.ops import aggregation_denominator
from cod_fast.train.step import on_device, runnable, train_step
from tests.data.test_sequence_split import episodes
from tests.dist_worker import spawn_ranks, start_rank

# 4 query heads over 2 key/value heads: SP=2 splits both, SP=4 repeats the key/value heads.
TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48)
LOSSES = {
    "token": LossConfig(policy="rec_one_side", eps_low=0.99, eps_high=100.0, entropy_coef=0.01),
    "sequence": LossConfig(
        policy="ppo",
        ratio_level="sequence",
        agg="seq-mean-token-mean",
        eps_low=0.2,
        eps_high=0.28,
        entropy_coef=0.02,
    ),
    # old log-probs recomputed and a KL reference: forwards in `logprobs` mode
    "kl": LossConfig(policy="ppo", kl="k3", beta=0.1, eps_low=0.2, eps_high=0.2),
}


def run_steps(policy, optimizer, pick, sp: int, data_world: int) -> list[dict]:
    """For each layout (flat, shared-prefix) and loss: one optimizer step on `pick(batches)`
    of the step's micro-batches (token_budget 40 per rank: a group's micro-batches hold up to
    40 sp tokens); its loss, metrics, gradients and updated parameters."""
    seen = []
    sequences = rollout_sequences(episodes(7))
    for share in (False, True):
        batches = pack_microbatches(sequences, 40 * sp, data_world, share)
        tokens, segments = step_totals(batches)
        for name, loss in LOSSES.items():
            mine = pick(batches)
            if loss.kl is not None:
                score(policy, mine, loss)
            result = train_step(
                policy,
                optimizer,
                mine,
                denominator=aggregation_denominator(loss, tokens, segments),
                loss_config=loss,
                grad_clip=1.0,
            )
            grads = {n: _full(p.grad).clone() for n, p in policy.named_parameters()}
            seen.append(
                {
                    "case": ("shared" if share else "flat", name),
                    "loss": result.loss,
                    "norm": result.grad_norm,
                    "tokens": result.trainable_tokens,
                    "metrics": result.metrics,
                    "grads": grads,
                    "params": {n: t.clone() for n, t in full_parameters(policy)},
                }
            )
    return seen


@torch.no_grad()
def score(policy, microbatches, loss: LossConfig) -> None:
    """Old and reference log-probs from the policy, as the trainer recomputes them."""
    for mb in microbatches:
        logp = policy(on_device(runnable(mb), policy, "cpu"), loss_config=loss, mode="logprobs")
        mb.old_logp, mb.ref_logp = logp - 0.01, logp - 0.2


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


PRECISIONS = {
    # the ground truth: float64, the torch kernels (log-probs gathered, loss by autograd)
    "float64": (torch.float64, "torch", 1e-10),
    # the C++ kernels: the fused driver over each rank's tokens (closed-form gradients); SGD,
    # whose update is linear in the gradient, so float32 rounding stays rounding
    "float32": (torch.float32, "cpp", 2e-5),
}


def fresh(precision: str, ctx=None):
    """The tiny Qwen3 in `precision` (sharded over the ranks, sequence-parallel, under `ctx`)."""
    dtype, impl, _ = PRECISIONS[precision]
    model, _ = load_policy(TINY, "cpu", seed=3, dtype=dtype)
    policy = Policy(model, impl, None if ctx is None else ctx.sequence_group)
    if ctx is not None:
        policy = shard_policy(policy, ctx)
    if dtype == torch.float64:
        return policy, torch.optim.AdamW(policy.parameters(), lr=1e-2)
    return policy, torch.optim.SGD(policy.parameters(), lr=1e-2)


def sp_rank(rank: int, world: int, port: int, out: str, sp: int) -> None:
    start_rank(rank, world, port)
    ctx = init_distributed("cpu", sequence_parallel=sp)
    seen = {}
    for precision in PRECISIONS:
        policy, optimizer = fresh(precision, ctx)
        pick = lambda b: b[ctx.data_rank]  # noqa: E731
        seen[precision] = run_steps(policy, optimizer, pick, sp, ctx.data_world)
    torch.save(seen, os.path.join(out, f"rank{rank}.pt"))
    shutdown(ctx)


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    scale = want.abs().max().item() or 1.0
    return (got - want).abs().max().item() <= rel * scale


@pytest.mark.slow
@pytest.mark.parametrize(("world", "sp"), [(2, 2), (4, 4), (4, 2)])
def test_sequence_parallel_steps_equal_one_process(tmp_path, world, sp):
    """Every rank's loss, metrics, gradients and updated parameters equal one process's, which
    trains every data rank's micro-batches in one step (FSDP sums the data ranks' gradients),
    step after step: to 1e-10 relative in float64 (torch kernels), and to float32 rounding
    with the C++ kernels' fused loss."""
    ranks = spawn_ranks(sp_rank, world, (str(tmp_path), sp), tmp_path, 300, f"SP={sp}")
    for precision, (_, _, rel) in PRECISIONS.items():
        policy, optimizer = fresh(precision)
        everything = lambda b: [mb for rank in b for mb in rank]  # noqa: E731
        want = run_steps(policy, optimizer, everything, sp, world // sp)
        for rank, seen in enumerate(ranks):
            for got, ref in zip(seen[precision], want, strict=True):
                what = f"rank {rank}, {precision}, {got['case']}"
                assert got["loss"] == pytest.approx(ref["loss"], rel=rel), what
                assert got["norm"] == pytest.approx(ref["norm"], rel=rel), what
                assert got["tokens"] == ref["tokens"], what
                assert got["metrics"].keys() == ref["metrics"].keys(), what
                for key, value in ref["metrics"].items():
                    want_metric = pytest.approx(value, rel=10 * rel, abs=10 * rel)
                    assert got["metrics"][key] == want_metric, (what, key)
                for n, g in ref["grads"].items():
                    assert close(got["grads"][n], g, rel), (what, n)
                for n, t in ref["params"].items():
                    assert close(got["params"][n], t, rel), (what, n)
