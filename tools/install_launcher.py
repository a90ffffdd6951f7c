#!/usr/bin/env python3
"""Makes the checkout importable and the `tide` command runnable in the interpreter's venv, without
building anything: `make` builds the core in place (tools/build.sh), then runs

    .venv/bin/python tools/install_launcher.py

which writes, for the interpreter running it,
  <site-packages>/tide-checkout.pth   the checkout's root, so tide, tide_torch, tide_xla and
                                      tide_apps import from any directory;
  <venv>/bin/tide                     the console script pip would write for [project.scripts]
                                      (tide_apps.cli:main), run by this interpreter.
Both are rewritten on every run (a moved checkout is picked up by the next `make`). Stdlib only.
"""
from __future__ import annotations

import os
import stat
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = """#!{python}
# Written by tools/install_launcher.py (make): the `tide` command of the checkout {root}.
import sys

from tide_apps.cli import main

sys.exit(main())
"""


def main() -> int:
    if sys.prefix == sys.base_prefix:
        print("tools/install_launcher.py: not in a virtual environment; run it with the venv's "
              "python (make does: .venv/bin/python tools/install_launcher.py)", file=sys.stderr)
        return 2
    site = sysconfig.get_paths()["purelib"]
    with open(os.path.join(site, "tide-checkout.pth"), "w", encoding="utf-8") as f:
        f.write(ROOT + "\n")
    path = os.path.join(sysconfig.get_paths()["scripts"], "tide")
    with open(path, "w", encoding="utf-8") as f:
        f.write(LAUNCHER.format(python=sys.executable, root=ROOT))
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    print(f"tide: {path} (the checkout {ROOT} on {sys.executable}'s path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
