"""Child processes for tests that need real separate processes (gloo ranks, writers racing for one file) but not
fresh interpreters, which would each first spend seconds importing transformers.

They are forked from a fork server (multiprocessing's `forkserver`), one per test process, which has imported the
model stack once. Not from the test process itself: by the time a test runs, it has threads (pytest-xdist's channel,
a trainer's publisher), and a fork taken while one of them holds the allocator's lock gives a child whose heap is
corrupt ("malloc(): unaligned fastbin chunk detected", a rank aborting mid-test).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

_SERVER = multiprocessing.get_context("forkserver")


def start(fn: Callable[..., Any], *args: Any, log: Path) -> BaseProcess:
    """`fn(*args)` in a forked process whose output goes to `log`; its exit code is 1 if it raises, else `fn`'s
    return value if that is an int, else 0. `fn` and `args` are pickled to the child."""
    _SERVER.set_forkserver_preload([fn.__module__, "opd.models.target"])  # read when the server first starts
    proc = _SERVER.Process(target=_child, args=(fn, args, str(log)))
    proc.start()
    return proc


def join(procs: list[BaseProcess], logs: list[Path], timeout: float = 240.0) -> None:
    """Wait for every child; the first that failed or outlived `timeout` fails the test with its log's end."""
    for proc in procs:
        proc.join(timeout=timeout)
    failed = [(proc.exitcode, log) for proc, log in zip(procs, logs) if proc.exitcode != 0]
    for proc in procs:
        proc.kill()  # one still running past the timeout (exitcode None) is among the failed
    assert not failed, f"a forked process ended with {failed[0][0]}:\n{failed[0][1].read_text()[-3000:]}"


def _child(fn: Callable[..., Any], args: tuple, log: str) -> None:
    """Runs in the fork. pytest owns the inherited streams, so the output goes to `log`; `os._exit` skips the
    interpreter's shutdown, which would run the test process's exit hooks here."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        result = fn(*args)
        code = result if isinstance(result, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
