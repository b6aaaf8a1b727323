"""A sampler over any Hugging Face causal LM through `generate` (KV cache, temperature, top-p).

It returns, for every sampled token, its log-prob under the distribution it was sampled from
(the logits divided by the temperature, then top-p filtered), so the numbers match what the loss
computes at the same temperature when top_p = 1. Prompts of a batch are left-padded. This is the
evaluation sampler and the reference for the trainer's samplers; vLLM replaces it on GPUs.
"""

from __future__ import annotations

import torch

from cod_fast.rollout.sampler import Sample


class HFGenerateSampler:
    def __init__(
        self, model, tokenizer, *, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0
    ):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (sampling), got {temperature}")
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.top_p = temperature, top_p
        self.generator_seed = seed
        self.calls = 0
        self.eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.eos

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        self.calls += 1
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        torch.manual_seed(self.generator_seed + self.calls)  # reproducible, different per call
        out = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=True,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0,
            max_new_tokens=max(max_new_tokens),
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            return_dict_in_generate=True,
            output_scores=True,
        )
        new = out.sequences[:, width:].cpu()
        # scores: one [B, V] tensor per step, the processed (temperature, top-p) logits.
        logps = torch.stack([s.float().log_softmax(-1).cpu() for s in out.scores], dim=1)
        picked = logps.gather(-1, new[..., None]).squeeze(-1)
        samples = []
        for i, cap in enumerate(max_new_tokens):
            tokens = new[i].tolist()
            end = tokens.index(self.eos) + 1 if self.eos in tokens else len(tokens)
            n = min(end, cap)
            finish = "stop" if end <= cap and self.eos in tokens[:n] else "length"
            samples.append(
                Sample(token_ids=tokens[:n], logprobs=picked[i, :n].tolist(), finish_reason=finish)
            )
        return samples
