"""A spec as flat strings: MLflow's params, and the schema default of each, so a run page shows what was changed."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, TypeAdapter

from opd.spec.experiment import ExperimentSpec


def field_default(dotted: str) -> str | None:
    """The schema default of a `flatten` key, in `flatten`'s form; None where the path has none (a required field,
    an item of a list, or no such field)."""
    model: Any = ExperimentSpec
    *sections, name = dotted.split(".")
    for part in sections:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        model = field.annotation if field is not None else None
    if not (isinstance(model, type) and issubclass(model, BaseModel)) or name not in model.model_fields:
        return None
    field = model.model_fields[name]
    if field.is_required():
        return None
    annotation: Any = field.annotation
    value = TypeAdapter(annotation).dump_python(field.get_default(call_default_factory=True), mode="json")
    return value if isinstance(value, str) else json.dumps(value)


def flatten(spec: ExperimentSpec) -> dict[str, str]:
    """Dotted key -> string value, for MLflow params (`optim.lr` -> "0.0003"; lists of sections by index)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else key, sub)
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
            for i, sub in enumerate(value):
                walk(f"{prefix}.{i}", sub)
        else:
            out[prefix] = value if isinstance(value, str) else json.dumps(value)

    walk("", spec.model_dump(mode="json"))
    return out
