"""The interleaved rollout driver (docs/concepts.md sections 1-2): P packs x G members at once.

Each (pack, member) run alternates a solve-task episode (one or more turns: a response, then the
environment's observation) and an update-context episode (one response whose hint block replaces
the hints), K solve and K-1 update episodes per pack; in `task_by_task` mode there are no update
episodes and every task starts from `Hints: null`. For evaluation the hints between tasks may
come from elsewhere (`DriverSettings.hint_source`: the hidden rule, the scripted explorer's
reading of the model's own moves, or none), and then no update episode is sampled; an update
episode of an environment that declares its hint entries records how its hints score against
the hidden rule (`hint_check`, cod_fast.diagnostics). Every driver step gathers the next prompt of
every live run and makes ONE batched sampler call, then steps the environments. Token ids are
kept exactly as sampled; later turns of an episode append to them (see cod_fast.rollout.chat).

A failure stays with its own episode: a response cut at the length limit is recorded with its
finish reason (and usually fails to parse, which the environment scores); an environment that
raises, or outlasts `env_timeout_s`, ends that solve episode with reward `error_reward` and the
error in `Episode.info` (a NaN or infinite reward counts as such an error); the other runs go
on. On the main thread (the normal case) a SIGALRM timer stops an environment call that
outlasts its timeout, even one stuck in a regular expression, which holds the GIL and which no
other thread could interrupt; elsewhere the call runs on a worker thread that is abandoned.
"""

from __future__ import annotations

import math
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from cod_fast.config import Config
from cod_fast.diagnostics import hint_check
from cod_fast.envs.base import Environment, Task, derive_seed
from cod_fast.envs.packs import PackSpec
from cod_fast.records import Episode, Rollout, Turn
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.hints import context_line, parse_hints
from cod_fast.rollout.prompts import PROMPT_STYLES, Trajectory
from cod_fast.rollout.sampler import Sample, Sampler


class _EnvTimeout(BaseException):
    """An environment call outlasted DriverSettings.env_timeout_s. A BaseException because the
    alarm raises it inside the environment's code, whose `except Exception` must not swallow it."""


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


@dataclass(frozen=True)
class DriverSettings:
    max_response_tokens: int = 512
    max_hint_tokens: int = 256
    min_hint_chars: int = 1
    hint_penalty: float = 0.1
    mode: Literal["cod", "task_by_task"] = "cod"
    error_reward: float = 0.0
    """Reward of a solve episode whose environment raised or timed out."""
    env_timeout_s: float | None = None
    """Stop an environment call after this long (None: wait); the episode ends as an error. On
    the main thread a SIGALRM timer interrupts the call itself; on any other thread the call
    runs on a worker thread that is abandoned, still running, since Python cannot stop it."""
    length_penalty: float = 0.0
    """Subtracted from the reward of an episode with a response cut at the length limit."""
    prompt_style: Literal["full", "compact"] = "full"
    """The wording of the prompts (cod_fast.rollout.prompts); `compact` suits tiny models."""
    judge: str = "rule"
    """Who scores the environments that ask for a judge (`Task.judge_query`; cod_fast.judges):
    `rule`, a model folder, or an OpenAI-compatible endpoint's URL."""
    judge_model: str | None = None
    """The model name an endpoint judge is asked for."""
    judge_timeout_s: float = 30.0
    """How long one endpoint judge request may take."""
    judge_max_tokens: int = 64
    """The longest verdict a model or endpoint judge may write."""
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
        rollout = cfg.rollout
        return cls(
            max_response_tokens=rollout.max_response_tokens,
            max_hint_tokens=rollout.max_hint_tokens,
            min_hint_chars=rollout.min_hint_chars,
            hint_penalty=rollout.hint_penalty,
            mode="task_by_task" if cfg.algo.algorithm == "task_by_task" else "cod",
            error_reward=rollout.env_error_reward,
            env_timeout_s=rollout.env_timeout_s,
            length_penalty=rollout.length_penalty,
            prompt_style=rollout.prompt_style,
            judge=rollout.judge,
            judge_model=rollout.judge_model,
            judge_timeout_s=rollout.judge_timeout_s,
            judge_max_tokens=rollout.judge_max_tokens,
        )


