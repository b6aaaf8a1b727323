"""The preset a config for a model of the user's own starts from, when it names none.

The default preset is a tiny model's CPU run (`tiny-cpu`): its response and hint caps, learning
rate, warm start and run folder are wrong for a real model. A config that names its own model
(`model.name_or_path`) and no preset therefore starts from the GPU preset sized nearest to the
model (cod_fast.config.presets.GPU_PRESETS, by parameter count on a log scale; a model over
twice the largest preset's size is refused), counted on the
meta device from the model's config.json (cod_fast.model.shapes: no weights are read, no code
from the folder runs). A model whose size cannot be read is refused in one line naming the
preset choice.
"""

from __future__ import annotations

import math
from pathlib import Path

from cod_fast.config import ConfigError, ModelConfig
from cod_fast.config.presets import GPU_PRESETS
from cod_fast.model.loading import ModelFolderError, model_path_problem, size_problem
from cod_fast.model.shapes import shape_of, transformers_config


def preset_for(model: str) -> tuple[str, int]:
    """(the GPU preset sized nearest to `model`, its parameter count); a ConfigError of one
    line when its size cannot be read."""
    if problem := model_path_problem(model):  # what the preflight would refuse it with
        raise ConfigError("model.name_or_path", problem)
    try:
        config = transformers_config(ModelConfig(name_or_path=model))
        if problem := size_problem(model, config):  # the preflight's refusal of the folder
            raise ConfigError("model.name_or_path", problem)
        params = shape_of(config, model).params
    except ConfigError:
        raise
    except (ModelFolderError, ValueError, OSError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if Path(model).exists():  # a folder of the user's that is no model folder
            raise ConfigError("model.name_or_path", first) from None
        raise ConfigError(
            "preset",
            f"the config names its own model and no preset, and its size cannot be read to "
            f"choose one ({first}); name the preset to start from with --preset or a `preset:` "
            f"key: {', '.join(GPU_PRESETS)}",
        ) from None
    largest = max(GPU_PRESETS, key=GPU_PRESETS.__getitem__)
    if params > 2 * GPU_PRESETS[largest]:
        raise ConfigError(
            "preset",
            f"the config names its own model {model} ({params / 1e9:.1f}B parameters) and no "
            f"preset, and no preset is sized for a model that large (the largest, {largest}, "
            f"is for {GPU_PRESETS[largest] / 1e9:.0f}B); name one with --preset or a `preset:` "
            "key and size the run with `cod-fast plan` (docs/gpu.md)",
        )
    name = min(GPU_PRESETS, key=lambda p: abs(math.log(params / GPU_PRESETS[p])))
    return name, params
