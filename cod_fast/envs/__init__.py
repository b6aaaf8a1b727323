"""CoD environments (SPEC.md section 6)."""
