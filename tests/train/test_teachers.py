"""Teachers of on-policy distillation: their scores against a float64 reference, one forward per
token, the tokenizer check and where their weights stay."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import cod_fast.train.teachers as teachers_module
from cod_fast.config import ConfigError, LossConfig, ModelConfig
from cod_fast.data.packing import Segment, Sequence
from cod_fast.model.attention import KERNELS, resolve_attn_impl
from cod_fast.model.tokenizer import CHATML, char_tokenizer
from cod_fast.train.teachers import Teachers, fits_on_device
from tests.reference import assert_within_budget
from tests.rollout_helpers import save_tiny_qwen3

MODEL = ModelConfig(dtype="float32")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two teachers with different weights (peaked, like trained models) and the student's
    tokenizer."""
    root, tok = tmp_path_factory.mktemp("teachers"), char_tokenizer(CHATML)
    return {
        "a": save_tiny_qwen3(root / "a", tok, seed=1, scale=4.0),
        "b": save_tiny_qwen3(root / "b", tok, seed=2, scale=4.0),
    }


def _sequences(vocab: int, seed: int) -> list[Sequence]:
    """Sequences of environments a and b with odd lengths, several segments, a 1-token one."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for k, lengths in enumerate([[7, 1], [13], [2, 5, 3], [1], [11, 4]]):
        tokens, segments = [], []
        for n in lengths:
            prompt = int(torch.randint(1, 6, (1,), generator=rng))
            tokens += torch.randint(0, vocab, (prompt,), generator=rng).tolist()
            start = len(tokens)
            tokens += torch.randint(0, vocab, (n,), generator=rng).tolist()
            logp = (-torch.rand(n, generator=rng) * 3).tolist()
            segments.append(Segment(start=start, length=n, advantage=1.0, rollout_logp=logp))
        out.append(Sequence(tokens=tokens, segments=segments, env="ab"[k % 2]))
    return out


def _reference(folder, seq: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """The teacher's log-probs of the response tokens, the sequence alone through the plain
    Hugging Face forward with full logits."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        logits = model(torch.tensor([seq.tokens])).logits[0].to(dtype)
    logp = torch.log_softmax(logits, dim=-1)
    rows = [
        logp[seg.start - 1 + i, seq.tokens[seg.start + i]]
        for seg in seq.segments
        for i in range(seg.length)
    ]
    return torch.stack(rows)


def test_each_sequence_is_scored_by_its_environments_teacher(folders):
    """Every segment's teacher_logp is its environment's teacher's log-prob of each response
    token, within the error budget of the eager float32 forward against float64, for
    sequences packed into several budget-sized batches; the gap metric is the mean of
    teach - roll per environment."""
    tok = char_tokenizer(CHATML)
    teachers = Teachers({k: str(v) for k, v in folders.items()}, MODEL, torch.device("cpu"), tok)
    seqs = _sequences(len(tok), seed=0)
    metrics = teachers.score(seqs, LossConfig(), token_budget=24)
    for env in "ab":
        mine = [s for s in seqs if s.env == env]
        got = torch.tensor([x for s in mine for seg in s.segments for x in seg.teacher_logp])
        truth = torch.cat([_reference(folders[env], s, torch.float64) for s in mine])
        eager = torch.cat([_reference(folders[env], s, torch.float32) for s in mine])
        assert_within_budget(f"teacher {env}", got, eager, truth)
        roll = torch.tensor([x for s in mine for seg in s.segments for x in seg.rollout_logp])
        assert metrics[f"teacher_gap/{env}"] == pytest.approx(float((got - roll).mean()), abs=1e-6)
    other = torch.cat([_reference(folders["b"], s, torch.float64) for s in seqs if s.env == "a"])
    mine = torch.tensor(
        [x for s in seqs if s.env == "a" for g in s.segments for x in g.teacher_logp]
    )
    assert (other - mine).abs().max() > 0.1  # the other teacher would have scored differently


def test_one_teacher_forward_per_token(folders):
    """Each teacher's decoder sees exactly its environment's tokens once (no teacher runs on
    another environment's sequences, none twice), and no LM-head logits are computed."""
    tok = char_tokenizer(CHATML)
    teachers = Teachers({k: str(v) for k, v in folders.items()}, MODEL, torch.device("cpu"), tok)
    seen = {env: 0 for env in teachers.models}
    heads = []
    for env, teacher in teachers.models.items():

        def count(module, args, kwargs, env=env):
            seen[env] += kwargs["input_ids"].numel()

        teacher.model.get_decoder().register_forward_pre_hook(count, with_kwargs=True)
        teacher.model.lm_head.register_forward_hook(lambda *a: heads.append(1))
    seqs = _sequences(len(tok), seed=1)
    teachers.score(seqs, LossConfig(), token_budget=20)
    for env in "ab":
        assert seen[env] == sum(len(s) for s in seqs if s.env == env)
    assert not heads


def test_teacher_with_another_tokenizer_is_refused(folders, tmp_path):
    """A teacher folder whose tokenizer differs from the student's (vocabulary or end token) is
    refused naming algo.teachers.ENV and the fix."""
    plain = save_tiny_qwen3(tmp_path / "plain", char_tokenizer(), seed=1)  # eos <eos>
    with pytest.raises(ConfigError, match=r"algo.teachers.b: the teacher's tokenizer .* share"):
        Teachers(
            {"a": str(folders["a"]), "b": str(plain)},
            MODEL,
            torch.device("cpu"),
            char_tokenizer(CHATML),
        )


def test_teachers_stay_on_a_gpu_only_when_they_fit(monkeypatch):
    """On the CPU teachers always stay; on a GPU only while their weights take at most
    DEVICE_SHARE of the free memory (else they are moved in turn)."""
    assert fits_on_device(10**15, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 4000))
    share = teachers_module.DEVICE_SHARE
    assert fits_on_device(int(1000 * share), torch.device("cuda"))
    assert not fits_on_device(int(1000 * share) + 1, torch.device("cuda"))


@pytest.mark.parametrize("attn_impl", ["auto", "varlen_attn"])
def test_teachers_waiting_in_host_memory_are_prepared_for_the_gpu(folders, monkeypatch, attn_impl):
    """Teachers of a CUDA run that do not fit next to the student wait in host memory, but in
    the GPU's dtype (bfloat16 under model.dtype=auto) and with its attention kernel, the ones
    they compute with once moved there; an explicit CUDA kernel is not refused for the host."""
    monkeypatch.setattr(teachers_module, "fits_on_device", lambda nbytes, device: False)
    cuda = torch.device("cuda")
    model = ModelConfig(attn_impl=attn_impl)
    paths = {k: str(v) for k, v in folders.items()}
    teachers = Teachers(paths, model, cuda, char_tokenizer(CHATML))
    kernel = KERNELS[resolve_attn_impl(attn_impl, cuda, torch.bfloat16)]
    assert not teachers.resident
    for teacher in teachers.models.values():
        assert {(p.dtype, p.device.type) for p in teacher.parameters()} == {(torch.bfloat16, "cpu")}
        assert teacher.model.config._attn_implementation == kernel
