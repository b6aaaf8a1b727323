"""A few "connect the dots" (CoD) training steps on the CPU, top to bottom, without the Trainer.

Every step plays packs of FrozenLake tasks with a tiny model (docs/concepts.md sections 1-2),
turns their rewards into CoD advantages (section 3), packs the episodes into micro-batches
(section 5) and takes one AdamW step on the fused policy loss (section 4), then prints the
step's mean task reward and loss. `cod-fast train` runs these same pieces
(cod_fast.train.trainer) with what a real run adds around them: the warm start on scripted
demonstrations, evaluations, checkpoints, several processes, vLLM.

    python examples/minimal_loop.py [STEPS]      # default 10 steps, about a second each

The model starts from random weights and never reaches a goal in so few steps. What it does
learn here is the length penalty: a response cut at the length limit loses 0.5, so the reward
rises from about -0.45 towards 0 as the model learns to end its responses (the `tiny-cpu`
preset warm-starts the model on scripted demonstrations before RL, which is what gets it to
the goals).
"""

from __future__ import annotations

import sys

import torch

from cod_fast.algo.assign import assign_advantages
from cod_fast.config.io import load_config
from cod_fast.data.packing import pack_microbatches, rollout_sequences, step_totals
from cod_fast.envs import make_env
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.model.loading import load_policy
from cod_fast.model.policy import Policy
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.ops import aggregation_denominator
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.rollout.torch_sampler import TorchSampler
from cod_fast.train.step import train_step


def main(steps: int) -> None:
    # The run's config: the tiny-cpu preset (float32 on the CPU, tiny FrozenLake, compact
    # prompts) with a smaller model and batch and one character per token, so a step takes
    # about a second; a length penalty gives the random model a reward it can improve. The
    # loss's temperature and length limit follow the rollout's (the config sees to it).
    cfg = load_config(
        "tiny-cpu",
        overrides=[
            "model.tokenizer=char",
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.intermediate_size=64",
            "rollout.packs_per_step=2",
            "rollout.group_size=4",
            "rollout.tasks_per_pack=3",
            "rollout.max_response_tokens=16",
            "rollout.length_penalty=0.5",
            "train.lr=1e-2",
        ],
    )
    rollout, algo, train = cfg.rollout, cfg.algo, cfg.train
    torch.manual_seed(train.seed)

    # The model, loaded as any model is: `model.name_or_path` may as well name a Hugging Face
    # folder or hub id, which then brings its own tokenizer and chat template.
    model, tokenizer = load_policy(cfg.model, "cpu", train.seed, char_tokenizer(CHATML))
    chat = ChatFormat.for_model(tokenizer, cfg.model)

    # Rollouts: the environment, a sampler over the very module being trained (so it always
    # samples the latest weights) and the driver that plays packs x members in batched calls.
    env = make_env(rollout.env, rollout.env_setting, rollout.env_size)
    sampler = TorchSampler(model, tokenizer, temperature=rollout.temperature, seed=train.seed)
    driver = RolloutDriver(env, sampler, chat, DriverSettings.from_config(cfg))

    # Training: the model wrapped so that its forward ends in the fused loss, and AdamW.
    policy = Policy(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=train.lr, weight_decay=train.weight_decay)

    for step in range(steps):
        # 1. Play: each pack by group_size members, each carrying its hints from task to task.
        seeds = pack_seeds(
            "train", rollout.packs_per_step, train.seed, start=step * rollout.packs_per_step
        )
        packs = make_packs(seeds, rollout.tasks_per_pack)
        rollouts = driver.run(packs, rollout.group_size, keyed=rollout.keyed_sampling)

        # 2. Credit: each episode's advantage against its pack's group (written onto it).
        assign_advantages(rollouts, algo)

        # 3. Pack: every turn's tokens into micro-batches of at most token_budget tokens.
        episodes = [episode for r in rollouts for episode in r.episodes]
        (microbatches,) = pack_microbatches(rollout_sequences(episodes), train.token_budget)
        tokens, segments = step_totals([microbatches])

        # 4. Learn: the loss summed over micro-batches with the step's one denominator, the
        # gradient clipped, one AdamW step.
        result = train_step(
            policy,
            optimizer,
            microbatches,
            denominator=aggregation_denominator(algo.loss, tokens, segments),
            loss_config=algo.loss,
            grad_clip=train.grad_clip,
        )
        rewards = [reward for r in rollouts for reward in r.task_rewards]
        print(
            f"step {step + 1}: reward {sum(rewards) / len(rewards):.4f} "
            f"loss {result.loss:.6f} grad_norm {result.grad_norm:.4f} "
            f"tokens {result.trainable_tokens}",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
