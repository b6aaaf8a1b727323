"""The rank processes of tests/distributed/test_distributed.py, and the batches both sides train on.

`run` is one rank of a 2-process gloo job (started by torch.multiprocessing): it shards the tiny
Qwen3 with cod_fast.distributed.fsdp, trains the steps of `STEPS`, round-trips the full model and
optimizer states, and torch.saves what it saw to `out/rank{r}.pt`. The test runs the same steps
in one process and compares. No test functions here.
"""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from cod_fast import LossConfig
from cod_fast.config import ModelConfig
from cod_fast.data.packing import pack_microbatches, rollout_sequences, step_totals
from cod_fast.distributed.context import (
    all_reduce_max,
    broadcast_object,
    gather_objects,
    init_distributed,
    shutdown,
)
from cod_fast.distributed.fsdp import full_parameters, load_model_state, model_state, shard_policy
from cod_fast.distributed.optim_state import load_optimizer_state, optimizer_state
from cod_fast.model.loading import load_policy
from cod_fast.model.policy import Policy
from cod_fast.ops import aggregation_denominator
from cod_fast.train.step import train_step
from tests.data.test_layout_invariance import random_episode

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
KEEP_ALL = LossConfig(policy="rec_one_side", eps_low=0.99, eps_high=100.0)
GRAD_CLIP = 1.0
# (episode seed, episodes, token budget) per step. With 2 ranks: 3 micro-batches each; 4 each
# with rank 1's last one empty; 3 each with rank 0's last one empty. The last step is the one
# every restored state continues with.
STEPS = [(0, 10, 30), (8, 7, 18), (4, 5, 25)]
NEXT_STEP = (1, 8, 30)


def step_batch(step: tuple[int, int, int], world_size: int):
    """(batches[rank][i], the step's global denominator) for one entry of STEPS."""
    seed, episodes, budget = step
    rng = random.Random(seed)
    eps = [random_episode(rng, p, "solve", 0) for p in range(episodes)]
    batches = pack_microbatches(rollout_sequences(eps), budget, world_size)
    tokens, segments = step_totals(batches)
    return batches, aggregation_denominator(KEEP_ALL, tokens, segments)


def fresh(ctx, seed: int = 1):
    """The tiny Qwen3 as a (sharded, under several ranks) Policy and its AdamW."""
    model, _ = load_policy(TINY, "cpu", seed=seed)
    policy = shard_policy(Policy(model), ctx)
    return policy, torch.optim.AdamW(policy.parameters(), lr=1e-2)


def train(policy, optimizer, step, ctx) -> dict:
    batches, denominator = step_batch(step, ctx.world_size)
    result = train_step(
        policy,
        optimizer,
        batches[ctx.rank],
        denominator=denominator,
        loss_config=KEEP_ALL,
        grad_clip=GRAD_CLIP,
    )
    return vars(result)


def free_port() -> int:
    """A free TCP port on the loopback, for a job's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, world: int, args: tuple, out, timeout_s: float, what: str) -> list[dict]:
    """Every rank's results of `fn(rank, world, port, *args)`, which torch.saves them to
    out/rank{r}.pt; a rank's traceback, or a job past `timeout_s`, fails the test (`what` names
    the job in the message)."""
    job = mp.start_processes(
        fn, args=(world, free_port(), *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not job.join(timeout=max(deadline - time.monotonic(), 0)):
            if time.monotonic() >= deadline:
                pytest.fail(f"the {what} job did not finish in {timeout_s} s")
    except ProcessException as err:
        pytest.fail(f"a rank of the {what} job failed:\n{err}", pytrace=False)
    finally:
        for proc in job.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def start_rank(rank: int, world_size: int, port: int) -> None:
    """What torchrun gives a rank on one node (loopback, one CPU thread each)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)


def run(rank: int, world_size: int, port: int, out: str, one_process_state: str) -> None:
    """One rank: everything the distributed tests check, written to out/rank{rank}.pt."""
    start_rank(rank, world_size, port)
    ctx = init_distributed("cpu")
    got: dict = {
        "ctx": (ctx.rank, ctx.world_size, ctx.local_rank, ctx.is_main, ctx.distributed),
        "mesh": (ctx.mesh.mesh_dim_names, tuple(ctx.mesh.shape)),
    }

    policy, optimizer = fresh(ctx)
    # A no-grad forward leaves the root gathered; the gathers must still see the true weights.
    probe = step_batch(STEPS[0], world_size)[0][ctx.rank][0]
    with torch.no_grad():
        policy(probe, loss_config=KEEP_ALL, mode="logprobs")
    got["init_params"] = [(name, t.clone()) for name, t in full_parameters(policy)]
    # Saving and loading a never-stepped optimizer must leave it fresh (the steps compare it).
    got["fresh_optimizer_state"] = optimizer_state(policy, optimizer, ctx)
    load_optimizer_state(policy, optimizer, got["fresh_optimizer_state"], ctx)
    got["fresh_after_round_trip"] = not optimizer.state
    got["steps"] = [train(policy, optimizer, step, ctx) for step in STEPS]
    weights = model_state(policy, ctx)
    optim = optimizer_state(policy, optimizer, ctx)
    got["model_state"], got["optimizer_state"] = weights, optim
    train(policy, optimizer, NEXT_STEP, ctx)
    got["continued"] = model_state(policy, ctx)

    for label, (w, o) in {
        "resumed_2to2": (weights, optim),
        "resumed_1to2": torch.load(one_process_state) if ctx.is_main else ({}, {}),
    }.items():
        policy, optimizer = fresh(ctx, seed=7)
        load_model_state(policy, w, ctx)
        load_optimizer_state(policy, optimizer, o, ctx)
        got[f"{label}_tied"] = (
            policy.model.lm_head.weight is policy.model.get_input_embeddings().weight
        )
        train(policy, optimizer, NEXT_STEP, ctx)
        got[label] = model_state(policy, ctx)

    try:  # the main rank's state lacks a key: every rank must raise, none may hang
        load_model_state(
            policy, {k: v for k, v in weights.items() if k != "model.norm.weight"}, ctx
        )
    except ValueError as err:
        got["bad_load"] = str(err)

    got["gathered"] = gather_objects({"rank": rank}, ctx)
    got["broadcast"] = broadcast_object(f"from {rank}", ctx)
    got["max"] = all_reduce_max(10 + rank, ctx)

    hsdp = init_distributed("cpu", hsdp_replicate=2)
    got["hsdp_mesh"] = (hsdp.mesh.mesh_dim_names, tuple(hsdp.mesh.shape))
    policy, optimizer = fresh(hsdp)
    got["hsdp_step"] = train(policy, optimizer, STEPS[0], hsdp)
    got["hsdp_state"] = model_state(policy, hsdp)

    torch.save(got, Path(out) / f"rank{rank}.pt")
    shutdown(ctx)
