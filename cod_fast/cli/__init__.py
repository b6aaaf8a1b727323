"""The `cod-fast` command (typer): resolves a config, validates it and runs; every refusal is one
line (`--traceback` or COD_FAST_TRACEBACK=1 shows the traceback)."""
