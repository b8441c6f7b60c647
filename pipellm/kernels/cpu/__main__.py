"""`python -m pipellm.kernels.cpu`: build the C++ CPU kernels into the extension cache now (what
scripts/setup.sh runs), so that the server's first start loads them instead of compiling.
Says every 30 s that a build is still running. Exits 0 even when the build fails: the server
then runs the PyTorch reference."""

from __future__ import annotations

import logging

from pipellm.kernels.cpu import build, extension

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build())
    module = extension()
    print(f"  {module.__file__}" if module is not None else
          "  the server still works, with the PyTorch reference kernels (slower on a CPU)")
