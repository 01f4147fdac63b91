"""The ``ray job submit`` entrypoints (jobs/STAGE.py) run the CLI as a script: a subprocess each, so not in the
unit layer."""

import json
import subprocess
import sys

from pipeline.runtime.config import REPO_ROOT


def test_job_entrypoint_runs_the_cli(tmp_path):
    proc = subprocess.run([sys.executable, "jobs/prepare.py", f"output_dir={tmp_path}", "progress=false",
                           "prepare.limit=3", "prepare.sources=[{name: he, kind: bundled, path: humaneval}]", "--json"],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["rows"] == 3  # --json: stdout is the summary alone, the log on stderr
    assert "[prepare] done: 3 rows" in proc.stderr
    bad = subprocess.run([sys.executable, "jobs/prepare.py", "no_such_key=1"], capture_output=True, text=True,
                         cwd=REPO_ROOT)
    assert bad.returncode == 2 and "no_such_key" in bad.stderr
