"""The torch sampler on a tiny random Qwen3 saved and loaded through from_pretrained: its
log-probs against float64 and the trainer's own path, reproducibility, stop tokens and caps,
top-p, bucketing and compaction, the weight push, and keyed draws."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from cod_fast.config import RolloutConfig
from cod_fast.data.metrics import solve_results
from cod_fast.data.packing import Segment, Sequence, build_microbatch
from cod_fast.envs import make_env
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.model.loading import lm_head_weight, packed_hidden_states
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.ops import linear_logprobs
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.rollout.torch_batch import BUCKET_RATIO, draw, length_buckets, processed_logprobs
from cod_fast.rollout.torch_sampler import TorchSampler
from tests.rollout_helpers import save_tiny_qwen3

T = 0.7


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer(CHATML)


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    """A 2-layer Qwen3 with random weights and a character tokenizer, saved like a real model."""
    path = save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), tokenizer)
    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Chat prompts of 34 to 96 tokens: two length buckets, with padding inside each."""
    chat = ChatFormat(tokenizer)
    users = ["hi", "short", "hello you", "x" * 60, "y" * 64, "z" * 52]
    return [chat.first_prompt("sys", user) for user in users]


def biased(model, bias: dict[int, float]):
    """A copy of `model` whose logits get `bias[token]` added (a hook on the LM head, so the
    tied embedding stays as it is)."""
    out = copy.deepcopy(model)
    add = torch.zeros(out.config.vocab_size)
    for token, value in bias.items():
        add[token] = value
    out.get_output_embeddings().register_forward_hook(lambda mod, inp, logits: logits + add)
    return out


def forward_logprobs(model, prompt: list[int], tokens: list[int], temperature: float):
    """log_softmax(logits / T) of `tokens` after `prompt`, one unpadded no-cache forward pass,
    in the model's dtype."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logp = (logits / temperature).log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def assert_within_budget(got, want64, eager32, slack: float = 1e-6, what: str = "log-probs"):
    """|got - want64| may be at most twice the fp32 eager forward's own error, plus slack."""
    budget = 2 * (eager32.double() - want64).abs().max().item() + slack
    err = (got.double() - want64).abs()
    bad = (err > budget).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} of {err.numel()} beyond the budget {budget:.2e}; first bad "
        f"indices {bad[:5].tolist()}, errors {err[bad[:5]].tolist()}"
    )


def cat_logprobs(samples) -> torch.Tensor:
    return torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float32)


def test_logprobs_match_float64_forward_with_padding_and_buckets(model, tokenizer, prompts):
    """Each sampled token's log-prob is float32 log_softmax(logits / T) of a plain forward pass
    over the prompt and the tokens before it, within twice the fp32 forward's own distance from
    float64, for prompts of different lengths (left padding, two buckets, rows leaving at their
    own caps)."""
    assert len(length_buckets([len(p) for p in prompts], 65536)) == 2
    caps = [3, 17, 9, 12, 5, 20]
    samples = TorchSampler(model, tokenizer, temperature=T, seed=3).generate(prompts, caps)
    model64 = copy.deepcopy(model).double()
    want, eager = [], []
    for prompt, sample, cap in zip(prompts, samples, caps, strict=True):
        assert 1 <= len(sample.token_ids) <= cap and len(sample.logprobs) == len(sample.token_ids)
        want.append(forward_logprobs(model64, prompt, sample.token_ids, T))
        eager.append(forward_logprobs(model, prompt, sample.token_ids, T))
    assert_within_budget(cat_logprobs(samples), torch.cat(want), torch.cat(eager))


