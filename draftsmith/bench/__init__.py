"""`make bench` (`python -m draftsmith.bench`): one module per section, BENCHMARKS.md and BENCHMARKS.json
written by `__main__`."""
