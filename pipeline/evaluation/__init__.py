"""What evaluate compares and what it concludes, Ray-free: the methods and the per-prompt oracle (methods), the
result rows and their modelled time (results), per-method summaries (summary), the headline against the
train-chosen fixed b with paired-bootstrap intervals from pipeline.policy.stats (headline), the cost model's
modelled against measured decode seconds per method (cost_check), and their rendering
(render). stages/evaluate.py runs the decodes that produce the rows. Imports the layers below it: io, policy,
runtime, data, training."""
