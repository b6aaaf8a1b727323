"""The interleaved rollout driver (docs/concepts.md sections 1-2): P packs x G members at once.

Each (pack, member) play alternates a solve-task episode (one or more turns: a response, then the
environment's observation) and an update-context episode (one response whose hint block replaces
the hints), K solve and K-1 update episodes per pack; in `task_by_task` mode there are no update
episodes and every task starts from `Hints: null`. For evaluation the hints between tasks may
come from elsewhere (`DriverSettings.hint_source`: the hidden rule, the scripted explorer's
reading of the model's own moves, or none), and then no update episode is sampled; an update
episode of an environment that declares its hint entries records how its hints score against
the hidden rule (`hint_check`, cod_fast.data.diagnostics). Every driver step gathers the next prompt of
every live play and makes ONE batched sampler call, then steps the environments. Token ids are
kept exactly as sampled; later turns of an episode append to them (see cod_fast.rollout.chat).

A failure stays with its own episode: a response cut at the length limit is recorded with its
finish reason (and usually fails to parse, which the environment scores); an environment that
raises, or outlasts `rollout.env_timeout_s`, ends that solve episode with reward
`rollout.env_error_reward` and the error in `Episode.info` (a NaN or infinite reward counts as
such an error); the other plays go on. On the main thread (the normal case) a SIGALRM timer
stops an environment call that outlasts its timeout, even one stuck in a regular expression,
which holds the GIL and which no other thread could interrupt; elsewhere the call runs on a
worker thread that is abandoned.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from cod_fast.config import Config, RolloutConfig
from cod_fast.data.diagnostics import hint_check
from cod_fast.data.records import Episode, Rollout, Turn
from cod_fast.envs.base import Environment, Task, derive_seed
from cod_fast.envs.packs import PackSpec
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.hints import context_line, parse_hints
from cod_fast.rollout.prompts import PROMPT_STYLES, Trajectory
from cod_fast.rollout.sampler import Sample, Sampler


class _EnvTimeout(BaseException):
    """An environment call outlasted `rollout.env_timeout_s`. A BaseException because the alarm
    raises it inside the environment's code, whose `except Exception` must not swallow it."""


def _expire(signum, frame):
    raise _EnvTimeout


def _alarm_works() -> bool:
    """Whether a call may be timed by SIGALRM: only the main thread may set signal handlers,
    and only POSIX systems have setitimer."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _call_with_alarm(fn, timeout: float):
    """`fn()` on this (the main) thread, stopped by _EnvTimeout once `timeout` seconds pass.
    The handler runs between bytecodes and in CPython's periodic signal checks (the regex
    engine makes them), so the call itself ends: nothing is left running. The previous SIGALRM
    handler comes back afterwards, and a timer someone else had set is re-armed with what it
    had left (one due during the call fires right after it)."""
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _expire)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:  # also when the alarm fired just as fn returned, inside the inner finally
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
        if outer_delay:
            left = outer_delay - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6), outer_interval)


class _EnvWorker:
    """The fallback off the main thread, where no signal can reach the call: runs environment
    calls on one daemon thread, reused from call to call (starting a thread per call took a
    third of a scripted-explorer rollout's time). A call that outlasts its timeout keeps that
    thread (Python cannot stop it, and a call stuck in C code such as a regular expression
    holds the GIL, starving the caller too): the worker drops it and the next call starts a
    fresh one. `close` ends the idle thread (the driver closes its worker after each `run`, so
    drivers made per batch leave no threads behind)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue | None = None

    def call(self, fn, timeout: float):
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._jobs,), daemon=True).start()
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((fn, done))
        try:
            ok, value = done.get(timeout=timeout)
        except queue.Empty:
            self.close()  # the stuck thread ends once its call returns, if it ever does
            raise _EnvTimeout from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            fn, done = job
            try:
                done.put((True, fn()))
            except Exception as exc:  # handed back to the driver's thread
                done.put((False, exc))


HintSource = Literal["own", "oracle", "explorer", "none"]
HINT_SOURCES = ("own", "oracle", "explorer", "none")


