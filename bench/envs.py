"""Environment and rollout-driver throughput (the environments issue's benchmark).

1. Environment steps per second, per environment: the scripted explorer plays packs; only time
   inside `reset`/`step`/`feedback` counts (the explorer's own thinking is excluded).
2. The driver's own overhead per batched sampler call: P packs x G members on FrozenLake with a
   stand-in sampler that answers instantly; overhead = wall time minus the sampler's time, per
   call. In training this must stay a small fraction of a generation call.

    python -m cod_fast.bench.envs [--packs 50] [--size full]

Prints a table and, last, one JSON line; appends rows to bench/results/envs.csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import time
from pathlib import Path

from cod_fast.envs import ENVIRONMENTS, make_env
from cod_fast.envs.base import Task, play_task
from cod_fast.envs.packs import make_packs, pack_seeds


class _TimedTask:
    """Wraps a task and accumulates the seconds spent in the environment's own methods."""

    def __init__(self, task: Task, clock: list[float], steps: list[int]):
        self._task, self._clock, self._steps = task, clock, steps

    def __getattr__(self, name):
        attr = getattr(self._task, name)
        if name not in ("reset", "step", "feedback"):
            return attr

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self._clock[0] += time.perf_counter() - start
                self._steps[0] += name == "step"

        return timed


def env_steps_per_second(name: str, packs: int, tasks: int, size: str) -> dict:
    env = make_env(name, "train", size)
    clock, steps = [0.0], [0]
    for seed in pack_seeds("bench", packs):
        agent, hints = env.explorer(), None
        for k in range(tasks):
            task = env.task(seed, k)
            timed = _TimedTask(task, clock, steps)
            play_task(timed, agent, hints)  # type: ignore[arg-type] - a transparent wrapper
            timed.feedback()
            hints = agent.write_hints(task, hints)
    return {
        "env": name,
        "steps": steps[0],
        "env_seconds": clock[0],
        "steps_per_s": steps[0] / clock[0] if clock[0] else float("inf"),
    }


def driver_overhead(packs: int, group: int, tasks: int) -> dict:
    from cod_fast.config import RolloutConfig
    from cod_fast.model.tokenizer import char_tokenizer
    from cod_fast.rollout.chat import ChatFormat
    from cod_fast.rollout.driver import DriverSettings, RolloutDriver
    from cod_fast.rollout.sampler import TextPolicySampler

    chat = ChatFormat(char_tokenizer())
    answer = "Direction 1\n--- Start of updated hints ---\n1=?\n--- End of updated hints ---"
    sampler = TextPolicySampler(lambda prompt: answer, chat)
    sampler_seconds = [0.0]
    generate = sampler.generate

    def timed_generate(prompts, caps):
        start = time.perf_counter()
        try:
            return generate(prompts, caps)
        finally:
            sampler_seconds[0] += time.perf_counter() - start

    sampler.generate = timed_generate
    driver = RolloutDriver(
        make_env("frozenlake", "train", "full"),
        sampler,
        chat,
        DriverSettings(rollout=RolloutConfig(max_response_tokens=256, env_timeout_s=None)),
    )
    start = time.perf_counter()
    rollouts = driver.run(make_packs(pack_seeds("bench-driver", packs), tasks), group)
    wall = time.perf_counter() - start
    turns = sum(len(e.turns) for r in rollouts for e in r.episodes)
    return {
        "runs": packs * group,
        "calls": sampler.calls,
        "turns": turns,
        "wall_s": wall,
        "sampler_s": sampler_seconds[0],
        "overhead_ms_per_call": 1e3 * (wall - sampler_seconds[0]) / sampler.calls,
        "overhead_us_per_turn": 1e6 * (wall - sampler_seconds[0]) / turns,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packs", type=int, default=50)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--size", default="full", choices=("tiny", "full"))
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    envs = [env_steps_per_second(name, args.packs, args.tasks, args.size) for name in ENVIRONMENTS]
    driver = driver_overhead(args.packs, args.group, args.tasks)
    print(f"{'env':<16} {'steps':>7} {'env s':>8} {'steps/s':>10}")
    for row in envs:
        print(
            f"{row['env']:<16} {row['steps']:>7} {row['env_seconds']:>8.3f} "
            f"{row['steps_per_s']:>10.0f}"
        )
    print(
        f"driver: {driver['runs']} runs, {driver['calls']} batched calls, {driver['turns']} "
        f"turns; overhead {driver['overhead_ms_per_call']:.1f} ms/call "
        f"({driver['overhead_us_per_turn']:.0f} us/turn)"
    )
    result = {
        "machine": f"{platform.processor() or platform.machine()}",
        "size": args.size,
        "envs": envs,
        "driver": driver,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    with open(out / "envs.csv", "a", newline="") as f:
        writer = csv.writer(f)
        for row in envs:
            writer.writerow(
                [
                    stamp,
                    result["machine"],
                    args.size,
                    row["env"],
                    row["steps"],
                    f"{row['steps_per_s']:.1f}",
                ]
            )
        writer.writerow(
            [
                stamp,
                result["machine"],
                args.size,
                "driver-overhead-ms-per-call",
                driver["calls"],
                f"{driver['overhead_ms_per_call']:.3f}",
            ]
        )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
