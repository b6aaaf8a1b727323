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
same arithmetic without transformers' module stack), else through the model's forward. The
batch's pieces (buckets, prefill and join, the draw, the step runners) are in
cod_fast.rollout.torch_batch; this module holds the sampler and its decode loops.

On CUDA (`static_shapes`, `cuda_graphs`) the fast decode loop keeps one shape instead: the batch
padded to a row bucket and the cache to a width bucket (fast_decode.StaticCache), stopped rows
masked rather than removed, each step's tokens and log-probs read in one transfer, and the step
(decode, then draw) replayed as a CUDA graph. A small model's step there is launch-bound, and
compaction would change the shapes whenever a row stops; on a CPU a stopped row's compute is
real time, so the CPU default compacts. A row gets the same uniforms either way, so both draw
the same tokens up to their kernels' rounding. Every bucket's graph is kept
(`torch_batch.StaticRuns`), its KV cache a view of one storage sized for the largest bucket,
until `sleep()` (before every training step) frees them all; without graphs the cache is freed
as each call returns. `held_bytes()` and `captures` say what the sampler holds and how often it recorded.

Randomness comes from the sampler's own generator, never the global RNG: the trainer's
bit-for-bit resume depends on the global state, and `state_dict` lets a resumed run draw the
same samples. A keyed call (cod_fast.rollout.sampler) takes each row's uniforms from its key
instead, and leaves the generator as it was.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from cod_fast.common.rng import set_generator_state
from cod_fast.rollout.fast_decode import CapturedStep, FastDecoder, row_bucket, width_bucket
from cod_fast.rollout.sampler import Sample, key_streams, keyed_uniforms, sampler_calls
from cod_fast.rollout.torch_batch import (
    ModuleDecoder,
    Responses,
    StaticRun,
    StaticRuns,
    cache_keyword,
    distinct_prompts,
    draw,
    join,
    length_buckets,
    prefill,
    processed_logprobs,
)


def stop_ids(model, tokenizer) -> frozenset[int]:
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
        self.stop_ids = stop_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        # Padding is masked out, so any valid id will do.
        self.pad_id = pad if pad is not None else min(self.stop_ids, default=0)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.calls = 0
        self._cache_kw = cache_keyword(model)
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
        # The static path's buckets and KV storage (graphs recorded by `capture`), kept between
        # calls with CUDA graphs.
        self.static_runs = StaticRuns(capture=CapturedStep if self.cuda_graphs else None)

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
                    prefill(decoder, [distinct[j] for j in bucket], self.pad_id, self.device)
                    for bucket in buckets
                ]
                flat = [j for bucket in buckets for j in bucket]
                order = [i for j in flat for i in copies[j]]
                starts = [row for row, j in enumerate(flat) for _ in copies[j]]
                caps = [max_new_tokens[i] for i in order]
                streams = None if keys is None else key_streams(self.seed, [keys[i] for i in order])
                decode = self._decode_static if self._decodes_static(decoder) else self._decode
                batch = join(prefilled, self.model.config)
                samples = decode(decoder, *batch, starts, caps, streams)
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

    def _decoder(self):
        """Decode steps without transformers' module stack where the model allows
        (cod_fast.rollout.fast_decode; checked at every call, since hooks or adapters may come
        and go), else through its forward; `decode_path` records which and why."""
        why = FastDecoder.supports(self.model) if self.fast_decode else "fast_decode=False"
        self.decode_path = "fast" if why is None else f"transformers ({why})"
        return FastDecoder(self.model) if why is None else ModuleDecoder(self.model, self._cache_kw)

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
        responses = Responses(caps, self.stop_ids)
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
        rows, steps = row_bucket(len(caps)), max(caps)
        try:
            run = self._static_run(decoder, rows, width_bucket(mask.shape[1] + steps), cache)
            # Batch row i is response i; the padding rows repeat response 0's prompt.
            index = torch.tensor(starts + starts[:1] * (rows - len(caps)), device=self.device)
            run.load(cache, mask, next_pos, index, caps)
            table = None if streams is None else self._uniform_table(streams, steps, rows)
            return self._static_steps(run, logits.index_select(0, index), caps, table)
        finally:
            self.static_runs.finish()

    def _static_steps(self, run: StaticRun, logits, caps: list[int], table) -> list[Sample]:
        """Sample on a loaded `run` from the first step's `logits` [rows, V] until every row
        stopped or reached its cap; `table`: the keyed uniforms (None: the generator's)."""
        responses = Responses(caps, self.stop_ids)
        live = list(range(len(caps)))
        for step in range(max(caps)):
            run.set_uniforms(step, len(live), table)
            if step == 0:
                run.sample(logits)
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

    def _static_run(self, decoder, rows: int, width: int, cache) -> StaticRun:
        """The run of bucket (rows, width) for a prefilled `cache`: kept from an earlier call
        while the model's tensors are still where its graph reads them (an in-place update keeps
        them there; a replaced parameter does not) and the storage it views was not replaced,
        else a new one."""
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        return self.static_runs.run(
            decoder,
            rows,
            width,
            dtype=cache.layers[0].keys.dtype,
            device=self.device,
            weights=tuple(t.data_ptr() for t in tensors),
            temperature=self.temperature,
            top_p=self.top_p,
            generator=self.generator,
            stop_ids=self.stop_ids,
        )

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

    # --- memory --------------------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Bytes of buffers the sampler holds now, between calls: the static path's KV storage
        and its buckets' own buffers (torch_batch.StaticRuns.held_bytes); 0 without CUDA graphs,
        and after sleep() or close(). The model's weights are not counted."""
        return self.static_runs.held_bytes()

    @property
    def captures(self) -> int:
        """How many decode-step graphs the sampler has recorded so far."""
        return self.static_runs.captures

    def sleep(self) -> None:
        """Free the static path's KV storage, CUDA graphs and their memory pool, for the training
        step (the trainer calls this before each); the next call records its graphs again. The
        memory goes back to torch's caching allocator, where training's allocations reuse it;
        the graphs' pool is returned at the allocator's next release, which an allocation that
        would otherwise fail triggers (c10/cuda/CUDACachingAllocator.cpp, graph_pools_freeable).
        The model is the trainer's own, or a copy that keeps its weights."""
        self.static_runs.release()

    def close(self) -> None:
        """Free what sleep() frees; the model belongs to whoever made the sampler."""
        self.static_runs.release()