def test_logprobs_match_the_trainers_packed_path(model, tokenizer, prompts):
    """The sampler's log-probs are what the trainer recomputes at the same temperature: packed
    hidden states of the sequences, then linear_logprobs of the trainable positions."""
    samples = TorchSampler(model, tokenizer, temperature=T, seed=5).generate(prompts, [11] * 6)
    sequences = [
        Sequence(
            tokens=prompt + s.token_ids,
            segments=[
                Segment(
                    start=len(prompt),
                    length=len(s.token_ids),
                    advantage=0.0,
                    rollout_logp=s.logprobs,
                )
            ],
        )
        for prompt, s in zip(prompts, samples, strict=True)
    ]

    def trainer_logprobs(m):
        mb = build_microbatch(sequences)
        with torch.no_grad():
            hidden = packed_hidden_states(m, mb)
            return linear_logprobs(
                hidden[mb.trainable_idx], lm_head_weight(m), mb.targets, temperature=T
            )

    got = trainer_logprobs(model)
    want64 = trainer_logprobs(copy.deepcopy(model).double())
    assert got.dtype == torch.float32 and want64.dtype == torch.float64
    assert_within_budget(cat_logprobs(samples), want64, got, what="vs the trainer's float64")


def test_same_seed_same_samples_new_call_new_samples(model, tokenizer, prompts):
    """Two samplers with one seed draw identical samples; the next call draws different ones."""
    caps = [10] * len(prompts)
    a = TorchSampler(model, tokenizer, temperature=1.0, seed=7)
    b = TorchSampler(model, tokenizer, temperature=1.0, seed=7)
    first = a.generate(prompts, caps)
    assert first == b.generate(prompts, caps)
    second = a.generate(prompts, caps)
    assert [s.token_ids for s in second] != [s.token_ids for s in first]
    other_seed = TorchSampler(model, tokenizer, temperature=1.0, seed=8).generate(prompts, caps)
    assert [s.token_ids for s in other_seed] != [s.token_ids for s in first]


def test_state_dict_resumes_the_same_samples(model, tokenizer, prompts):
    """A sampler loaded from another's state_dict (through torch.save / torch.load) draws
    exactly the samples the other draws next."""
    caps = [8] * len(prompts)
    a = TorchSampler(model, tokenizer, temperature=1.0, seed=11)
    a.generate(prompts, caps)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b = TorchSampler(model, tokenizer, temperature=1.0, seed=99)
    b.load_state_dict(torch.load(buffer, weights_only=True))
    assert b.calls == a.calls == 1
    assert b.generate(prompts, caps) == a.generate(prompts, caps)


def test_generate_leaves_global_rng_training_flag_and_warnings_alone(model, tokenizer, prompts):
    """generate draws from its own generator only (the global RNG state is unchanged), restores
    the model's training flag, and raises no warning (no deprecated cache keyword)."""
    train_model = copy.deepcopy(model).train()
    sampler = TorchSampler(train_model, tokenizer, temperature=1.0, seed=0)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.generate(prompts, [6] * len(prompts))
    assert torch.equal(torch.get_rng_state(), before)
    assert train_model.training and all(m.training for m in train_model.modules())
    model.eval()
    TorchSampler(model, tokenizer, temperature=1.0).generate(prompts[:1], [2])
    assert not model.training


def test_stop_tokens_end_responses_and_caps_are_per_prompt(model, tokenizer, prompts):
    """With EOS likely, every response either ends on its first stop token (included, "stop")
    or has exactly its own cap of tokens and no stop token ("length"); both happen."""
    eos = tokenizer.eos_token_id
    sampler = TorchSampler(biased(model, {eos: 3.0}), tokenizer, temperature=1.0, seed=2)
    batch = prompts * 4
    caps = [1, 2, 4, 8, 16, 30] * 4
    samples = sampler.generate(batch, caps)
    for sample, cap in zip(samples, caps, strict=True):
        ids = sample.token_ids
        assert 1 <= len(ids) <= cap
        assert eos not in ids[:-1]
        if sample.finish_reason == "stop":
            assert ids[-1] == eos
        else:
            assert sample.finish_reason == "length" and len(ids) == cap and ids[-1] != eos
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}


