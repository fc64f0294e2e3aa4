"""The base of every error a user causes and can fix: a bad id, data set, option, checkpoint or reward.

Command lines print such an error's message alone, without a traceback (`--debug` shows it, and the
Prefect log keeps it). Bugs and crashes stay tracebacks.
"""
from __future__ import annotations


class UserError(ValueError):
    """An error whose message names what is wrong and how to fix it."""


def user_error(exc: BaseException | None) -> UserError | None:
    """`exc`, or the error it was explicitly raised from (`raise ... from err`), when a user caused it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__
    return None
