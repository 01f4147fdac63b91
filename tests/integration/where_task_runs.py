"""A job's driver asks for a decoding stage's one-off task (pipeline.executor.ray.device_task.on_a_worker: what evaluate's pass at
load and tune's load check run in) and prints where the driver and the task ran, as one JSON line after "WHERE ".
Submitted by tests/integration/test_cluster_growth.py from a head without a GPU:

    python tests/integration/where_task_runs.py output_dir=... [overrides]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the job's working dir: the checkout

if __name__ == "__main__":
    import ray
    import torch

    from pipeline.runtime.config import load_config
    from pipeline.executor.ray.device_task import on_a_worker, where
    from stages.evaluate import EvaluateStage

    ray.init(address="auto")
    stage = EvaluateStage(load_config(sys.argv[1:]))
    print("WHERE " + json.dumps({"driver": where(torch.device("cpu")),
                                 "task": on_a_worker(stage, where, torch.device("cpu"), what="where")}))
