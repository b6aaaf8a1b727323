"""The batch under `TorchSampler` (cod_fast.rollout.torch_sampler): how a call's prompts become
prefilled rows, how each row draws its next token, and what runs the decode steps.

Equal prompts are merged, the distinct ones sorted into length buckets, each bucket left-padded
and prefilled, and the buckets' KV caches left-padded to one width and joined, so one decode loop
serves the whole call. Each step draws from the processed distribution (temperature, then top-p)
by inverse CDF, and `Responses` keeps the drawn tokens, log-probs and finish reasons. The steps
run through fast_decode.FastDecoder, through `ModuleDecoder` (the model's own forward) for
architectures it does not cover, or, with static shapes, through a `StaticRun`: one
(rows, width) bucket whose step may be replayed as a CUDA graph, kept across calls by
`StaticRuns` with the KV storage every bucket shares.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from cod_fast.rollout.fast_decode import KVStorage, StaticCache
from cod_fast.rollout.sampler import Sample

BUCKET_RATIO = 1.25
"""A bucket's longest prompt is at most this many times its shortest: at most ~20% padding."""


def distinct_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """The indices of equal prompts grouped, in order of first appearance."""
    first: dict[tuple[int, ...], int] = {}
    copies: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        j = first.setdefault(tuple(prompt), len(copies))
        if j == len(copies):
            copies.append([])
        copies[j].append(i)
    return copies


def length_buckets(
    lengths: list[int], max_tokens: int, ratio: float = BUCKET_RATIO
) -> list[list[int]]:
    """Indices of `lengths` grouped into buckets of similar length, shortest first.

    Greedy over the sorted lengths: a bucket takes the next prompt while the longest stays within
    `ratio` times the shortest and the padded prefill (rows x longest) within `max_tokens`; a
    prompt longer than `max_tokens` gets a bucket of its own.
    """
    buckets: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if buckets:
            bucket = buckets[-1]
            fits = lengths[i] <= ratio * lengths[bucket[0]]
            if fits and (len(bucket) + 1) * lengths[i] <= max_tokens:
                bucket.append(i)
                continue
        buckets.append([i])
    return buckets


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, W], attention mask [B, W]) of the prompts right-aligned to the longest, W."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def prefill(decoder, prompts: list[list[int]], pad_id: int, device: torch.device):
    """One left-padded batch through `decoder`: (cache, last logits [B, V], mask [B, W], next
    positions [B, 1])."""
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    # Every prompt's positions start at 0 whatever its padding (pads get 0, and are masked).
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    cache, logits = decoder.prefill(ids, mask, positions)
    return cache, logits, mask, positions[:, -1:] + 1


def join(prefilled, config):
    """The buckets' batches as one: caches and masks left-padded to the widest, stacked (a cache
    for a model with this `config`)."""
    if len(prefilled) == 1:
        return prefilled[0]
    width = max(mask.shape[1] for _, _, mask, _ in prefilled)
    cache = DynamicCache(config=config)
    for layer in range(len(prefilled[0][0].layers)):
        parts = [(c.layers[layer], width - m.shape[1]) for c, _, m, _ in prefilled]
        keys = torch.cat([F.pad(kv.keys, (0, 0, pad, 0)) for kv, pad in parts])
        values = torch.cat([F.pad(kv.values, (0, 0, pad, 0)) for kv, pad in parts])
        cache.update(keys, values, layer)
    logits = torch.cat([lg for _, lg, _, _ in prefilled])
    mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for _, _, m, _ in prefilled])
    next_pos = torch.cat([p for _, _, _, p in prefilled])
    return cache, logits, mask, next_pos


def processed_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[B, V] float32 log-probs of the sampling distribution: log_softmax(logits / T), then the
    nucleus (the fewest most likely tokens whose mass reaches top_p; the top token always)
    renormalised, every other token at -inf."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_logp.exp()
    # A token stays when the mass strictly above it has not reached top_p yet: the first one
    # always does (mass 0), and the last one kept is the one that reaches top_p.
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logp.masked_fill(drop, -math.inf).log_softmax(dim=-1)


