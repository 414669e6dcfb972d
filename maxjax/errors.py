"""Errors a user can act on: the CLI prints them as one line and exits 2, without a traceback."""


class UserError(Exception):
    """Bad flag, model, checkpoint or artifact; the message names the problem."""
