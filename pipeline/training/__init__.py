"""Fitting the block-size policy on a label set, Ray-free; stages/train.py runs these under Ray Train.

problem (what a run learns from: candidates, cost profile, split, the train-chosen fixed b and other baselines),
data (label shards -> arrays and splits), loop (loss, step, epoch, val metrics, the epoch loop reporting through a
callable), checkpoint (a checkpoint folder's files), progress (metrics.jsonl and the driver's epoch lines), export
(policy.json metadata, saved through BlockSizePolicy), analysis (the held-out ridge and calibration analyses),
summary (summary.json and the closing lines), plots (curves.png).
Imports the layers below it: io, policy, runtime, data."""
