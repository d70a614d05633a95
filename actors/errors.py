"""The one unwrapping of Ray's errors: what a rank, a loop or a constructor actually raised, as one line.

Ray wraps what an actor raised in its own exceptions (a task error holding the cause; a constructor's failure
keeping only the traceback text), and prints tracebacks, fatal-error banners and C++ stacks around them. A user
gets the cause's line: an `OpdError`'s own (bad input: a rerun would fail alike), or the role, the error and, for
a fault a rerun can fix (an actor, object or node lost), the advice to rerun.
"""

from __future__ import annotations

import ray

from opd.errors import OpdError
from opd.train.restarts import RESUME


def root(exc: BaseException) -> BaseException:
    """What actually went wrong: the exception a task raised, or the `OpdError` an actor's constructor raised (Ray
    keeps only its traceback text, whose last line is `module.Type: message`)."""
    while isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    if init_failed(exc):
        last = [line for line in str(exc).splitlines() if line.strip()][-1]
        kind, _, message = last.partition(": ")
        if kind == f"{OpdError.__module__}.{OpdError.__name__}":
            return OpdError(message)
    return exc


def init_failed(exc: BaseException) -> bool:
    """Whether `exc` is an actor's constructor failing (which no restart heals: it would fail again)."""
    return isinstance(exc, ray.exceptions.RayActorError) and exc.actor_init_failed


def is_bad_input(exc: BaseException) -> bool:
    """An `OpdError` or a constructor that raised: the run stops with its line instead of restarting."""
    return isinstance(root(exc), OpdError) or init_failed(exc)


def failure(name: str, exc: BaseException, context: str = "") -> OpdError:
    """The one line for role `name` failing with `exc`. When the root cause is an `OpdError` (bad input, a refused
    resume), that error's own line: a rerun would fail the same way, so it gets no advice to rerun. Only a fault a
    rerun can fix (an actor, object or node lost, not an exception raised by the code) ends with that advice."""
    cause = root(exc)
    if isinstance(cause, OpdError):
        return OpdError(str(cause))
    fixable = isinstance(cause, ray.exceptions.RayError) and not init_failed(cause)
    line = f"{name} failed ({context}{type(cause).__name__}: {first_line(cause)})"
    return OpdError(line + (RESUME if fixable else ""))


def first_line(exc: BaseException) -> str:
    """One line for an error; for a constructor that raised, the last line of its traceback (the first is only
    Ray's banner naming the task and process)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    return lines[-1] if init_failed(exc) else lines[0]


def cause_line(exc: BaseException) -> str:
    """`Type: first line` of what a rank raised (the exception a task raised, not Ray's wrapper)."""
    while isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    lines = [line for line in str(exc).strip().splitlines() if line.strip()] or [""]
    return f"{type(exc).__name__}: {lines[0]}".rstrip(": ")
