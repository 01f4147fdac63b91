"""Choosing how much to verify: the per-request block-size policy (an MLP on the prefill logits), the per-step
verify rules, the cost model both are judged by, and the statistics and speed labels they are chosen with.
Imports only pipeline.io."""