def draw(logp: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[B, 1] token ids drawn from the rows of `logp` [B, V] (log-probs, -inf for excluded
    tokens) by inverse CDF: the first v whose cumulative probability exceeds u * total, with
    `uniforms` [B, 1] float64 u ~ U[0, 1), one per row. The sums are float64, so every token's
    interval has its probability to 1e-16 (a float32 running sum over 150k tokens would shift
    them by up to 1e-7, more than a rare token's p). A token with p = 0 adds nothing to the sum and can never be the first to exceed u. On a
    CPU: an exp, a cumsum and a search, 18 us for 32 rows of 334 tokens, where the exponential
    race took 180 us and torch.multinomial 150 us."""
    cdf = logp.double().exp_().cumsum_(dim=-1)
    total = cdf[:, -1:]
    u = uniforms.to(device=cdf.device, dtype=cdf.dtype) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # rounding: u < total
    return torch.searchsorted(cdf, u, right=True)


class Responses:
    """The tokens, log-probs and finish reasons drawn so far, one response per prompt."""

    def __init__(self, caps: list[int], stop_ids: frozenset[int]):
        self.caps, self.stop_ids = caps, stop_ids
        self.tokens: list[list[int]] = [[] for _ in caps]
        self.logps: list[list[float]] = [[] for _ in caps]
        self.finish = ["length"] * len(caps)

    def add(self, rows: list[int], tokens: list[int], logps: list[float]) -> list[int]:
        """Append token j and its log-prob to response rows[j]; the positions j whose response
        goes on (no stop token, below its cap)."""
        keep = []
        for j, (r, t, lp) in enumerate(zip(rows, tokens, logps, strict=True)):
            self.tokens[r].append(t)
            self.logps[r].append(lp)
            if t in self.stop_ids:
                self.finish[r] = "stop"
            elif len(self.tokens[r]) < self.caps[r]:
                keep.append(j)
        return keep

    def samples(self) -> list[Sample]:
        return [
            Sample(token_ids=t, logprobs=lp, finish_reason=f)
            for t, lp, f in zip(self.tokens, self.logps, self.finish, strict=True)
        ]


def cache_keyword(model) -> str:
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns
    until 5.40); 5.17 knows only `past_key_values`. The signature says which this model takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class ModuleDecoder:
    """Decode steps through the model's own forward and transformers' cache (FastDecoder's
    interface), for the architectures FastDecoder does not cover; `cache_kw` is the forward's
    name for the cache (`cache_keyword`)."""

    def __init__(self, model, cache_kw: str):
        self.model, self.cache_kw = model, cache_kw

    def forward(self, ids, mask, positions, cache) -> torch.Tensor:
        """[B, V] logits of each row's last position; the cache grows by ids.shape[1]."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: cache},
        )
        return out.logits[:, -1]

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
        cache = DynamicCache(config=self.model.config)
        return cache, self.forward(ids, mask, positions, cache)

    def start(self, cache, mask: torch.Tensor, new_tokens: int, index: torch.Tensor) -> None:
        cache.batch_select_indices(index)
        self.cache, self.mask = cache, mask[index]

    def select(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        return self.forward(tokens, self.mask, positions, self.cache)


class StaticRun:
    """One (rows, width) bucket of `TorchSampler._decode_static`: the StaticCache (its keys and
    values views of `storage`), the sampling buffers, and the step (decode, then draw), run
    eagerly or, with `capture` (fast_decode.CapturedStep or a stand-in with its interface),
    recorded into the memory pool `pool` and replayed. Row i's uniform for this step is in
    `uniforms`; the device tracks which rows are still decoding (`alive`) to hand the
    generator's draws to the live rows in order.

    The small buffers are the bucket's own, not views of shared storage as the keys and values
    are: a graph reads its buffers by address, so they live as long as the graph, and they are
    O(rows x width) bytes, the KV share's 1 / (layers x 2 x kv_heads x head_dim)."""

    def __init__(
        self,
        decoder,
        rows: int,
        width: int,
        storage: KVStorage,
        *,
        temperature: float,
        top_p: float,
        generator: torch.Generator,
        stop_ids: frozenset[int],
        capture=None,
        pool=None,
    ):
        self.temperature, self.top_p = temperature, top_p
        self.generator = generator
        device = storage.device
        self.cache = StaticCache(decoder, rows, width, storage)
        self.uniforms = torch.zeros(rows, dtype=torch.float64, device=device)
        self.fresh = torch.zeros(rows, dtype=torch.float64, device=device)  # the live rows'
        self.alive = torch.zeros(rows, dtype=torch.bool, device=device)
        self.caps = torch.zeros(rows, dtype=torch.long, device=device)
        self.drawn = torch.zeros(1, dtype=torch.long, device=device)  # tokens per live row
        self.stops = torch.tensor(sorted(stop_ids) or [-1], device=device)
        self.out = torch.zeros(rows, 2, dtype=torch.float64, device=device)  # token, log-prob
        # Recorded on these buffers before any call loads them (the recording runs a step).
        self.graph = None if capture is None else capture(self._decode_and_sample, pool)
        self.step = self._decode_and_sample if self.graph is None else self.graph

    def nbytes(self) -> int:
        """Bytes of the buffers this bucket owns: the StaticCache's mask, tokens, positions and
        column, and the sampling buffers (the keys and values are the storage's)."""
        own = (self.uniforms, self.fresh, self.alive, self.caps, self.drawn, self.stops, self.out)
        return self.cache.nbytes() + sum(t.nbytes for t in own)

    def load(self, cache, mask, next_pos, index: torch.Tensor, caps: list[int]) -> None:
        """A call's prefilled rows `index` (one per batch row) and the caps of its responses
        (batch rows past len(caps) are padding: never alive)."""
        self.cache.load(cache, mask, next_pos, index)
        padded = caps + [0] * (len(index) - len(caps))
        self.caps.copy_(torch.tensor(padded))
        torch.gt(self.caps, 0, out=self.alive)
        self.drawn.zero_()

    def set_uniforms(self, step: int, live: int, table: torch.Tensor | None) -> None:
        """This step's uniforms: row `step` of the keyed table, or `live` draws of the
        generator given to the live rows in order, as `TorchSampler._uniforms` gives them to
        the compacting batch (so both paths draw the same tokens and leave the generator in
        the same state)."""
        if table is not None:
            self.uniforms.copy_(table[step])
            return
        self.fresh[:live].uniform_(0, 1, generator=self.generator)
        rank = (self.alive.cumsum(0) - 1).clamp_(min=0)
        torch.gather(self.fresh, 0, rank, out=self.uniforms)

    def sample(self, logits: torch.Tensor) -> None:
        """Draw every row's next token from `logits` [rows, V]; `out` gets the tokens and
        their log-probs, the cache the tokens to decode next, `alive` the rows that go on."""
        logp = processed_logprobs(logits, self.temperature, self.top_p)
        tok = draw(logp, self.uniforms[:, None])
        torch.cat([tok.double(), logp.gather(-1, tok).double()], dim=1, out=self.out)
        self.cache.tokens.copy_(tok)
        self.drawn += 1
        self.alive &= (tok != self.stops).all(-1) & (self.caps > self.drawn)

    def _decode_and_sample(self) -> None:
        self.sample(self.cache.step())


class StaticRuns:
    """The static path's state across a sampler's calls: one `KVStorage` that every bucket's
    keys and values view, and a `StaticRun` per (rows, width) bucket, its step recorded by
    `capture` (None: steps run eagerly) into one memory pool that all of them share.

    A bucket is recorded once, then replayed by every call with its shape, until one of these
    drops every run (and so every graph, and the pool with them): a bucket that does not fit the
    storage (more elements, or another dtype) replaces it, sized for that bucket, and the graphs
    read the old addresses; a parameter or buffer of the model at a new address (replaced, not
    updated in place) makes the weights the graphs read stale. Without `capture` a cache buys
    nothing once the call is over (no graph reads its addresses), so `finish` frees everything.
    Each capture starts with a device synchronize and torch.cuda.empty_cache()
    (torch/cuda/graphs.py, `graph.__enter__`): keeping every bucket's graph records each bucket
    once between two `release`s (the trainer's sleep() before each training step), however
    often a rollout's calls move between buckets as prompts grow and live rows shrink."""

    def __init__(self, capture=None):
        self.capture = capture
        self.storage: KVStorage | None = None
        self.runs: dict[tuple[int, int], StaticRun] = {}
        self.weights: tuple = ()  # the data_ptrs the runs' graphs read
        self.pool = None  # the memory pool of the runs' graphs
        self.captures = 0  # graphs recorded so far

    def run(
        self, decoder, rows: int, width: int, *, dtype, device, weights: tuple, **sampling
    ) -> StaticRun:
        """The run of bucket (rows, width) for `decoder`'s model, its cache in `dtype` on
        `device`, the model's tensors at `weights` (their data_ptrs); `sampling`: StaticRun's
        sampling arguments (the sampler's own, the same at every call)."""
        if weights != self.weights:
            self.drop_runs()
            self.weights = weights
        numel = rows * decoder.kv_heads * width * decoder.head_dim
        if self.storage is None or not self.storage.fits(numel, dtype, device):
            self.drop_runs()
            self.storage = None  # the old storage is freed before the new one is allocated
            self.storage = KVStorage(len(decoder.layers), numel, dtype, device)
        run = self.runs.get((rows, width))
        if run is None:
            run = StaticRun(
                decoder, rows, width, self.storage, capture=self.capture, pool=self.pool, **sampling
            )
            if run.graph is not None:
                self.pool = run.graph.pool
                self.captures += 1
            self.runs[rows, width] = run
        return run

    def finish(self) -> None:
        """A call is over: without graphs, free everything (see the class docstring)."""
        if self.capture is None:
            self.release()

    def drop_runs(self) -> None:
        """Forget every bucket's run and graph, and their pool (a pool whose graphs are gone
        takes no further capture: fast_decode.CapturedStep)."""
        self.runs = {}
        self.pool = None

    def release(self) -> None:
        """Free the storage, the runs, their graphs and pool."""
        self.drop_runs()
        self.storage = None
        self.weights = ()

    def held_bytes(self) -> int:
        """Bytes of the buffers held now: the KV storage (layers x 2 x kv_heads x head_dim x
        itemsize x the largest bucket's rows x width) and each run's own buffers (`StaticRun.
        nbytes`). The graphs' pool (one step's intermediates, shared by the graphs) is not
        counted: its size is the allocator's to know."""
        storage = 0 if self.storage is None else self.storage.nbytes()
        return storage + sum(run.nbytes() for run in self.runs.values())
