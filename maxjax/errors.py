"""Errors a user can act on: the CLI prints them as one line and exits 2, without a traceback."""


class UserError(Exception):
    """Bad flag, model, checkpoint or artifact; the message names the problem."""


def read_user_file(path: str, flag: str) -> str:
    """The text of a file a flag names; a UserError naming the flag if it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise UserError(f"{flag} {path}: {e.strerror}") from e
