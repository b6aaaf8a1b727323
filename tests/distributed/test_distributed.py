"""cod_fast.distributed (context, fsdp, optim_state): a 2-process gloo FSDP2 job trains like one
process, full states move between world sizes, and every function also works in one plain
process.

The 2-rank job (tests/dist_worker.py) runs once per module; its results are compared with the
same steps run here in one process.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from cod_fast.distributed.context import (
    DistContext,
    all_reduce_max,
    barrier,
    broadcast_object,
    gather_objects,
    init_distributed,
    shutdown,
)
from cod_fast.distributed.fsdp import full_parameters, load_model_state, model_state, shard_policy
from cod_fast.distributed.optim_state import load_optimizer_state, optimizer_state
from cod_fast.model.loading import load_policy
from cod_fast.model.policy import Policy
from tests import dist_worker
from tests.dist_worker import (
    GRAD_CLIP,
    KEEP_ALL,
    NEXT_STEP,
    STEPS,
    TINY,
    fresh,
    spawn_ranks,
    start_rank,
    step_batch,
    train,
)

pytestmark = pytest.mark.slow  # runs, processes or benchmarks: seconds each

WORKER_TIMEOUT_S = 240
FP32 = {"atol": 1e-5, "rtol": 1.3e-6}
SMALL, SMALL_NEXT = (11, 2, 4096), (12, 2, 4096)  # one-micro-batch steps for in-process tests


def assert_states_close(got: dict, want: dict, exact: bool = False) -> None:
    """Same keys; every tensor equal (or within FP32), listing each one that is not."""
    assert list(got) == list(want), f"keys differ: {sorted(set(got) ^ set(want))}"
    bad = []
    for name, expected in want.items():
        actual = got[name]
        try:
            torch.testing.assert_close(
                actual, expected, **({"atol": 0, "rtol": 0} if exact else FP32)
            )
        except AssertionError:
            diff = (actual.double() - expected.double()).abs()
            first = tuple(torch.nonzero(diff == diff.max())[0].tolist())
            bad.append(
                f"{name}: max |diff| {diff.max():.3g} at {first}, {int((diff > 0).sum())} differ"
            )
    assert not bad, "tensors differ:\n  " + "\n  ".join(bad)


def one_process_ctx() -> DistContext:
    return DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The steps of the 2-rank job, in one process."""
    ctx = one_process_ctx()
    policy, optimizer = fresh(ctx)
    got = {"init_params": [(n, t.clone()) for n, t in full_parameters(policy)]}
    got["steps"] = [train(policy, optimizer, STEPS[0], ctx)]
    got["first_step_state"] = model_state(policy, ctx)  # what the HSDP job trains
    got["steps"] += [train(policy, optimizer, step, ctx) for step in STEPS[1:]]
    got["model_state"] = model_state(policy, ctx)
    got["optimizer_state"] = optimizer_state(policy, optimizer, ctx)
    got["state_path"] = tmp_path_factory.mktemp("one") / "state.pt"
    torch.save((got["model_state"], got["optimizer_state"]), got["state_path"])
    train(policy, optimizer, NEXT_STEP, ctx)
    got["continued"] = model_state(policy, ctx)
    return got


def two_ranks(fn, out, *args) -> list[dict]:
    """Both ranks' results of `fn(rank, 2, port, out, *args)`, which torch.saves them to
    out/rank{r}.pt; a rank's traceback fails the test."""
    return spawn_ranks(fn, 2, (str(out), *args), out, WORKER_TIMEOUT_S, "2-rank")


@pytest.fixture(scope="module")
def ranks(one_process, tmp_path_factory):
    """Both ranks' results of tests/dist_worker.py."""
    out = tmp_path_factory.mktemp("ranks")
    return two_ranks(dist_worker.run, out, str(one_process["state_path"]))


# --- two gloo ranks against one process --------------------------------------------------------


