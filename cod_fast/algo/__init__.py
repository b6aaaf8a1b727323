"""Credit assignment for CoD rollouts (docs/concepts.md section 3)."""
