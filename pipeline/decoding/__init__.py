"""Speculative decoding with a DFlash draft: model loading, the exact engine and adaptive decoding (the policy
plus a per-step rule). Imports the layers below it: io, policy, runtime, data."""
