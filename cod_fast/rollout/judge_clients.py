"""Judges that read: a Hugging Face model folder or an OpenAI-compatible endpoint scores episodes.

Some environments are best scored by a reader rather than a rule (a free-text diagnosis, an
essay). Such an environment hands each finished solve episode to a judge as a `JudgeQuery`
(cod_fast.envs.judge), and the judge answers with a `Verdict`. Three back ends:

- `rule`: the environment's own rule-based verdict (`RuleJudge`, no reader at all);
- a model folder: a local causal LM run in this process through the trainer's own sampler,
  near-greedy, in float32 on the CPU (`ModelJudge`);
- an `http(s)://` URL: an OpenAI-compatible chat-completions endpoint such as vLLM's or
  llama.cpp's server (`EndpointJudge`), standard library only, each request bounded in time and
  size, the API key sent to the named host alone.

The model and the endpoint read the same (system, user) prompt, `judge_prompt`, and their reply
is read by `parse_verdict`, so a judge can move from one back end to the other unchanged. A judge
that gives no verdict raises `JudgeError` with one line naming the cause and the fix; the rollout
driver then scores the episode like an environment error.

This module sits above the environments: the rollout driver uses it, and the environment layer
knows nothing of it.
"""

from __future__ import annotations

import functools
from pathlib import Path

from cod_fast.envs.judge import (
    Judge,
    JudgeError,
    JudgeQuery,
    RuleJudge,
    Verdict,
    judge_prompt,
    parse_verdict,
)
from cod_fast.rollout.chat_endpoint import (
    MAX_REPLY_BYTES,  # noqa: F401 - the judge's cap too
    ChatEndpoint,
    EndpointError,
    EndpointNames,
    is_url,
    one_line,
    url_problem,
)

API_KEY_VARS = ("COD_FAST_JUDGE_API_KEY", "OPENAI_API_KEY")
"""Where an endpoint judge's API key comes from, the first one set winning; sent as a bearer
token, never shown in a message."""
NEAR_GREEDY = 1e-3
"""The model judge's temperature: the sampler divides the logits by it, so 0 is refused; at
1e-3 a token needs a logit within ~0.01 of the best one to have any real chance."""
SPECS = "'rule', the http(s):// URL of an OpenAI-compatible endpoint, or a local model folder"
JUDGE_NAMES = EndpointNames(
    who="judge endpoint",
    url_setting="rollout.judge",
    model_setting="rollout.judge_model",
    timeout_fix="raise rollout.judge_timeout_s",
)
"""How an endpoint judge's messages name it and the settings that fix it."""


def judge_problem(spec: str) -> str | None:
    """Why `spec` names no usable judge (one line), or None. Cheap enough for a config check:
    it loads no model and sends no request, so a folder with config.json may still fail to load
    (its tokenizer, its sizes) and a URL may still find no server."""
    if not spec.strip():
        return f"an empty judge; write {SPECS}"
    if spec == "rule":
        return None
    if is_url(spec):
        return url_problem(spec)
    path = Path(spec)
    if not path.is_dir():
        what = "a file" if path.exists() else "no such folder"
        return f"{spec}: {what}; a judge is {SPECS}"
    if not (path / "config.json").is_file():
        return (
            f"{spec}: a folder without config.json; expected a model folder as `cod-fast export` "
            "or a model's save_pretrained writes it"
        )
    return None


