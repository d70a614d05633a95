"""The drafter families, by `kind`: the one place that lists them (a new family adds its line here and its
section in opd/formats/__init__.py)."""

from __future__ import annotations

from pathlib import Path

from opd.errors import OpdError
from opd.formats import detect_section
from opd.model_dir import ModelDir
from opd.models.dflash2 import DFlash2Family
from opd.models.drafter import DFlashFamily
from opd.models.drafter_family import DrafterFamily
from opd.models.dspark import DSparkFamily
from opd.models.eagle3 import Eagle3Family
from opd.models.family import Drafter
from opd.models.peagle import PEagleFamily
from opd.models.shared_head import SharedHead
from opd.models.target import Target

FAMILIES: dict[str, DrafterFamily] = {f.kind: f for f in (DFlashFamily(), DFlash2Family(), Eagle3Family(),
                                                            DSparkFamily())}
FAMILIES[PEagleFamily().kind] = PEagleFamily()


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
                       f"{', '.join(FAMILIES)}: a DFlash, DFlash 2, EAGLE-3, DSpark or P-EAGLE checkpoint)")
    return family(str(section.model_fields["kind"].default))


def load_drafter(path: str | Path, base: Target | SharedHead) -> Drafter:
    """A drafter directory of any family, for `base`, with its family's default options where the checkpoint
    leaves one to the spec (EAGLE-3's block size)."""
    directory = ModelDir.read(path, "drafter")
    found = detect(directory)
    return found.load(directory, base, found.section.model_validate({}))