@dataclass(frozen=True, kw_only=True)
class DriverSettings:
    """What the driver plays by: a run's rollout section, the mode and the hint source."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The caps, penalties, environment error reward and timeout, prompt style and judge
    (cod_fast.config.RolloutConfig)."""
    mode: Literal["cod", "task_by_task"] = "cod"
    """`task_by_task`: no update episodes, every task starts from `Hints: null`."""
    hint_source: HintSource = "own"
    """Where the hints before each task k > 0 come from (`cod` mode): `own`, the model's update
    episodes; `oracle`, the hidden rule in the environment's hint format; `explorer`, what the
    scripted explorer writes from the model's own moves in the pack so far; `none`, no hints
    (`Hints: null` at every task). Only `own` samples update episodes."""

    @classmethod
    def from_config(cls, cfg: Config) -> DriverSettings:
        """The one way a run's config becomes driver settings (training, evaluation, export and
        `cod-fast eval` of an exported run all use it): the rollout section, and the mode from
        the algorithm."""
        mode = "task_by_task" if cfg.algo.algorithm == "task_by_task" else "cod"
        return cls(rollout=cfg.rollout, mode=mode)

    def with_rollout(self, **changes) -> DriverSettings:
        """These settings with `changes` to their rollout section (checked as the config checks
        them)."""
        return dataclasses.replace(self, rollout=dataclasses.replace(self.rollout, **changes))


@dataclass
class MemberPlay:
    """One group member's way through one pack."""

    spec: PackSpec
    member: int
    position: int = 0
    hints: str | None = None
    shown_hints: str | None = None
    """The hints the current solve episode's prompt shows (None: `Hints: null`)."""
    phase: Literal["solve", "update", "done"] = "solve"
    task: Task | None = None
    prompt_ids: list[int] = field(default_factory=list)
    observation: str = ""
    turns: list[Turn] = field(default_factory=list)
    steps: list[tuple[str, str]] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)
    error: str | None = None
    knowable: dict[str, str] = field(default_factory=dict)
    """The hint entries the pack's solve episodes so far show (Environment.knowable_entries)."""

    @property
    def solved(self) -> int:
        """Its finished solve episodes."""
        return sum(episode.kind == "solve" for episode in self.episodes)


def check_hint_source(settings: DriverSettings, envs: Sequence[Environment]) -> None:
    """ValueError, in one line, for a hint source these environments cannot serve."""
    source = settings.hint_source
    if source not in HINT_SOURCES:
        raise ValueError(f"unknown hint source {source!r}; choose one of {', '.join(HINT_SOURCES)}")
    if source != "own" and settings.mode != "cod":
        raise ValueError(f"hint source {source!r} needs the cod mode; task_by_task has no hints")
    mute = [env.name for env in envs if not env.has_hint_entries()]
    if source in ("oracle", "explorer") and mute:
        raise ValueError(
            f"hint source {source!r} needs environments that declare their hint entries; "
            f"{', '.join(mute)} declares none"
        )


