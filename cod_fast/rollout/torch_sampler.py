"""The trainer's torch sampler: batched generation with a KV cache over any Hugging Face causal LM.

For every sampled token it returns the log-prob under the distribution it was drawn from,
vLLM's "processed" log-prob: float32 log_softmax(logits / T), then top-p filtered and
renormalised. The logits are upcast before the division because the trainer computes float32
log-probs of h W^T / T; with top_p = 1 the two are the same numbers up to the forward pass's own
rounding, so the loss's importance ratios start at 1.

How a call runs: prompts are sorted into length buckets, and each bucket is left-padded into one
batch with a 2-D attention mask and positions counted from each row's first real token, then
prefilled (logits of the last position only), so a 200-token prompt is never padded to 1000.
The buckets' KV caches are then left-padded to one width and joined, and ONE decode loop runs
for the whole call, one token per step, rows leaving the batch (and the cache) as soon as they
stop or reach their own cap: a decode step costs about the same for 8 rows as for 64 (per-step
overhead on a CPU, memory bandwidth on a GPU), so separate loops per bucket would multiply it.
Equal prompts (a group's members) are prefilled once and their copies decode from its cache
rows. Prefill and decode run through cod_fast.rollout.fast_decode where the model allows (the
same arithmetic without transformers' module stack), else through the model's forward.

On CUDA (`static_shapes`, `cuda_graphs`) the fast decode loop keeps one shape instead: the batch
padded to a row bucket and the cache to a width bucket (fast_decode.StaticCache), stopped rows
masked rather than removed, each step's tokens and log-probs read in one transfer, and the step
(decode, then draw) replayed as a CUDA graph. A small model's step there is launch-bound, and
compaction would change the shapes whenever a row stops; on a CPU a stopped row's compute is
real time, so the CPU default compacts. A row gets the same uniforms either way, so both draw
the same tokens up to their kernels' rounding.

Randomness comes from the sampler's own generator, never the global RNG: the trainer's
bit-for-bit resume depends on the global state, and `state_dict` lets a resumed run draw the
same samples. A keyed call (cod_fast.rollout.sampler) takes each row's uniforms from its key
instead, and leaves the generator as it was.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from cod_fast.checkpoint import set_generator_state
from cod_fast.rollout.fast_decode import (
    CapturedStep,
    FastDecoder,
    StaticCache,
    row_bucket,
    width_bucket,
)
from cod_fast.rollout.sampler import Sample, key_streams, keyed_uniforms, sampler_calls

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
    `uniforms` [B, 1] float64 u ~ U[0, 1), one per row. The sums are float64, so every token's interval has its probability to 1e-16 (a
    float32 running sum over 150k tokens would shift them by up to 1e-7, more than a rare token's
    p). A token with p = 0 adds nothing to the sum and can never be the first to exceed u. On a
    CPU: an exp, a cumsum and a search, 18 us for 32 rows of 334 tokens, where the exponential
    race took 180 us and torch.multinomial 150 us."""
    cdf = logp.double().exp_().cumsum_(dim=-1)
    total = cdf[:, -1:]
    u = uniforms.to(device=cdf.device, dtype=cdf.dtype) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # rounding: u < total
    return torch.searchsorted(cdf, u, right=True)


