"""Fitting the block-size policy on a label set, Ray-free: label shards to arrays, the loss and the epoch, held-out
metrics, the export, the held-out analyses and the plots. stages/train.py runs these under Ray Train.
Imports the layers below it: io, policy, runtime, data."""
