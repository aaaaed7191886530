"""What ``make demo`` runs: the seed examples on the embedded SmolLM2, a logit lens table and
PNG, and the same calls through a local Ray cluster. Not part of the library's API (nothing in
``interp_engine`` imports it); ``python -m interp_engine.examples.demo`` runs it."""