def _cache_keyword(model) -> str:
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns
    until 5.40); 5.17 knows only `past_key_values`. The signature says which this model takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _stop_ids(model, tokenizer) -> frozenset[int]:
    """The tokenizer's EOS and the model's generation-config EOS ids (Qwen lists several)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    if extra is not None:
        ids.update(int(t) for t in ([extra] if isinstance(extra, int) else extra))
    return frozenset(ids)


class TorchSampler:
    """`Sampler` over a Hugging Face causal LM in this process (see the module docstring)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        max_batch_tokens: int = 65536,
        fast_decode: bool = True,
        static_shapes: bool | None = None,
        cuda_graphs: bool | None = None,
    ):
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(
                f"temperature must be a finite number > 0 (it divides the logits), got "
                f"{temperature}; for near-greedy sampling use a small value such as 1e-3"
            )
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables the nucleus), got {top_p}")
        if max_batch_tokens < 1:
            raise ValueError(
                f"max_batch_tokens must be >= 1 (padded prefill tokens per batch), got "
                f"{max_batch_tokens}"
            )
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.seed, self.max_batch_tokens = seed, max_batch_tokens
        self.stop_ids = _stop_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        # Padding is masked out, so any valid id will do.
        self.pad_id = pad if pad is not None else min(self.stop_ids, default=0)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.calls = 0
        self._cache_kw = _cache_keyword(model)
        self.fast_decode = fast_decode
        self.decode_path = ""  # set by each call: "fast", or "transformers (why not fast)"
        cuda = self.device.type == "cuda"
        self.static_shapes = cuda if static_shapes is None else static_shapes
        self.cuda_graphs = cuda and self.static_shapes if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not (cuda and self.static_shapes):
            raise ValueError(
                "cuda_graphs=True records the static-shape decode step on a GPU: it needs a CUDA "
                f"model (this one is on {self.device}) and static_shapes not False"
            )
        # Set by each call: "static shapes" (", CUDA graphs") or "compacting (why not static)".
        self.decode_steps = ""
        self._static: _StaticRun | None = None  # the last call's buckets, reused by the next

    # --- checkpointing -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The call counter and the generator state (a CPU uint8 tensor, also for CUDA)."""
        return {"calls": self.calls, "generator": self.generator.get_state()}

    def load_state_dict(self, state: Any) -> None:
        """Take back `state_dict()`; ValueError, saying what is wrong, for a state that is not one
        (a damaged or edited checkpoint)."""
        calls = sampler_calls(state)
        set_generator_state(self.generator, state.get("generator"), "the sampler's generator state")
        self.calls = calls

    # --- generation ----------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], max_new_tokens: list[int], keys: list[int] | None = None
    ) -> list[Sample]:
        """One response per prompt, at most max_new_tokens[i] tokens for prompt i; a response
        that samples a stop token ends with it (included), finish reason "stop". With `keys`,
        response i's draws come from keys[i] alone (cod_fast.rollout.sampler)."""
        self._check_inputs(prompts, max_new_tokens)
        if keys is not None and len(keys) != len(prompts):
            raise ValueError(f"keys needs one key per prompt: {len(prompts)} prompts, {len(keys)}")
        if not prompts:
            return []
        self.calls += 1
        device = next(self.model.parameters()).device
        if device != self.device:
            raise ValueError(
                f"the model moved from {self.device} to {device} after the sampler was built; "
                "its generator lives on the old device: build the sampler after moving the model"
            )
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                # Equal prompts (a group's members) are prefilled once; each copy then decodes
                # from that prompt's cache row.
                copies = distinct_prompts(prompts)
                distinct = [prompts[same[0]] for same in copies]
                buckets = length_buckets([len(p) for p in distinct], self.max_batch_tokens)
                decoder = self._decoder()
                prefilled = [
                    self._prefill(decoder, [distinct[j] for j in bucket]) for bucket in buckets
                ]
                flat = [j for bucket in buckets for j in bucket]
                order = [i for j in flat for i in copies[j]]
                starts = [row for row, j in enumerate(flat) for _ in copies[j]]
                caps = [max_new_tokens[i] for i in order]
                streams = None if keys is None else key_streams(self.seed, [keys[i] for i in order])
                decode = self._decode_static if self._decodes_static(decoder) else self._decode
                samples = decode(decoder, *self._join(prefilled), starts, caps, streams)
        finally:
            self.model.train(was_training)
        out: list[Sample] = [None] * len(prompts)  # type: ignore[list-item]
        for i, sample in zip(order, samples, strict=True):
            out[i] = sample
        return out

    def _check_inputs(self, prompts: list[list[int]], max_new_tokens: list[int]) -> None:
        if len(prompts) != len(max_new_tokens):
            raise ValueError(
                f"max_new_tokens needs one cap per prompt: {len(prompts)} prompts, "
                f"{len(max_new_tokens)} caps"
            )
        for i, (prompt, cap) in enumerate(zip(prompts, max_new_tokens, strict=True)):
            if not isinstance(prompt, list) or not prompt:
                raise ValueError(
                    f"prompts[{i}] must be a non-empty list of token ids, got {prompt!r}"
                )
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
                raise ValueError(
                    f"prompts[{i}] must hold ints in [0, {self.vocab_size}) (the model's "
                    "vocabulary); encode text with the model's tokenizer"
                )
            if not isinstance(cap, int) or cap < 1:
                raise ValueError(f"max_new_tokens[{i}] must be an int >= 1, got {cap!r}")

    def _forward(self, ids, mask, positions, cache) -> torch.Tensor:
        """[B, V] logits of each row's last position; the cache grows by ids.shape[1]."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1]

    def _prefill(self, decoder, prompts: list[list[int]]):
        """One left-padded batch through the model: (cache, last logits [B, V], mask [B, W],
        next positions [B, 1])."""
        ids, mask = left_pad(prompts, self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Every prompt's positions start at 0 whatever its padding (pads get 0, and are masked).
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache, logits = decoder.prefill(ids, mask, positions)
        return cache, logits, mask, positions[:, -1:] + 1

    def _join(self, prefilled):
        """The buckets' batches as one: caches and masks left-padded to the widest, stacked."""
        if len(prefilled) == 1:
            return prefilled[0]
        width = max(mask.shape[1] for _, _, mask, _ in prefilled)
        cache = DynamicCache(config=self.model.config)
        for layer in range(len(prefilled[0][0].layers)):
            parts = [(c.layers[layer], width - m.shape[1]) for c, _, m, _ in prefilled]
            keys = torch.cat([F.pad(kv.keys, (0, 0, pad, 0)) for kv, pad in parts])
            values = torch.cat([F.pad(kv.values, (0, 0, pad, 0)) for kv, pad in parts])
            cache.update(keys, values, layer)
        logits = torch.cat([lg for _, lg, _, _ in prefilled])
        mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for _, _, m, _ in prefilled])
        next_pos = torch.cat([p for _, _, _, p in prefilled])
        return cache, logits, mask, next_pos

    def _decoder(self):
        """Decode steps without transformers' module stack where the model allows
        (cod_fast.rollout.fast_decode; checked at every call, since hooks or adapters may come
        and go), else through its forward; `decode_path` records which and why."""
        why = FastDecoder.supports(self.model) if self.fast_decode else "fast_decode=False"
        self.decode_path = "fast" if why is None else f"transformers ({why})"
        return FastDecoder(self.model) if why is None else _ModuleDecoder(self)

    def _decodes_static(self, decoder) -> bool:
        """Whether this call decodes with static shapes; `decode_steps` records which and why."""
        if not self.static_shapes:
            why = "static_shapes=False"
        elif not isinstance(decoder, FastDecoder):
            why = "the transformers path"
        else:
            why = decoder.static_refusal()
        if why is not None:
            self.decode_steps = f"compacting ({why})"
        else:
            self.decode_steps = "static shapes" + (", CUDA graphs" if self.cuda_graphs else "")
        return why is None

    def _decode(
        self, decoder, cache, logits, mask, next_pos, starts: list[int], caps: list[int], streams
    ) -> list[Sample]:
        """Sample until every row stopped or reached its cap; finished rows leave the batch.
        Response i starts from the prefilled batch row starts[i] (repeats allowed); `streams`
        (None: the generator) are the rows' key streams."""
        index = torch.tensor(starts, device=self.device)
        decoder.start(cache, mask, max(caps), index)
        logits, next_pos = logits[index], next_pos[index]
        responses = _Responses(caps, self.stop_ids)
        rows = list(range(len(caps)))  # the prompt each live batch row belongs to
        step = 0  # live rows decode in lockstep: each has drawn `step` tokens
        while True:
            logp = processed_logprobs(logits, self.temperature, self.top_p)
            tok = draw(logp, self._uniforms(step, streams, rows))  # [B, 1]
            step += 1
            picked = logp.gather(-1, tok)
            # One host sync per step: the stop test needs the tokens.
            keep = responses.add(rows, tok[:, 0].tolist(), picked[:, 0].tolist())
            if not keep:
                break
            if len(keep) < len(rows):
                # Finished rows leave the batch: no more compute or cache for them.
                idx = torch.tensor(keep, device=self.device)
                decoder.select(idx)
                next_pos, tok = next_pos[idx], tok[idx]
                rows = [rows[j] for j in keep]
            logits = decoder.step(tok, next_pos)
            next_pos = next_pos + 1
        return responses.samples()

    def _decode_static(
        self, decoder, cache, logits, mask, next_pos, starts: list[int], caps: list[int], streams
    ) -> list[Sample]:
        """`_decode` with every step on one (rows, width) bucket (fast_decode's StaticCache):
        stopped rows stay in the batch, masked, and each step reads the host once. The same
        samples as `_decode`: a row's uniforms are the ones `_decode` gives it."""
        n, steps = len(caps), max(caps)
        rows = row_bucket(n)
        dtype = cache.layers[0].keys.dtype
        run = self._static_run(decoder, rows, width_bucket(mask.shape[1] + steps), dtype)
        # Batch row i is response i; the padding rows repeat response 0's prompt.
        index = torch.tensor(starts + starts[:1] * (rows - n), device=self.device)
        run.load(cache, mask, next_pos, index, caps)
        table = None if streams is None else self._uniform_table(streams, steps, rows)
        responses = _Responses(caps, self.stop_ids)
        live = list(range(n))
        for step in range(steps):
            run.set_uniforms(step, len(live), table)
            if step == 0:
                run.sample(logits.index_select(0, index))
            else:
                run.step()
            drawn = run.out.tolist()  # the step's one host read: [token, log-prob] per row
            keep = responses.add(
                live, [int(drawn[r][0]) for r in live], [drawn[r][1] for r in live]
            )
            live = [live[j] for j in keep]
            if not live:
                break
        return responses.samples()

    def _static_run(self, decoder, rows: int, width: int, dtype) -> _StaticRun:
        """The last call's run when it has these buckets and the model's tensors are still
        where its graph reads them (an in-place update keeps them there; a replaced parameter
        does not), else a new one, the old one freed first (it holds a KV cache)."""
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        key = (rows, width, dtype, tuple(t.data_ptr() for t in tensors))
        if self._static is None or self._static.key != key:
            self._static = None
            self._static = _StaticRun(self, decoder, rows, width, dtype, key)
        return self._static

    def _uniform_table(self, streams, steps: int, rows: int) -> torch.Tensor:
        """[steps, rows] float64: every step's keyed uniforms, copied to the device at once
        (the padding rows' are 0)."""
        table = np.zeros((steps, rows))
        for step in range(steps):
            table[step, : len(streams)] = keyed_uniforms(streams, step)
        return torch.from_numpy(table).to(self.device)

    def _uniforms(self, step: int, streams, rows: list[int]) -> torch.Tensor:
        """[len(rows), 1] float64 uniforms for one decode step of the live `rows`: from the
        generator, or from each row's key stream."""
        if streams is None:
            shape = (len(rows), 1)
            return torch.rand(
                shape, generator=self.generator, dtype=torch.float64, device=self.device
            )
        return torch.from_numpy(keyed_uniforms(streams[rows], step)[:, None])

    # --- weights -------------------------------------------------------------------------------

    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy full tensors into the sampler's model by name, in the given order; returns how
        many were loaded. Every parameter and persistent buffer must come exactly once (a tied
        weight under any of its names); an unknown name, a repeat or a shape mismatch raises
        ValueError when it arrives (the tensors before it are already loaded), missing ones at
        the end. Needed only when the sampler holds its own copy of the policy (e.g. under FSDP).
        """
        targets = dict(self.model.state_dict(keep_vars=True))
        targets.update(self.model.named_buffers())  # non-persistent buffers: accepted, optional
        required = {id(t): name for name, t in self.model.state_dict(keep_vars=True).items()}
        seen: set[str] = set()
        loaded: set[int] = set()
        with torch.no_grad():
            for name, tensor in named:
                if name not in targets:
                    raise ValueError(
                        f"push_weights: {name!r} is not a parameter or buffer of the sampler's "
                        "model; push names as model.named_parameters() spells them"
                    )
                if name in seen:
                    raise ValueError(f"push_weights: {name!r} was given twice; push each once")
                target = targets[name]
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"push_weights: {name!r} has shape {tuple(tensor.shape)}, the model's "
                        f"is {tuple(target.shape)}; push full (gathered) tensors, not shards"
                    )
                target.data.copy_(tensor)
                seen.add(name)
                loaded.add(id(target))
        missing = sorted(name for key, name in required.items() if key not in loaded)
        if missing:
            raise ValueError(f"push_weights: no tensor was given for {missing}")
        return len(seen)


class _Responses:
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


class _StaticRun:
    """One (rows, width) bucket of `TorchSampler._decode_static`: the StaticCache, the
    sampling buffers, and the step (decode, then draw) as a CUDA graph or run eagerly. Row i's
    uniform for this step is in `uniforms`; the device tracks which rows are still decoding
    (`alive`) to hand the generator's draws to the live rows in order."""

    def __init__(self, sampler: TorchSampler, decoder, rows: int, width: int, dtype, key):
        self.key = key
        self.temperature, self.top_p = sampler.temperature, sampler.top_p
        self.generator = sampler.generator
        device = sampler.device
        self.cache = StaticCache(decoder, rows, width, dtype, device)
        self.uniforms = torch.zeros(rows, dtype=torch.float64, device=device)
        self.fresh = torch.zeros(rows, dtype=torch.float64, device=device)  # the live rows'
        self.alive = torch.zeros(rows, dtype=torch.bool, device=device)
        self.caps = torch.zeros(rows, dtype=torch.long, device=device)
        self.drawn = torch.zeros(1, dtype=torch.long, device=device)  # tokens per live row
        self.stops = torch.tensor(sorted(sampler.stop_ids) or [-1], device=device)
        self.out = torch.zeros(rows, 2, dtype=torch.float64, device=device)  # token, log-prob
        # Recorded on these buffers before any call loads them (the recording runs a step).
        self.step = (
            CapturedStep(self._decode_and_sample)
            if sampler.cuda_graphs
            else self._decode_and_sample
        )

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


class _ModuleDecoder:
    """Decode steps through the model's own forward and transformers' cache (FastDecoder's
    interface), for the architectures FastDecoder does not cover."""

    def __init__(self, sampler: TorchSampler):
        self.forward, self.config = sampler._forward, sampler.model.config

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
        cache = DynamicCache(config=self.config)
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
