"""The torch sampler's static-shape decode path (fast_decode.StaticCache, TorchSampler with
static_shapes=True): the same samples as the compacting path, one host read per step, the same
ops on the same shapes at every step (what makes a CUDA graph's replay valid), SDPA fed the
cache itself, and the step's graph kept across calls only while the weights stay in place.
`CountingCapture` stands in for fast_decode.CapturedStep on the CPU
(tests/rollout/test_decode_memory.py counts captures with it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cod_fast.rollout import torch_batch
from cod_fast.rollout.fast_decode import row_bucket, width_bucket
from cod_fast.rollout.torch_batch import StaticRuns
from cod_fast.rollout.torch_sampler import TorchSampler
from tests.rollout.test_fast_decode import TOKENIZER, VOCAB, assert_same_samples, saved_model

HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.item.default"})


def prompts_and_caps(seed: int):
    """11 prompts (a batch bucket of 16: 5 padding rows) of 2 to 23 tokens in four length
    buckets, four of them repeated, and caps from 1 to 14 so that rows stop at many steps."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (2, 5, 7, 8, 20, 23)]
    prompts = [base[i] for i in (0, 1, 3, 1, 2, 4, 5, 1, 3, 0, 4)]
    caps = [9, 4, 14, 12, 1, 7, 14, 5, 3, 11, 13]
    return prompts, caps


class _Reads(TorchDispatchMode):
    """The addresses (data_ptr) of the tensors a function reads that it did not make: what a
    CUDA graph of it has recorded and reads at every replay."""

    def __init__(self):
        super().__init__()
        self.made: set[int] = set()  # storages of the tensors made inside
        self.read: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.made:
                self.read.add(t.data_ptr())
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.add(t.untyped_storage().data_ptr())
        return out


class _Replay:
    """A recorded step: runs it as a graph replay would, checking that it reads the very
    addresses its recording read (a graph cannot follow a tensor that moved)."""

    def __init__(self, step, pool):
        self.step, self.pool = step, pool
        self.reads = self._run()  # CapturedStep runs the step once before recording it

    def _run(self) -> set[int]:
        with _Reads() as reads:
            self.step()
        return reads.read

    def __call__(self) -> None:
        assert self._run() == self.reads, "a replay would read addresses its recording did not"


class CountingCapture:
    """fast_decode.CapturedStep's interface on the CPU: `capture(step, pool)` returns a
    replayable step whose `pool` is the pool it was recorded into (a new one for None), and
    remembers the pool every capture was given."""

    def __init__(self):
        self.pools: list[object] = []

    def __call__(self, step, pool):
        self.pools.append(pool)
        return _Replay(step, object() if pool is None else pool)


def sample(model, static: bool | None, prompts, caps, keys=None, seed=5, **kwargs):
    """(sampler, samples) of one call; the sampler's generator state tells what it consumed."""
    sampler = TorchSampler(
        model, TOKENIZER, temperature=0.8, seed=seed, static_shapes=static, **kwargs
    )
    return sampler, sampler.generate(prompts, caps, keys=keys)


