"""Credit assignment for CoD rollouts (SPEC.md section 3)."""
