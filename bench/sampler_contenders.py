"""The contenders of `cod-fast bench sampler` (cod_fast.bench.sampler) and what they run on.

- Models: Qwen3-architecture decoders of the SIZES with seeded random weights, saved with the run's
  own tokenizer as a Hugging Face folder that every contender loads (and described from its
  config.json).
- Samplers: make_sampler builds a contender over such a folder: the trainer's `TorchSampler`,
  transformers' `model.generate` behind the `Sampler` protocol (GenerateSampler, what a plain
  transformers user runs), or the in-process vLLM engine with and without torch.compile.
- The check: logp_mismatch recomputes the sampled tokens' log-probs as the trainer does and
  measures how far the sampler's are from them.
"""

from __future__ import annotations

from pathlib import Path

from cod_fast.rollout.sampler import Sample

# Qwen3Config sizes; vocab, EOS and padding come from the run's tokenizer.
# fmt: off
SIZES = {
    "tiny": dict(num_hidden_layers=3, hidden_size=96, num_attention_heads=3,
                 num_key_value_heads=3, head_dim=32, intermediate_size=256),
    "small": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, intermediate_size=1536),
}
# fmt: on


# --------------------------------------------------------------------------------------------
# The `generate` contender.


class GenerateSampler:
    """`Sampler` over transformers' `model.generate`, as a plain transformers user calls it:
    one left-padded batch with its attention mask, sampled up to the longest cap; each response
    is then cut at its own cap and after its first stop token (kept, finish reason "stop"),
    the TorchSampler's conventions. Log-probs are the processed ones (after temperature and
    top-p), from the scores generate hands back. Each call seeds the global RNG with
    seed + calls inside fork_rng, which puts the caller's state back afterwards."""

    def __init__(self, model, tokenizer, *, temperature: float, top_p: float = 1.0, seed: int = 0):
        from cod_fast.rollout.torch_sampler import stop_ids

        self.model, self.temperature, self.top_p, self.seed = model, temperature, top_p, seed
        self.stop_ids = stop_ids(model, tokenizer)  # the torch sampler's stop set
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.stop_ids, default=0)
        self.calls = 0

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        import torch

        from cod_fast.rollout.torch_batch import left_pad

        if not prompts:
            return []
        self.calls += 1
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompts, self.pad_id)
        width = ids.shape[1]
        was_training = self.model.training
        self.model.eval()
        cuda = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda), torch.inference_mode():
                torch.manual_seed(self.seed + self.calls)
                out = self.model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    do_sample=True,
                    temperature=self.temperature,
                    top_p=self.top_p,
                    top_k=0,  # generate's default is 50; the other samplers draw from all tokens
                    max_new_tokens=max(max_new_tokens),
                    eos_token_id=sorted(self.stop_ids),
                    pad_token_id=self.pad_id,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
                # `scores` are the processed logits (divided by T, -inf outside the nucleus):
                # their log_softmax is the processed log-prob, as TorchSampler returns it.
                logps = self.model.compute_transition_scores(
                    out.sequences, out.scores, normalize_logits=True
                )
        finally:
            self.model.train(was_training)
        samples = []
        for tokens, logp, cap in zip(
            out.sequences[:, width:].tolist(), logps.tolist(), max_new_tokens, strict=True
        ):
            end, finish = min(cap, len(tokens)), "length"
            stop = next((i for i, t in enumerate(tokens[:end]) if t in self.stop_ids), None)
            if stop is not None:
                end, finish = stop + 1, "stop"
            samples.append(
                Sample(token_ids=tokens[:end], logprobs=logp[:end], finish_reason=finish)
            )
        return samples


# --------------------------------------------------------------------------------------------
# Models and samplers.


def save_model(size: str, folder: Path, cfg) -> Path:
    """A seeded random-weight Qwen3 of `size` (SIZES) with the run's own tokenizer (the `bpe`
    vocabulary the trainer trains on the environment's transcripts, or the character one),
    saved as a Hugging Face folder (the vLLM engine starts from one); the global RNG is left as
    it was."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from cod_fast.envs import make_env
    from cod_fast.model.tokenizer import CHATML, char_tokenizer
    from cod_fast.rollout.driver import DriverSettings
    from cod_fast.run.vocab import environment_tokenizer

    if cfg.model.tokenizer == "bpe":
        env = make_env(cfg.rollout.env, cfg.rollout.env_setting, cfg.rollout.env_size)
        settings = DriverSettings.from_config(cfg)
        tokenizer = environment_tokenizer(env, settings, cfg.model.vocab_size, cfg.train.seed)
    else:
        tokenizer = char_tokenizer(CHATML)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        **SIZES[size],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def describe_model(folder: str | Path) -> str:
    """The shape of the model in `folder`, from its config.json."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return (
        f"{c.model_type} {c.num_hidden_layers}L H{c.hidden_size} {c.num_attention_heads}q/{kv}kv "
        f"heads d{head} I{c.intermediate_size} V{c.vocab_size}"
        + (" tied" if getattr(c, "tie_word_embeddings", False) else "")
    )


def make_sampler(contender: str, folder: str, cfg):
    """(sampler, tokenizer) of a contender over the model in `folder`, with the run's settings."""
    from cod_fast.config import ModelConfig
    from cod_fast.model.loading import load_policy

    kwargs = dict(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p)
    kwargs["seed"] = cfg.train.seed  # the trainer's training stream on rank 0
    if contender in ("torch", "generate"):
        from cod_fast.rollout.torch_sampler import TorchSampler

        model, tokenizer = load_policy(ModelConfig(name_or_path=folder, dtype="float32"))
        cls = TorchSampler if contender == "torch" else GenerateSampler
        return cls(model, tokenizer, **kwargs), tokenizer
    from transformers import AutoConfig, AutoTokenizer

    from cod_fast.rollout.choice import engine_max_len
    from cod_fast.rollout.vllm_sampler import VLLMSampler

    positions = AutoConfig.from_pretrained(folder).max_position_embeddings
    sampler = VLLMSampler.create(
        folder,
        **kwargs,
        dtype="float32",
        max_model_len=engine_max_len(cfg, positions),
        enforce_eager=contender == "vllm-eager",
    )
    return sampler, AutoTokenizer.from_pretrained(folder)


def logp_mismatch(episodes, folder: str, cfg) -> dict:
    """|sampler - trainer| log-prob over the episodes' trainable tokens: packed and recomputed
    as Trainer._fill_logprobs does, by a fresh float32 model loaded from `folder`."""
    import torch

    from cod_fast.config import ModelConfig
    from cod_fast.data.packing import pack_microbatches, rollout_sequences
    from cod_fast.model.loading import load_policy
    from cod_fast.model.policy import Policy
    from cod_fast.train.step import runnable

    model, _ = load_policy(ModelConfig(name_or_path=folder, dtype="float32"))
    policy = Policy(model).eval()
    (mbs,) = pack_microbatches(rollout_sequences(episodes), cfg.train.token_budget)
    gaps = []
    with torch.no_grad():
        for mb in mbs:
            logp = policy(runnable(mb), loss_config=cfg.algo.loss, mode="logprobs")
            gaps.append((logp.double() - mb.rollout_logp.double()).abs())
    gap = torch.cat(gaps)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "logp_tokens": gap.numel(),
        "logp_mean_abs": gap.mean().item() if gap.numel() else None,
        "logp_max_abs": gap.max().item() if gap.numel() else None,
    }
