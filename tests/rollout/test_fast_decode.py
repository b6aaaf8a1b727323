"""The torch sampler's fast decode path (cod_fast.rollout.fast_decode) against transformers' own
forward: the same samples and log-probs in float64 for every supported architecture, the
refusals that send a model back to transformers, and equal prompts prefilled once."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

from cod_fast.model.lean import make_lean
from cod_fast.rollout.fast_decode import FastDecoder
from cod_fast.rollout.torch_batch import distinct_prompts
from cod_fast.rollout.torch_sampler import TorchSampler

VOCAB, STOP = 13, 3  # a small vocabulary: random weights sample the stop token often
SIZES = dict(
    vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
CONFIGS = {
    "qwen3": lambda **kw: Qwen3Config(**SIZES, head_dim=10, tie_word_embeddings=True, **kw),
    "qwen2": lambda **kw: Qwen2Config(**SIZES, tie_word_embeddings=False, **kw),  # qkv bias
    "llama": lambda **kw: LlamaConfig(**SIZES, attention_bias=True, mlp_bias=True, **kw),
}
TOKENIZER = types.SimpleNamespace(eos_token_id=STOP, pad_token_id=None)


def saved_model(tmp_path, arch: str, dtype=torch.float64, **overrides):
    """A random model of `arch` (norm weights moved off 1), saved and loaded back."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](**overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / arch)
    return AutoModelForCausalLM.from_pretrained(tmp_path / arch, dtype=dtype).eval()


def prompts_and_caps(seed: int):
    """Prompts of 3 to 23 tokens (two length buckets, padding in each), two of them repeated
    (a group's members), and a cap per prompt."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 8, 20, 23)]
    prompts = [base[0], base[1], base[3], base[1], base[2], base[4], base[1], base[3]]
    caps = [9, 4, 12, 12, 1, 7, 12, 5]
    return prompts, caps


def generate(model, fast: bool, prompts, caps, seed=5):
    sampler = TorchSampler(model, TOKENIZER, temperature=0.8, seed=seed, fast_decode=fast)
    samples = sampler.generate(prompts, caps)
    return sampler.decode_path, samples


def forward_logprobs(model, prompt, tokens, temperature=0.8):
    """log_softmax(logits / T) of `tokens` after `prompt`: one unpadded forward, no cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logp = (logits.double() / temperature).log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def assert_same_samples(got, want, atol=2e-6):
    """Equal tokens and finish reasons; log-probs equal up to their float32 rounding (the
    sampler reports float32 log-probs, as the trainer computes them)."""
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0
        )


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("lean", [False, True], ids=["plain", "lean"])
def test_fast_path_draws_what_transformers_draws_in_float64(tmp_path, arch, lean):
    """Same seed, same samples: token for token, finish reasons, and log-probs; and each
    log-prob is the plain forward's (so prefilling a repeated prompt once is exact). The
    log-probs are float32, so "equal" is up to float32 rounding here; the logits themselves
    are compared in float64 below."""
    model = saved_model(tmp_path, arch)
    if lean:
        make_lean(model)
    prompts, caps = prompts_and_caps(seed=1)
    path, fast = generate(model, True, prompts, caps)
    slow_path, slow = generate(model, False, prompts, caps)
    assert path == "fast" and slow_path == "transformers (fast_decode=False)"
    assert_same_samples(fast, slow)
    assert {s.finish_reason for s in fast} == {"stop", "length"}  # rows leave the batch early
    for prompt, sample in zip(prompts, fast, strict=True):
        want = forward_logprobs(model, prompt, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs).double(), want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_prefill_and_steps_give_the_forwards_logits_in_float64(tmp_path, arch):
    """FastDecoder's logits after a left-padded prefill (two prompts, one padded, one of them
    repeated in the batch) and three decode steps equal an unpadded float64 forward's to 1e-12
    (lean modules: float64 throughout, where transformers' RMSNorm rounds to float32)."""
    model = saved_model(tmp_path, arch)
    make_lean(model)
    g = torch.Generator().manual_seed(7)
    short, long = (torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (5, 11))
    follow = torch.randint(4, VOCAB, (3, 3), generator=g)  # three steps' tokens for 3 rows
    ids = torch.tensor([[0] * 6 + short, long])
    mask = torch.tensor([[0] * 6 + [1] * 5, [1] * 11])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    decoder = FastDecoder(model)
    with torch.inference_mode():
        cache, logits = decoder.prefill(ids, mask, positions)
        rows = torch.tensor([0, 1, 0])  # the short prompt twice
        decoder.start(cache, mask, 3, rows)
        outs, pos = [logits[rows]], positions[rows, -1:] + 1
        for t in range(3):
            outs.append(decoder.step(follow[:, t : t + 1], pos))
            pos = pos + 1
        for r, prompt in enumerate((short, long, short)):
            full = torch.tensor([prompt + follow[r].tolist()])
            want = model(full).logits[0, len(prompt) - 1 :]
            got = torch.stack([o[r] for o in outs])
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_decode_steps_hand_sdpa_the_cache_itself(tmp_path, monkeypatch, dtype):
    """The torch decode step (CUDA, 16-bit and float64; float32 on a CPU under
    COD_FAST_IMPL=torch) hands SDPA the KV cache's own keys and values, views with a contiguous
    last dimension as SDPA's fused backends need, and the key-value heads unrepeated with
    enable_gqa: no step copies the cache, transposed or repeated per query head."""
    monkeypatch.setenv("COD_FAST_IMPL", "torch")
    model = saved_model(tmp_path, "qwen3", dtype=dtype)
    decoder = FastDecoder(model)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(4, VOCAB, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((k, v, kwargs.get("enable_gqa")))
        return sdpa(q, k, v, **kwargs)

    with torch.inference_mode():
        cache, _ = decoder.prefill(ids, mask, positions)
        decoder.start(cache, mask, 4, torch.arange(3))
        monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
        for t in range(2):
            decoder.step(ids[:, t : t + 1], positions[:, -1:] + 1 + t)
    layers = len(decoder.layers)
    assert len(seen) == 2 * layers
    for i, (k, v, gqa) in enumerate(seen):
        assert k.stride(-1) == 1 and v.stride(-1) == 1, (k.stride(), v.stride())
        assert k.shape[1] == v.shape[1] == decoder.kv_heads < decoder.heads and gqa
        for got, cached in ((k, decoder.keys[i % layers]), (v, decoder.values[i % layers])):
            assert got.untyped_storage().data_ptr() == cached.untyped_storage().data_ptr()


def test_float32_fast_path_matches_float64(tmp_path):
    """In float32 the fast path's log-probs stay within float32 rounding of float64's."""
    model64 = saved_model(tmp_path, "qwen3")
    model32 = saved_model(tmp_path, "qwen3", dtype=torch.float32)
    prompts, caps = prompts_and_caps(seed=2)
    _, samples = generate(model32, True, prompts, caps)
    for prompt, sample in zip(prompts, samples, strict=True):
        want = forward_logprobs(model64, prompt, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs).double(), want, atol=2e-5, rtol=0)


