"""Measuring tau(b) for every candidate block size: the paper's per-b decode, and exact greedy replay of the draft
(batch 1 and batched) along one target decode. Imports the layers below it: io, policy, runtime, data, decoding."""
