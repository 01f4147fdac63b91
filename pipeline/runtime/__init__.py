"""Running the library: the one typed config schema (defaults in the top-level conf/) and logging.
Imports pipeline.io and pipeline.policy (the rule grammar config validation uses)."""
