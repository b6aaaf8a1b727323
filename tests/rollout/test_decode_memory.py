"""What the torch sampler's static decode path holds between calls (torch_batch.StaticRuns):
nothing without CUDA graphs; with them, one KV storage for every bucket (the largest bucket's
size, as a memory plan counts it) and one recording per bucket, kept until the storage grows,
a parameter is replaced or sleep() frees it all. Recording is counted on the CPU with
`CountingCapture` (fast_decode.CapturedStep's interface), which also checks that every replay
reads the addresses its recording read; the samples are the compacting path's throughout."""

from __future__ import annotations

import gc

import pytest
import torch

from cod_fast.rollout import torch_batch
from cod_fast.rollout.fast_decode import row_bucket, width_bucket
from cod_fast.rollout.torch_batch import StaticRuns
from cod_fast.rollout.torch_sampler import TorchSampler
from tests.rollout.test_fast_decode import TOKENIZER, VOCAB, assert_same_samples, saved_model
from tests.rollout.test_static_decode import CountingCapture


def random_call(g: torch.Generator, count: int):
    """`count` prompts of 2 to 20 random tokens, the first repeated when count > 2 (a group's
    members), with caps from 1 to 14: a call whose cache fits one 256-column bucket."""
    lengths = torch.randint(2, 21, (count,), generator=g).tolist()
    prompts = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]
    if count > 2:
        prompts[-1] = prompts[0]
    caps = torch.randint(1, 15, (count,), generator=g).tolist()
    return prompts, caps


def samplers(model, capture=None):
    """(static-shape sampler, compacting sampler) with one seed: called alike, they draw alike."""
    static = TorchSampler(model, TOKENIZER, temperature=0.8, seed=3, static_shapes=True)
    if capture is not None:
        static.static_runs = StaticRuns(capture=capture)
    compacting = TorchSampler(model, TOKENIZER, temperature=0.8, seed=3, static_shapes=False)
    return static, compacting


def call_both(static, compacting, prompts, caps, keys=None):
    """One call of each; the samples must agree (float64 model: float32 log-prob rounding)."""
    got = static.generate(prompts, caps, keys=keys)
    assert static.decode_steps == "static shapes"
    assert_same_samples(got, compacting.generate(prompts, caps, keys=keys))


def kv_bytes(model, rows: int, width: int) -> int:
    """The memory plan's count: rows_bucket x width_bucket x layers x 2 x kv_heads x head_dim
    x itemsize."""
    config = model.config
    layers, kv_heads, head_dim = (
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
    )
    return rows * width * layers * 2 * kv_heads * head_dim * model.dtype.itemsize


def small_bytes(rows: int, width: int, itemsize: int, stops: int) -> int:
    """A bucket's own buffers: the additive mask (rows x width, the cache's dtype); per row the
    tokens, positions, caps, uniforms and the generator's draws (int64 / float64, 8 bytes each),
    the alive flag (1) and the [token, log-prob] pair read back (16); the column and the drawn
    count (8 each); and the stop ids (8 each)."""
    return rows * width * itemsize + rows * (5 * 8 + 1 + 16) + 2 * 8 + 8 * stops


def tensor_bytes_reachable(sampler) -> int:
    """Bytes of the tensors reachable from the sampler through its own objects (cod_fast
    classes) and their containers, the model's parameters and buffers aside: what it keeps
    whatever it reports."""
    model_storages = {
        t.untyped_storage().data_ptr()
        for t in (*sampler.model.parameters(), *sampler.model.buffers())
    }
    seen, storages, todo = set(), {}, [sampler]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in model_storages:
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict | list | tuple | set | frozenset):
            todo.extend(gc.get_referents(obj))
        elif type(obj).__module__.startswith("cod_fast") and hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return sum(storages.values())


def test_nothing_is_held_after_a_call_without_graphs(tmp_path):
    """Without CUDA graphs (the CPU) a static-shape call's KV cache and buffers are freed as
    the call returns, as they are when it raises: held_bytes() is 0 and no tensor of the
    sampler's but the model's is left (a 9-row call would keep 16 rows x 256 columns)."""
    model = saved_model(tmp_path, "qwen3")
    sampler, compacting = samplers(model)
    prompts, caps = random_call(torch.Generator().manual_seed(11), 9)
    call_both(sampler, compacting, prompts, caps)
    assert sampler.held_bytes() == 0 and sampler.captures == 0
    assert tensor_bytes_reachable(sampler) == 0


def test_nothing_is_held_after_a_call_that_raises(tmp_path, monkeypatch):
    """A call that fails mid-decode frees what it took as well."""
    model = saved_model(tmp_path, "qwen3")
    sampler = TorchSampler(model, TOKENIZER, temperature=0.8, static_shapes=True)

    def fails(*args):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(torch_batch.StaticRun, "set_uniforms", fails)
    with pytest.raises(RuntimeError, match="interrupted"):
        sampler.generate(*random_call(torch.Generator().manual_seed(12), 5))
    assert sampler.held_bytes() == 0 and tensor_bytes_reachable(sampler) == 0


