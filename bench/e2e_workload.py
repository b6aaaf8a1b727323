"""The workload of `cod-fast bench e2e` (cod_fast.bench.e2e), the same for every contender:
the models of its two sizes with their tokenizers, the single-turn prompts and the reward."""

from __future__ import annotations

import itertools
import json
import string
from pathlib import Path

PRESET = "tiny-cpu-tbt"
"""The single-turn GRPO step: task-by-task advantages, `ppo` clipping, no RED weight."""
SMALL_VOCAB = 32768
ACTION_ALPHABET = frozenset("direction 1234")


# --------------------------------------------------------------------------------------------
# Models: the size's folder, with its tokenizer.


def padded_tokenizer(tokenizer, size: int):
    """`tokenizer` (a cod_fast.model.tokenizer `bpe` one) with filler entries `~aa`, `~ab`, ...
    added to its BPE vocabulary up to `size` ids: no merge produces them, so encoding is
    unchanged, and each decodes to its own text."""
    from tokenizers import Tokenizer

    from cod_fast.model.tokenizer import TINY_CHAT, TINY_SPECIALS, _wrap

    data = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    names = (
        "~" + "".join(letters)
        for n in itertools.count(2)
        for letters in itertools.product(string.ascii_lowercase, repeat=n)
    )
    free = (name for name in names if name not in vocab)
    vocab.update({name: i for i, name in zip(range(len(tokenizer), size), free, strict=False)})
    return _wrap(
        Tokenizer.from_str(json.dumps(data)), TINY_CHAT, TINY_SPECIALS, tokenizer.eos_token
    )


def save_e2e_model(size: str, folder: Path, cfg) -> Path:
    """The `size` model (cod_fast.bench.e2e's docstring) with its tokenizer, saved as a Hugging
    Face folder."""
    from cod_fast.bench.sampler_contenders import save_model

    if size == "tiny":
        return save_model("tiny", folder, cfg)
    from cod_fast.bench.train_workload import StepShape
    from cod_fast.envs import make_env
    from cod_fast.rollout.driver import DriverSettings
    from cod_fast.run.vocab import environment_tokenizer

    env = make_env(cfg.rollout.env, cfg.rollout.env_setting, cfg.rollout.env_size)
    settings = DriverSettings.from_config(cfg)
    base = environment_tokenizer(env, settings, cfg.model.vocab_size, cfg.train.seed)
    shape = StepShape(vocab=SMALL_VOCAB)
    tokenizer = padded_tokenizer(base, shape.vocab)
    eos = tokenizer.eos_token_id
    model = shape.seeded_model(eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------------------------
# The workload both contenders share: prompts and the reward.


def task_prompts(cfg, tokenizer, count: int, start: int = 0) -> list[tuple[int, list[int]]]:
    """(pack seed, prompt ids) of packs start..start+count-1: the first solve prompt of each
    pack, written by the rollout driver's own code under `cfg`'s settings."""
    from cod_fast.envs import make_env
    from cod_fast.envs.packs import make_packs, pack_seeds
    from cod_fast.rollout.chat import ChatFormat
    from cod_fast.rollout.driver import DriverSettings, MemberPlay, RolloutDriver

    env = make_env(cfg.rollout.env, cfg.rollout.env_setting, cfg.rollout.env_size)
    settings = DriverSettings.from_config(cfg)
    driver = RolloutDriver(env, None, ChatFormat(tokenizer), settings)  # type: ignore[arg-type]
    out = []
    for spec in make_packs(pack_seeds("e2e", count, cfg.train.seed, start=start), 1):
        play = MemberPlay(spec=spec, member=0)
        driver._start_solve(play)
        out.append((spec.pack_seed, play.prompt_ids))
    return out


def reward(env, pack_seed: int, text: str) -> float:
    """1 when the pack's first task takes `text` as a valid first action, else half the share
    of its characters in ACTION_ALPHABET (see the module docstring)."""
    task = env.task(pack_seed, 0)
    task.reset()
    if task.step(text).valid:
        return 1.0
    return 0.5 * sum(c in ACTION_ALPHABET for c in text.lower()) / max(len(text), 1)


def steps_of(spec: dict) -> int:
    """Steps a worker runs: the untimed warm-up ones, then the timed ones."""
    return spec["warmup"] + spec["reps"]
