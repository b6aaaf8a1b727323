"""Priority replay against no replay from one tiny-cpu warm start (3 seeds, paired)."""

import json
import sys
from pathlib import Path

from cod_fast.bench.rl_effect import Arm, run_arms, summarize_arms

out = Path(sys.argv[1])
start = Path(sys.argv[2])
runs = out / "runs"
runs.mkdir(parents=True, exist_ok=True)
arms = {
    "no replay": Arm("plain", threads=1),
    "replay 1": Arm("replay1", ("train.replay_batches=1", "train.replay_sigma=1.0"), threads=1),
}
rows = run_arms(start, arms, [0, 1, 2], 90, 256, [], runs)
summary = summarize_arms(rows, pair=("replay 1", "no replay"))
(out / "replay.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary))
