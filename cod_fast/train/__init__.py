"""The training loop (`trainer.Trainer`) and what it holds: the optimizer step, the batch sources,
replay, teachers, the warm start's loss, the preflight and distillation's teacher jobs."""
