"""The command line: one module per command, all registered on commands.app.app (in this order in --help)."""

from maskcli.commands import show  # noqa: F401, I001  (each import registers its commands)
from maskcli.commands import blocks, diff  # noqa: F401
from maskcli.commands import attend, verify  # noqa: F401
from maskcli.commands import inspect, kinds  # noqa: F401
from maskcli.commands.app import app


def main() -> None:
    app()
