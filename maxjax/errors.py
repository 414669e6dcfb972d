"""Errors a user can act on. The CLI prints a UserError as one line and exits 2, without a
traceback; the server turns a RequestError into an OpenAI 400 naming its field and a
QueueFullError into a 429."""


class UserError(Exception):
    """Bad flag, model, checkpoint or artifact; the message names the problem."""


class RequestError(ValueError):
    """A request the engine refuses at admission. `param` is the SamplingParams field at fault
    (or "prompt"), `reason` says why; the message is "param: reason"."""

    def __init__(self, param: str, reason: str):
        super().__init__(f"{param}: {reason}")
        self.param, self.reason = param, reason


class EngineDeadError(Exception):
    """The engine's loop has died; the server answers 503 and is on its way out."""


class QueueFullError(Exception):
    """The engine's request queue is at capacity; the server answers 429 with Retry-After."""


def read_user_file(path: str, flag: str) -> str:
    """The text of a file a flag names; a UserError naming the flag if it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise UserError(f"{flag} {path}: {e.strerror}") from e
