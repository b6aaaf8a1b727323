"""Benchmarks of cod-fast, installed as `cod_fast.bench` (the repository's bench/ folder)."""
