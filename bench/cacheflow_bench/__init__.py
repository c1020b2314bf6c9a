"""Reproducible benchmarks; each writes JSON, a Markdown table and PNG plots under bench/results/."""
