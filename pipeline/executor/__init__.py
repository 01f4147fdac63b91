"""The stage driver: shards a stage's work into tasks, owns completions, resume, rejects, manifests and the summary,
while each step stays small; executors (local.py in the driver's process; ray/, the Ray executor's room) only run
tasks. Imports every layer below it; only ray/ imports Ray."""
