"""The Ray executor's room: the actor pool that runs a stage's shards on a cluster (one actor per GPU, CPU workers
without one), its placement as the cluster grows, the preflight every actor runs before its first shard, one-off
device tasks, and joining or starting Ray. The one place in pipeline/ that imports Ray; it imports the layers below
and the Ray-free executor beside it (driver, preflight checks, memory checks), never stages/, and only stages/
imports it (tests/unit/test_layering.py). Beside pipeline/executor/local.py as datatrove keeps executor/{local,ray}."""