def test_each_bucket_is_recorded_once(tmp_path):
    """With graphs, calls that alternate between a 16-row and an 8-row bucket record each
    once (the larger first: the storage never grows), all into the first recording's pool;
    every replay reads what its recording read, and the samples are the compacting path's,
    keyed or not."""
    model = saved_model(tmp_path, "qwen3")
    capture = CountingCapture()
    static, compacting = samplers(model, capture)
    g = torch.Generator().manual_seed(13)
    for count, keyed in [(12, False), (3, False), (12, True), (3, False), (12, False)]:
        prompts, caps = random_call(g, count)
        keys = list(range(50, 50 + count)) if keyed else None
        call_both(static, compacting, prompts, caps, keys)
    assert static.captures == 2
    assert set(static.static_runs.runs) == {(16, 256), (8, 256)}
    first_pool = static.static_runs.runs[16, 256].graph.pool
    assert capture.pools == [None, first_pool]


@pytest.mark.slow  # 0.5-1 s: left to the full suite
def test_a_larger_bucket_grows_the_storage_and_records_again(tmp_path):
    """An 8-row bucket, then a 16-row one: the storage is replaced by one for 16 rows, every
    recording on the old storage is dropped with its pool, and the 8-row bucket is recorded
    again (into the new pool) on its next call, then replayed."""
    model = saved_model(tmp_path, "qwen3")
    capture = CountingCapture()
    static, compacting = samplers(model, capture)
    g = torch.Generator().manual_seed(14)
    call_both(static, compacting, *random_call(g, 3))
    small = static.static_runs.storage
    assert static.captures == 1 and small.nbytes() == kv_bytes(model, 8, 256)
    call_both(static, compacting, *random_call(g, 12))
    assert static.static_runs.storage.nbytes() == kv_bytes(model, 16, 256)
    assert static.captures == 2
    assert set(static.static_runs.runs) == {(16, 256)}
    for count in (3, 12, 3):
        call_both(static, compacting, *random_call(g, count))
    assert static.captures == 3
    assert capture.pools == [None, None, static.static_runs.runs[16, 256].graph.pool]


def test_held_bytes_are_the_largest_bucket_and_the_buckets_buffers(tmp_path):
    """While held, held_bytes() is the storage the memory plan counts for the largest bucket
    (rows_bucket x width_bucket x layers x 2 x kv_heads x head_dim x itemsize) plus each kept
    bucket's own buffers (`small_bytes`); sleep() frees it all, and the next call records
    again into a new pool."""
    model = saved_model(tmp_path, "qwen3")
    capture = CountingCapture()
    static, compacting = samplers(model, capture)
    g = torch.Generator().manual_seed(15)
    item, stops = model.dtype.itemsize, len(static.stop_ids)
    call_both(static, compacting, *random_call(g, 12))
    rows, width = row_bucket(12), width_bucket(1)
    assert static.held_bytes() == kv_bytes(model, rows, width) + small_bytes(
        rows, width, item, stops
    )
    call_both(static, compacting, *random_call(g, 3))
    assert static.held_bytes() == (
        kv_bytes(model, 16, 256)
        + small_bytes(16, 256, item, stops)
        + small_bytes(8, 256, item, stops)
    )
    assert tensor_bytes_reachable(static) == static.held_bytes()
    static.sleep()
    assert static.held_bytes() == 0 and tensor_bytes_reachable(static) == 0
    assert static.static_runs.runs == {} and static.static_runs.pool is None
    call_both(static, compacting, *random_call(g, 3))
    assert static.captures == 3 and capture.pools[-1] is None
    static.close()
    assert static.held_bytes() == 0


@pytest.mark.slow  # 0.5-1 s: left to the full suite
def test_a_replaced_parameter_is_recorded_again(tmp_path):
    """A weight updated in place is read by the kept recording (same address); a parameter
    replaced by a new tensor drops every recording and its pool, and the next call records
    again. The samples are the compacting path's on the current weights throughout."""
    model = saved_model(tmp_path, "qwen3")
    capture = CountingCapture()
    static, compacting = samplers(model, capture)
    g = torch.Generator().manual_seed(16)
    call_both(static, compacting, *random_call(g, 12))
    call_both(static, compacting, *random_call(g, 3))
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        mlp.down_proj.weight.mul_(3.0)
    call_both(static, compacting, *random_call(g, 12))
    assert static.captures == 2
    mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach() * 0.5)
    call_both(static, compacting, *random_call(g, 12))
    assert static.captures == 3 and capture.pools[-1] is None
    assert set(static.static_runs.runs) == {(16, 256)}
    call_both(static, compacting, *random_call(g, 3))
    assert static.captures == 4


@pytest.mark.gpu
def test_cuda_graphs_are_kept_per_bucket_and_freed_by_sleep(tmp_path):
    """On CUDA: alternating buckets record one graph each into one pool, replays draw what
    the compacting path draws, and sleep() gives the storage back to the allocator."""
    model = saved_model(tmp_path, "qwen3", dtype=torch.float32).cuda()
    graphs = TorchSampler(model, TOKENIZER, temperature=0.8, seed=3)
    compacting = TorchSampler(model, TOKENIZER, temperature=0.8, seed=3, static_shapes=False)
    g = torch.Generator().manual_seed(17)
    for count in (12, 3, 12, 3):
        prompts, caps = random_call(g, count)
        got = graphs.generate(prompts, caps)
        assert_same_samples(got, compacting.generate(prompts, caps), atol=1e-4)
    assert graphs.captures == 2 and graphs.decode_steps == "static shapes, CUDA graphs"
    pools = {run.graph.pool for run in graphs.static_runs.runs.values()}
    assert len(pools) == 1
    held = graphs.static_runs.storage.nbytes()
    assert held == kv_bytes(model, 16, 256)
    before = torch.cuda.memory_allocated()
    graphs.sleep()
    assert graphs.held_bytes() == 0
    assert before - torch.cuda.memory_allocated() >= held