def test_certain_stop_and_certain_length(model, tokenizer, prompts):
    """A huge EOS bias stops every response at its first token, EOS included (log-prob 0); a
    huge negative one makes every response exactly its cap long."""
    eos = tokenizer.eos_token_id
    stop = TorchSampler(biased(model, {eos: 1e4}), tokenizer, temperature=T).generate(
        prompts, [5] * len(prompts)
    )
    assert all(s.token_ids == [eos] and s.finish_reason == "stop" for s in stop)
    assert all(abs(s.logprobs[0]) < 1e-6 for s in stop)
    caps = [1, 2, 3, 7, 4, 13]
    never = TorchSampler(biased(model, {eos: -1e4}), tokenizer, temperature=T)
    for sample, cap in zip(never.generate(prompts, caps), caps, strict=True):
        assert len(sample.token_ids) == cap and sample.finish_reason == "length"


def test_generation_config_eos_ids_also_stop(model, tokenizer, prompts):
    """An id listed in model.generation_config.eos_token_id stops a response like the
    tokenizer's EOS does."""
    extra = tokenizer.convert_tokens_to_ids("!")
    m = biased(model, {extra: 1e4})
    m.generation_config.eos_token_id = [tokenizer.eos_token_id, extra]
    samples = TorchSampler(m, tokenizer, temperature=T).generate(prompts, [5] * len(prompts))
    assert all(s.token_ids == [extra] and s.finish_reason == "stop" for s in samples)


