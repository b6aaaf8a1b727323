"""Runs the vLLM sampler against the real engine in a process of its own and prints one JSON line.

Why a process of its own: an in-process vLLM engine changes its process for good (a
torch.distributed group, a no-op torch.set_num_threads, NUMA memory binding, LD_PRELOAD), which
the rest of the test session must not inherit. One engine serves every scenario, in an order that
keeps them independent: sampling and seed checks first, then the weight push, then a second
engine after the first is closed. As under torchrun, the process group exists before the engine.

Usage: python -m tests.vllm_engine_worker FOLDER  (FOLDER receives the tiny model)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import weakref

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from cod_fast.config import LossConfig, ModelConfig
from cod_fast.data.packing import Segment, Sequence, build_microbatch, step_totals
from cod_fast.distributed.fsdp import full_parameters
from cod_fast.model.loading import load_policy
from cod_fast.model.policy import Policy
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.ops import aggregation_denominator
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.torch_batch import processed_logprobs
from cod_fast.rollout.vllm_sampler import VLLMSampler, engine_support
from cod_fast.train.step import train_step
from tests.rollout_helpers import save_tiny_qwen3

T = 0.7
TOP_P = 0.8


def sequences(prompts, samples, advantages=None) -> list[Sequence]:
    advantages = advantages or [0.0] * len(prompts)
    return [
        Sequence(
            tokens=p + s.token_ids,
            segments=[
                Segment(start=len(p), length=len(s.token_ids), advantage=a, rollout_logp=s.logprobs)
            ],
        )
        for p, s, a in zip(prompts, samples, advantages, strict=True)
    ]


@torch.no_grad()
def trainer_logprobs(policy: Policy, seqs: list[Sequence], temperature: float) -> list[float]:
    """The trainer's own log-probs of the response tokens: Policy over one packed micro-batch."""
    policy.eval()
    mb = build_microbatch(seqs)
    out = policy(mb, loss_config=LossConfig(temperature=temperature), mode="logprobs")
    return out.double().tolist()


@torch.no_grad()
def nucleus_reference(model64, prompts, samples) -> tuple[list[float], list[bool]]:
    """float64 processed log-probs (temperature T, top-p TOP_P) of the sampled tokens, and
    whether each token lies in its step's nucleus."""
    want, inside = [], []
    for p, s in zip(prompts, samples, strict=True):
        logits = model64(torch.tensor([p + s.token_ids])).logits[0, len(p) - 1 : -1]
        logp = processed_logprobs(logits, T, TOP_P).double()
        picked = logp.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        want += picked.tolist()
        inside += torch.isfinite(picked).tolist()
    return want, inside