class ModelJudge(Judge):
    """A causal LM folder that reads `judge_prompt` in its chat format and answers near-greedily
    (at most `max_tokens` tokens). Loaded once, in float32 on the CPU, with the loader every
    model of a run goes through (cod_fast.model.loading.load_policy); `close` frees it."""

    name = "model"

    def __init__(self, path: str, *, max_tokens: int = 64, seed: int = 0):
        if problem := judge_problem(path):
            raise JudgeError(f"judge model {problem}; fix rollout.judge")
        # Imported here: the rule and endpoint judges, and config checks, need no torch.
        from cod_fast.config import ModelConfig
        from cod_fast.model.loading import load_policy
        from cod_fast.rollout.chat import ChatFormat
        from cod_fast.rollout.torch_sampler import TorchSampler

        cfg = ModelConfig(name_or_path=path, dtype="float32")
        try:
            model, tokenizer = load_policy(cfg, "cpu")
            self.chat = ChatFormat.for_model(tokenizer, cfg)
        except (ValueError, OSError) as e:  # ModelFolderError, ConfigError, unreadable files
            raise JudgeError(
                f"judge model {path} does not load ({one_line(e)}); fix the folder or rollout.judge"
            ) from None
        self.path, self.max_tokens, self.seed = path, max_tokens, seed
        # A judge never trains: frozen weights, so no call can build a graph over them.
        self.model = model.eval().requires_grad_(False)
        self.sampler = TorchSampler(self.model, tokenizer, temperature=NEAR_GREEDY, seed=seed)

    def score(self, query: JudgeQuery) -> Verdict:
        import torch

        if self.sampler is None:
            raise JudgeError(f"judge model {self.path} was closed; make a new judge to score")
        prompt = self.chat.first_prompt(*judge_prompt(query))
        with torch.inference_mode():
            # Keyed by the seed alone: a query gets the same reply whatever was judged before.
            [sample] = self.sampler.generate([prompt], [self.max_tokens], keys=[self.seed])
        reply = self.chat.decode(sample.token_ids)
        try:
            return parse_verdict(reply)
        except JudgeError as e:
            raise JudgeError(
                f"judge model {self.path}: unreadable reply ({e}); use a model that follows the "
                "prompt's <score>S</score> form, or raise rollout.judge_max_tokens"
            ) from None

    def close(self) -> None:
        self.model = self.sampler = None


class EndpointJudge(Judge):
    """An OpenAI-compatible server: one POST to `{url}/chat/completions` per episode, with the
    `judge_prompt` messages, temperature 0 and `max_tokens`; the reply is
    `choices[0].message.content`.

    The request goes through `ChatEndpoint` (cod_fast.rollout.chat_endpoint): the API key (from
    API_KEY_VARS) goes to the named host alone, directly and through no redirect, and is blanked
    out of every message and verdict reason; connect, send and the whole reply within
    `timeout_s`, a reply over MAX_REPLY_BYTES an error read no further."""

    name = "endpoint"

    def __init__(
        self, url: str, model: str = "default", *, timeout_s: float = 30.0, max_tokens: int = 64
    ):
        try:
            self.endpoint = ChatEndpoint(
                url, model, key_vars=API_KEY_VARS, timeout_s=timeout_s, names=JUDGE_NAMES
            )
        except EndpointError as e:
            raise JudgeError(str(e)) from None
        self.url, self.model = self.endpoint.url, model
        self.timeout_s, self.max_tokens = timeout_s, max_tokens

    def score(self, query: JudgeQuery) -> Verdict:
        system, user = judge_prompt(query)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        try:
            reply, _ = self.endpoint.complete(messages, temperature=0, max_tokens=self.max_tokens)
        except EndpointError as e:
            raise JudgeError(str(e)) from None
        try:
            return parse_verdict(self.endpoint.blank(reply))  # the verdict's reason quotes it
        except JudgeError as e:
            raise JudgeError(
                self.endpoint.message(
                    f"unreadable reply ({e})",
                    "use a model that follows the prompt's <score>S</score>, or raise "
                    "rollout.judge_max_tokens",
                )
            ) from None


def make_judge(
    spec: str, *, model: str | None = None, timeout_s: float = 30.0, max_tokens: int = 64
) -> Judge:
    """The judge `spec` names: `rule`, an http(s):// endpoint URL (serving `model`, default
    "default"), else a model folder (loaded once per process and shared: not to be closed).
    JudgeError, in one line, for a spec `judge_problem` refuses or a model folder that does not
    load."""
    if problem := judge_problem(spec):
        raise JudgeError(f"rollout.judge: {problem}")
    if spec == "rule":
        return RuleJudge()
    if is_url(spec):
        return EndpointJudge(spec, model or "default", timeout_s=timeout_s, max_tokens=max_tokens)
    return _loaded_model_judge(spec, max_tokens)


@functools.lru_cache(maxsize=1)
def _loaded_model_judge(path: str, max_tokens: int) -> ModelJudge:
    """One loaded judge model per process: every rollout driver of a run (training, and each
    evaluation, which makes a driver per environment) shares it instead of loading the folder
    again. Its replies depend on the query alone (keyed sampling), so sharing changes none."""
    return ModelJudge(path, max_tokens=max_tokens)
