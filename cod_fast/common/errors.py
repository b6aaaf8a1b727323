"""The base of cod-fast's own errors: what a user can act on, not a bug.

A bad config, a damaged or foreign run directory, a model folder that does not load, a full
disk: each error class for such a cause derives from `CodFastError` beside its Python base
(`class ConfigError(ValueError, CodFastError)`), so that `except ValueError` still catches it
and `except CodFastError` catches all of them. Its message is one line naming the cause and the
fix; the command line shows that line alone unless asked for the traceback (`cod-fast
--traceback`, `COD_FAST_TRACEBACK=1`: docs/cli.md)."""


class CodFastError(Exception):
    """An error whose one-line message names its cause and its fix (a bad input or a bad
    machine, never a bug of cod-fast)."""