def test_two_ranks_train_like_one_process(one_process, ranks):
    """Same loss, gradient norm, tokens and metrics per step, and the same parameters after
    three AdamW steps, on 2 FSDP2 ranks (each its share of the micro-batches, empty bins run as
    placeholders, clipping at the global norm) as in one process; an optimizer state saved and
    loaded before the first step changes nothing."""
    plans = [step_batch(step, 2)[0] for step in STEPS]
    assert any(not mb.num_tokens for plan in plans for rank in plan for mb in rank)
    assert any(s["grad_norm"] > GRAD_CLIP for s in one_process["steps"])  # clipping is active
    assert ranks[0]["fresh_optimizer_state"]["state"] == {}
    for r, rank in enumerate(ranks):
        assert rank["ctx"] == (r, 2, r, r == 0, True)
        assert rank["mesh"] == (("shard",), (2,))
        assert rank["fresh_after_round_trip"]
        for got, want in zip(rank["steps"], one_process["steps"], strict=True):
            assert got["trainable_tokens"] == want["trainable_tokens"]
            names = sorted(want["metrics"])
            assert sorted(got["metrics"]) == names
            got_values = [got["loss"], got["grad_norm"], *(got["metrics"][n] for n in names)]
            want_values = [want["loss"], want["grad_norm"], *(want["metrics"][n] for n in names)]
            torch.testing.assert_close(torch.tensor(got_values), torch.tensor(want_values), **FP32)
    assert ranks[1]["model_state"] == {} and ranks[1]["optimizer_state"] == {}
    assert_states_close(ranks[0]["model_state"], one_process["model_state"])


def test_full_parameters_under_two_ranks(one_process, ranks):
    """full_parameters on every rank: each name once, in named_parameters order, each tensor
    the full one-process initial tensor (even right after a no-grad forward)."""
    want = one_process["init_params"]
    assert len({n for n, _ in want}) == len(want)
    for rank in ranks:
        assert [n for n, _ in rank["init_params"]] == [n for n, _ in want]
        assert_states_close(dict(rank["init_params"]), dict(want), exact=True)


def test_states_move_between_world_sizes(one_process, ranks):
    """Both world sizes write the same format (names, groups, moments); the 2-rank model and
    optimizer states, loaded into fresh 2-rank (bit for bit) or 1-process policies, continue as
    the uninterrupted run, and so does a 1-process state loaded into 2 ranks."""
    two, one = ranks[0], one_process
    assert list(two["optimizer_state"]["state"]) == list(one["optimizer_state"]["state"])
    assert two["optimizer_state"]["param_groups"] == one["optimizer_state"]["param_groups"]
    for name, moments in one["optimizer_state"]["state"].items():
        assert_states_close(two["optimizer_state"]["state"][name], moments)
    assert two["resumed_2to2_tied"] and two["resumed_1to2_tied"]
    assert_states_close(two["resumed_2to2"], two["continued"], exact=True)
    assert_states_close(two["resumed_1to2"], one["continued"])

    ctx = one_process_ctx()
    policy, optimizer = fresh(ctx, seed=7)
    load_model_state(policy, two["model_state"], ctx)
    load_optimizer_state(policy, optimizer, two["optimizer_state"], ctx)
    train(policy, optimizer, NEXT_STEP, ctx)
    assert_states_close(model_state(policy, ctx), one["continued"])