def test_updated_weights_are_read_at_every_call(tmp_path):
    """The fast path reads the live parameters: after an in-place update both paths agree on
    the new model, and differ from the old samples."""
    model = saved_model(tmp_path, "qwen3")
    prompts, caps = prompts_and_caps(seed=3)
    _, before = generate(model, True, prompts, caps)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    _, fast = generate(model, True, prompts, caps)
    _, slow = generate(model, False, prompts, caps)
    assert_same_samples(fast, slow)
    assert [s.logprobs for s in fast] != [s.logprobs for s in before]


def _hooked(model):
    model.get_output_embeddings().register_forward_hook(lambda mod, inp, out: out + 1.0)


def _adapter(model):
    class Adapter(torch.nn.Linear):  # stands for a LoRA-style replacement of a projection
        pass

    old = model.model.layers[0].self_attn.q_proj
    new = Adapter(old.in_features, old.out_features, bias=False, dtype=old.weight.dtype)
    new.weight = old.weight
    model.model.layers[0].self_attn.q_proj = new


def _replaced_forward(model):
    mlp = model.model.layers[0].mlp
    mlp.forward = types.MethodType(lambda self, x: 2 * type(self).forward(self, x), mlp)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (_hooked, "lm_head has a forward hook"),
        (_adapter, "q_proj is a Adapter, not a plain nn.Linear"),
        (_replaced_forward, "model.layers.0.mlp's forward was replaced"),
    ],
    ids=["hook", "adapter", "forward"],
)
def test_models_the_fast_path_would_misread_decode_through_transformers(tmp_path, change, why):
    """A hook, an adapter or a replaced forward sends decoding back to transformers, which
    honours them (the samples equal fast_decode=False's)."""
    model = saved_model(tmp_path, "qwen3")
    change(model)
    prompts, caps = prompts_and_caps(seed=4)
    path, samples = generate(model, True, prompts, caps)
    assert path.startswith("transformers (") and why in path
    _, slow = generate(model, False, prompts, caps)
    assert_same_samples(samples, slow)


def test_unsupported_configurations_are_named():
    sliding = Qwen3Config(**SIZES, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    gelu = Qwen3Config(**SIZES, hidden_act="gelu")
    for config, why in ((sliding, "sliding-window"), (gelu, "hidden_act 'gelu'")):
        model = AutoModelForCausalLM.from_config(config)
        assert why in FastDecoder.supports(model)
        with pytest.raises(ValueError, match="FastDecoder"):
            FastDecoder(model)
    gpt2 = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2"))
    assert "model_type 'gpt2'" in FastDecoder.supports(gpt2)


def test_distinct_prompts_groups_equal_prompts_in_first_order():
    prompts = [[1, 2], [3], [1, 2], [1], [3], [1, 2]]
    assert distinct_prompts(prompts) == [[0, 2, 5], [1, 4], [3]]
    assert distinct_prompts([]) == []


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_fast_path_on_cuda_matches_a_float64_forward(tmp_path, dtype, atol):
    """On CUDA (bench/gpu_check.sh runs this file): the fast path's log-probs against a float64
    CPU forward of the same tokens, within the dtype's rounding (bf16's is coarse, but a wrong
    position, mask or cache column is off by far more)."""
    model64 = saved_model(tmp_path, "qwen3")
    model = saved_model(tmp_path, "qwen3", dtype=dtype).cuda()
    prompts, caps = prompts_and_caps(seed=6)
    path, samples = generate(model, True, prompts, caps)
    assert path == "fast"
    for prompt, sample in zip(prompts, samples, strict=True):
        want = forward_logprobs(model64, prompt, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs).double(), want, atol=atol, rtol=0)
