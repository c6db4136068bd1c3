"""Request field validation: ids, texts, metadata, numbers in a range, facts and messages, each against Limits;
INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the field at fault. Pure: it runs before any backend is touched."""
from __future__ import annotations

from dataclasses import dataclass, field

from inferscale_core.errors import InvalidIdError, check_id
from inferscale_core.types import check_user_id

from .errors import invalid, too_big
from .limits import Limits


def user_id(value: str, field_name: str = "user_id") -> str:
    """A caller's user id (also a token's subject and a Mem0 scope value): printable, bounded, not reserved."""
    try:
        return check_user_id(field_name, value)
    except InvalidIdError as e:
        raise invalid(str(e), field_name) from None


def fact_id(value: str, field_name: str = "fact_id") -> str:
    try:
        return check_id(field_name, value)
    except InvalidIdError as e:
        raise invalid(str(e), field_name) from None


def text_field(value: str, name: str, max_chars: int, required: bool = True) -> str:
    if required and not value.strip():
        raise invalid(f"{name} must not be empty", name)
    if len(value) > max_chars:
        raise too_big(f"{name} is {len(value)} characters long, the limit is {max_chars}", name)
    return value


def metadata(value, name: str, limits: Limits) -> dict[str, str]:
    if len(value) > limits.max_metadata_entries:
        raise too_big(f"{name} has {len(value)} entries, the limit is {limits.max_metadata_entries}", name)
    for k, v in value.items():
        if not k:
            raise invalid(f"{name} has an empty key", name)
        if len(k) > limits.max_metadata_key_chars:
            raise too_big(f"{name} key {k[:40]!r}... is {len(k)} characters, the limit is "
                          f"{limits.max_metadata_key_chars}", name)
        if len(v) > limits.max_metadata_value_chars:
            raise too_big(f"{name}[{k!r}] is {len(v)} characters, the limit is {limits.max_metadata_value_chars}",
                          name)
    return dict(value)


def bounded_int(value: int, name: str, lo: int, hi: int, default: int) -> int:
    """0 means 'server default'; otherwise lo <= value <= hi or INVALID_ARGUMENT."""
    if value == 0:
        return default
    if not lo <= value <= hi:
        raise invalid(f"{name} must be in [{lo}, {hi}] (or 0 for the default {default}), got {value}", name)
    return value


@dataclass(frozen=True)
class FactIn:
    text: str
    metadata: dict = field(default_factory=dict)
    window: tuple[str, ...] = ()


def facts_in(facts, limits: Limits) -> list[FactIn]:
    if not facts:
        raise invalid("facts must not be empty", "facts")
    if len(facts) > limits.max_facts_per_request:
        raise too_big(f"facts has {len(facts)} entries, the limit is {limits.max_facts_per_request} per request",
                      "facts")
    out = []
    for i, f in enumerate(facts):
        text = text_field(f.text, f"facts[{i}].text", limits.max_fact_chars)
        if len(f.window) > limits.max_window_turns:
            raise too_big(f"facts[{i}].window has {len(f.window)} turns, the limit is {limits.max_window_turns}",
                          f"facts[{i}].window")
        for j, turn in enumerate(f.window):
            text_field(turn, f"facts[{i}].window[{j}]", limits.max_message_chars, required=False)
        window_chars = sum(len(turn) for turn in f.window)
        if window_chars > limits.max_window_chars:
            raise too_big(f"facts[{i}].window holds {window_chars} characters, the limit is {limits.max_window_chars}",
                          f"facts[{i}].window")
        out.append(FactIn(text.strip(), metadata(f.metadata, f"facts[{i}].metadata", limits), tuple(f.window)))
    return out


ROLES = ("system", "user", "assistant")


def messages_in(messages, limits: Limits) -> list[dict[str, str]]:
    if not messages:
        raise invalid("messages must not be empty", "messages")
    if len(messages) > limits.max_messages:
        raise too_big(f"messages has {len(messages)} entries, the limit is {limits.max_messages}", "messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role!r}", f"messages[{i}].role")
        text_field(m.content, f"messages[{i}].content", limits.max_message_chars)
        out.append({"role": m.role, "content": m.content})
    return out
