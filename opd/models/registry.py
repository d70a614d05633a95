"""The drafter families, by `kind`: each registers itself (`@drafter_family`, opd/models/family.py) in
its own module, and its spec section in its format module (opd/formats/), so a new family is listed nowhere."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from opd.errors import OpdError
from opd.formats import KINDS, detect_section
from opd.model_dir import ModelDir
from opd.models.family import DrafterFamily, registered_families
from opd.models.protocol import Drafter
from opd.models.shared_head import SharedHead
from opd.models.target import Target


def family(kind: str) -> DrafterFamily:
    """The family of a spec's `models.drafter.kind`."""
    try:
        return FAMILIES[kind]
    except KeyError:
        raise OpdError(f"models.drafter.kind: {kind!r} (expected one of {', '.join(FAMILIES)})") from None


def detect(directory: ModelDir) -> DrafterFamily:
    """The family a drafter directory's config.json describes; a one-line OpdError when it is of none."""
    section = detect_section(directory.config)
    if section is None:
        raise OpdError(f"drafter {directory.path}: its config.json is of no drafter family here (expected one of "
                       f"{', '.join(FAMILIES)})")
    return family(str(section.model_fields["kind"].default))


def load_drafter(path: str | Path, base: Target | SharedHead, *, field: str = "drafter") -> Drafter:
    """A drafter directory of any family, for `base`, with its family's default options where the checkpoint
    leaves one to the spec (EAGLE-3's block size); `field` names the path in the refusal of a target's directory."""
    directory = ModelDir.read(path, "drafter").expect("drafter", field)
    found = detect(directory)
    return found.load(directory, base, found.section.model_validate({}))


def _discover() -> dict[str, DrafterFamily]:
    """Every family, in the order of the spec sections (opd/formats/): each module of this package is imported,
    so each family has registered itself."""
    from opd import models

    for module in pkgutil.iter_modules(models.__path__):
        importlib.import_module(f"{models.__name__}.{module.name}")
    found = registered_families()
    missing = [kind for kind in KINDS if kind not in found]
    if missing:
        raise RuntimeError(f"drafter kind {missing[0]!r} has a spec section but no family: add a @drafter_family "
                           "class for it in opd/models/")
    return {kind: found[kind] for kind in KINDS}


FAMILIES: dict[str, DrafterFamily] = _discover()
