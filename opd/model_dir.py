"""A model directory, read once: its `config.json`, its safetensors headers, where its tokenizer is.

The spec's resolution, the preflight, the family detection, the builders and the suite all ask a model directory the
same questions (how deep is the target, which family is this drafter, do its weight files hold what the config
says). Each reading was once its own `json.loads`, with its own message for a missing file. Here the directory is
read once into a value, every reader takes that value, and each check is written once.

That includes what kind of directory it is (`ModelDir.kind`). A drafter named where the target belongs was once
read as a target: a speculators drafter failed on "field 'hidden_size' missing", a z-lab drafter's depth became the
target's, and past a few overrides it ran as a target with a random embedding and head. Each reader now asks
`expect`, which refuses a directory of the wrong kind in one line naming its kind and the field it belongs in.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from opd.errors import OpdError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TARGET_FIELD, DRAFTER_FIELD = "models.target_path", "models.drafter_path"
# how transformers names a class that writes text: Qwen3ForCausalLM, Gemma4ForConditionalGeneration, GPT2LMHeadModel
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
# what says a directory holds weights, unread: safetensors files, their index, PyTorch's own files
WEIGHT_GLOBS = ("*.safetensors", WEIGHTS_INDEX, "pytorch_model*.bin")
Wanted = Literal["target", "drafter"]
# Where a published multimodal checkpoint keeps its language model, and the names a text-only causal LM gives the
# same tensors: Qwen3.5 and Gemma 4 (`model.language_model.*`), the Llava family's older layout
# (`language_model.model.*`, `language_model.lm_head.*`). The text-only model is what every role loads.
TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                 "language_model.lm_head.": "lm_head."}


@dataclass(frozen=True)
class DirKind:
    """What a model directory is: a target model (`layout` "target", `name` its architecture), a drafter
    (`layout` its family's style, "DFlash" or "EAGLE", or "speculators"; `name` its family), or neither."""

    layout: str
    name: str = ""

    @property
    def is_drafter(self) -> bool:
        return self.layout not in ("target", "neither")

    def __str__(self) -> str:
        if self.layout == "target":
            return f"a target model ({self.name})"
        if self.layout == "neither":
            return "neither a target model nor a drafter"
        style = self.layout if self.layout == "speculators" else f"{self.layout}-style"
        return f"{'an' if style[0] in 'AEIOU' else 'a'} {style} drafter ({self.name})"


Recogniser = Callable[[dict[str, Any]], DirKind | None]
# What a config.json is recognised as before the causal-LM rule: the drafter formats register theirs when opd is
# imported (opd/__init__.py imports opd.formats), as families register themselves, so classifying a directory
# imports nothing behind the layering test's back.
RECOGNISERS: list[Recogniser] = []


def recognises(recogniser: Recogniser) -> Recogniser:
    """Register `recogniser` for `ModelDir.kind`."""
    RECOGNISERS.append(recogniser)
    return recogniser


@dataclass(frozen=True)
class ModelDir:
    """A local Hugging Face-style model directory (a target or a drafter) and its parsed config.json."""

    path: Path
    config: dict[str, Any]
    role: str = "model"  # how messages name it: "target model", "drafter"
    _headers: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def read(cls, path: str | Path, role: str = "model",
             expected: str = f"a local model directory with {CONFIG_FILE}") -> ModelDir:
        """The directory at `path`, or a one-line OpdError naming the file and what is `expected` there."""
        config_path = Path(path) / CONFIG_FILE
        if not config_path.is_file():
            raise OpdError(f"{role}: {config_path} not found (expected {expected})")
        return cls(Path(path), _json(config_path, role), role)

    @classmethod
    def find(cls, path: str | Path | None, role: str = "model") -> ModelDir | None:
        """The directory, or None when it is absent or unreadable (the spec's path check names those)."""
        if path is None or path == "random":
            return None
        try:
            return cls.read(path, role)
        except OpdError:
            return None

    # -- config fields -----------------------------------------------------------------------------------------

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's fields: a multimodal checkpoint nests them under `text_config`."""
        nested = self.config.get("text_config")
        return nested if isinstance(nested, dict) else self.config

    @property
    def architectures(self) -> list[str]:
        value = self.config.get("architectures")
        return [str(a) for a in value] if isinstance(value, list) else []

    @property
    def num_layers(self) -> int | None:
        """`num_hidden_layers`, None when the config does not say (or says something that is not an integer)."""
        value = self.text_config.get("num_hidden_layers")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def int_or_none(self, name: str) -> int | None:
        """An integer field, at the top level or in the language model's config; None where neither has one."""
        value = self.config.get(name, self.text_config.get(name))
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def int_field(self, name: str) -> int:
        """An integer field of the language model's config, or a one-line OpdError naming it."""
        value = self.text_config.get(name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise OpdError(f"{self.role} {self.path}/{CONFIG_FILE}: field {name!r} missing or not an integer")
        return value

    # -- what kind of directory ---------------------------------------------------------------------------------

    @cached_property
    def kind(self) -> DirKind:
        """A drafter when a registered recogniser says so (opd/formats registers the drafter families' own, asked
        first because EAGLE-3's architecture names, `Eagle3LlamaForCausalLM`, read as causal LMs too); else a target
        when its architecture is a transformers causal LM and weights sit beside it; else neither."""
        for recognise in RECOGNISERS:
            if (found := recognise(self.config)) is not None:
                return found
        causal = [name for name in self.architectures if name.endswith(CAUSAL_LM_SUFFIXES)]
        if causal and any(any(self.path.glob(pattern)) for pattern in WEIGHT_GLOBS):
            return DirKind("target", causal[0])
        return DirKind("neither")

    def misplaced(self, wanted: Wanted, field: str, elsewhere: str | None = None) -> str | None:
        """The one line refusing a drafter given where the target belongs (`field`), or a target where a drafter
        does, naming where the other kind goes (`elsewhere`: the spec's field by default, a command's argument
        where it has its own); None otherwise. A directory that is neither is left to its reader, which names what
        it lacks."""
        kind = self.kind
        if wanted == "target" and kind.is_drafter:
            return (f"{field}: {self.path} is {kind}, not a target model (expected the target's directory; a drafter "
                    f"goes in {elsewhere or DRAFTER_FIELD})")
        if wanted == "drafter" and kind.layout == "target":
            return (f"{field}: {self.path} is {kind}, not a drafter (expected a drafter's directory; the target goes "
                    f"in {elsewhere or TARGET_FIELD})")
        return None

    def expect(self, wanted: Wanted, field: str, elsewhere: str | None = None) -> ModelDir:
        """This directory, or a one-line OpdError when it is of the other kind (`misplaced`)."""
        problem = self.misplaced(wanted, field, elsewhere)
        if problem is not None:
            raise OpdError(problem)
        return self

    # -- weight files ------------------------------------------------------------------------------------------

    def weight_files(self) -> list[Path]:
        """The safetensors files the directory's index names (a missing one is a one-line OpdError), else its one
        `model.safetensors`, else none (weights in another format, which transformers reads itself)."""
        index = self.path / WEIGHTS_INDEX
        if not index.is_file():
            single = self.path / WEIGHTS_FILE
            return [single] if single.is_file() else []
        files = [self.path / name for name in sorted(set(_json(index, self.role).get("weight_map", {}).values()))]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise OpdError(f"{missing[0]}: weights file not found (expected it next to {CONFIG_FILE}, as "
                           f"{WEIGHTS_INDEX} names it)")
        return files

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape from the safetensors headers, which safetensors checks against each file's length,
        so a truncated file is caught without reading the weights. Read once per directory value."""
        if not self._headers:
            from safetensors import SafetensorError, safe_open

            for path in self.weight_files():
                try:
                    with safe_open(str(path), framework="pt") as f:
                        for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                            self._headers[name] = {"shape": tuple(f.get_slice(name).get_shape()), "file": path.name}
                except (SafetensorError, OSError) as exc:
                    raise OpdError(f"{path}: unreadable safetensors file ({exc})") from None
        return {name: header["shape"] for name, header in self._headers.items()}

    def tensor_files(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file holding it (from the same headers), for reading one tensor alone."""
        self.tensor_shapes()
        return {name: self.path / header["file"] for name, header in self._headers.items()}

    # -- the language model inside a published checkpoint --------------------------------------------------------

    @cached_property
    def text_prefixes(self) -> dict[str, str]:
        """The published prefixes (`TEXT_PREFIXES`) this checkpoint's tensors carry, each with its text-only name."""
        names = self.tensor_shapes()
        return {old: new for old, new in TEXT_PREFIXES.items() if any(n.startswith(old) for n in names)}

    def text_key_mapping(self) -> dict[str, str]:
        """The renaming transformers' `from_pretrained(key_mapping=...)` applies to load the text-only model."""
        return {"^" + old.replace(".", r"\."): new for old, new in self.text_prefixes.items()}

    def text_names(self) -> dict[str, str]:
        """Text-only name -> the name the checkpoint stores it under, for every tensor (a vision tower's and an
        MTP head's keep their own names, which no text-only module asks for)."""
        out = {}
        for name in self.tensor_shapes():
            old = next((p for p in self.text_prefixes if name.startswith(p)), None)
            out[name if old is None else self.text_prefixes[old] + name[len(old):]] = name
        return out


def _json(path: Path, role: str) -> dict[str, Any]:
    """A JSON object file, or a one-line OpdError naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise OpdError(f"{role}: cannot read {path} ({exc})") from None
    except ValueError as exc:
        raise OpdError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise OpdError(f"{role}: {path} holds a {type(data).__name__} (expected a JSON object)")
    return data
