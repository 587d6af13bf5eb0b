"""Errors the engine raises to callers: input it cannot accept (each message names the field
and the limit), overload, and requests that failed underneath."""


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded (missing, corrupt or unsupported)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at its bound (`max_waiting_requests`); retry later."""


class EngineDeadError(RuntimeError):
    """The engine can run no more steps (a tensor-parallel rank exited, or its thread
    stopped): every request fails, and a server stops so that its supervisor restarts it."""


class RequestFailedError(RuntimeError):
    """The engine (or the replica) running a request failed; the request ended unfinished."""

    code = "request_failed"  # the API error's code


class ServerStoppingError(RequestFailedError):
    """The server stopped (SIGTERM or Ctrl+C) before the request finished, once its
    `--shutdown-timeout` had passed."""

    code = "server_shutting_down"
