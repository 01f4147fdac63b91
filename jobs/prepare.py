"""Ray job entrypoint for the prepare stage.

    ray job submit --working-dir . -- python jobs/prepare.py -c published:qwen3-8b output_dir=/shared/runs/q8

Arguments are those of ``blockpilot prepare``; prepare itself runs on the job's driver (it needs no Ray workers).
Exits with the CLI's status (0 ok, 1 bad input / drift / unwritable output, 2 bad config or a relative
output_dir: the job runs in a temporary copy of its working dir).
"""

import sys
from pathlib import Path

# The job runs from the uploaded working dir; make the repository importable even where it is not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stages.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["prepare", *sys.argv[1:]]))
