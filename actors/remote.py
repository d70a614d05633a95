"""`as_actor_class`: a class `@ray.remote` decorated, typed as the actor class it became.

mypy keeps a decorated class's own type whatever the decorator returns, so it sees `WeightStore` without the
`.options` and `.remote` Ray gave it; Ray's own types do not help, as pyproject.toml's mypy override reads none of
Ray. Starting an actor through this protocol keeps those calls checked instead of silenced line by line.
"""

from __future__ import annotations

from typing import Any, Protocol, cast


class ActorClass(Protocol):
    """The part of Ray's `ActorClass` the driver uses: set the placement and name, then start an actor."""

    def options(self, **options: Any) -> ActorClass: ...

    def remote(self, *args: Any, **kwargs: Any) -> Any:  # an actor handle, whose methods are called by .remote
        ...


def as_actor_class(cls: type) -> ActorClass:
    """`cls`, which `@ray.remote` already replaced by Ray's actor class at import: only its static type changes."""
    return cast(ActorClass, cls)
