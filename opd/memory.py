"""Peak CPU memory of a piece of code, from the PyTorch profiler's allocator events.

CPU torch has no `max_memory_allocated`; the profiler's memory events carry the allocator's running total, so
the peak of that total while `fn` runs, minus where it started, is the memory `fn` needed on top of what was
already alive. Used by tests (memory must not grow with response length) and bench/scale.py.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import torch


def peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """Bytes allocated at the peak while `fn` runs, above what was allocated when it started."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    finally:
        os.unlink(path)
    cpu = [e for e in events if e.get("Device Type") == 0]
    if not cpu:
        return 0
    start = cpu[0]["Total Allocated"] - cpu[0]["Bytes"]
    return max(e["Total Allocated"] for e in cpu) - start
