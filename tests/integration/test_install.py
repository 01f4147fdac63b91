"""A real install, not only a checkout: build the wheel, install it into a fresh venv, run it from elsewhere.

`pip install .` (no -e) or a wheel must give the same run as the checkout: the default config, the published
configs and the bundled assets (tiny models, prompt sets) all ship inside the package. Nothing is downloaded: the
fresh venv sees the dependencies through a `.pth` file pointing at (a filtered view of) the current interpreter's
site-packages, and the wheel is installed with `--no-deps --no-index`.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
# Not copied into the build tree: environments, run outputs, earlier build leftovers (a stale build/lib would leak
# deleted files into the wheel).
_SKIP = shutil.ignore_patterns(".venv", ".git", "runs", "build", "dist", "*.egg-info", "__pycache__",
                               ".pytest_cache", "tmp", ".whl")


def _run(cmd, cwd, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, venv): the wheel built from a clean copy of this checkout, installed into a fresh venv."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    shutil.copytree(REPO, src, ignore=_SKIP, symlinks=True)
    wheels = root / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
          "-w", wheels, src], cwd=root, timeout=180)
    (wheel,) = wheels.glob("blockpilot_pipeline-*.whl")

    # The dependencies: every entry of this interpreter's site-packages except this project's own install (an
    # editable finder, its dist-info), so that neither import nor pip in the new venv can see the checkout.
    deps = root / "deps"
    deps.mkdir()
    for sp in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(sp).iterdir():
            name = entry.name
            if (name.startswith(("blockpilot_pipeline", "__editable__")) or name.endswith(".pth")
                    or name in ("pipeline", "stages") or (deps / name).exists()):
                continue
            (deps / name).symlink_to(entry)

    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    vpy = venv / "bin" / "python"
    site = Path(_run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).strip())
    (site / "_blockpilot_test_deps.pth").write_text(f"{deps}\n")
    _run([vpy, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-cache-dir", wheel], cwd=root)
    return wheel, venv


def test_wheel_holds_the_config_and_the_assets(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    # conf/ ships as the package blockpilot_conf (pyproject.toml's package-dir), which the installed config reads.
    assert "blockpilot_conf/default.yaml" in names
    published = sorted(n for n in names if n.startswith("blockpilot_conf/published/") and n.endswith(".yaml"))
    shipped = (REPO / "conf" / "published").glob("*.yaml")
    assert published == sorted(f"blockpilot_conf/published/{p.name}" for p in shipped)
    assert len(published) == 6, published  # as tests/unit/test_conf_defaults.py names them
    assets = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "pipeline" / "assets").rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts)
    for must in ("pipeline/assets/tiny-target/model.safetensors", "pipeline/assets/tiny-target/tokenizer.json",
                 "pipeline/assets/tiny-draft/model.safetensors", "pipeline/assets/prompts/stdlib-heldout.jsonl"):
        assert must in assets
    missing = [a for a in assets if a not in names]
    assert not missing, f"assets missing from the wheel: {missing}"
    # One version: the wheel's metadata carries pipeline.__version__.
    import pipeline

    assert wheel.name.startswith(f"blockpilot_pipeline-{pipeline.__version__}-")


def test_installed_cli_from_another_directory_matches_the_checkout(installed, tmp_path):
    _, venv = installed
    bp = venv / "bin" / "blockpilot"
    # It really is the installed package, not the checkout.
    where = _run([venv / "bin" / "python", "-c", "import pipeline, stages; print(pipeline.__file__, stages.__file__)"],
                 cwd=tmp_path)
    assert str(venv) in where and str(REPO) not in where, where

    checkout = _run([sys.executable, "-m", "stages.cli", "run", "--print-config"], cwd=REPO)
    got = _run([bp, "run", "--print-config"], cwd=tmp_path)
    assert got == checkout
    # default.yaml's values (prepare.limit, evaluate.limit / tune.limit, shard_size): the wheel ships conf/.
    assert "  limit: 104\n" in got and "  limit: 8\n" in got and "  shard_size: 64\n" in got

    published_checkout = _run([sys.executable, "-m", "stages.cli", "prepare", "-c", "published:qwen3-8b",
                               "--print-config"], cwd=REPO)
    published = _run([bp, "prepare", "-c", "published:qwen3-8b", "--print-config"], cwd=tmp_path)
    assert published == published_checkout
    assert "target: Qwen/Qwen3-8B" in published and "block_size: 16" in published


def test_installed_prepare_runs_on_the_bundled_assets(installed, tmp_path):
    _, venv = installed
    out = tmp_path / "run"
    stdout = _run([venv / "bin" / "blockpilot", "prepare", f"output_dir={out}", "prepare.limit=2", "progress=false",
                   "--json"], cwd=tmp_path, timeout=180)
    summary = json.loads(stdout)  # --json: stdout is the summary alone
    # 2 of each kind's bundled label set: the wheel ships every one of them (and prompt_sets.json, which names them).
    from pipeline.runtime.config import KINDS

    assert summary["rows"] == 2 * len(KINDS), summary
    assert list(summary["sources"]) == list(KINDS), summary["sources"]
    assert (out / "prompts" / "_SUCCESS").exists()
