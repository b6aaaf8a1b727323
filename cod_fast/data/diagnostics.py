"""Hint-quality and credit diagnostics of a batch (docs/concepts.md, "Reading the diagnostics").

CoD credit (section 3) reaches the hints only through update episodes, and only as far as the
group's returns differ. These numbers show where it goes: how the hints a model writes score
against the hidden rule and against what its own trajectory showed (for environments that
declare their hint entries, cod_fast.envs.base), and how much advantage survives equal returns
and identical copies among a group's members. Pure Python over the records, no torch.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence

from cod_fast.data.records import Episode, Rollout

HINT_COUNTS = ("correct", "wrong", "unknown", "knowable", "knowable_correct")
"""What `hint_check` counts for one hint, in the order the metrics list them."""
ZERO_ADVANTAGE = 1e-9
"""|A| at or below this is a zero advantage: equal returns leave float rounding of their mean."""
_LETTER = {"solve": "s", "update": "u"}


def hint_check(
    truth: dict[str, str], stated: dict[str, str], knowable: dict[str, str]
) -> dict[str, int]:
    """How one hint's entries score: `correct` (stated as the truth has it), `wrong` (stated
    otherwise, or not in the truth), `unknown` (in the truth but not stated), `knowable` (entries
    the trajectory so far shows) and `knowable_correct` (those the hint states correctly)."""
    return {
        "correct": sum(stated.get(k) == v for k, v in truth.items()),
        "wrong": sum(truth.get(k) != v for k, v in stated.items()),
        "unknown": sum(k not in stated for k in truth),
        "knowable": len(knowable),
        "knowable_correct": sum(stated.get(k) == truth.get(k) for k in knowable),
    }


def hint_checks(rollout: Rollout) -> list[dict[str, int] | None]:
    """The `hint_check` of each update episode of a rollout, by index u (None where the driver
    recorded none: an environment without hint entries)."""
    updates = sorted(
        (e for e in rollout.episodes if e.kind == "update"), key=lambda e: e.task_index
    )
    return [e.info.get("hint_check") for e in updates]


def hint_metrics(checks: Sequence[Sequence[dict[str, int] | None]]) -> dict[str, float]:
    """`hint_COUNT_uU`: the mean of each count of `HINT_COUNTS` over the update episodes at
    index U that have a check (`checks`: one `hint_checks` list per rollout); empty without."""
    by_index: dict[int, list[dict[str, int]]] = defaultdict(list)
    for row in checks:
        for u, check in enumerate(row):
            if check is not None:
                by_index[u].append(check)
    return {
        f"hint_{count}_u{u}": sum(c[count] for c in found) / len(found)
        for count in HINT_COUNTS
        for u, found in sorted(by_index.items())
    }


def credit_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """The credit diagnostics of a batch whose advantages are assigned (cod_fast.algo.assign):

    - `zero_var_sK`, `zero_var_uU`: share of packs whose group has equal returns (every
      advantage zero) at solve episode K, update episode U;
    - `adv_surviving_solve`, `adv_surviving_update`: sum over a pack's distinct token sequences
      of |their summed advantages| / sum over episodes of |advantage| (identical copies add
      their advantages, and opposite ones cancel: 1 when every episode is distinct);
    - `nll_solve`, `nll_update`: mean negative sampled log-prob per response token;
    - `distinct_s0`: distinct solve-0 episodes per group;
    - `same_hint_u0`: share of member pairs whose update episode 0 wrote the same hints.
    """
    groups: dict[tuple, list[Episode]] = defaultdict(list)
    for rollout in rollouts:
        for episode in rollout.episodes:
            groups[(episode.kind, episode.task_index, rollout.pack_id)].append(episode)
    out = _zero_variance(groups)
    for kind in _LETTER:
        mine = [e for r in rollouts for e in r.episodes if e.kind == kind]
        if mine:
            out[f"adv_surviving_{kind}"] = _surviving(mine)
            out[f"nll_{kind}"] = _nll(mine)
    first = [m for (kind, index, _), m in groups.items() if (kind, index) == ("solve", 0)]
    if first:
        out["distinct_s0"] = sum(len({_tokens(e) for e in m}) for m in first) / len(first)
    written = [
        [e.info.get("hints") for e in m]
        for (kind, index, _), m in groups.items()
        if (kind, index) == ("update", 0) and len(m) > 1
    ]
    if written:
        out["same_hint_u0"] = sum(_same_pairs(hints) for hints in written) / len(written)
    return out


def _zero_variance(groups: dict[tuple, list[Episode]]) -> dict[str, float]:
    """`zero_var_sK` / `zero_var_uU` over the groups (kind, index, pack) whose advantages are
    all assigned."""
    zero: dict[tuple[str, int], list[bool]] = defaultdict(list)
    for (kind, index, _), members in groups.items():
        if all(e.advantage is not None for e in members):
            zero[(kind, index)].append(all(abs(e.advantage) <= ZERO_ADVANTAGE for e in members))
    return {
        f"zero_var_{_LETTER[kind]}{index}": sum(flags) / len(flags)
        for (kind, index), flags in sorted(zero.items())
    }


def _tokens(episode: Episode) -> tuple:
    """What makes two episodes copies: every turn's prompt and response ids."""
    return tuple((tuple(t.prompt_ids), tuple(t.response_ids)) for t in episode.turns)


def _surviving(episodes: list[Episode]) -> float:
    """Advantage mass left once each pack's identical episodes are summed (nan without any)."""
    summed: dict[tuple, float] = defaultdict(float)
    total = 0.0
    for e in episodes:
        if e.advantage is not None:
            summed[(e.pack_id, _tokens(e))] += e.advantage
            total += abs(e.advantage)
    return sum(abs(a) for a in summed.values()) / total if total else math.nan


def _nll(episodes: list[Episode]) -> float:
    logprobs = [lp for e in episodes for t in e.turns for lp in t.response_logprobs]
    return -sum(logprobs) / len(logprobs)


def _same_pairs(values: list) -> float:
    """Share of the pairs of `values` that are equal."""
    n = len(values)
    same = sum(c * (c - 1) // 2 for c in Counter(values).values())
    return same / (n * (n - 1) // 2)
