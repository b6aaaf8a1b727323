"""Mixed-domain runs below the trainer: packs of several environments in one driver, the
environment draw, the tokenizer over all environments, and the packing of teacher log-probs."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from cod_fast.config import RolloutConfig
from cod_fast.data.packing import Segment, Sequence, build_microbatch, episode_sequences
from cod_fast.envs import make_env
from cod_fast.envs.packs import draw_env, make_packs, pack_seeds
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.rollout.sampler import TextPolicySampler
from cod_fast.rollout.scripted import demonstrations, transcripts
from cod_fast.run.vocab import environment_tokenizer
from tests.rollout_helpers import GuessEnv, guess_policy


class OtherGuessEnv(GuessEnv):
    name = "guess2"


def test_one_driver_plays_packs_of_several_environments_in_shared_sampler_calls():
    """Each pack is played in the environment it names (its rollouts and episodes carry that
    name, its tasks come from that environment), all runs share the batched sampler calls, and
    a pack naming no environment, or one the driver lacks, is refused."""
    chat = ChatFormat(char_tokenizer(CHATML))
    sampler = TextPolicySampler(guess_policy, chat)
    driver = RolloutDriver([GuessEnv(), OtherGuessEnv()], sampler, chat, DriverSettings())
    packs = make_packs(pack_seeds("test", 4), 3)
    named = [dataclasses.replace(p, env=("guess", "guess2")[i % 2]) for i, p in enumerate(packs)]
    rollouts = driver.run(named, group_size=2)
    assert [r.env for r in rollouts] == ["guess", "guess", "guess2", "guess2"] * 2
    assert all(e.env == r.env for r in rollouts for e in r.episodes)
    assert all(r.task_rewards == [1.0, 1.0, 1.0] for r in rollouts)
    single = TextPolicySampler(guess_policy, chat)
    RolloutDriver(GuessEnv(), single, chat, DriverSettings()).run(packs, group_size=2)
    assert sampler.calls == single.calls  # both environments' runs in the same batched calls
    with pytest.raises(ValueError, match="names no environment"):
        driver.run(packs[:1], group_size=1)
    with pytest.raises(ValueError, match="this driver has guess, guess2"):
        driver.run([dataclasses.replace(packs[0], env="pde")], group_size=1)


def test_environment_draw_follows_the_weights_and_the_index_alone():
    """Packs are drawn with probability weight / sum (each count within 4 standard deviations
    of its expectation over 6000 packs), the draw of a pack depends on (split, seed, index)
    only, other seeds draw differently, and one environment is always itself."""
    names, weights, n = ["a", "b", "c"], [1.0, 2.0, 3.0], 6000
    counts = Counter(draw_env(names, weights, "train", 0, i) for i in range(n))
    for name, w in zip(names, weights, strict=True):
        p = w / sum(weights)
        assert abs(counts[name] - n * p) <= 4 * math.sqrt(n * p * (1 - p)), counts
    again = [draw_env(names, weights, "train", 0, i) for i in range(50)]
    assert again == [draw_env(names, weights, "train", 0, i) for i in range(50)]
    assert again != [draw_env(names, weights, "train", 1, i) for i in range(50)]
    assert {draw_env(["x"], [5.0], "warm", 3, i) for i in range(20)} == {"x"}


@pytest.mark.slow  # 1-2 s: left to the full suite
def test_tokenizer_of_several_environments_covers_each():
    """The bpe vocabulary of a mixed run is trained on every environment's transcripts: one
    environment gives the single-environment tokenizer exactly, and on each environment's
    demonstrations the mixed tokenizer needs fewer tokens than the other environment's own."""
    settings = DriverSettings(rollout=RolloutConfig(prompt_style="compact"))
    lake, term = make_env("frozenlake", "train", "tiny"), make_env("terminal", "train", "tiny")
    single = environment_tokenizer(lake, settings, 256, 0)
    assert environment_tokenizer([lake], settings, 256, 0).get_vocab() == single.get_vocab()
    mixed = environment_tokenizer([lake, term], settings, 256, 0)
    own = {"frozenlake": single, "terminal": environment_tokenizer(term, settings, 256, 0)}
    chat = ChatFormat(char_tokenizer(CHATML))
    packs = make_packs(pack_seeds("held-out", 4), 4)
    for env, other in ((lake, own["terminal"]), (term, own["frozenlake"])):
        text = "".join(transcripts(demonstrations(env, chat, settings, packs), chat))
        assert len(mixed.encode(text)) < len(other.encode(text)), env.name
        assert mixed.decode(mixed.encode(text)) == text


def _sequence(rng: torch.Generator, env: str, lengths: list[int], scored: bool) -> Sequence:
    tokens, segments, start = [], [], 0
    for n in lengths:
        prompt = int(torch.randint(1, 4, (1,), generator=rng))
        tokens += torch.randint(0, 50, (prompt + n,), generator=rng).tolist()
        start += prompt
        logp = torch.randn(n, generator=rng).tolist()
        segments.append(
            Segment(
                start=start,
                length=n,
                advantage=0.5,
                rollout_logp=logp,
                teacher_logp=[x - 1 for x in logp] if scored else None,
            )
        )
        start += n
    return Sequence(tokens=tokens, segments=segments, env=env)


def test_teacher_logprobs_ride_the_segments_into_the_microbatch():
    """A micro-batch's teacher_logp lists each segment's teacher log-probs in trainable order
    (aligned with rollout_logp), None when no segment is scored; a mix of scored and unscored
    segments is refused."""
    rng = torch.Generator().manual_seed(0)
    seqs = [_sequence(rng, "a", [3, 1], True), _sequence(rng, "b", [5], True)]
    mb = build_microbatch(seqs)
    assert torch.equal(mb.teacher_logp, mb.rollout_logp - 1)
    assert build_microbatch([_sequence(rng, "a", [2], False)]).teacher_logp is None
    with pytest.raises(ValueError, match="some segments have teacher log-probs"):
        build_microbatch([*seqs, _sequence(rng, "a", [2], False)])


def test_sequences_carry_their_episode_environment():
    """Packing keeps each episode's environment on its sequences (it picks the teacher)."""
    chat = ChatFormat(char_tokenizer(CHATML))
    settings = DriverSettings(rollout=RolloutConfig(prompt_style="compact"))
    lake, term = make_env("frozenlake", "train", "tiny"), make_env("terminal", "train", "tiny")
    packs = [
        dataclasses.replace(p, env=name)
        for p, name in zip(
            make_packs(pack_seeds("t", 2), 2), ("frozenlake", "terminal"), strict=True
        )
    ]
    for rollout in demonstrations([lake, term], chat, settings, packs):
        for episode in rollout.episodes:
            assert {s.env for s in episode_sequences(episode)} == {rollout.env}
