"""cod-fast: a performance-first RL trainer for 'connect the dots' (CoD) agents."""

from cod_fast.config import LossConfig

__version__ = "0.1.0"

__all__ = ["LossConfig", "__version__"]
