"""Measuring tau(b) for every candidate block size: the paper's per-b decodes (labels), and exact greedy replay of
the draft along one target decode, batch 1 (replay) and batched across prompts (batched), both through one draft
runner (runner, draft, walks); the per-step trace at every start of g, by the same runner (trace); the target's
batched greedy decode (greedy); what a label row and shard hold (shard, summary, settings). Imports the layers
below it: io, policy, runtime, data, decoding."""
