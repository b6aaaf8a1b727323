"""Triton kernels of cod-fast, installed as `cod_fast.kernels` (the repository's kernels/ folder)."""
