"""How a prompt row becomes the token ids the target sees: the one rendering every path uses.

A served chat model never sees raw text: vLLM or SGLang wrap each request in the tokenizer's chat template, and
Qwen3's template also carries the thinking switch. A drafter post-trained on states the served target never
visits learns the wrong distribution, so rollout, SFT data generation, eval, serve-bench and the up-front checks
all take their ids from `render` (through `opd.data.prompts.load_prompts`), never from their own tokenizer call.

`raw` is the tiny target's mode (trained without a template): the prompt text, tokenized as is. `chat` is the
target tokenizer's own `apply_chat_template(messages, add_generation_prompt=True, enable_thinking=...)`; a plain
prompt row becomes one user message. Nothing here touches the response: a thinking response is kept whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from opd.errors import OpdError

if TYPE_CHECKING:
    from opd.spec import DataSpec

ROLES = ("system", "user", "assistant")
_PROBE = [{"role": "user", "content": "1 + 1?"}]


@dataclass(frozen=True)
class Rendering:
    """The spec's `data.render` and `data.enable_thinking` (None = the template's own default)."""

    mode: str = "raw"
    enable_thinking: bool | None = None

    @classmethod
    def of(cls, data: DataSpec) -> Rendering:
        return cls(data.render, data.enable_thinking)


@dataclass(frozen=True)
class Rendered:
    text: str  # what the target sees, special tokens written out
    ids: list[int]


def check_tokenizer(tokenizer, rendering: Rendering) -> None:
    """Refuse, before any row is read, a chat rendering the tokenizer cannot do or a thinking switch it ignores."""
    if rendering.mode != "chat":
        return
    if not getattr(tokenizer, "chat_template", None):
        raise OpdError("data.render: chat but the tokenizer has no chat template (expected chat_template in its "
                       "tokenizer_config.json or chat_template.jinja, or data.render: raw)")
    if rendering.enable_thinking is not None:
        on, off = (_template(tokenizer, _PROBE, thinking) for thinking in (True, False))
        if on == off:
            raise OpdError(f"data.enable_thinking: {str(rendering.enable_thinking).lower()} but the tokenizer's "
                           f"chat template renders the same either way, so it would do nothing (expected null)")


def messages_of(record: dict) -> list[dict[str, str]] | None:
    """The row's chat turns, checked; None for a plain `prompt` row. Raises ValueError naming what is wrong.

    Every turn has non-empty content and the last is the user's: the generation prompt opens the assistant turn
    that answers it. A row ending on the assistant's answer would put the answer in the prompt and open a second
    assistant turn after it."""
    if "messages" not in record:
        return None
    if "prompt" in record:
        raise ValueError("has both 'prompt' and 'messages' (expected one)")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    for number, turn in enumerate(messages):
        if not isinstance(turn, dict) or not {"role", "content"} <= turn.keys():
            raise ValueError(f"messages[{number}] must be an object with 'role' and 'content'")
        if turn["role"] not in ROLES:
            raise ValueError(f"messages[{number}] has unknown role {turn['role']!r} (expected one of {ROLES})")
        if not isinstance(turn["content"], str):
            raise ValueError(f"messages[{number}].content is not a string")
        if not turn["content"].strip():
            raise ValueError(f"messages[{number}].content is empty (expected non-empty text, as for 'prompt')")
    if not any(turn["role"] == "user" for turn in messages):
        raise ValueError("'messages' has no user turn")
    if messages[-1]["role"] != "user":  # the template would open a second assistant turn after it
        raise ValueError(f"'messages' ends on the {messages[-1]['role']}'s turn (expected the user's turn last: the "
                         f"target answers it; keep a reference answer in another field)")
    return messages


def render(prompt: str | None, messages: list[dict[str, str]] | None, tokenizer, rendering: Rendering) -> Rendered:
    """A row's text and ids as the target sees them. Raises ValueError for a chat row under `raw`."""
    if rendering.mode == "raw":
        if messages is not None:
            raise ValueError("a 'messages' row needs data.render: chat (raw renders 'prompt' text only)")
        return Rendered(prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"])
    turns = messages if messages is not None else [{"role": "user", "content": prompt}]
    text = _template(tokenizer, turns, rendering.enable_thinking)
    # The template writes its special tokens out; tokenizing without adding more is what apply_chat_template does.
    return Rendered(text, tokenizer(text, add_special_tokens=False)["input_ids"])


def _template(tokenizer, messages: list[dict[str, str]], enable_thinking: bool | None) -> str:
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