@pytest.mark.parametrize(
    ("arch", "dtype", "atol"),
    [
        ("qwen3", torch.float64, 2e-6),
        ("qwen3", torch.float32, 1e-5),
        ("llama", torch.float32, 1e-5),
    ],
)
@pytest.mark.parametrize("keyed", [False, True], ids=["generator", "keyed"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_static_shapes_draw_what_compaction_draws(tmp_path, arch, dtype, atol, keyed, top_p):
    """Same seed (or keys), same samples token for token, finish reasons and log-probs within
    the dtype's rounding, whether stopped rows leave the batch or stay in it masked; unkeyed,
    both paths leave the generator in the same state (each draws for the live rows only)."""
    model = saved_model(tmp_path, arch, dtype=dtype)
    prompts, caps = prompts_and_caps(seed=1)
    keys = list(range(100, 100 + len(prompts))) if keyed else None
    static, got = sample(model, True, prompts, caps, keys, top_p=top_p)
    compacting, want = sample(model, False, prompts, caps, keys, top_p=top_p)
    assert static.decode_steps == "static shapes"
    assert compacting.decode_steps == "compacting (static_shapes=False)"
    assert_same_samples(got, want, atol=atol)
    assert torch.equal(static.generator.get_state(), compacting.generator.get_state())
    # Rows stop at several steps, by a stop token and by their caps.
    assert len({len(s.token_ids) for s in got}) >= 4
    assert {s.finish_reason for s in got} == {"stop", "length"}


def test_a_dynamic_rope_decodes_by_compaction(tmp_path):
    """A dynamic RoPE rescales by the batch's largest position, which padding rows and stopped
    rows would change: such a model keeps the compacting path, and says why."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = saved_model(tmp_path, "llama", rope_parameters=dynamic)
    prompts, caps = prompts_and_caps(seed=9)
    sampler, got = sample(model, True, prompts, caps)
    assert sampler.decode_path == "fast"
    assert (
        sampler.decode_steps
        == "compacting (rope_type 'dynamic' depends on the batch's largest position)"
    )
    assert_same_samples(got, sample(model, False, prompts, caps)[1], atol=0)


def test_buckets():
    """Rows round up to powers of two from 8, columns to multiples of 256."""
    assert [row_bucket(n) for n in (1, 7, 8, 9, 16, 17, 100)] == [8, 8, 8, 16, 16, 32, 128]
    assert [width_bucket(n) for n in (1, 255, 256, 257, 600)] == [256, 256, 256, 512, 768]


class _Recorder(TorchDispatchMode):
    """Every dispatched aten op as (name, its tensors' shapes, strides and dtypes, its other
    arguments): what a CUDA graph records, addresses aside."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        described = tuple(
            (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else repr(a)
            for a in tree_leaves((args, kwargs, out))
        )
        self.ops.append((str(func), described))
        return out


@pytest.mark.slow
def test_static_steps_dispatch_the_same_ops_on_the_same_shapes(tmp_path, monkeypatch):
    """Every decode step after the first draw dispatches the same aten ops with the same
    shapes, strides, dtypes and scalar arguments, none of them a host read: replaying one
    recorded step is the same as running each (rows stop meanwhile, the column moves)."""
    model = saved_model(tmp_path, "qwen3", dtype=torch.float32)
    steps = []
    decode_and_sample = torch_batch.StaticRun._decode_and_sample

    def recorded(run):
        with _Recorder() as recorder:
            decode_and_sample(run)
        steps.append(recorder.ops)

    monkeypatch.setattr(torch_batch.StaticRun, "_decode_and_sample", recorded)
    prompts, caps = prompts_and_caps(seed=2)
    _, samples = sample(model, True, prompts, caps, top_p=0.9)
    assert len(steps) == max(len(s.token_ids) for s in samples) - 1 >= 5
    names = {name for name, _ in steps[0]}
    assert "aten.index_copy_.default" in names and not names & HOST_READS
    for i, ops in enumerate(steps[1:], start=2):
        assert ops == steps[0], f"step {i} differs from step 1"


@pytest.mark.parametrize("keyed", [False, True], ids=["generator", "keyed"])
def test_static_path_reads_the_host_once_per_step(tmp_path, monkeypatch, keyed):
    """A static-shape call reads device values on the host once per drawn token position
    (one tolist of tokens and log-probs together), and nowhere else: no .item(), int() or
    bool() of a tensor, in prefill or decode."""
    model = saved_model(tmp_path, "qwen3", dtype=torch.float32)
    prompts, caps = prompts_and_caps(seed=3)
    reads = []
    tolist = torch.Tensor.tolist

    def counted(self):
        reads.append("tolist")
        return tolist(self)

    class Scalars(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in HOST_READS:
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    sampler = TorchSampler(model, TOKENIZER, temperature=0.8, static_shapes=True)
    with Scalars():
        samples = sampler.generate(prompts, caps, keys=list(range(len(prompts))) if keyed else None)
    assert reads == ["tolist"] * max(len(s.token_ids) for s in samples)


def test_static_steps_hand_sdpa_the_cache_with_its_own_kv_heads(tmp_path, monkeypatch):
    """The static step's SDPA reads each layer's whole cache buffer itself (no copy), last
    dimension contiguous as the fused kernels need, with the key-value heads unrepeated: the
    query heads of a group come as that head's queries, and no enable_gqa is asked for."""
    model = saved_model(tmp_path, "qwen3", dtype=torch.float32)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((q.shape, k, v, kwargs))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    sampler = TorchSampler(model, TOKENIZER, temperature=0.8, static_shapes=True)
    sampler.static_runs = StaticRuns(capture=CountingCapture())  # keeps the run to look at
    prompts, caps = prompts_and_caps(seed=4)
    sampler.generate(prompts, caps)
    cache = sampler.static_runs.runs[16, width_bucket(1)].cache
    storage = sampler.static_runs.storage
    heads, kv_heads = cache.decoder.heads, cache.decoder.kv_heads
    decode = [s for s in seen if s[1].shape[2] == width_bucket(1)]
    assert decode and len(decode) % len(cache.keys) == 0
    for i, (q_shape, k, v, kwargs) in enumerate(decode):
        assert k.stride(-1) == 1 and v.stride(-1) == 1, (k.stride(), v.stride())
        assert k.shape[1] == v.shape[1] == kv_heads < heads
        assert tuple(q_shape) == (16, kv_heads, heads // kv_heads, k.shape[-1])
        assert not kwargs.get("enable_gqa", False)
        layer = i % len(cache.keys)
        assert k.data_ptr() == cache.keys[layer].data_ptr() and k.shape == cache.keys[layer].shape
        assert v.data_ptr() == cache.values[layer].data_ptr()
        # The bucket's cache is the shared storage's first elements, not a copy.
        assert k.data_ptr() == storage.keys[layer].data_ptr()
        assert v.data_ptr() == storage.values[layer].data_ptr()


@pytest.mark.slow
def test_static_run_is_kept_while_the_weights_stay_in_place(tmp_path):
    """With graphs, a call on the same buckets replays the last call's recording (the same
    buffers, the same addresses) and sees weights updated in place; a parameter replaced by a
    new tensor, or other buckets, get a new recording. Either way the samples are the
    compacting path's on the current weights."""
    model = saved_model(tmp_path, "qwen3")
    prompts, caps = prompts_and_caps(seed=5)
    sampler = TorchSampler(model, TOKENIZER, temperature=0.8, static_shapes=True)
    sampler.static_runs = StaticRuns(capture=CountingCapture())
    sampler.generate(prompts, caps)
    first = sampler.static_runs.runs[16, width_bucket(1)]

    def check_against_compaction(seed):
        sampler.load_state_dict(
            {"calls": 0, "generator": torch.Generator().manual_seed(seed).get_state()}
        )
        got = sampler.generate(prompts, caps)
        _, want = sample(model, False, prompts, caps, seed=seed)
        assert_same_samples(got, want)

    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        mlp.down_proj.weight.mul_(3.0)
    check_against_compaction(seed=6)
    assert sampler.static_runs.runs[16, width_bucket(1)] is first and sampler.captures == 1
    mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach() * 0.5)
    check_against_compaction(seed=7)
    assert sampler.static_runs.runs[16, width_bucket(1)] is not first and sampler.captures == 2
    sampler.generate(prompts[:3], caps[:3])  # 8 rows, not 16
    assert set(sampler.static_runs.runs) == {(16, 256), (8, 256)} and sampler.captures == 3


def test_static_shape_switches_default_to_the_device():
    """On a CPU both switches default to off; CUDA graphs need static shapes and CUDA."""
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(VOCAB, 4)
    model.get_input_embeddings = lambda: model.embed
    sampler = TorchSampler(model, TOKENIZER, temperature=1.0)
    assert sampler.static_shapes is False and sampler.cuda_graphs is False
    assert TorchSampler(model, TOKENIZER, temperature=1.0, static_shapes=True).cuda_graphs is False
    with pytest.raises(ValueError, match="cuda_graphs=True"):
        TorchSampler(model, TOKENIZER, temperature=1.0, static_shapes=True, cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("keyed", [False, True], ids=["generator", "keyed"])
def test_cuda_graph_steps_draw_what_eager_steps_draw(tmp_path, keyed):
    """On CUDA: replayed graphs, the same static step run eagerly, and the compacting path
    draw the same tokens (float32; the compacting path's attention kernel differs, so its
    log-probs agree within 1e-4); a weight updated in place is seen by the replay, a replaced
    one gets a new graph."""
    model = saved_model(tmp_path, "qwen3", dtype=torch.float32).cuda()
    prompts, caps = prompts_and_caps(seed=8)
    keys = list(range(len(prompts))) if keyed else None
    graphs, got = sample(model, None, prompts, caps, keys)
    assert graphs.decode_steps == "static shapes, CUDA graphs"
    eager, same = sample(model, True, prompts, caps, keys, cuda_graphs=False)
    assert eager.decode_steps == "static shapes"
    assert_same_samples(got, same, atol=1e-6)
    _, want = sample(model, False, prompts, caps, keys)
    assert_same_samples(got, want, atol=1e-4)
    assert graphs.captures == 1
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        mlp.down_proj.weight.mul_(3.0)
    for replace in (False, True):
        if replace:
            mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach() * 0.5)
        state = graphs.state_dict()
        got = graphs.generate(prompts, caps, keys=keys)
        compacting = TorchSampler(model, TOKENIZER, temperature=0.8, seed=5, static_shapes=False)
        compacting.load_state_dict(state)
        assert_same_samples(got, compacting.generate(prompts, caps, keys=keys), atol=1e-4)
        assert graphs.captures == 1 + replace
