"""Reading evaluation results, Ray-free: per-method summaries, the headline against the train-chosen fixed b with
paired-bootstrap intervals, and their rendering. stages/evaluate.py produces the results these read.
Imports the layers below it: io, policy, runtime, data, training."""
