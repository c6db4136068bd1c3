"""The order retrieved facts take in a request's memory. Apart from compose.py, which needs torch: the gateway
orders every answer's facts, and importing torch there on its first answer held its event loop ~1-2 s."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

SERVING_ORDERS = ("relevance", "stored")


def check_serving_order(order: str) -> str:
    if order not in SERVING_ORDERS:
        raise ValueError(f"serving order must be one of {SERVING_ORDERS}, got {order!r}")
    return order


def serving_order(hits: Sequence[tuple[str, float]], order: str = "relevance",
                  stored_rank: Mapping[str, int] | None = None) -> list[str]:
    """Retrieval returns best first. "relevance" (the default): the best fact last, adjacent to the query.
    "stored": the order the user stored the facts in (`stored_rank`, oldest first), so facts stored one after
    another sit together, each behind neighbours it was encoded behind (bench/locomo.py --serving-order)."""
    if check_serving_order(order) == "relevance":
        return [fact_id for fact_id, _ in reversed(hits)]
    if stored_rank is None:
        raise ValueError('serving order "stored" needs the facts\' stored ranks')
    return sorted((fact_id for fact_id, _ in hits), key=stored_rank.__getitem__)
