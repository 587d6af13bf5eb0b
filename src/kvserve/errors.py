"""Errors raised for input the engine cannot accept; each message names the field and the limit."""


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded (missing, corrupt or unsupported)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at its bound (`max_waiting_requests`); retry later."""
