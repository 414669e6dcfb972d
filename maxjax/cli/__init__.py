"""The `maxjax` command line: flags, subcommands and the server's start-up."""
from maxjax.cli.main import main

__all__ = ["main"]
