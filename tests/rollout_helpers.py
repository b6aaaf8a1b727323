"""A toy environment and a scripted policy for the rollout-driver tests."""

from __future__ import annotations

import re
import threading

import torch

from cod_fast.envs.base import Agent, Environment, StepOutcome, Task, rng_for
from cod_fast.model.tokenizer import CHATML, char_tokenizer  # noqa: F401 - re-exported for tests


class GuessTask(Task):
    env_name = "guess"
    max_steps = 4

    def __init__(self, pack_seed: int, task_index: int, secret: int, fail_on_step: str | None):
        super().__init__(pack_seed, task_index)
        self.secret, self.fail_on_step = secret, fail_on_step
        self.solved = False

    def prompt(self) -> str:
        return "Guess the secret digit. Answer with one digit, e.g. 7."

    def reset(self) -> str:
        return "Make a guess."

    def step(self, action: str) -> StepOutcome:
        if self.fail_on_step == "raise":
            raise RuntimeError("simulated environment failure")
        if self.fail_on_step == "hang":
            threading.Event().wait()  # never set: a step that never returns
        if self.fail_on_step == "regex":  # backtracks 2^40 times, holding the GIL throughout
            re.match(r"(a+)+$", "a" * 40 + "b")
        if self.fail_on_step == "swallow":  # an environment that catches every Exception
            try:
                threading.Event().wait()
            except Exception:
                return StepOutcome("swallowed", done=True)
        match = re.fullmatch(r"\s*(\d)\s*", action)
        if match is None:
            return StepOutcome("Expected one digit 0-9.", done=True, valid=False)
        guess = int(match.group(1))
        if guess == self.secret:
            self.solved = True
            return StepOutcome("correct", done=True)
        return StepOutcome("higher" if guess < self.secret else "lower", done=False)

    @property
    def reward(self) -> float:
        if self.fail_on_step == "nan":
            return float("nan")
        return 1.0 if self.solved else 0.0

    def feedback(self) -> str:
        return f"The secret was {self.secret}."

    @property
    def success(self) -> bool:
        return self.solved


class GuessEnv(Environment):
    """The hidden rule is the secret digit of the pack; every task asks for it."""

    name = "guess"
    description = "guess a digit"

    def __init__(self, failing_pack_seed: int | None = None, failure: str = "raise"):
        super().__init__()
        self.failing_pack_seed, self.failure = failing_pack_seed, failure

    def task(self, pack_seed: int, task_index: int) -> GuessTask:
        secret = rng_for("guess", pack_seed).randrange(10)
        failing = pack_seed == self.failing_pack_seed
        return GuessTask(pack_seed, task_index, secret, self.failure if failing else None)

    def solver(self) -> Agent:
        raise NotImplementedError

    def explorer(self) -> Agent:
        raise NotImplementedError


def guess_policy(prompt: str) -> str:
    """Scripted text policy: write the secret as a hint once seen; use a hint if there is one;
    otherwise binary-search with the higher/lower answers in the conversation so far."""
    if "Write the updated hints" in prompt:
        seen = re.search(r"The secret was (\d)", prompt)
        body = f"secret={seen.group(1)}" if seen else ""
        return f"thinking\n--- Start of updated hints ---\n{body}\n--- End of updated hints ---"
    hint = re.search(r"Hints: secret=(\d)", prompt)
    if hint:
        return hint.group(1)
    lo, hi = 0, 9
    # Special tokens are not in the decoded prompt: ChatML turns read "4\nuser\nhigher".
    for guess, answer in re.findall(r"(\d)\n(?:User: |user\n)(higher|lower)", prompt):
        if answer == "higher":
            lo = int(guess) + 1
        else:
            hi = int(guess) - 1
    return str((lo + hi) // 2)


def save_tiny_qwen3(path, tokenizer, seed: int = 0, head_dim: int = 8, scale: float = 1.0):
    """A 2-layer Qwen3 with random weights (seeded, global RNG untouched; multiplied by `scale`,
    which makes the next-token distributions more peaked, like a trained model's) saved with
    `tokenizer` like a real model folder; returns the path. Not `cod_fast.model.loading.build_tiny_qwen3`:
    this one has grouped-query attention (2 KV heads for 4 query heads), as real Qwen3 models
    do, which the samplers' KV caches and the eval tests should see."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(scale)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
