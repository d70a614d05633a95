"""What may cross to a worker of another Python environment (vLLM's): plain data only, so neither side ever
unpickles the other's tensors or classes, whose libraries differ there."""

from __future__ import annotations

from typing import Any

PLAIN = (str, int, float, bool, type(None))


def plain(value: Any, where: str) -> Any:
    """`value` itself when it is plain data (nested lists, tuples and dicts of str, int, float, bool, None), else
    a TypeError naming `where`: the boundary to another environment carries nothing its pickles would need."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, list | tuple):
        for item in value:
            plain(item, where)
        return value
    if isinstance(value, dict):
        for key, item in value.items():
            plain(key, where)
            plain(item, where)
        return value
    raise TypeError(f"{where}: {type(value).__name__} cannot cross to another Python environment (plain lists, "
                    f"dicts, strings and numbers only)")