def test_draw_follows_the_distribution_and_never_picks_an_excluded_token():
    """The inverse-CDF draw picks token v with probability p_v: 40000 draws per row of two
    rows, every frequency within 5 standard errors; -inf tokens (p = 0) never come up."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.0, 0.0, 0.9, 0.1, 0.0]])
    logp = probs.log().repeat_interleave(20000, dim=0)
    uniforms = torch.rand(
        logp.shape[0], 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    tokens = draw(logp, uniforms)[:, 0].view(2, -1)
    for row in range(2):
        freq = torch.bincount(tokens[row], minlength=5).double() / tokens.shape[1]
        se = (probs[row].double() * (1 - probs[row].double()) / tokens.shape[1]).sqrt()
        assert ((freq - probs[row]).abs() <= 5 * se + 1e-12).all(), (freq, probs[row])
        assert freq[probs[row] == 0].sum() == 0


def test_processed_logprobs_nucleus_by_hand():
    """Top-p keeps the fewest most likely tokens whose mass reaches top_p (the top one always),
    renormalised; the rest are -inf; top_p = 1 is plain log_softmax(logits / T)."""
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    logits = probs.log() * 2.0  # at T = 2 these are the probabilities again
    got = processed_logprobs(logits, 2.0, 0.75)
    want = torch.tensor([[0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]]).log()
    torch.testing.assert_close(got, want)
    top_only = processed_logprobs(logits, 2.0, 0.4)
    assert top_only[0, 1] == 0 and torch.isinf(top_only[0, [0, 2, 3]]).all()
    torch.testing.assert_close(processed_logprobs(logits, 2.0, 1.0), probs.log())


def test_top_p_samples_lie_in_the_nucleus_with_renormalised_logprobs(model, tokenizer, prompts):
    """With top_p = 0.8 every sampled token is in the float64 nucleus of its step, and its
    log-prob is log(p / nucleus mass) within the fp32 error budget."""
    top_p = 0.8
    caps = [12] * len(prompts)
    samples = TorchSampler(model, tokenizer, temperature=T, top_p=top_p, seed=4).generate(
        prompts, caps
    )
    model64 = copy.deepcopy(model).double()
    got, want, eager = [], [], []
    for prompt, sample in zip(prompts, samples, strict=True):
        full = torch.tensor([prompt + sample.token_ids])
        for m, acc in ((model64, want), (model, eager)):
            with torch.no_grad():
                logits = m(full).logits[0, len(prompt) - 1 : -1]
            probs = (logits / T).softmax(-1)
            sorted_p, order = probs.sort(-1, descending=True)
            keep_sorted = sorted_p.cumsum(-1) - sorted_p < top_p
            for step, token in enumerate(sample.token_ids):
                nucleus = order[step, keep_sorted[step]]
                assert token in nucleus.tolist(), f"step {step}: {token} outside the nucleus"
                acc.append((probs[step, token] / probs[step, nucleus].sum()).log())
        got.extend(sample.logprobs)
    assert_within_budget(
        torch.tensor(got), torch.stack(want), torch.stack(eager), what="top-p log-probs"
    )
    assert max(got) <= 0 and min(got) > -1e3


def test_length_buckets_partition_and_bounds():
    """Buckets partition the prompts; in each the longest is within BUCKET_RATIO of the shortest
    and the padded prefill within max_tokens unless a prompt alone exceeds it."""
    lengths = [200, 950, 210, 880, 240, 199, 905, 5000, 1, 2, 3]
    for max_tokens in (65536, 2000, 1):
        buckets = length_buckets(lengths, max_tokens)
        assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
        for bucket in buckets:
            sizes = [lengths[i] for i in bucket]
            assert max(sizes) <= BUCKET_RATIO * min(sizes)
            assert len(bucket) == 1 or len(bucket) * max(sizes) <= max_tokens
    assert length_buckets([200] * 32 + [900] * 16, 65536) == [
        list(range(32)),
        list(range(32, 48)),
    ]
    assert length_buckets([100] * 10, 300) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_bucketing_padding_and_order_do_not_change_near_greedy_samples(model, tokenizer, prompts):
    """At a near-greedy temperature the samples are the argmax paths, so the same prompt gets
    the same response whether it is padded into a bucket or runs alone (max_batch_tokens = 1),
    and whatever its place in the call; rows leave the batch at different steps."""
    caps = [4, 9, 2, 14, 6, 11]

    def run(order, max_batch_tokens):
        sampler = TorchSampler(
            model, tokenizer, temperature=1e-3, seed=0, max_batch_tokens=max_batch_tokens
        )
        out = sampler.generate([prompts[i] for i in order], [caps[i] for i in order])
        return {i: s.token_ids for i, s in zip(order, out, strict=True)}

    order = list(range(len(prompts)))
    batched = run(order, 65536)
    assert run(order, 1) == batched
    assert run(order[::-1], 65536) == batched
    assert run([3, 0, 5, 1, 4, 2], 100) == batched
    # And the argmax path is the reference's: each token is the forward pass's argmax.
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + batched[i]])).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == batched[i]


def test_push_weights_copies_every_tensor_once_and_rejects_bad_names(model, tokenizer, prompts):
    """push_weights loads a policy's tensors by name (the sampler then samples like that
    policy); unknown, repeated, wrongly shaped and missing tensors raise ValueError naming
    them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        other = Qwen3ForCausalLM(model.config).eval()
    sampler = TorchSampler(other, tokenizer, temperature=1.0, seed=6)
    state = model.state_dict()
    assert sampler.push_weights(iter(state.items())) == len(state)
    for name, tensor in other.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    reference = TorchSampler(model, tokenizer, temperature=1.0, seed=6)
    assert sampler.generate(prompts, [6] * 6) == reference.generate(prompts, [6] * 6)
    # named_parameters() lists a tied weight once: that is a complete push too.
    assert sampler.push_weights(model.named_parameters()) == len(list(model.parameters()))

    first, tensor = next(iter(state.items()))
    with pytest.raises(ValueError, match=r"'nope\.weight' is not a parameter"):
        sampler.push_weights([("nope.weight", tensor)])
    with pytest.raises(ValueError, match="given twice"):
        sampler.push_weights([(first, tensor), (first, tensor)])
    with pytest.raises(ValueError, match="push full"):
        sampler.push_weights([(first, tensor[:1])])
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        sampler.push_weights((k, v) for k, v in state.items() if k != "model.norm.weight")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature must be"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p must be"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p must be"),
        ({"temperature": 1.0, "max_batch_tokens": 0}, "max_batch_tokens must be"),
    ],
)
def test_bad_settings_are_rejected(model, tokenizer, kwargs, match):
    """Settings outside their range raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=match):
        TorchSampler(model, tokenizer, **kwargs)


@pytest.mark.parametrize(
    ("bad_prompts", "caps", "match"),
    [
        ([[1, 2]], [1, 2], "one cap per prompt"),
        ([[]], [3], r"prompts\[0\] must be a non-empty list"),
        ([[1], [2, 10**6]], [3, 3], r"prompts\[1\] must hold ints"),
        ([[1], [2]], [3, 0], r"max_new_tokens\[1\] must be an int >= 1"),
    ],
)
def test_bad_inputs_are_rejected(model, tokenizer, bad_prompts, caps, match):
    """Malformed prompts and caps raise ValueError naming the argument, before any compute."""
    sampler = TorchSampler(model, tokenizer, temperature=1.0)
    with pytest.raises(ValueError, match=match):
        sampler.generate(bad_prompts, caps)
    assert sampler.calls == 0


@pytest.mark.gpu
def test_cuda_model_gets_a_cuda_generator(model, tokenizer, prompts):
    """On a CUDA model the generator is a CUDA one and the log-probs still match the forward
    pass; the state dict still resumes the same samples."""
    cuda_model = copy.deepcopy(model).cuda()
    sampler = TorchSampler(cuda_model, tokenizer, temperature=T, seed=1)
    assert sampler.generator.device.type == "cuda"
    state = sampler.state_dict()
    samples = sampler.generate(prompts, [9] * len(prompts))
    sampler.load_state_dict(state)
    assert sampler.generate(prompts, [9] * len(prompts)) == samples
    model64 = copy.deepcopy(model).double()
    want = torch.cat(
        [
            forward_logprobs(model64, p, s.token_ids, T)
            for p, s in zip(prompts, samples, strict=True)
        ]
    )
    eager = torch.cat(
        [forward_logprobs(model, p, s.token_ids, T) for p, s in zip(prompts, samples, strict=True)]
    )
    assert_within_budget(cat_logprobs(samples), want, eager, slack=1e-5)


def test_torch_sampler_keyed_draws_ignore_the_rest_of_the_call(model, tokenizer):
    """With keys, each response is the same whether its prompt is sampled alone, in a larger
    batch (other lengths, other buckets), or after other calls; the sampler's generator is not
    advanced; other keys give other responses."""
    chat = ChatFormat(tokenizer)
    prompts = [chat.first_prompt("sys", u) for u in ["hi", "hello there", "x" * 40, "y" * 9]]
    keys = [11, 22, 33, 44]
    sampler = TorchSampler(model, tokenizer, temperature=1.0, seed=5)
    state = sampler.generator.get_state()
    full = sampler.generate(prompts, [16] * 4, keys=keys)
    assert torch.equal(sampler.generator.get_state(), state)
    sampler.generate(prompts, [16] * 4)  # advances the stream; keyed draws must not care
    for i in (2, 0):
        alone = sampler.generate([prompts[i]], [16], keys=[keys[i]])[0]
        assert alone.token_ids == full[i].token_ids
        assert alone.logprobs == pytest.approx(full[i].logprobs, abs=1e-5)
    others = sampler.generate(prompts, [16] * 4, keys=[k + 1 for k in keys])
    assert [s.token_ids for s in others] != [s.token_ids for s in full]


def test_keyed_rollouts_of_a_split_equal_the_whole(model, tokenizer):
    """Packs rolled out with keyed sampling in two halves (as two ranks do) give every pack the
    rewards, responses and hints it gets when all packs are rolled out together; without keys
    the halves differ from the whole (which is why evaluation keys its draws)."""
    chat = ChatFormat(tokenizer)
    env = make_env("frozenlake", "train", "tiny")
    settings = DriverSettings(rollout=RolloutConfig(max_response_tokens=12, prompt_style="compact"))
    packs = make_packs(pack_seeds("eval", 5), 3)

    def played(subset, keyed):
        sampler = TorchSampler(model, tokenizer, temperature=1.0, seed=1)
        driver = RolloutDriver(env, sampler, chat, settings)
        return {
            r.pack_id: (solve_results(r), [t.response_ids for e in r.episodes for t in e.turns])
            for r in driver.run(subset, group_size=1, keyed=keyed)
        }

    whole = played(packs, keyed=True)
    halves = {**played(packs[0::2], keyed=True), **played(packs[1::2], keyed=True)}
    assert halves == whole
    unkeyed = {**played(packs[0::2], keyed=False), **played(packs[1::2], keyed=False)}
    assert unkeyed != played(packs, keyed=False)
