"""draftsmith: train, validate and export speculative-decoding draft heads.

Layers, lowest first (tests/test_layering.py enforces them): recipe.py, artifacts.py; targets/;
data/ and heads/ (peers); train/ and runtime/ (peers); stages.py, cli.py, bench.py."""
