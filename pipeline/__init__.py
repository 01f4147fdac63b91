"""blockpilot-pipeline: learn a per-request block size for DFlash speculative decoding.

The library: config schema (``config``), model loading (``models``), the decoding engine (``engine``), the
label dataset schema and I/O, and the block-size policy. Stages that run on Ray live in the ``stages`` package.
"""

from pathlib import Path

# The bundled tiny pair and prompt sets (package data, so a wheel carries them).
ASSETS = Path(__file__).resolve().parent / "assets"

# The one place the version lives: pyproject.toml reads it ([tool.setuptools.dynamic]).
__version__ = "0.1.0"
