"""`ray job submit --working-dir . -- python jobs/evaluate.py [-c FILE.yaml | -c published:NAME] [key=value ...]`

A thin entrypoint: the job's driver runs `blockpilot evaluate`, which joins the job's Ray cluster (RAY_ADDRESS).
A relative output_dir is refused (exit 2): the job runs in a temporary copy of its working dir; give an
absolute path on storage every node shares (or s3://...).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the working dir, when not pip-installed

from stages.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["evaluate", *sys.argv[1:]]))
