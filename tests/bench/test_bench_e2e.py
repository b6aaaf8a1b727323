"""The end-to-end benchmark (bench/e2e.py): its shared workload (prompts, reward, the padded
vocabulary), its skips, its command line, and a one-step smoke run of every contender on the tiny
model, whose timings mean nothing and are only checked to exist; the work is checked to be equal."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json

import pytest
from rich.console import Console

from cod_fast.bench import e2e
from cod_fast.bench import e2e_workload as workload
from cod_fast.config.io import load_config
from cod_fast.envs import make_env
from cod_fast.envs.packs import make_packs, pack_seeds
from cod_fast.model.tokenizer import CHATML, bpe_tokenizer, char_tokenizer
from cod_fast.rollout.chat import ChatFormat
from cod_fast.rollout.driver import DriverSettings, RolloutDriver
from cod_fast.rollout.sampler import TextPolicySampler

CORPUS = ["pos 1 2\nAction: Direction 3\n", "Hints: null\n## Hints\n", "goal 2 2 hole 1 1"] * 20


def test_padded_tokenizer_keeps_encoding_and_decodes_every_id():
    """Padding a bpe vocabulary to V ids: len is V, every text encodes to the same ids as before
    (all below the old size), every id decodes, and the fillers' text never encodes back to a
    filler."""
    base = bpe_tokenizer(CORPUS, vocab_size=128)
    size = len(base) + 700  # more fillers than two letters give (676): three-letter names too
    padded = workload.padded_tokenizer(base, size)
    assert len(padded) == size and padded.eos_token_id == base.eos_token_id
    for text in [*CORPUS[:3], "<|user|>odd ~ text ~ab 12", ""]:
        ids = padded.encode(text, add_special_tokens=False)
        assert ids == base.encode(text, add_special_tokens=False), text
        assert all(i < len(base) for i in ids), ids
    fillers = list(range(len(base), size))
    texts = [padded.decode([i]) for i in fillers]
    assert len(set(texts)) == len(fillers) and all(t.startswith("~") for t in texts)
    again = padded.encode("".join(texts), add_special_tokens=False)
    assert max(again) < len(base), "a filler came back from encoding"


def test_reward_is_one_for_a_valid_action_and_shaped_below_half_otherwise():
    """The environment's parser decides validity (1.0); anything else scores half the share of
    its characters in the action alphabet, so it stays in [0, 0.5] and rises with that share."""
    cfg = load_config(workload.PRESET)
    env = make_env(cfg.rollout.env, cfg.rollout.env_setting, cfg.rollout.env_size)
    seed = pack_seeds("test", 1)[0]
    assert workload.reward(env, seed, "Direction 2") == 1.0
    assert workload.reward(env, seed, " direction 4 ") == 1.0
    assert workload.reward(env, seed, "") == 0.0
    assert workload.reward(env, seed, "~~~~") == 0.0
    scores = [workload.reward(env, seed, text) for text in ("zzzzd", "zzzdi", "zdirz", "direc")]
    assert all(0 < s <= 0.5 for s in scores) and scores == sorted(scores), scores
    assert len(set(scores)) == len(scores), scores


def test_task_prompts_are_the_drivers_first_prompts():
    """task_prompts gives, per pack, the prompt the rollout driver samples the first solve
    response from (same packs, same settings)."""
    cfg = load_config(workload.PRESET)
    chat = ChatFormat(char_tokenizer(CHATML))
    prompts = workload.task_prompts(cfg, chat.tokenizer, 3, start=5)
    env = make_env(cfg.rollout.env, cfg.rollout.env_setting, cfg.rollout.env_size)
    seeds = pack_seeds("e2e", 3, cfg.train.seed, start=5)
    driver = RolloutDriver(
        env, TextPolicySampler(lambda _: "x", chat), chat, DriverSettings.from_config(cfg)
    )
    rollouts = driver.run(make_packs(seeds, 1), group_size=1)
    first = [r.episodes[0].turns[0].prompt_ids for r in rollouts]
    assert [seed for seed, _ in prompts] == seeds
    assert [ids for _, ids in prompts] == first


@pytest.mark.parametrize(
    ("size", "asked", "has_vllm", "expected"),
    [
        ("tiny", "auto", True, ("torch", None)),
        ("small", "auto", True, (e2e.COD_SAMPLER["small"], None)),
        ("small", "auto", False, ("torch", None)),
        ("tiny", "vllm", True, ("vllm", None)),
        ("tiny", "torch", False, ("torch", None)),
    ],
)
def test_cod_sampler_choice(size, asked, has_vllm, expected):
    """auto takes the measured-faster sampler per size, the torch sampler without vLLM."""
    assert e2e._cod_sampler(size, asked, has_vllm) == expected


def test_auto_falls_back_to_torch_where_vllm_would_be_taken_but_is_missing(monkeypatch):
    monkeypatch.setitem(e2e.COD_SAMPLER, "small", "vllm")
    assert e2e._cod_sampler("small", "auto", True) == ("vllm", None)
    assert e2e._cod_sampler("small", "auto", False) == ("torch", None)


def test_missing_packages_are_skipped_not_a_crash(tmp_path, monkeypatch):
    """Without TRL the trl row, and without vLLM an explicit `--cod-sampler vllm`'s cod-fast
    rows, are reported as skipped (no worker runs)."""
    from transformers import Qwen3Config

    Qwen3Config(num_hidden_layers=1, hidden_size=64, vocab_size=128).save_pretrained(tmp_path)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("trl", "vllm") else find_spec(name, *a),
    )
    args = argparse.Namespace(
        contenders=list(e2e.CONTENDERS), cod_sampler="vllm", prompts=2, group=2
    )
    args.max_completion, args.reps = 4, 1
    progress = Console(file=io.StringIO())
    rows = e2e.run_size("tiny", tmp_path, args, progress)
    assert [r["contender"] for r in rows] == list(e2e.CONTENDERS)
    notes = {r["contender"]: r["status"] for r in rows}
    assert notes["trl"].startswith("skipped: TRL"), notes
    assert notes["cod-fast"].startswith("skipped: vLLM"), notes
    assert notes["cod-multiturn"].startswith("skipped: vLLM"), notes


def test_bad_options_are_refused():
    """A group of one (no advantage), an unknown size or contender exit with a usage error."""
    for argv in (["--group", "1"], ["--sizes", "huge"], ["--contenders", "verl"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            e2e._parse_args(argv)


def test_cli_forwards_only_the_given_options(monkeypatch):
    """`cod-fast bench e2e` passes the options it was given, and no others, to main()."""
    from typer.testing import CliRunner

    from cod_fast.cli.app import app

    seen = []
    monkeypatch.setattr(e2e, "main", seen.append)
    args = ["bench", "e2e", "--sizes", "tiny", "--max-completion", "4", "--cod-sampler", "torch"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen == [["--sizes", "tiny", "--max-completion", "4", "--cod-sampler", "torch"]]


@pytest.mark.slow
def test_tiny_step_of_every_contender_does_equal_work(tmp_path, capsys, monkeypatch):
    """One step of each contender on the tiny model (2 prompts x 2 completions of <= 4 tokens):
    cod-fast and TRL sample the same number of completions, each within the cap, read the same
    prompt tokens and train on exactly the completion tokens; cod-fast's forward reads no
    padding and every distinct prefix at least once, TRL's a padded rectangle at least as big as the
    tokens; both have advantages that are not all zero; the multi-turn reference rolls out every
    episode of its packs. The last stdout line, e2e.json and e2e.csv agree."""
    pytest.importorskip("trl")
    # One thread per worker: on a small shared machine two OpenMP threads can straggle by 20x.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    p, g, n = 2, 2, 4
    argv = ["--sizes", "tiny", "--prompts", str(p), "--group", str(g), "--max-completion", str(n)]
    e2e.main([*argv, "--reps", "1", "--warmup", "0", "--out", str(tmp_path)])

    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("timestamp", "commit", "machine", "torch", "transformers", "trl", "settings"):
        assert key in summary, key
    rows = {r["contender"]: r for r in summary["sizes"]["tiny"]}
    assert list(rows) == list(e2e.CONTENDERS)
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["median_s"] > 0 and r["sample_s"] > 0 and r["train_s"] > 0, r
        assert r["train_tok_s"] > 0 and r["peak_mib"] >= 0 and r["params"] > 0, r
        (step,) = r["steps"]
        assert all(1 <= length <= n for length in step["completion_lengths"]), step
        assert step["trainable_tokens"] == sum(step["completion_lengths"]), step
        assert r["completion_tokens"] == sum(step["completion_lengths"]), r
    cod, trl, multi = rows["cod-fast"], rows["trl"], rows["cod-multiturn"]
    assert (cod["sampler"], trl["sampler"]) == ("torch", "generate")
    assert cod["completions"] == trl["completions"] == p * g
    prompt_tokens = [r["real_tokens"] - r["completion_tokens"] for r in (cod, trl)]
    assert prompt_tokens[0] == prompt_tokens[1] > 0, prompt_tokens
    # The trainer's packing: no padding, and at least every distinct prefix once.
    (step,) = cod["steps"]
    assert step["tree_tokens"] <= cod["train_tokens"] <= cod["real_tokens"], step
    assert trl["train_tokens"] >= trl["real_tokens"] and trl["train_tokens"] % (p * g) == 0
    assert cod["adv_nonzero"] > 0 and trl["adv_nonzero"] > 0
    assert len(cod["steps"][0]["rewards"]) == len(trl["steps"][0]["rewards"]) == p * g
    k = load_config(e2e.MULTITURN_PRESET).rollout.tasks_per_pack
    assert multi["completions"] >= p * g * (2 * k - 1), multi
    assert trl["speedup"] == trl["sample_speedup"] == trl["train_speedup"] == 1.0
    assert trl["mem_ratio"] in (1.0, None)  # None: a peak that rounded to 0
    assert cod["speedup"] > 0 and cod["sample_speedup"] > 0 and cod["train_speedup"] > 0
    assert "speedup" not in multi

    with (tmp_path / "e2e.csv").open() as f:
        written = list(csv.DictReader(f))
    assert [r["contender"] for r in written] == list(e2e.CONTENDERS)
    for r in written:
        assert r["size"] == "tiny" and r["commit"] and r["torch"] and r["transformers"], r
        assert r["trl"] == summary["trl"] != "", r
        assert float(r["median_s"]) > 0 and int(r["prompts"]) == p and int(r["group"]) == g, r
    assert json.loads((tmp_path / "e2e.json").read_text())["sizes"] == summary["sizes"]
