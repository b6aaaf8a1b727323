"""The run directory and what reads it: the lock and resume checks, logs and plots, checkpoints,
the run's vocabulary, --init-from, export to a Hugging Face folder, and `validate` (a config's
names checked against the world)."""
