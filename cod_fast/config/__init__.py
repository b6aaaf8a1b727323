"""The configuration of a cod-fast run: one tree of dataclasses, checked as it is built.

The ground floor of the package: it imports nothing of the project's but `common/` (the error
base, bounded reads of a config file), and every layer may import it. Each class checks its
own fields (types, ranges, the combinations a run cannot train with) and raises `ConfigError`,
one line naming the dotted key, the value and the fix.
What needs the world outside the config (environment names and plugins, judges, model
folders) is checked by cod_fast.run.validate, which the CLI and the preflight call; what fits
this machine (devices, memory) by the preflight (cod_fast.train.preflight).

- base: `ConfigError` and the type-hint checks every class shares
- algo, model, rollout, run: the sections, and `Config`, a whole run
- presets: the named configs; io: a run's config from a preset, YAML and `a.b=value` overrides;
  doc: the generated reference (docs/configuration.md)
"""

from cod_fast.config.algo import AlgoConfig, LossConfig
from cod_fast.config.base import ConfigError, clipped, shown
from cod_fast.config.model import ModelConfig, refuse_cpu_dtype
from cod_fast.config.rollout import MAX_EVAL_PACKS, EnvEntry, RolloutConfig
from cod_fast.config.run import DERIVED, Config, RuntimeConfig, TrainConfig

__all__ = [
    "DERIVED",
    "MAX_EVAL_PACKS",
    "AlgoConfig",
    "Config",
    "ConfigError",
    "EnvEntry",
    "LossConfig",
    "ModelConfig",
    "RolloutConfig",
    "RuntimeConfig",
    "TrainConfig",
    "clipped",
    "refuse_cpu_dtype",
    "shown",
]
