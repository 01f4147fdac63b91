"""Choosing how much to verify: the per-request block-size policy (an MLP on the prefill logits), the per-step
verify rules and their exact offline simulator on a label row's trace (simulate, trace), the cost model both are
judged by, and the statistics and speed labels they are chosen with. Imports only pipeline.io."""
