"""Fact texts at and over the encoder's limit (256 fact tokens with the serving model's tokenizer)."""
from __future__ import annotations

# The case: under the API's 2,000 characters, far over the encoder's 256 tokens.
LONG_FACT = ("Carol wrote a very long note about her garden, her bees and her roof terrace. " * 26)[:1990]


def text_of_tokens(template, n: int) -> str:
    """A fact text of exactly n fact tokens under `template` (inferscale_core.template.PromptTemplate)."""
    words = "Dana keeps a small notebook about the birds she sees near the harbour".split()
    text, i = "", 0
    while len(template.fact_ids((text + " " + words[i % len(words)]).strip())) <= n:
        text = (text + " " + words[i % len(words)]).strip()
        i += 1
    assert len(template.fact_ids(text)) == n, "no word boundary hits the count exactly"
    return text