@dataclass
class RunState:
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
        self.prompts = PROMPT_STYLES[settings.prompt_style]
        self._worker = _EnvWorker()
        check_hint_source(settings, envs)
        from cod_fast.judges import make_judge  # a model judge imports the sampler

        self.judge = make_judge(
            settings.judge,
            model=settings.judge_model,
            timeout_s=settings.judge_timeout_s,
            max_tokens=settings.judge_max_tokens,
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
        runs = [RunState(spec=spec, member=g) for spec in packs for g in range(group_size)]
        total = sum(len(run.spec.task_indices) for run in runs)
        try:
            for run in runs:
                self._start_solve(run)
            while live := [run for run in runs if run.phase != "done"]:
                for run, sample in zip(live, self._sample(live, keyed), strict=True):
                    self._advance(run, sample)
                if on_progress is not None:
                    on_progress(sum(run.solved for run in runs), total)
        finally:
            self._worker.close()
        return [
            Rollout(
                pack_id=run.spec.pack_id,
                member=run.member,
                env=self.env_of(run.spec).name,
                episodes=run.episodes,
            )
            for run in runs
        ]

    def _sample(self, live: list[RunState], keyed: bool) -> list[Sample]:
        """One batched sampler call for the next response of every live run."""
        prompts = [run.prompt_ids for run in live]
        caps = [self.settings.max_response_tokens] * len(live)
        if not keyed:
            return self.sampler.generate(prompts, caps)
        return self.sampler.generate(prompts, caps, keys=[self.response_key(r) for r in live])

    def response_key(self, run: RunState) -> int:
        """The sampling key of a run's next response: its environment, pack (seed and tasks),
        member, position, episode kind and turn."""
        spec = run.spec
        return derive_seed(
            "response",
            self.env_of(spec).name,
            spec.pack_seed,
            spec.task_indices,
            run.member,
            run.position,
            run.phase,
            len(run.turns),
        )

    # --- solve-task episodes -------------------------------------------------------------------

    def _start_solve(self, run: RunState) -> None:
        run.task = self.env_of(run.spec).task(
            run.spec.pack_seed, run.spec.task_indices[run.position]
        )
        run.turns, run.steps, run.error = [], [], None
        first = run.position == 0 or not self._carries_hints
        run.shown_hints = None if first else run.hints
        system = self.prompts.solve_system(run.task.prompt(), context_line(run.hints, first))
        observation = self._safe(run, run.task.reset)
        # A task that failed to start still gets one response (so the episode has a turn, and
        # the group keeps its shape); the error ends it right after.
        run.observation = observation if run.error is None else f"(environment error: {run.error})"
        run.prompt_ids = self.chat.first_prompt(system, run.observation)

    def _advance(self, run: RunState, sample: Sample) -> None:
        run.turns.append(
            Turn(
                prompt_ids=run.prompt_ids,
                response_ids=sample.token_ids,
                response_logprobs=sample.logprobs,
                finish_reason=sample.finish_reason,
            )
        )
        if run.phase == "update":
            self._end_update(run, sample)
            return
        action = self.chat.decode(sample.token_ids)
        outcome = None if run.error else self._safe(run, lambda: run.task.step(action))
        run.steps.append((run.observation, action))
        if outcome is None or outcome.done or len(run.turns) >= run.task.max_steps:
            self._end_solve(run)
            return
        run.observation = outcome.observation
        run.prompt_ids = (
            run.prompt_ids
            + sample.token_ids
            + self.chat.continuation(sample.token_ids, outcome.observation)
        )

    def _safe(self, run: RunState, call):
        """Call into the environment; an exception or a timeout ends this episode, not the
        rollout."""
        timeout = self.settings.env_timeout_s
        try:
            if timeout is None:
                return call()
            if _alarm_works():
                return _call_with_alarm(call, timeout)
            return self._worker.call(call, timeout)
        except _EnvTimeout:
            run.error = f"TimeoutError: the environment took longer than {timeout} s"
        except Exception as exc:  # environment code is not ours to trust: record, go on
            run.error = f"{type(exc).__name__}: {exc}"
        return None

    def _end_solve(self, run: RunState) -> None:
        task = run.task
        info = {"task": run.spec.task_indices[run.position], "success": task.success}
        if run.error is None:
            reward = self._scored(run, task, info)
            if run.error is None and not math.isfinite(reward):
                run.error = f"ValueError: the environment gave a non-finite reward {reward}"
        if run.error is not None:
            reward = self.settings.error_reward
        if run.error:
            info["error"] = run.error
        run.episodes.append(self._episode(run, "solve", reward, info))
        if run.position == len(run.spec.task_indices) - 1:
            run.phase = "done"
            return
        if self._carries_hints:
            feedback = run.error or self._safe(run, run.task.feedback) or ""
            env = self.env_of(run.spec)
            run.knowable = env.knowable_entries(run.knowable, run.task, run.steps, feedback)
            if self.settings.hint_source == "own":
                self._start_update(run, reward, feedback)
                return
            run.hints = self._given_hints(run)
        run.position += 1
        self._start_solve(run)

    def _scored(self, run: RunState, task: Task, info: dict) -> float | None:
        """The finished task's reward: its own, or from the run's judge when the task asks for
        one (a flagged verdict marks the episode `malformed`). A judge that fails ends the
        episode as an environment error does (the judge keeps its own timeout: an endpoint or a
        model may take longer than an environment call is allowed)."""
        query = self._safe(run, task.judge_query)
        if run.error is not None or query is None:
            return None if run.error else self._safe(run, lambda: float(task.reward))
        try:
            verdict = self.judge.score(query)
        except Exception as exc:  # a judge is a remote or a model: record, go on
            run.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            return None
        if verdict.malformed:
            info["malformed"] = True
        if self.judge.name != "rule":
            info["judge"] = verdict.reason
        return self._safe(run, lambda: float(task.judged_reward(verdict)))

    @property
    def _carries_hints(self) -> bool:
        """Whether a task's hints reach the next task (else every task reads `Hints: null`)."""
        return self.settings.mode == "cod" and self.settings.hint_source != "none"

    def _given_hints(self, run: RunState) -> str:
        """The hints an `oracle` or `explorer` hint source puts before the next task."""
        env = self.env_of(run.spec)
        if self.settings.hint_source == "oracle":
            return env.render_hints(env.hint_truth(run.spec.pack_seed))
        return env.render_hints(run.knowable)

    # --- update-context episodes ---------------------------------------------------------------

    def _start_update(self, run: RunState, reward: float, feedback: str) -> None:
        traj = Trajectory(
            task_prompt=run.task.prompt(),
            steps=run.steps,
            feedback=feedback,
            reward=reward if self.env_of(run.spec).reveals_reward else None,
        )
        context = context_line(run.hints, run.position == 0)
        run.prompt_ids = self.chat.first_prompt(
            self.prompts.update_system, self.prompts.update_user(context, traj)
        )
        run.turns, run.phase = [], "update"

    def _end_update(self, run: RunState, sample: Sample) -> None:
        s = self.settings
        parsed = parse_hints(
            self.chat.decode(sample.token_ids),
            min_chars=s.min_hint_chars,
            hint_penalty=s.hint_penalty,
            max_tokens=s.max_hint_tokens,
            truncate=self.chat.truncate,
        )
        info = {"hints": parsed.text, "truncated": parsed.truncated}
        env = self.env_of(run.spec)
        if (truth := env.hint_truth(run.spec.pack_seed)) is not None:
            info["hint_check"] = hint_check(truth, env.hint_entries(parsed.text), run.knowable)
        run.episodes.append(self._episode(run, "update", parsed.reward, info))
        run.hints = parsed.text
        run.position += 1
        run.phase = "solve"
        self._start_solve(run)

    def _episode(self, run: RunState, kind: str, reward: float, info: dict) -> Episode:
        if any(turn.finish_reason == "length" for turn in run.turns):
            reward -= self.settings.length_penalty
            info["cut"] = True
        return Episode(
            pack_id=run.spec.pack_id,
            member=run.member,
            kind=kind,
            task_index=run.position,
            turns=run.turns,
            reward=reward,
            env=self.env_of(run.spec).name,
            info=info,
        )
