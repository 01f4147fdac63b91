"""``blockpilot submit``'s upload rule and early refusals (too big an upload, a relative output_dir, which the
jobs/ entrypoints refuse too inside a Ray job), on temporary checkouts (no Ray cluster).

The rule (stages/upload.py): in a git checkout only the top-level entries holding a tracked file are uploaded,
less .gitignore/.rayignore matches, .git, __pycache__ and any virtualenv (a folder with pyvenv.cfg); outside git,
everything less those. The plan is also checked against the zip Ray itself builds with the same excludes.
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from stages import submit as command
from stages import upload as submit  # the upload rule (stages/upload.py)
from stages.cli import main

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _write(root: Path, rel: str, data: bytes = b"x") -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def _checkout(root: Path, git: bool) -> Path:
    """A small checkout: tracked code, and beside it what must not travel."""
    tracked = ["jobs/prepare.py", "pipeline/__init__.py", "conf/default.yaml", ".gitignore",
               "README.md"]
    for rel in tracked:
        _write(root, rel, b"# " + rel.encode() + b"\n")
    (root / ".gitignore").write_text("runs/\n*.log\n# a comment\n\n")
    if git:
        subprocess.run(["git", "init", "-q"], cwd=root, check=True)
        subprocess.run(["git", "add", *tracked], cwd=root, check=True)
    _write(root, "venv-anything/pyvenv.cfg", b"home = /usr/bin\n")  # a venv under an unusual name
    _write(root, "venv-anything/lib/site.py", b"v" * 1000)
    _write(root, "data/big.bin", b"d" * 5000)  # untracked data, not ignored
    _write(root, "notes.txt", b"n" * 100)  # an untracked top-level file
    _write(root, "runs/default/x.parquet", b"r" * 100)  # .gitignore'd
    _write(root, "pipeline/new_module.py", b"# not yet git add-ed\n")  # untracked inside a tracked folder: uploaded
    _write(root, "pipeline/debug.log", b"l" * 100)  # .gitignore'd (*.log)
    _write(root, "pipeline/__pycache__/a.cpython-311.pyc", b"c" * 100)
    _write(root, "pipeline/inner-env/pyvenv.cfg", b"home = /usr/bin\n")  # a venv inside a tracked folder
    _write(root, "pipeline/inner-env/bin/python", b"p" * 100)
    _write(root, "pipeline/assets/.gitignore", b"secret/\n")  # a nested ignore file, as Ray reads it
    _write(root, "pipeline/assets/secret/key", b"k")
    _write(root, "pipeline/assets/tiny.json", b"{}")
    return root


CODE = {"jobs/prepare.py", "pipeline/__init__.py", "conf/default.yaml", ".gitignore", "README.md",
        "pipeline/new_module.py", "pipeline/assets/.gitignore", "pipeline/assets/tiny.json"}


def _ray_zip_names(plan: submit.UploadPlan, tmp: Path):
    """What Ray's own packaging zips for this plan (the defaults Ray adds, then the plan's excludes).

    Imported plainly, not skipped when missing: Ray is pinned, and the upload plan claims to predict exactly this
    private function's zip, so a Ray whose packaging moved must fail here rather than pass unchecked."""
    from ray._private.runtime_env import packaging

    target = tmp / "pkg.zip"
    packaging.create_package(str(plan.root), target, include_gitignore=True,
                             excludes=submit._ray_default_excludes() + plan.excludes)
    with zipfile.ZipFile(target) as z:
        names = {i.filename for i in z.infolist() if not i.is_dir()}
    return names, target.stat().st_size


@needs_git
def test_git_checkout_uploads_only_tracked_top_level_entries(tmp_path):
    root = _checkout(tmp_path / "repo", git=True)
    plan = submit.plan_upload(root)
    assert plan.rule.startswith("git checkout")
    assert set(plan.files) == CODE
    skipped = dict(plan.skipped)
    assert skipped["venv-anything/"] == "holds no tracked file"
    assert skipped["data/"] == "holds no tracked file"
    assert skipped["notes.txt"] == "holds no tracked file"
    assert skipped["pipeline/inner-env/"] == "a virtualenv (pyvenv.cfg)"
    for pattern in ("/venv-anything", "/data", "/notes.txt", "/pipeline/inner-env", ".git", "runs/", "*.log"):
        assert pattern in plan.excludes
    # Ray, given these excludes, zips exactly the planned files, in the predicted size.
    names, size = _ray_zip_names(plan, tmp_path)
    assert names == set(plan.files)
    assert size == plan.package_bytes


