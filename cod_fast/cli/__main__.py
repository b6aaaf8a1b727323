"""`python -m cod_fast.cli` runs the `cod-fast` command (what `torchrun -m cod_fast.cli` runs on
every rank)."""

from cod_fast.cli.app import app

if __name__ == "__main__":  # importing the module (a wheel's import check) runs nothing
    app()