def prompt_logprobs(sampler: VLLMSampler, seq: list[int]) -> list[float]:
    """The engine's log-probs (temperature 1) of every token of `seq` after the first."""
    from vllm import SamplingParams

    out = sampler.engine.generate(
        [{"prompt_token_ids": seq}],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    return [float(d[t].logprob) for t, d in zip(seq[1:], out.prompt_logprobs[1:], strict=True)]


def logps(samples) -> list[float]:
    return [lp for s in samples for lp in s.logprobs]


def sampled(sampler, policy, policy64, prompts, caps) -> tuple[dict, list]:
    """Processed log-probs of sampled tokens vs the trainer's Policy at the loss temperature."""
    samples = sampler.generate(prompts, caps)
    seqs = sequences(prompts, samples)
    return {
        "vllm": logps(samples),
        "trainer": trainer_logprobs(policy, seqs, T),
        "ref64": trainer_logprobs(policy64, seqs, T),
        "lengths": [len(s.token_ids) for s in samples],
        "caps": caps,
    }, samples


def top_p(sampler, models, policies, prompts) -> dict:
    """Top-p: the sampled tokens and their log-probs renormalised over the nucleus, beside the
    trainer's (Policy: the full softmax) and float64's full-softmax log-probs of them."""
    (model, model64), (policy, policy64) = models, policies
    nucleus = sampler.with_seed(6)
    nucleus.top_p = TOP_P
    top = nucleus.generate(prompts, [20] * len(prompts))
    want64, inside = nucleus_reference(model64, prompts, top)
    want32, _ = nucleus_reference(model, prompts, top)
    seqs = sequences(prompts, top)
    return {
        "vllm": logps(top),
        "ref64": want64,
        "eager32": want32,
        "inside": inside,
        "trainer": trainer_logprobs(policy, seqs, T),
        "full64": trainer_logprobs(policy64, seqs, T),
    }


def seeds(sampler, prompts) -> dict:
    """Same seed, other seed, and a stream restored from its state_dict."""

    def ids(s: VLLMSampler) -> list[list[int]]:
        return [x.token_ids for x in s.generate(prompts, [30] * len(prompts))]

    a, b, c = ids(sampler.with_seed(11)), ids(sampler.with_seed(11)), ids(sampler.with_seed(12))
    stream = sampler.with_seed(21)
    ids(stream)
    state = stream.state_dict()
    after = ids(stream)
    resumed = sampler.with_seed(21)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    return {
        "same_seed_equal": a == b,
        "other_seed_differs": a != c,
        "resumed_equal": ids(resumed) == after,
        "next_call_differs": after != a,
    }


def long_batch(sampler) -> dict:
    """One call whose prompts (12 of 400-700 tokens) exceed an engine step's token budget, twice
    with the same seed: it must run and repeat itself."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(400, 700, (12,), generator=g).tolist()
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in lengths]
    first = sampler.with_seed(41).generate(prompts, [8] * 12)
    again = sampler.with_seed(41).generate(prompts, [8] * 12)
    return {
        "prompt_tokens": sum(lengths),
        "equal": [a.token_ids for a in first] == [b.token_ids for b in again],
        "lengths": [len(a.token_ids) for a in first],
    }


def push(sampler, policy, prompts, caps, samples) -> dict:
    """A training step, then the push: the engine should follow the new policy."""
    fixed = prompts[1] + samples[1].token_ids + prompts[2]
    whole = Segment(
        start=1, length=len(fixed) - 1, advantage=0.0, rollout_logp=[0.0] * (len(fixed) - 1)
    )
    fixed_seq = [Sequence(tokens=fixed, segments=[whole])]
    old = trainer_logprobs(policy, fixed_seq, 1.0)
    before = prompt_logprobs(sampler, fixed)
    batch = [build_microbatch(sequences(prompts, samples, [1.0, -1.0, 0.5, -0.5]))]
    loss = LossConfig(temperature=T)
    denominator = aggregation_denominator(loss, *step_totals([batch]))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-2)
    train_step(policy, optimizer, batch, denominator=denominator, loss_config=loss, grad_clip=1e9)
    pushed = sampler.push_weights(full_parameters(policy))
    resampled = sampler.with_seed(31).generate(prompts, caps)
    return {
        "old": old,
        "new": trainer_logprobs(policy, fixed_seq, 1.0),
        "engine_before": before,
        "engine_after": prompt_logprobs(sampler, fixed),
        "pushed": pushed,
        "parameters": len(list(policy.parameters())),
        "resampled_vllm": logps(resampled),
        "resampled_trainer": trainer_logprobs(policy, sequences(prompts, resampled), T),
    }


def _model_ref(worker) -> weakref.ref:
    """A weak reference to the engine's model; runs on the worker through collective_rpc."""
    return weakref.ref(worker.model_runner.get_model())


def reopen(sampler, folder, policy, prompts, caps) -> dict:
    """Close the engine, then start a second one in this process from the same folder and push
    the policy into it: the first engine's model is freed, the process group it found is kept,
    and the second samples the policy's log-probs."""
    model = sampler.engine.collective_rpc(_model_ref)[0]
    sampler.close()
    closed = {"model_freed": model() is None, "group_kept": dist.is_initialized()}
    second = VLLMSampler.create(
        folder, temperature=T, seed=5, dtype="float32", max_model_len=1024, enforce_eager=True
    )
    second.push_weights(full_parameters(policy))
    samples = second.with_seed(51).generate(prompts, caps)
    second.close()
    return {
        **closed,
        "vllm": logps(samples),
        "trainer": trainer_logprobs(policy, sequences(prompts, samples), T),
    }


def main(folder: str) -> dict:
    tokenizer = char_tokenizer(CHATML)
    # head_dim 32: the smallest head size the CPU attention backend takes.
    save_tiny_qwen3(folder, tokenizer, seed=3, head_dim=32, scale=4.0)
    chat = ChatFormat(tokenizer)
    users = ["hi", "a longer question?", "x" * 41, "state: row 2 col 3"]
    prompts = [chat.first_prompt("sys", u) for u in users]
    caps = [5, 23, 12, 17]
    model, _ = load_policy(ModelConfig(name_or_path=folder, dtype="float32"))
    model64 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    policy, policy64 = Policy(model), Policy(model64)  # policy64: block-mask float64 truth
    # The trainer's process group under torchrun exists before the engine, which joins it.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sampler = VLLMSampler.create(
        folder, temperature=T, seed=5, dtype="float32", max_model_len=1024, enforce_eager=True
    )
    from vllm.engine.arg_utils import EngineArgs

    out: dict = {
        "sleep_mode": sampler.sleep_mode,
        "support": dataclasses.asdict(engine_support()),
        "engine_args": sorted(f.name for f in dataclasses.fields(EngineArgs)),
    }
    out["sampled"], samples = sampled(sampler, policy, policy64, prompts, caps)
    out["top_p"] = top_p(sampler, (model, model64), (policy, policy64), prompts)
    out["seeds"] = seeds(sampler, prompts)
    out["long_batch"] = long_batch(sampler)
    out["push"] = push(sampler, policy, prompts, caps, samples)  # it changes the weights
    out["reopen"] = reopen(sampler, folder, policy, prompts, caps)  # last: it closes the engine
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
