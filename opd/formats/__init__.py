"""The drafter families' public checkpoint formats and spec sections, beneath the spec and the models: a family's
`config.json` both ways, its weight names and shapes, and the `models.drafter` section that describes it.

Each family's section registers itself (`@drafter_section`, opd/formats/section.py) in its format module, and
every module of this package is imported here, so a new family's format is one new file listed nowhere else.
`DrafterSpec` is the union the spec validates `models.drafter` against, told apart by `kind`.
"""

import importlib
import pkgutil
from typing import TYPE_CHECKING, Annotated, Any, Union

from pydantic import Field

from opd.formats.section import DrafterSection, registered_sections
from opd.formats.speculators import is_speculators, model_type
from opd.model_dir import DirKind, recognises


def _discover() -> tuple[type[DrafterSection], ...]:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return registered_sections()


DRAFTER_SECTIONS = _discover()
KINDS: tuple[str, ...] = tuple(str(section.model_fields["kind"].default) for section in DRAFTER_SECTIONS)
if TYPE_CHECKING:
    DrafterSpec = DrafterSection
else:
    DrafterSpec = Annotated[Union[DRAFTER_SECTIONS], Field(discriminator="kind")]  # noqa: UP007 (a tuple of types)


def detect_section(config: dict[str, Any]) -> type[DrafterSection] | None:
    """The family section a drafter's config.json describes, None when it is of no family here: of the sections
    that recognise it, the most specific (a DFlash 2 config is a DFlash config too, and its section subclasses
    DFlash's)."""
    found = [section for section in DRAFTER_SECTIONS if section.detects(config)]
    specific = [s for s in found if not any(t is not s and issubclass(t, s) for t in found)]
    return specific[0] if specific else None


@recognises
def drafter_kind(config: dict[str, Any]) -> DirKind | None:
    """A drafter directory's kind (`ModelDir.kind`): its family's style, or speculators' layout (of any family,
    one of ours or not); None for anything else."""
    section = detect_section(config)
    if section is not None:
        return DirKind("speculators" if is_speculators(config) else section.style,
                       str(section.model_fields["kind"].default))
    if is_speculators(config):
        return DirKind("speculators", model_type(config) or "unknown family")
    return None