class RolloutDriver:
    """Rolls out packs of one environment, or of several (`env` a sequence; each PackSpec then
    names its environment), all in the same batched sampler calls."""

    def __init__(
        self,
        env: Environment | Sequence[Environment],
        sampler: Sampler,
        chat: ChatFormat,
        settings: DriverSettings,
    ):
        envs = [env] if isinstance(env, Environment) else list(env)
        self.envs = {e.name: e for e in envs}
        self.env = envs[0]
        self.sampler, self.chat, self.settings = sampler, chat, settings
        self.prompts = PROMPT_STYLES[settings.rollout.prompt_style]
        self._worker = _EnvWorker()
        check_hint_source(settings, envs)
        from cod_fast.rollout.judge_clients import make_judge  # a model judge imports the sampler

        self.judge = make_judge(
            settings.rollout.judge,
            model=settings.rollout.judge_model,
            timeout_s=settings.rollout.judge_timeout_s,
            max_tokens=settings.rollout.judge_max_tokens,
        )

    def env_of(self, spec: PackSpec) -> Environment:
        """The environment a pack is played in."""
        if spec.env is None:
            if len(self.envs) > 1:
                raise ValueError(
                    f"pack {spec.pack_id} names no environment; this driver has several"
                )
            return self.env
        if spec.env not in self.envs:
            raise ValueError(
                f"pack {spec.pack_id} is of environment {spec.env!r}; this driver has "
                f"{', '.join(self.envs)}"
            )
        return self.envs[spec.env]

    def run(
        self,
        packs: list[PackSpec],
        group_size: int,
        keyed: bool = False,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> list[Rollout]:
        """Roll out every pack `group_size` times; one Rollout per (pack, member). `keyed`: every
        response's sampling noise comes from what it answers (`response_key`), so a pack plays
        the same whatever other packs share its sampler calls (evaluation split over ranks).
        `on_progress(done, total)` hears after every batched sampler call how many of the
        solve episodes (tasks x members) are finished."""
        plays = [MemberPlay(spec=spec, member=g) for spec in packs for g in range(group_size)]
        total = sum(len(play.spec.task_indices) for play in plays)
        try:
            for play in plays:
                self._start_solve(play)
            while live := [play for play in plays if play.phase != "done"]:
                for play, sample in zip(live, self._sample(live, keyed), strict=True):
                    self._advance(play, sample)
                if on_progress is not None:
                    on_progress(sum(play.solved for play in plays), total)
        finally:
            self._worker.close()
        return [
            Rollout(
                pack_id=play.spec.pack_id,
                member=play.member,
                env=self.env_of(play.spec).name,
                episodes=play.episodes,
            )
            for play in plays
        ]

    def _sample(self, live: list[MemberPlay], keyed: bool) -> list[Sample]:
        """One batched sampler call for the next response of every live play."""
        prompts = [play.prompt_ids for play in live]
        caps = [self.settings.rollout.max_response_tokens] * len(live)
        if not keyed:
            return self.sampler.generate(prompts, caps)
        return self.sampler.generate(prompts, caps, keys=[self.response_key(r) for r in live])

    def response_key(self, play: MemberPlay) -> int:
        """The sampling key of a play's next response: its environment, pack (seed and tasks),
        member, position, episode kind and turn."""
        spec = play.spec
        return derive_seed(
            "response",
            self.env_of(spec).name,
            spec.pack_seed,
            spec.task_indices,
            play.member,
            play.position,
            play.phase,
            len(play.turns),
        )

    # --- solve-task episodes -------------------------------------------------------------------

    def _start_solve(self, play: MemberPlay) -> None:
        play.task = self.env_of(play.spec).task(
            play.spec.pack_seed, play.spec.task_indices[play.position]
        )
        play.turns, play.steps, play.error = [], [], None
        first = play.position == 0 or not self._carries_hints
        play.shown_hints = None if first else play.hints
        system = self.prompts.solve_system(play.task.prompt(), context_line(play.hints, first))
        observation = self._safe(play, play.task.reset)
        # A task that failed to start still gets one response (so the episode has a turn, and
        # the group keeps its shape); the error ends it right after.
        play.observation = (
            observation if play.error is None else f"(environment error: {play.error})"
        )
        play.prompt_ids = self.chat.first_prompt(system, play.observation)

    def _advance(self, play: MemberPlay, sample: Sample) -> None:
        play.turns.append(
            Turn(
                prompt_ids=play.prompt_ids,
                response_ids=sample.token_ids,
                response_logprobs=sample.logprobs,
                finish_reason=sample.finish_reason,
            )
        )
        if play.phase == "update":
            self._end_update(play, sample)
            return
        action = self.chat.decode(sample.token_ids)
        outcome = None if play.error else self._safe(play, lambda: play.task.step(action))
        play.steps.append((play.observation, action))
        if outcome is None or outcome.done or len(play.turns) >= play.task.max_steps:
            self._end_solve(play)
            return
        play.observation = outcome.observation
        play.prompt_ids = (
            play.prompt_ids
            + sample.token_ids
            + self.chat.continuation(sample.token_ids, outcome.observation)
        )

    def _safe(self, play: MemberPlay, call):
        """Call into the environment; an exception or a timeout ends this episode, not the
        rollout."""
        timeout = self.settings.rollout.env_timeout_s
        try:
            if timeout is None:
                return call()
            if _alarm_works():
                return _call_with_alarm(call, timeout)
            return self._worker.call(call, timeout)
        except _EnvTimeout:
            play.error = f"TimeoutError: the environment took longer than {timeout} s"
        except Exception as exc:  # environment code is not ours to trust: record, go on
            play.error = f"{type(exc).__name__}: {exc}"
        return None

    def _end_solve(self, play: MemberPlay) -> None:
        task = play.task
        info = {"task": play.spec.task_indices[play.position], "success": task.success}
        if play.error is None:
            reward = self._scored(play, task, info)
            if play.error is None and not math.isfinite(reward):
                play.error = f"ValueError: the environment gave a non-finite reward {reward}"
        if play.error is not None:
            reward = self.settings.rollout.env_error_reward
        if play.error:
            info["error"] = play.error
        play.episodes.append(self._episode(play, "solve", reward, info))
        if play.position == len(play.spec.task_indices) - 1:
            play.phase = "done"
            return
        if self._carries_hints:
            feedback = play.error or self._safe(play, play.task.feedback) or ""
            env = self.env_of(play.spec)
            play.knowable = env.knowable_entries(play.knowable, play.task, play.steps, feedback)
            if self.settings.hint_source == "own":
                self._start_update(play, reward, feedback)
                return
            play.hints = self._given_hints(play)
        play.position += 1
        self._start_solve(play)

    def _scored(self, play: MemberPlay, task: Task, info: dict) -> float | None:
        """The finished task's reward: its own, or from the driver's judge when the task asks for
        one (a flagged verdict marks the episode `malformed`). A judge that fails ends the
        episode as an environment error does (the judge keeps its own timeout: an endpoint or a
        model may take longer than an environment call is allowed)."""
        query = self._safe(play, task.judge_query)
        if play.error is not None or query is None:
            return None if play.error else self._safe(play, lambda: float(task.reward))
        try:
            verdict = self.judge.score(query)
        except Exception as exc:  # a judge is a remote or a model: record, go on
            play.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            return None
        if verdict.malformed:
            info["malformed"] = True
        if self.judge.name != "rule":
            info["judge"] = verdict.reason
        return self._safe(play, lambda: float(task.judged_reward(verdict)))

    @property
    def _carries_hints(self) -> bool:
        """Whether a task's hints reach the next task (else every task reads `Hints: null`)."""
        return self.settings.mode == "cod" and self.settings.hint_source != "none"

    def _given_hints(self, play: MemberPlay) -> str:
        """The hints an `oracle` or `explorer` hint source puts before the next task."""
        env = self.env_of(play.spec)
        if self.settings.hint_source == "oracle":
            return env.render_hints(env.hint_truth(play.spec.pack_seed))
        return env.render_hints(play.knowable)

    # --- update-context episodes ---------------------------------------------------------------

    def _start_update(self, play: MemberPlay, reward: float, feedback: str) -> None:
        traj = Trajectory(
            task_prompt=play.task.prompt(),
            steps=play.steps,
            feedback=feedback,
            reward=reward if self.env_of(play.spec).reveals_reward else None,
        )
        context = context_line(play.hints, play.position == 0)
        play.prompt_ids = self.chat.first_prompt(
            self.prompts.update_system, self.prompts.update_user(context, traj)
        )
        play.turns, play.phase = [], "update"

    def _end_update(self, play: MemberPlay, sample: Sample) -> None:
        s = self.settings.rollout
        parsed = parse_hints(
            self.chat.decode(sample.token_ids),
            min_chars=s.min_hint_chars,
            hint_penalty=s.hint_penalty,
            max_tokens=s.max_hint_tokens,
            truncate=self.chat.truncate,
        )
        info = {"hints": parsed.text, "truncated": parsed.truncated}
        env = self.env_of(play.spec)
        if (truth := env.hint_truth(play.spec.pack_seed)) is not None:
            info["hint_check"] = hint_check(truth, env.hint_entries(parsed.text), play.knowable)
        play.episodes.append(self._episode(play, "update", parsed.reward, info))
        play.hints = parsed.text
        play.position += 1
        play.phase = "solve"
        self._start_solve(play)

    def _episode(self, play: MemberPlay, kind: str, reward: float, info: dict) -> Episode:
        if any(turn.finish_reason == "length" for turn in play.turns):
            reward -= self.settings.rollout.length_penalty
            info["cut"] = True
        return Episode(
            pack_id=play.spec.pack_id,
            member=play.member,
            kind=kind,
            task_index=play.position,
            turns=play.turns,
            reward=reward,
            env=self.env_of(play.spec).name,
            info=info,
        )
