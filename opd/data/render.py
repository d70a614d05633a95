"""How a prompt row becomes the token ids the target sees: the one rendering every path uses.

A served chat model never sees raw text: vLLM or SGLang wrap each request in the tokenizer's chat template, and
Qwen3's template also carries the thinking switch. A drafter post-trained on states the served target never
visits learns the wrong distribution, so rollout, SFT data generation, eval, serve-bench and the up-front checks
all take their ids from `render` (through `opd.data.prompts.load_prompts`), never from their own tokenizer call.

`raw` is the tiny target's mode (trained without a template): the prompt text, tokenized as is. `chat` is the
target tokenizer's own `apply_chat_template(messages, add_generation_prompt=True, ...)`; a plain prompt row becomes
one user message. Nothing here touches the response: a thinking response is kept whole.

The thinking switch reaches each template under the name it reads, as z-lab's benchmark harness maps it
(`dflash.benchmark._reasoning_kwargs`): on/off (`data.enable_thinking`) as `enable_thinking` (Qwen3); an effort
level (`data.reasoning_effort`) as `reasoning_strength` where the template reads that, else `reasoning_effort`
(gpt-oss). A template that reads none of the names a setting needs refuses it in one line: passed anyway, the
setting would silently do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from opd.errors import OpdError

if TYPE_CHECKING:
    from opd.spec import DataSpec

ROLES = ("system", "user", "assistant")
EFFORT_KEYS = ("reasoning_strength", "reasoning_effort")  # z-lab's order of preference
_PROBE = [{"role": "user", "content": "1 + 1?"}]


@dataclass(frozen=True)
class Rendering:
    """The spec's `data.render`, `data.enable_thinking` and `data.reasoning_effort` (None = the template's own
    default)."""

    mode: str = "raw"
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None

    @classmethod
    def of(cls, data: DataSpec) -> Rendering:
        return cls(data.render, data.enable_thinking, data.reasoning_effort)


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
    reasoning_kwargs(str(tokenizer.chat_template), rendering)
    if rendering.enable_thinking is not None:
        on, off = (_template(tokenizer, _PROBE, Rendering("chat", thinking)) for thinking in (True, False))
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
        assert prompt is not None  # a row without messages has its prompt (the callers check)
        return Rendered(prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if messages is not None:
        turns = messages
    else:
        assert prompt is not None
        turns = [{"role": "user", "content": prompt}]
    text = _template(tokenizer, turns, rendering)
    # The template writes its special tokens out; tokenizing without adding more is what apply_chat_template does.
    return Rendered(text, tokenizer(text, add_special_tokens=False)["input_ids"])


def reasoning_kwargs(template: str, rendering: Rendering) -> dict[str, bool | str]:
    """The chat template's arguments for the rendering's thinking switch, under the names `template` reads;
    OpdError naming the spec field when it reads none of them."""
    out: dict[str, bool | str] = {}
    if rendering.enable_thinking is not None:
        if "enable_thinking" not in template:
            effort = next((key for key in EFFORT_KEYS if key in template), None)
            hint = (f"it reads '{effort}': set data.reasoning_effort instead" if effort else
                    "expected null: the template has no thinking switch")
            raise OpdError(f"data.enable_thinking: {str(rendering.enable_thinking).lower()} but the tokenizer's chat "
                           f"template reads no 'enable_thinking' ({hint})")
        out["enable_thinking"] = rendering.enable_thinking
    if rendering.reasoning_effort is not None:
        key = next((key for key in EFFORT_KEYS if key in template), None)
        if key is None:
            hint = ("it reads 'enable_thinking': set data.enable_thinking instead" if "enable_thinking" in template
                    else "expected null: the template has no reasoning switch")
            raise OpdError(f"data.reasoning_effort: {rendering.reasoning_effort} but the tokenizer's chat template "
                           f"reads neither 'reasoning_strength' nor 'reasoning_effort' ({hint})")
        out[key] = rendering.reasoning_effort
    return out


def _template(tokenizer, messages: list[dict[str, str]], rendering: Rendering) -> str:
    extra = reasoning_kwargs(str(tokenizer.chat_template), rendering)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
