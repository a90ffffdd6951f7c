#!/usr/bin/env python3
"""Makes the checkout importable and the `tide` command runnable in the interpreter's venv, without
building anything: `make` builds the core in place (tools/build.sh), then runs

    .venv/bin/python tools/install_launcher.py

which writes, for the interpreter running it,
  <site-packages>/tide-checkout.pth   the checkout's root, so tide, tide_torch, tide_xla and
                                      tide_apps import from any directory;
  <venv>/bin/<name>                   for each [project.scripts] entry of pyproject.toml
                                      (`tide = "tide_apps.cli:main"`), the console script pip
                                      writes for it (distlib's template: the call sits under
                                      `if __name__ == "__main__":`, so a worker that
                                      multiprocessing's spawn starts, which re-runs the parent's
                                      main script as `__mp_main__`, imports it without running
                                      the command again), run by this interpreter.
Both are rewritten on every run (a moved checkout is picked up by the next `make`). Stdlib only.
"""
from __future__ import annotations

import os
import stat
import sys
import sysconfig
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pip's console-script template (pip/_internal/operations/install/wheel.py, via distlib).
LAUNCHER = """#!{python}
# -*- coding: utf-8 -*-
# Written by tools/install_launcher.py (make): [project.scripts] {name} = "{spec}" of {root}.
import re
import sys
from {module} import {attr}
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit({attr}())
"""


def console_scripts(root: str = ROOT) -> dict[str, tuple[str, str]]:
    """pyproject.toml's [project.scripts]: name -> (module, attribute)."""
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    out = {}
    for name, spec in scripts.items():
        module, _, attr = spec.partition(":")
        if not module or not attr.isidentifier():
            raise SystemExit(f"tools/install_launcher.py: [project.scripts] {name} = {spec!r}: "
                             "expected 'module:function'")
        out[name] = (module, attr)
    return out


def main() -> int:
    if sys.prefix == sys.base_prefix:
        print("tools/install_launcher.py: not in a virtual environment; run it with the venv's "
              "python (make does: .venv/bin/python tools/install_launcher.py)", file=sys.stderr)
        return 2
    site = sysconfig.get_paths()["purelib"]
    with open(os.path.join(site, "tide-checkout.pth"), "w", encoding="utf-8") as f:
        f.write(ROOT + "\n")
    for name, (module, attr) in console_scripts().items():
        path = os.path.join(sysconfig.get_paths()["scripts"], name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(LAUNCHER.format(python=sys.executable, root=ROOT, name=name,
                                    spec=f"{module}:{attr}", module=module, attr=attr))
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        print(f"{name}: {path} (the checkout {ROOT} on {sys.executable}'s path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
