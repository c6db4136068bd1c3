"""LoCoMo evaluation harness: dataset loading, scoring, statistics and reports (no engine needed)."""
