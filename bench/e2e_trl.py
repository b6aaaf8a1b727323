"""The TRL contender of `cod-fast bench e2e` (cod_fast.bench.e2e): GRPOTrainer set to the same
work as cod-fast's step, its sampling timed inside `_generate_and_score_completions`."""

from __future__ import annotations

import time

from cod_fast.bench.e2e_workload import PRESET, reward, steps_of, task_prompts

PRELOAD_TRL = ("datasets", "trl", "trl.trainer.grpo_trainer")
"""What the TRL worker imports before its memory baseline."""


def trl_config(spec: dict, cfg, output_dir: str, steps: int):
    from trl import GRPOConfig

    loss = cfg.algo.loss
    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,  # TRL's default is bf16; fp32 here, as cod-fast on the CPU
        gradient_checkpointing=False,  # TRL's default is on; cod-fast's preset has it off
        learning_rate=cfg.train.lr,
        lr_scheduler_type="constant",  # cod-fast's RL learning rate is constant
        weight_decay=cfg.train.weight_decay,
        max_grad_norm=cfg.train.grad_clip,
        per_device_train_batch_size=spec["prompts"] * spec["group"],  # completions, not prompts
        gradient_accumulation_steps=1,
        num_generations=spec["group"],
        max_completion_length=spec["max_completion"],
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        beta=0.0,
        epsilon=loss.eps_low,
        epsilon_high=loss.eps_high,
        max_steps=steps,
        shuffle_dataset=False,  # both contenders see the same prompts at the same step
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=cfg.train.seed,
    )


def trl_worker(spec: dict, tmp: str):
    """TRL's `start`, as e2e_cod.cod_worker's: run(n) is one GRPOTrainer.train() of n steps."""
    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from cod_fast.config.io import load_config
    from cod_fast.envs import make_env

    cfg = load_config(PRESET)
    env = make_env(cfg.rollout.env, cfg.rollout.env_setting, cfg.rollout.env_size)
    tokenizer = AutoTokenizer.from_pretrained(spec["folder"])

    class Timed(GRPOTrainer):
        """GRPOTrainer recording the time and the shapes of each generation batch."""

        batches: list[dict]

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            prompt, completion = out["prompt_mask"], out["completion_mask"]
            lengths = completion.sum(dim=1).tolist()
            self.batches.append(
                {
                    "sample_s": time.perf_counter() - t0,
                    "completions": len(lengths),
                    "completion_lengths": lengths,
                    "real_tokens": int(prompt.sum() + completion.sum()),
                    "train_tokens": prompt.shape[0] * (prompt.shape[1] + completion.shape[1]),
                    "trainable_tokens": int(completion.sum()),
                    "adv_nonzero": float((out["advantages"] != 0).float().mean()),
                }
            )
            return out

    class Clock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.t0)

    rewards: list[list[float]] = []

    def frozenlake_reward(prompts, completions, pack_seed, **kwargs):
        seeds = map(int, pack_seed)
        rewards.append([reward(env, s, c) for s, c in zip(seeds, completions, strict=True)])
        return rewards[-1]

    def make_trainer(model, spec_: dict, prompts, output_dir: str) -> tuple:
        dataset = Dataset.from_list(
            # Pack seeds are 64-bit unsigned, beyond Arrow's int64: a string column.
            [{"prompt": tokenizer.decode(ids), "pack_seed": str(seed)} for seed, ids in prompts]
        )
        clock = Clock()
        t = Timed(
            model=model,
            reward_funcs=frozenlake_reward,
            args=trl_config(spec_, cfg, output_dir, len(prompts) // spec_["prompts"]),
            train_dataset=dataset,
            processing_class=tokenizer if not isinstance(model, str) else None,
            callbacks=[clock],
        )
        t.batches = []
        return t, clock

    # The warm-up: one step of the same path on a 1-layer model with the folder's tokenizer.
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    tiny = {"prompts": 2, "group": 2, "max_completion": 2}
    warm, _ = make_trainer(
        Qwen3ForCausalLM(config),
        spec | tiny,
        task_prompts(cfg, tokenizer, 2, start=10**6),
        f"{tmp}/warmup",
    )
    warm.train()
    del warm
    rewards.clear()

    def start():
        prompts = task_prompts(cfg, tokenizer, spec["prompts"] * steps_of(spec))
        t, clock = make_trainer(spec["folder"], spec, prompts, f"{tmp}/run")
        encoded = t.processing_class(text=list(t.train_dataset["prompt"]))["input_ids"]
        if encoded != [ids for _, ids in prompts]:
            raise RuntimeError("TRL's tokenization of the prompts differs from cod-fast's ids")

        def run(n: int) -> list[dict]:
            assert n == t.args.max_steps, (n, t.args.max_steps)
            t.train()
            return [
                batch
                | {"step_s": time_s, "train_s": time_s - batch["sample_s"], "push_s": 0.0}
                | {"rewards": r, "loss": None}
                for time_s, batch, r in zip(clock.times, t.batches, rewards, strict=True)
            ]

        return t.model, run

    return start
