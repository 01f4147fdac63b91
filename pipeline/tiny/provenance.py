"""Where each kind of text of the tiny pair's corpus came from, for the model cards and build_log.json: the Debian
packages that provided it with their installed versions (``dpkg-query``; for ``code``, the building interpreter),
and its licence as the kind's copyright file states it, with that file's SHA-256. ``licence_verified`` is true
only when the kind's evidence phrase is found in the file; a kind with a phrase that is not found has its licence
reported as UNVERIFIED.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.tiny import data as tdata
from pipeline.tiny.kinds import KindSpec

def dpkg_version(package: str) -> str | None:
    exe = shutil.which("dpkg-query")
    if exe is None:
        return None
    res = subprocess.run([exe, "-W", "-f=${Status}\t${Version}", package], capture_output=True, text=True,
                         check=False)
    if res.returncode != 0 or "\t" not in res.stdout:
        return None
    status, version = res.stdout.split("\t", 1)
    return version.strip() if status.strip().endswith("installed") and "not-installed" not in status else None


def provenance(spec: KindSpec) -> dict:
    """Source, packages with versions (dpkg-query), the licence and where it was read (with the evidence)."""
    packages = [{"name": p, "version": dpkg_version(p)} for p in spec.packages]
    if spec.name == "docs":  # python3-doc is a metapackage; python3.X-doc ships the files
        for name in sorted({m.group(0) for m in re.finditer(r"python3\.\d+-doc", _dpkg_depends("python3-doc"))}):
            packages.append({"name": name, "version": dpkg_version(name)})
    copyright_file = spec.copyright_file
    if spec.name == "code":
        copyright_file = str(tdata.stdlib_root() / "LICENSE.txt")
        packages = [{"name": f"python{sys.version_info[0]}.{sys.version_info[1]} (the building interpreter, "
                             f"{sys.base_prefix})", "version": ".".join(map(str, sys.version_info[:3]))}]
    found = None
    sha = None
    if copyright_file and Path(copyright_file).is_file():
        raw = Path(copyright_file).read_bytes()
        sha = hashlib.sha256(raw).hexdigest()
        found = spec.licence_evidence is not None and spec.licence_evidence in raw.decode("utf-8", "replace")
    licence = spec.licence if (found or spec.licence_evidence is None) else \
        f"UNVERIFIED ({spec.licence}; the evidence phrase was not found in {copyright_file})"
    return {"kind": spec.name, "text": spec.text, "source": spec.source, "packages": packages,
            "licence": licence, "copyright_file": copyright_file, "copyright_sha256": sha,
            "licence_evidence": spec.licence_evidence, "licence_verified": bool(found)}


def _dpkg_depends(package: str) -> str:
    exe = shutil.which("dpkg-query")
    if exe is None:
        return ""
    res = subprocess.run([exe, "-W", "-f=${Depends}", package], capture_output=True, text=True, check=False)
    return res.stdout if res.returncode == 0 else ""


__all__ = ["dpkg_version", "provenance"]
