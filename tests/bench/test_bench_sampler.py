"""The sampler benchmark (bench/sampler.py): a one-step smoke run of its contenders on the tiny
model, whose timings mean nothing and are only checked to exist, and the `generate` contender's
sampler against the Sampler contract and float64 log-probs."""

from __future__ import annotations

import copy
import csv
import importlib.util
import json

import pytest
import torch

from cod_fast.bench import sampler as bench
from cod_fast.config import ModelConfig
from cod_fast.config.io import load_config
from cod_fast.model.loading import load_policy
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.torch_batch import processed_logprobs

pytestmark = pytest.mark.slow

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_tiny_step_lands_in_json_and_csv(tmp_path, capsys):
    """Each contender rolls out the same step shape (packs x group x (2K - 1) episodes, at
    least 2K - 1 sampler calls), with positive times and token counts; its log-probs are the
    trainer's (mean gap < 1e-4: all are float32 processed log-probs of one model, and the torch
    sampler is built to match); the last stdout line, sampler.json and sampler.csv agree."""
    contenders = ["torch", "generate", *(["vllm-eager"] if HAS_VLLM else [])]
    argv = ["--sizes", "tiny", "--packs", "1", "--group", "2", "--reps", "1", "--warmup", "0"]
    bench.main([*argv, "--contenders", ",".join(contenders), "--out", str(tmp_path)])

    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("timestamp", "commit", "machine", "torch", "transformers", "vllm", "settings"):
        assert key in summary, key
    rows = summary["sizes"]["tiny"]
    assert [r["contender"] for r in rows] == contenders
    k = load_config(bench.PRESET).rollout.tasks_per_pack
    for r in rows:
        assert r["status"] == "ok", r
        assert r["episodes"] == 1 * 2 * (2 * k - 1) and r["turns"] >= r["episodes"], r
        assert r["calls"] >= 2 * k - 1, r
        assert r["new_tokens"] > 0 and r["prompt_tokens"] > r["new_tokens"], r
        assert r["median_s"] > 0 and r["start_s"] > 0 and r["new_tok_s"] > 0, r
        assert r["peak_mib"] >= 0 and r["params"] > 0, r
        assert r["logp_tokens"] == r["new_tokens"], r  # every sampled token is trainable
        assert r["logp_mean_abs"] < 1e-4 and r["logp_max_abs"] < 1e-3, r
    assert rows[0]["speedup"] == rows[0]["tok_s_ratio"] == 1.0
    assert all(r["speedup"] > 0 and r["tok_s_ratio"] > 0 for r in rows)

    with (tmp_path / "sampler.csv").open() as f:
        written = list(csv.DictReader(f))
    assert [r["contender"] for r in written] == contenders
    for r in written:
        assert r["size"] == "tiny" and r["commit"] and r["torch"] and r["transformers"], r
        assert float(r["median_s"]) > 0 and float(r["new_tok_s"]) > 0, r
        assert (r["vllm"] != "") == HAS_VLLM, r
    assert json.loads((tmp_path / "sampler.json").read_text())["sizes"] == summary["sizes"]


def test_generate_sampler_obeys_the_sampler_contract(tmp_path):
    """Per prompt: 1 <= tokens <= its own cap; finish reason "stop" exactly when the last token
    is the first stop token, else "length" at the cap; each log-prob <= 0 and equal to the
    float64 model's processed log-prob (T = 0.7, top_p = 0.9) within twice the float32 eager
    forward's own error plus 1e-6; and the global RNG is left as it was."""
    temperature, top_p = 0.7, 0.9
    folder = bench.save_model("tiny", tmp_path / "tiny", load_config(bench.PRESET))
    model, tokenizer = load_policy(ModelConfig(name_or_path=str(folder), dtype="float32"))
    eos = tokenizer.eos_token_id
    # A bias on EOS's logit (a hook on the LM head; the tied embedding stays) so that some
    # responses stop before their cap and others do not.
    bias = torch.zeros(model.config.vocab_size)
    bias[eos] = 2.0
    model.get_output_embeddings().register_forward_hook(lambda mod, inp, out: out + bias)
    model.eval()
    chat = ChatFormat(tokenizer)
    users = ["hi", "a longer question", "x" * 40, "y" * 90, "z", "move left", "w" * 7, "?"]
    prompts = [chat.first_prompt("sys", user) for user in users]
    caps = [1, 4, 9, 16, 24, 33, 40, 48]

    sampler = bench.GenerateSampler(model, tokenizer, temperature=temperature, top_p=top_p, seed=3)
    rng = torch.get_rng_state()
    samples = sampler.generate(prompts, caps)
    assert torch.equal(torch.get_rng_state(), rng), "the global RNG moved"

    assert len(samples) == len(prompts)
    for sample, cap in zip(samples, caps, strict=True):
        ids = sample.token_ids
        assert 1 <= len(ids) <= cap and len(sample.logprobs) == len(ids), (len(ids), cap)
        assert eos not in ids[:-1], ids
        if sample.finish_reason == "stop":
            assert ids[-1] == eos, ids
        else:
            assert sample.finish_reason == "length" and len(ids) == cap and ids[-1] != eos
    assert {s.finish_reason for s in samples} == {"stop", "length"}

    model64 = copy.deepcopy(model).double()
    got, want, eager = [], [], []
    with torch.no_grad():
        for prompt, sample in zip(prompts, samples, strict=True):
            full, picked = torch.tensor([prompt + sample.token_ids]), torch.tensor(sample.token_ids)
            for m, acc in ((model64, want), (model, eager)):
                logits = m(full).logits[0, len(prompt) - 1 : -1].double()
                logp = processed_logprobs(logits, temperature, top_p)
                acc.append(logp.gather(-1, picked[:, None])[:, 0].double())
            got += sample.logprobs
    got, want, eager = torch.tensor(got, dtype=torch.float64), torch.cat(want), torch.cat(eager)
    assert got.max() <= 0 and torch.isfinite(want).all(), "a sampled token outside the nucleus"
    budget = 2 * (eager - want).abs().max().item() + 1e-6
    err = (got - want).abs()
    bad = (err > budget).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {err.numel()} log-probs beyond {budget:.2e} of float64; first bad "
        f"indices {bad[:5].tolist()}, errors {err[bad[:5]].tolist()}"
    )
