"""The cod-fast contenders of `cod-fast bench e2e` (cod_fast.bench.e2e): the trainer's single-turn
GRPO step, one batched sampler call in place of the rollout driver, and the multi-turn reference,
one CoD step of the `tiny-cpu` trainer as it runs."""

from __future__ import annotations

import time

from cod_fast.bench.e2e_workload import PRESET, reward, steps_of, task_prompts
from cod_fast.bench.sampler import PRELOAD
from cod_fast.data.prefix_tree import unique_tokens

MULTITURN_PRESET = "tiny-cpu"
"""The reference row's CoD step."""
PRELOAD_COD = (*PRELOAD, "cod_fast.train.trainer")
"""What a cod-fast worker imports before its memory baseline."""


def _cod_config(preset: str, spec: dict, run_dir: str, **model):
    """The preset with the benchmark's model, sampler, workload and run folder."""
    from cod_fast.config.io import load_config

    n = spec["max_completion"]
    overrides = [
        f"rollout.sampler={spec['sampler']}",
        f"rollout.packs_per_step={spec['prompts']}",
        f"rollout.group_size={spec['group']}",
        f"rollout.max_response_tokens={n}",
        "rollout.eval_packs=0",
        "train.warm_start_steps=0",
        f"runtime.run_dir={run_dir}",
        "runtime.checkpoint_every=0",
        *(f"model.{key}={value}" for key, value in model.items()),
    ]
    return load_config(preset, overrides=overrides)


def single_turn_step(trainer, env, batch: list[tuple[int, list[int]]]) -> dict:
    """One GRPO step of `trainer` on `batch`'s prompts, G completions each: Trainer._rl_step
    with one batched sampler call in place of the rollout driver."""
    from cod_fast.algo.assign import assign_advantages
    from cod_fast.data.records import Episode, Rollout, Turn

    cfg, group = trainer.cfg, trainer.cfg.rollout.group_size
    cap = cfg.rollout.max_response_tokens
    t0 = time.perf_counter()
    prompts = [ids for _, ids in batch for _ in range(group)]
    samples = trainer.sampler.generate(prompts, [cap] * len(prompts))
    rollouts = []
    for i, sample in enumerate(samples):
        pack, member = divmod(i, group)
        turn = Turn(
            prompt_ids=prompts[i],
            response_ids=sample.token_ids,
            response_logprobs=sample.logprobs,
            finish_reason=sample.finish_reason,
        )
        r = reward(env, batch[pack][0], trainer.chat.decode(sample.token_ids))
        episode = Episode(
            pack_id=pack, member=member, kind="solve", task_index=0, turns=[turn], reward=r
        )
        rollouts.append(Rollout(pack_id=pack, member=member, env=env.name, episodes=[episode]))
    t_sampled = time.perf_counter()
    assign_advantages(rollouts, cfg.algo)
    update = trainer._update(rollouts, cfg.algo.loss, cfg.train.mini_batches)
    t_trained = time.perf_counter()
    trainer._sync_sampler()
    t_end = time.perf_counter()
    lengths = [len(s.token_ids) for s in samples]
    episodes = [r.episodes[0] for r in rollouts]
    return {
        "step_s": t_end - t0,
        "sample_s": t_sampled - t0,
        "train_s": t_trained - t_sampled,
        "push_s": t_end - t_trained,
        "completions": len(samples),
        "completion_lengths": lengths,
        "real_tokens": sum(map(len, prompts)) + sum(lengths),
        "tree_tokens": unique_tokens(
            [p + s.token_ids for p, s in zip(prompts, samples, strict=True)]
        ),
        "train_tokens": update.tokens,  # what the trainer packed
        "trainable_tokens": sum(s.trainable_tokens for s in update.steps),
        "rewards": [e.reward for e in episodes],
        "adv_nonzero": sum(e.advantage != 0 for e in episodes) / len(episodes),
        "loss": update.steps[-1].loss if update.steps else None,
    }


def _record_rollouts(trainer) -> None:
    """Give `trainer` a rollout driver that keeps its last rollouts (`driver.last`)."""
    from cod_fast.rollout.driver import RolloutDriver

    class Recorded(RolloutDriver):
        def run(self, packs, group_size, **options):
            self.last = super().run(packs, group_size, **options)
            return self.last

    recorded = Recorded(trainer.envs, trainer.sampler, trainer.chat, trainer.settings)
    trainer.driver = trainer.batches.driver = recorded


def _multiturn_step(trainer) -> dict:
    """One CoD step of the trainer (its driver from _record_rollouts): its own record, and what
    its rollouts hold."""
    record = trainer._rl_step()
    episodes = [e for r in trainer.driver.last for e in r.episodes]
    turns = [t for e in episodes for t in e.turns]
    lengths = [len(t.response_ids) for t in turns]
    return {
        **{k: record[k] for k in ("step_s", "sample_s", "train_s", "push_s")},
        "completions": len(turns),
        "completion_lengths": lengths,
        "real_tokens": sum(len(t.prompt_ids) + len(t.response_ids) for t in turns),
        "train_tokens": record["tokens"],  # prefix-merged: earlier turns are read once
        "trainable_tokens": record["trainable_tokens"],
        "rewards": [e.reward for e in episodes],
        "adv_nonzero": sum(e.advantage != 0 for e in episodes) / len(episodes),
        "loss": record["loss"],
    }


def cod_worker(spec: dict, tmp: str):
    """A cod-fast contender's `start`, after a tiny warm-up of the same path (before the memory
    baseline): start() builds the trainer and returns (model, run), run(n) runs n steps and
    returns their records."""
    from cod_fast.envs import make_env
    from cod_fast.train.trainer import Trainer

    preset = MULTITURN_PRESET if spec["contender"] == "cod-multiturn" else PRESET
    tiny = {"prompts": 2, "group": 2, "max_completion": 2, "sampler": "torch"}
    warm_cfg = _cod_config(
        PRESET,
        spec | tiny,
        f"{tmp}/warmup",
        name_or_path="builtin:tiny-qwen3",
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        intermediate_size=128,
        tokenizer="bpe",
        tokenizer_path=spec["folder"],
    )
    warm = Trainer(warm_cfg)
    env = make_env(warm_cfg.rollout.env, warm_cfg.rollout.env_setting, warm_cfg.rollout.env_size)
    single_turn_step(warm, env, task_prompts(warm_cfg, warm.tokenizer, 2, start=10**6))
    warm.close()  # a vLLM engine is shut down, not left running beside the timed one
    del warm

    def start():
        cfg = _cod_config(preset, spec, f"{tmp}/run", name_or_path=spec["folder"])
        trainer = Trainer(cfg)
        if spec["contender"] == "cod-multiturn":
            _record_rollouts(trainer)
            return trainer.policy, lambda n: [_multiturn_step(trainer) for _ in range(n)]
        p = spec["prompts"]
        prompts = task_prompts(cfg, trainer.tokenizer, p * steps_of(spec))
        batches = [prompts[i : i + p] for i in range(0, len(prompts), p)]
        return trainer.policy, lambda n: [single_turn_step(trainer, env, b) for b in batches[:n]]

    return start