def test_outside_git_uploads_all_but_ignored_and_venvs(tmp_path, monkeypatch):
    root = _checkout(tmp_path / "plain", git=False)
    monkeypatch.setattr(submit, "tracked_top_level", lambda root: None)  # even if tmp is inside some repository
    plan = submit.plan_upload(root)
    assert plan.rule.startswith("not a git checkout")
    assert set(plan.files) == CODE | {"data/big.bin", "notes.txt"}
    assert {rel for rel, _ in plan.skipped} == {"venv-anything/", "pipeline/inner-env/"}
    names, size = _ray_zip_names(plan, tmp_path)
    assert names == set(plan.files)
    assert size == plan.package_bytes


def test_names_with_pattern_characters_are_excluded_literally(tmp_path):
    spec = submit._pathspec([submit.anchored("we[i]rd *dir"), submit.anchored("!bang")])
    assert spec.match_file("we[i]rd *dir") and spec.match_file("we[i]rd *dir/f")
    assert not spec.match_file("weird xdir") and not spec.match_file("sub/we[i]rd *dir")
    assert spec.match_file("!bang")


@needs_git
def test_oversized_upload_is_refused_before_contacting_the_cluster(tmp_path, monkeypatch, capsys):
    root = _checkout(tmp_path / "repo", git=True)
    # 101 MiB, untracked inside a tracked folder and not ignored: it would be uploaded. Sparse: no disk used.
    with open(root / "pipeline" / "assets" / "model.bin", "wb") as f:
        f.truncate(101 * 1024 ** 2)
    _write(root, "pipeline/assets/small/a.bin", b"s" * 1000)
    plan = submit.plan_upload(root)
    assert plan.package_bytes > submit.RAY_UPLOAD_CAP
    assert plan.biggest()[0] == ("pipeline/assets/model.bin", 101 * 1024 ** 2)
    with pytest.raises(submit.SubmitError, match="pipeline/assets/model.bin"):
        submit.check_size(plan)
    submit.check_size(plan, cap=plan.package_bytes)  # at the cap exactly: accepted

    import ray.job_submission

    def no_client(*a, **k):
        raise AssertionError("the cluster was contacted")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", no_client)
    rc = main(["submit", "prepare", "output_dir=/tmp/nowhere", "--working-dir", str(root),
               "--address", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "over Ray's 100.0 MiB cap" in err and "pipeline/assets/model.bin" in err
    assert "101.0 MiB" in err


@needs_git
def test_dry_run_prints_size_and_entrypoint(tmp_path, capsys):
    root = _checkout(tmp_path / "repo", git=True)
    rc = main(["submit", "prepare", "-c", str(root / "conf/default.yaml"), "output_dir=/shared/r",
               "--working-dir", str(root), "prepare.limit=4", "--python", "/opt/py env/bin/python", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert f"{len(CODE)} files" in err
    assert "venv-anything/ (holds no tracked file)" in err
    # the config path becomes relative to the uploaded root (the job's cwd); arguments are shell-quoted
    assert ("entrypoint: '/opt/py env/bin/python' jobs/prepare.py -c conf/default.yaml "
            "output_dir=/shared/r prepare.limit=4") in err


@needs_git
def test_config_in_an_excluded_folder_or_bad_config_is_refused(tmp_path, capsys):
    root = _checkout(tmp_path / "repo", git=True)
    _write(root, "data/exp.yaml", b"label:\n  k: 1\n")
    assert main(["submit", "prepare", "-c", str(root / "data/exp.yaml"), "--working-dir", str(root),
                 "--dry-run"]) == 2
    assert "not uploaded" in capsys.readouterr().err
    assert main(["submit", "prepare", "no_such_key=1", "--working-dir", str(root), "--dry-run"]) == 2
    assert "no_such_key" in capsys.readouterr().err


@needs_git
def test_a_missing_config_file_is_refused_before_contacting_the_cluster(tmp_path, capsys):
    root = _checkout(tmp_path / "repo", git=True)
    for missing in (tmp_path / "nowhere.yaml", root / "conf" / "nowhere.yaml"):  # outside and inside the checkout
        rc = main(["submit", "prepare", "-c", str(missing), "output_dir=/shared/r", "--working-dir", str(root),
                   "--address", "http://127.0.0.1:9"])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert f"blockpilot submit: error: config file not found: {missing}" in err
        assert "entrypoint" not in err and "uploading" not in err  # refused before the plan is shown or sent


def _closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


@needs_git
def test_an_unreachable_address_exits_1_naming_it(tmp_path, capsys):
    """Real Ray job client against a port nothing listens on: exit 1 (not 2: the config was fine), the address
    named, no traceback, and with --no-wait too (no job id printed)."""
    root = _checkout(tmp_path / "repo", git=True)
    address = f"http://127.0.0.1:{_closed_port()}"
    for extra in ([], ["--no-wait"]):
        rc = main(["submit", "prepare", "output_dir=/shared/r", "--working-dir", str(root), "--address", address,
                   *extra])
        out, err = capsys.readouterr()
        assert rc == 1, err
        assert f"blockpilot submit: error: submitting to {address} failed: " in err
        assert "Traceback" not in err and out == ""


def test_address_and_entrypoint(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert command.resolve_address(None) == "http://127.0.0.1:8265"
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert command.resolve_address(None) == "http://head:8265"
    assert command.resolve_address("http://other:1") == "http://other:1"
    cmd = command.entrypoint("prepare", "python", "published:qwen3-8b",
                            ["prepare.sources=[{name: m, kind: jsonl, path: p.jsonl, field: text}]"])
    assert cmd == ("python jobs/prepare.py -c published:qwen3-8b "
                   "'prepare.sources=[{name: m, kind: jsonl, path: p.jsonl, field: text}]'")


@pytest.mark.integration  # the integration layer: a fresh interpreter of its own (tests/conftest.py)
def test_pipeline_imports_without_ray():
    code = ("import sys; import stages.submit, stages.cli; stages.cli.build_parser(); "
            "assert 'ray' not in sys.modules, 'ray imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@needs_git
def test_a_relative_output_dir_is_refused_before_contacting_the_cluster(tmp_path, capsys, monkeypatch):
    """The job would write a relative output_dir into its temporary copy of the checkout on one node: refused here
    (exit 2, one line naming output_dir and the fix), nothing planned or sent; the default one too (runs/default)."""
    import ray.job_submission

    from stages.job_guard import relative_output_dir_error

    def no_client(*a, **k):
        raise AssertionError("the cluster was contacted")

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", no_client)
    root = _checkout(tmp_path / "repo", git=True)
    for given, output_dir in ((["output_dir=runs/x"], "runs/x"), ([], "runs/default")):
        rc = main(["submit", "prepare", *given, "--working-dir", str(root), "--address", "http://127.0.0.1:9"])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert err == f"blockpilot submit: error: {relative_output_dir_error(output_dir)}\n"
        assert f"output_dir={output_dir} is relative" in err and "output_dir=s3://" in err
    # and --dry-run says the same: the job would refuse it
    assert main(["submit", "prepare", "output_dir=runs/x", "--working-dir", str(root), "--dry-run"]) == 2


def test_what_counts_as_a_relative_output_dir_and_a_ray_job():
    from stages.job_guard import RAY_JOB_ENV, in_ray_job, is_relative

    assert is_relative("runs/x") and is_relative("./runs") and is_relative("file://runs/x")
    assert not any(is_relative(p) for p in ("/shared/r", "s3://bucket/r", "gs://b/r", "file:///shared/r"))
    assert in_ray_job({RAY_JOB_ENV: "{}"}) and not in_ray_job({}) and not in_ray_job({"RAY_JOB_ID": "01000000"})


@pytest.mark.integration  # the integration layer: a fresh interpreter of its own (tests/conftest.py)
def test_a_jobs_entrypoint_refuses_a_relative_output_dir_inside_a_ray_job():
    """jobs/run.py as Ray's job supervisor starts it (RAY_JOB_CONFIG_JSON_ENV_VAR set; RAY_JOB_ID is not, Ray strips
    it from the driver's environment), with a relative output_dir: exit 2 and the one-line fix, before Ray is even
    imported (RAY_ADDRESS points nowhere: joining it would fail otherwise)."""
    import os

    from stages.job_guard import RAY_JOB_ENV, relative_output_dir_error

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, RAY_JOB_ENV: '{"runtime_env": {}, "metadata": {"job_submission_id": "raysubmit_t"}}',
           "RAY_ADDRESS": "127.0.0.1:9"}
    probe = ("import runpy, sys\n"
             "sys.argv = ['jobs/run.py', *sys.argv[1:]]\n"
             "try:\n"
             "    runpy.run_path('jobs/run.py', run_name='__main__')\n"
             "finally:\n"
             "    print('ray imported:', 'ray' in sys.modules, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", probe, "-c", "published:qwen3-8b", "output_dir=runs/x"], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [f"blockpilot run: error: {relative_output_dir_error('runs/x')}",
                                       "ray imported: False"]
