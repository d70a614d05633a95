"""What made a stored target sample, so a reader can refuse one that another target, tokenizer, rendering or length
cap made.

A sample file outlives the run that drew it and is shared across runs, arms and seeds, so nothing else ties a row to the
model and settings it came from. A row drawn at `max_new_tokens` 16 and trained on by a run at 128 teaches truncated
responses; one from another target makes offline τ meaningless (it was once measured off from the decoded τ that way; no
file in bench/results holds the figures). Every row therefore carries its `Provenance`, and every reader compares it
with its own, field by field.

The target and tokenizer are named by a digest of the files that decide their outputs, cheap at any size: the bytes
of the config and tokenizer files, and each weight file's name, size and first and last MiB (a retrained or
re-seeded model differs there; reading 16 GB of weights to open a sample file would not do). Model cards and
READMEs beside them are not read, so editing one keeps the samples.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from opd.errors import OpdError
from opd.model_dir import ModelDir

if TYPE_CHECKING:
    from opd.spec import ExperimentSpec

EDGE = 1 << 20  # bytes hashed at each end of a weight file
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
MODEL_FILES = ("config.json", ".index.json", *WEIGHT_SUFFIXES)  # names equal to, or ending with, one of these
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens", "chat_template")  # prefixes


@dataclass(frozen=True)
class Provenance:
    """The model and settings a sample was drawn under (its sampling setting is the row's key, kept apart)."""

    target: str  # digest of the target's files
    tokenizer: str  # digest of the tokenizer's files
    render: str  # "raw" or "chat" (opd/data/render.py)
    enable_thinking: bool | None  # the chat template's thinking switch
    max_new_tokens: int  # the cap responses were drawn under

    @classmethod
    def of(cls, spec: ExperimentSpec, max_new_tokens: int) -> Provenance:
        return cls(directory_digest(spec.models.target_path, "model"),
                   directory_digest(spec.models.tokenizer, "tokenizer"), spec.data.render, spec.data.enable_thinking,
                   max_new_tokens)

    def as_row(self) -> dict:
        """The row's `made_by` object and `max_new_tokens` field."""
        made_by = asdict(self)
        return {"made_by": {k: v for k, v in made_by.items() if k != "max_new_tokens"},
                "max_new_tokens": self.max_new_tokens}

    def mismatch(self, other: Provenance) -> str | None:
        """The first field where `other` (a row's) differs from this (the reader's), with both values."""
        for name, mine in asdict(self).items():
            theirs = getattr(other, name)
            if theirs != mine:
                field = name if name == "max_new_tokens" else f"made_by.{name}"
                return f"{field} is {_show(theirs)}, this run's is {_show(mine)}"
        return None


def _show(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def directory_digest(path: str | Path, kind: str) -> str:
    """`sha256:<16 hex>` of a `kind` ("model" or "tokenizer") directory's files that decide its outputs."""
    root = Path(path)
    if not root.is_dir():
        raise OpdError(f"{path}: not a directory (expected a local {kind} directory)")
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(root.iterdir())
                  if f.is_file() and _decides(f.name, kind))
    if not stamp:
        raise OpdError(f"{path}: no {kind} files (expected a local HF {kind} directory)")
    return _digest(str(root.resolve()), stamp)


def _decides(name: str, kind: str) -> bool:
    if kind == "model":
        return name.endswith(MODEL_FILES)
    return name.startswith(TOKENIZER_FILES)


@functools.lru_cache(maxsize=32)
def _digest(root: str, stamp: tuple) -> str:
    """Cached per directory state (names, sizes, mtimes), so a process reads each model's files once."""
    h = hashlib.sha256()
    for name, size, _ in stamp:
        file = Path(root) / name
        h.update(f"{name}:{size}\n".encode())
        with file.open("rb") as f:
            if name.endswith(WEIGHT_SUFFIXES) and size > 2 * EDGE:
                h.update(f.read(EDGE))
                f.seek(size - EDGE)
                h.update(f.read(EDGE))
            else:
                h.update(f.read())
    return f"sha256:{h.hexdigest()[:16]}"


def target_vocab_size(path: str | Path) -> int | None:
    """The vocabulary a target's config declares (stored token ids must lie below it), or None without one."""
    directory = ModelDir.find(path, "target model")
    return directory.int_or_none("vocab_size") if directory is not None else None