def test_collectives_and_errors_reach_every_rank(ranks):
    """gather_objects is in rank order, broadcast_object gives rank 0's object, all_reduce_max
    the maximum; a state that does not fit raises on every rank (none hangs)."""
    for rank in ranks:
        assert rank["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert rank["broadcast"] == "from 0"
        assert rank["max"] == 11
        assert "missing keys: model.norm.weight" in rank.get("bad_load", "(no error)")


def test_hsdp_mesh_trains_like_one_process(one_process, ranks):
    """hsdp_replicate=2 on 2 ranks: a ("replicate", "shard") mesh of shape (2, 1), and one step
    gives the one-process loss, gradient norm and parameters."""
    for rank in ranks:
        assert rank["hsdp_mesh"] == (("replicate", "shard"), (2, 1))
        got, want = rank["hsdp_step"], one_process["steps"][0]
        torch.testing.assert_close(
            torch.tensor([got["loss"], got["grad_norm"]]),
            torch.tensor([want["loss"], want["grad_norm"]]),
            **FP32,
        )
    assert_states_close(ranks[0]["hsdp_state"], one_process["first_step_state"])


def frozen_rank(rank: int, world_size: int, port: int, out: str) -> None:
    """One rank of test_a_frozen_policy_reshards_its_root_after_a_forward: which parameters
    are sharded DTensors after a no-grad log-prob forward, for a training and a frozen policy."""
    start_rank(rank, world_size, port)
    ctx = init_distributed("cpu")
    batch = step_batch(STEPS[0], world_size)[0][rank][0]
    got = {}
    for frozen in (False, True):
        model, _ = load_policy(TINY, "cpu", seed=1)
        policy = shard_policy(Policy(model), ctx, frozen=frozen)
        policy.eval().requires_grad_(False)
        with torch.no_grad():
            logp = policy(batch, loss_config=KEEP_ALL, mode="logprobs")
        sharded = {n: isinstance(p, DTensor) for n, p in policy.model.named_parameters()}
        got[frozen] = {"sharded": sharded, "logp": logp}
    torch.save(got, Path(out) / f"rank{rank}.pt")
    shutdown(ctx)


def test_a_frozen_policy_reshards_its_root_after_a_forward(tmp_path):
    """On 2 FSDP2 ranks, after a no-grad log-prob forward (the KL reference's only use) a
    training policy's root parameters (embeddings, final norm, tied LM head) stay gathered,
    torch's default for a root, while its layers reshard; a policy sharded `frozen` (the
    reference) has every parameter a sharded DTensor again, and the same log-probs."""
    for rank in two_ranks(frozen_rank, tmp_path):
        training, frozen = rank[False], rank[True]
        root = [n for n in training["sharded"] if ".layers." not in n]
        assert root and len(root) < len(training["sharded"])
        assert not any(training["sharded"][n] for n in root)
        assert all(v for n, v in training["sharded"].items() if n not in root)
        assert all(frozen["sharded"].values()), frozen["sharded"]
        torch.testing.assert_close(frozen["logp"], training["logp"], atol=0, rtol=0)


# --- one plain process ------------------------------------------------------------------------


def test_init_without_torchrun_is_one_process(monkeypatch):
    """No WORLD_SIZE (or 1): rank 0 of 1, no mesh, no process group; errors name the field."""
    for world in (None, "1"):
        if world is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", world)
        ctx = init_distributed("cpu")
        assert (ctx.rank, ctx.world_size, ctx.mesh, ctx.device) == (0, 1, None, torch.device("cpu"))
        assert ctx.is_main and not ctx.distributed
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=r"runtime\.device"):
        init_distributed("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"runtime\.device: got 'cuda', but no CUDA"):
            init_distributed("cuda")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"runtime\.hsdp_replicate=3"):
        init_distributed("cpu", hsdp_replicate=3)
    assert not torch.distributed.is_initialized()


def test_one_process_helpers_are_identities():
    """Without a process group: shard_policy is the identity, the collectives return their
    input, barrier and shutdown do nothing."""
    ctx = one_process_ctx()
    policy, _ = fresh(ctx)
    before = list(policy.parameters())
    assert shard_policy(policy, ctx) is policy
    assert all(a is b for a, b in zip(before, policy.parameters(), strict=True))
    assert gather_objects({"a": 1}, ctx) == [{"a": 1}]
    assert broadcast_object("x", ctx) == "x"
    assert all_reduce_max(7, ctx) == 7
    barrier(ctx)
    shutdown(ctx)


def test_a_frozen_policy_stays_whole_on_a_one_rank_mesh():
    """A one-rank mesh (mixed precision in one process) shards a training policy, for its
    float32 masters, but leaves a frozen one (held in the compute dtype) whole."""
    ctx = init_distributed("cpu", one_rank_mesh=True)
    try:
        frozen, _ = fresh(one_process_ctx())
        assert shard_policy(frozen, ctx, frozen=True) is frozen
        assert not any(isinstance(p, DTensor) for p in frozen.parameters())
        training = shard_policy(fresh(one_process_ctx())[0], ctx)
        assert all(isinstance(p, DTensor) for p in training.parameters())
    finally:
        shutdown(ctx)


def test_one_process_full_parameters_and_state():
    """full_parameters: named_parameters names and tensors, the tied embedding once; model_state
    holds copies, not views of the live weights; loading it into a fresh model gives the same
    weights with the tie kept."""
    ctx = one_process_ctx()
    policy, _ = fresh(ctx)
    named = list(policy.model.named_parameters())
    got = list(full_parameters(policy))
    assert [n for n, _ in got] == [n for n, _ in named]
    assert "lm_head.weight" not in dict(got)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, named, strict=True))
    state = model_state(policy, ctx)
    assert list(state) == [n for n, _ in named]
    with torch.no_grad():
        policy.model.model.norm.weight.add_(1.0)
    assert not torch.equal(state["model.norm.weight"], policy.model.model.norm.weight)

    other, _ = fresh(ctx, seed=5)
    load_model_state(other, state, ctx)
    assert other.model.lm_head.weight is other.model.model.embed_tokens.weight
    assert_states_close(model_state(other, ctx), state, exact=True)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("model.norm.weight"), "missing keys: model.norm.weight"),
        (lambda s: s.update(extra=torch.zeros(1)), "unexpected keys: extra"),
        (lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"]}), "tied to"),
        (lambda s: s.update({"model.norm.weight": torch.zeros(3)}), r"model.norm.weight \(3,\)"),
    ],
    ids=["missing", "unexpected", "tied-alias", "shape"],
)
def test_a_state_that_does_not_fit_raises(edit, message):
    """A missing, unexpected or misshapen key raises ValueError naming it, and nothing loads."""
    ctx = one_process_ctx()
    policy, _ = fresh(ctx)
    state = model_state(fresh(ctx, seed=3)[0], ctx)
    edit(state)
    before = model_state(policy, ctx)
    with pytest.raises(ValueError, match="does not fit this model") as err:
        load_model_state(policy, state, ctx)
    assert err.match(message)
    assert_states_close(model_state(policy, ctx), before, exact=True)


