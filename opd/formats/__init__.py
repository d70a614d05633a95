"""The drafter families' public checkpoint formats and spec sections, beneath the spec and the models: a family's
`config.json` both ways, its weight names and shapes, and the `models.drafter` section that describes it.

`DrafterSpec` is the union the spec validates `models.drafter` against, told apart by `kind`; `DRAFTER_SECTIONS` is
the order a warm drafter's config.json is recognised in (the most specific family first: a DFlash 2 config is a
DFlash config too). A new family adds its section to both.
"""

from typing import Annotated, Any

from pydantic import Field

from opd.formats.dflash import DFlash2Spec, DFlashSpec
from opd.formats.dspark import DSparkSpec
from opd.formats.eagle3 import Eagle3Spec
from opd.formats.peagle import PEagleSpec
from opd.formats.section import DrafterSection

DrafterSpec = Annotated[DFlashSpec | DFlash2Spec | Eagle3Spec | DSparkSpec | PEagleSpec, Field(discriminator="kind")]
DRAFTER_SECTIONS: tuple[type[DrafterSection], ...] = (DSparkSpec, Eagle3Spec, DFlash2Spec, DFlashSpec)
DRAFTER_SECTIONS += (PEagleSpec,)


def detect_section(config: dict[str, Any]) -> type[DrafterSection] | None:
    """The family section a drafter's config.json describes, None when it is of no family here."""
    return next((section for section in DRAFTER_SECTIONS if section.detects(config)), None)
