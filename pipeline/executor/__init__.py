"""The stage driver: shards a stage's work into tasks, owns completions, resume, rejects, manifests and the summary,
while each step stays small; executors (local here, Ray in stages/) only run tasks. Imports every layer below it."""