def test_one_process_optimizer_state_resumes_bit_for_bit():
    """optimizer_state after a step, loaded with the model state into a fresh policy and
    optimizer: the next step gives identical parameters, and the saved state is a snapshot. A
    never-stepped optimizer stays fresh through a save and a load, which restores its
    hyperparameters (its next step is a first step)."""
    ctx = one_process_ctx()
    policy, optimizer = fresh(ctx)
    assert optimizer_state(policy, optimizer, ctx)["state"] == {} and not optimizer.state
    saved_fresh = optimizer_state(policy, optimizer, ctx)
    train(policy, optimizer, SMALL, ctx)
    weights, optim = model_state(policy, ctx), optimizer_state(policy, optimizer, ctx)
    snapshot = copy.deepcopy(optim)
    assert "model.embed_tokens.weight" in optim["state"]
    train(policy, optimizer, SMALL_NEXT, ctx)

    resumed, resumed_opt = fresh(ctx, seed=9)
    load_model_state(resumed, weights, ctx)
    load_optimizer_state(resumed, resumed_opt, optim, ctx)
    train(resumed, resumed_opt, SMALL_NEXT, ctx)
    assert_states_close(model_state(resumed, ctx), model_state(policy, ctx), exact=True)
    # The saved state is a snapshot: neither optimizer's later steps reached it.
    for name, moments in optim["state"].items():
        assert_states_close(moments, snapshot["state"][name], exact=True)

    straight, straight_opt = fresh(ctx)
    train(straight, straight_opt, SMALL, ctx)
    reloaded, reloaded_opt = fresh(ctx)
    reloaded_opt.param_groups[0]["lr"] = 0.5  # the saved hyperparameters must replace it
    load_optimizer_state(reloaded, reloaded_opt, saved_fresh, ctx)
    assert not reloaded_opt.state and reloaded_opt.param_groups[0]["lr"] == 1e-2
    train(reloaded, reloaded_opt, SMALL, ctx)
    assert_states_close(model_state(reloaded, ctx), model_state(straight, ctx), exact=True)


def test_optimizer_state_that_does_not_fit_raises():
    """An optimizer state naming parameters this model lacks raises ValueError naming them."""
    ctx = one_process_ctx()
    policy, optimizer = fresh(ctx)
    train(policy, optimizer, SMALL, ctx)
    state = optimizer_state(policy, optimizer, ctx)
    state["state"]["ghost.weight"] = state["state"].pop("model.norm.weight")
    state["param_groups"][0]["params"][-1] = "ghost.weight"
    with pytest.raises(ValueError, match=r"does not fit.*ghost\.weight"):
        load_optimizer_state(policy, optimizer, state, ctx)


EXIT_PROBE = """
import atexit, gc, sys
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

def report():  # registered first, so it runs after cod-fast's own exit handler
    alive = sum(isinstance(o, DeviceMesh) for o in gc.get_objects())
    print(f"initialized={dist.is_initialized()} meshes={alive}", flush=True)

atexit.register(report)
gc.disable()  # cycles are left to the exit path, as after a run whose cycles were not collected
from cod_fast.distributed.context import gather_objects, init_distributed

def run():
    ctx = init_distributed("cpu", one_rank_mesh=True)
    keep = {"ctx": ctx}
    keep["self"] = keep  # a reference cycle holds the mesh after run() returns
    gather_objects({"rows": list(range(100))}, ctx)

run()
"""


def test_process_groups_are_freed_before_the_interpreter_is_torn_down():
    """A gloo group whose C++ objects are freed during interpreter finalization aborts the
    process now and then (SIGABRT, after a run that ended well); cod-fast leaves the group and
    frees its meshes in an exit handler, while the interpreter is whole."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", EXIT_PROBE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "initialized=False meshes=0"
