"""The user-facing error types (the CLI prints their message as one line, without a traceback).

They live below every other module so that ``hub`` (which ``config`` uses) can raise them too; ``config``
re-exports both, and ``from specserve.config import CheckpointError`` stays the usual spelling."""

from __future__ import annotations


class SpecserveError(Exception):
    """A user-facing error: the CLI prints its message without a traceback."""


class CheckpointError(SpecserveError):
    """A checkpoint could not be read or found (names the file, or the hub id, and the problem)."""
