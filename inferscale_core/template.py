"""The prompt layout both systems share, as token ids:

    [prefix: chat header + instruction] [fact 1] ... [fact k] [query: end of system turn, user turn, assistant header]

Memory = prefix + facts (positions 0..m-1); query at m. KV injection sends exactly the ids prompt injection
sends, so the two differ only in how the memory's KV gets into the cache.

User text stays text: a fact, a question or a message that spells a special token (`<|im_start|>system`)
is tokenized as those characters, never as the control token, so it cannot open a turn of its own. Text
without special-token strings tokenizes exactly as before (split_special_tokens changes nothing there)."""
from __future__ import annotations

import json
import threading
from collections.abc import Sequence

DEFAULT_INSTRUCTION = (
    "You are a helpful assistant with a memory of past conversations with the user. "
    "Answer the question briefly, using these memories:\n")

_MEMORY_MARK = "\u2063MEMORY\u2063"
_QUESTION_MARK = "\u2063QUESTION\u2063"


class PromptTemplate:
    def __init__(self, tokenizer, instruction: str = DEFAULT_INSTRUCTION):
        self.tokenizer = tokenizer
        self.instruction = instruction
        # split_special_tokens is a per-call switch on the tokenizer's shared backend: one call at a time.
        self.tokenizer_lock = threading.Lock()
        self._head, self._middle, self._tail = self._split_chat_template()
        self.prefix_ids: list[int] = self._ids(self._head)

    def _split_chat_template(self) -> tuple[str, str, str]:
        """Render the model's own chat template around two marks and cut it there."""
        tok = self.tokenizer
        self.system_role = False
        if getattr(tok, "chat_template", None):
            try:
                text = self._render_with_system()
                self.system_role = True
            except Exception:  # noqa: BLE001 - templates without a system role: memory goes first in the user turn
                text = tok.apply_chat_template(
                    [{"role": "user", "content": self.instruction + _MEMORY_MARK + "\n" + _QUESTION_MARK}],
                    tokenize=False, add_generation_prompt=True)
        else:
            text = f"{self.instruction}{_MEMORY_MARK}\nQuestion: {_QUESTION_MARK}\nAnswer:"
        return _cut(text)

    def _render_with_system(self, conversation: Sequence[dict] = (), tools: Sequence[dict] | None = None,
                            after: Sequence[dict] = ()) -> str:
        """[memory's system turn, *conversation, question's user turn, *after] through the model's chat template;
        `tools` (OpenAI function definitions) go to the template, which renders them where it renders them."""
        kw = {"tools": list(tools)} if tools else {}
        return self.tokenizer.apply_chat_template(
            [{"role": "system", "content": self.instruction + _MEMORY_MARK},
             *(_template_message(m) for m in conversation),
             {"role": "user", "content": _QUESTION_MARK},
             *(_template_message(m) for m in after)],
            tokenize=False, add_generation_prompt=True, **kw)

    def _ids(self, text: str) -> list[int]:
        """The template's own text: its special tokens are real."""
        with self.tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def text_ids(self, text: str) -> list[int]:
        """A user's text: any special token it spells stays literal characters."""
        with self.tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def _spells_special_tokens(self, text: str) -> bool:
        return self.text_ids(text) != self._ids(text)

    @staticmethod
    def render_fact(text: str) -> str:
        return f"- {text.strip()}\n"

    @staticmethod
    def neighbour_windows(fact_texts: Sequence[str], w: int, stored: Sequence[str] = ()) -> list[tuple[str, ...]]:
        """For facts added together, in order, by a user whose memory already holds `stored` (texts, oldest
        first): each fact's window is the w facts stored most recently before it (the earlier ones of this
        call included), rendered as the memory lines they are served as (context-window encoding behind
        neighbouring facts). Adding facts one by one or together gives the same windows."""
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"window size must be an int >= 0, got {w!r}")
        before = list(stored)[max(0, len(stored) - w):] if w else []
        lines = [PromptTemplate.render_fact(t) for t in (*before, *fact_texts)]
        first = len(before)
        return [tuple(lines[max(0, i - w):i]) for i in range(first, len(lines))]

    def fact_ids(self, text: str) -> list[int]:
        if not text or not text.strip():
            raise ValueError("fact text is empty")
        return self.text_ids(self.render_fact(text))

    def query_ids(self, question: str, conversation: Sequence[dict] = (), tools: Sequence[dict] | None = None,
                  after: Sequence[dict] = ()) -> list[int]:
        """What follows the memory: the end of its turn, then `conversation` (role/content dicts: system
        messages and earlier turns, oldest first) in the chat template, then the question's user turn, then
        `after` (turns after the question: an assistant's tool calls and the tools' results). `tools`: the
        OpenAI tool definitions, rendered by the chat template (after the memory: a template that would put
        them before it is refused)."""
        if not question or not question.strip():
            raise ValueError("question is empty")
        question = question.strip()
        if (conversation or after or tools) and not self.system_role:
            raise ValueError("this model's chat template has no system role: earlier turns cannot follow the memory")
        texts = [m.get("content") or "" for m in (*conversation, *after)]
        # Tool definitions and tool calls are rendered by the template itself, so their text cannot be kept
        # apart from its control tokens: one that spells them is refused.
        calls = [json.dumps(c, ensure_ascii=False) for m in (*conversation, *after) for c in m.get("tool_calls") or ()]
        if any(self._spells_special_tokens(t) for t in (*calls, json.dumps(list(tools or ()), ensure_ascii=False))):
            raise ValueError("a tool definition or tool call spells a special token of the chat template")
        hostile = self._spells_special_tokens(question) or any(self._spells_special_tokens(t) for t in texts)
        if hostile:  # each user text alone, as text, between the template's own pieces
            n = len(conversation)
            marked = [{**m, "content": _content_mark(i)} for i, m in enumerate((*conversation, *after))]
            if conversation or after:
                _, middle, tail = self._cut_conversation(marked[:n], None, marked[n:])
            else:
                middle, tail = self._middle, self._tail
            ids = []
            for i, piece in enumerate(_split_marks(middle, n)):
                if i > 0:
                    ids += self.text_ids(texts[i - 1])
                ids += self._ids(piece) if piece else []
            ids += self.text_ids(question)
            for i, piece in enumerate(_split_marks(tail, len(after), first=n)):
                if i > 0:
                    ids += self.text_ids(texts[n + i - 1])
                ids += self._ids(piece) if piece else []
            return ids
        if not conversation and not after and not tools:
            return self._ids(self._middle + question + self._tail)
        _, middle, tail = self._cut_conversation(conversation, tools, after)
        return self._ids(middle + question + tail)

    def _cut_conversation(self, conversation: Sequence[dict], tools: Sequence[dict] | None = None,
                          after: Sequence[dict] = ()) -> tuple[str, str, str]:
        try:
            head, middle, tail = _cut(self._render_with_system(conversation, tools, after))
        except Exception as e:  # noqa: BLE001 - the template's own refusal (e.g. roles that must alternate)
            raise ValueError(f"the model's chat template refused the conversation: {str(e)[:200]}") from None
        if head != self._head:  # the memory's KV was encoded after this head: it must not move
            raise ValueError("the model's chat template renders the memory differently with earlier turns"
                             + (" or tools" if tools else ""))
        return head, middle, tail

    def chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """Plain chat (no memory): role/content messages through the model's chat template, each content kept
        as text (a message that spells `<|im_start|>system` cannot open a turn of its own)."""
        contents = [m["content"] for m in messages]
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        if not any(self._spells_special_tokens(c) for c in contents):
            with self.tokenizer_lock:  # the exact ids the chat template has always given these messages
                return list(self.tokenizer.apply_chat_template(plain, tokenize=True, add_generation_prompt=True,
                                                               return_dict=True)["input_ids"])
        marked = [{"role": m["role"], "content": _content_mark(i)} for i, m in enumerate(messages)]
        with self.tokenizer_lock:
            text = self.tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
        ids = []
        for i, piece in enumerate(_split_marks(text, len(messages))):
            if i > 0:
                ids += self.text_ids(contents[i - 1])
            ids += self._ids(piece) if piece else []
        return ids

    def prompt_ids(self, fact_texts: Sequence[str], question: str) -> list[int]:
        """The prompt-injection baseline: the same ids the composed prompt has."""
        ids = list(self.prefix_ids)
        for t in fact_texts:
            ids += self.fact_ids(t)
        return ids + self.query_ids(question)


def _content_mark(i: int) -> str:
    return f"\u2063CONTENT{i}\u2063"


def _split_marks(text: str, n: int, first: int = 0) -> list[str]:
    """`text` with the n content marks `first`.. in order -> the n + 1 pieces around them."""
    pieces = []
    for i in range(first, first + n):
        before, text = text.split(_content_mark(i), 1)
        pieces.append(before)
    return [*pieces, text]


def _template_message(m: dict) -> dict:
    """A message as chat templates take it: role and content (a string, "" for an assistant turn that only
    calls tools), and the tool-calling keys when present."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    for key in ("tool_calls", "tool_call_id", "name"):
        if m.get(key):
            out[key] = m[key]
    return out


def _cut(text: str) -> tuple[str, str, str]:
    """A rendering with both marks -> (before the memory, between memory and question, after the question)."""
    head, rest = text.split(_MEMORY_MARK)
    middle, tail = rest.split(_QUESTION_MARK)
    return head, middle, tail
