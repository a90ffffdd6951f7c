"""Every command the README shows runs as written on a fresh clone after `make` (issue 45).

The README's shell commands (its bash blocks, and inline code spans that start with a command)
are collected and each is checked by what it is:
  make T                      T is a target of the Makefile;
  .venv/bin/tide SUB ...      SUB exists (`SUB --help` exits 0); `tide plan ...` runs as given;
  .venv/bin/python FILE ...   FILE exists and `FILE --help` exits 0 (with the command's variables);
  pip install SPEC            only in a block that activates an environment first; SPEC's extras
                              are pyproject.toml's;
  python3.12 -m venv DIR, . DIR/bin/activate   the set-up lines themselves;
  `tide SUB` in prose        names the command: SUB exists, as for .venv/bin/tide.
A bare `python`, `pip` or `tide` outside an activated environment is refused (on a fresh machine
that is not the venv's), and so is a command of any other kind: a new README command must be
taught here, never skipped. `.venv/bin/python` runs as this interpreter, `.venv/bin/tide` as
`python -m tide_apps` (the console script's main; tests/test_launcher.py runs the script itself).
"""
from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
ACTIVATE = re.compile(r"^(\.|source)$")
STARTERS = ("make", "python", "python3", "python3.12", "pip", "tide", ".", "source")


def _split(line: str) -> list[list[str]]:
    """One shell line -> its simple commands (split on && and ;), comments dropped."""
    words = shlex.split(line, comments=True)
    out, cur = [], []
    for w in words:
        if w in ("&&", ";"):
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    return [c for c in out + [cur] if c]


def _env_and_argv(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        k, _, v = words[0].partition("=")
        env[k] = v
        words = words[1:]
    return env, words


def readme_commands() -> list[tuple[str, dict[str, str], list[str], bool]]:
    """(where, env, argv, activated) of every README command."""
    cmds = []
    fence = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
    for m in fence.finditer(README):
        lang, body = m.group(1), m.group(2)
        if lang not in ("bash", "sh", "shell", "console"):
            continue  # python blocks are code, untagged ones diagrams: not commands
        activated = False
        for n, line in enumerate(body.splitlines()):
            for words in _split(line):
                env, argv = _env_and_argv(words)
                if ACTIVATE.match(argv[0]):
                    activated = True
                cmds.append((f"block at char {m.start()} line {n + 1}: {line.strip()}", env, argv,
                             activated))
    prose = fence.sub("", README)
    for span in re.findall(r"`([^`\n]+)`", prose):
        try:
            words = shlex.split(span)
        except ValueError:
            continue
        env, argv = _env_and_argv(words)
        if argv and (argv[0] in STARTERS or argv[0].startswith(".venv/")) and len(argv) > 1:
            # `tide plan` in prose names the command (the console script); it must exist
            cmds.append((f"inline `{span}`", env, [".venv/bin/tide", *argv[1:]]
                         if argv[0] == "tide" and not env else argv, False))
    return cmds


COMMANDS = readme_commands()


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M)}


def _extras() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


def _run(argv, env, timeout=120):
    full = dict(os.environ, **env)
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=full, timeout=timeout)


def test_the_readme_has_its_commands():
    """The collector is not vacuous: the set-up commands and the plan example are found."""
    argvs = [c[2] for c in COMMANDS]
    assert ["make", "demo"] in argvs and ["make", "test"] in argvs
    assert any(a[:2] == [".venv/bin/tide", "plan"] for a in argvs)
    assert any(a[0] == ".venv/bin/python" for a in argvs)
    assert any(a[:2] == ["pip", "install"] for a in argvs)


@pytest.mark.parametrize("where,env,argv,activated", COMMANDS, ids=[c[0][:60] for c in COMMANDS])
def test_readme_command_runs_as_written(where, env, argv, activated):
    exe, args = argv[0], argv[1:]
    if exe in ("python", "pip", "tide", "python3") and not activated:
        pytest.fail(f"{where}: bare `{exe}` is not the venv's on a fresh machine: say "
                    f".venv/bin/{exe} (or activate an environment first)")
    if exe == "make":
        assert args and set(args) <= _makefile_targets(), f"{where}: no such Makefile target"
    elif ACTIVATE.match(exe):
        assert len(args) == 1 and args[0].endswith("/bin/activate"), where
    elif exe == "python3.12":
        assert args[:2] == ["-m", "venv"] and len(args) == 3, where
    elif exe == "pip":
        assert args[0] == "install" and len(args) == 2, where
        m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", args[1])
        assert m, f"{where}: expected `.` or `.[extras]`"
        missing = set((m.group(1) or "").split(",")) - {""} - _extras()
        assert not missing, f"{where}: extras {missing} are not in pyproject.toml"
    elif exe == ".venv/bin/tide":
        assert args, where
        r = _run([sys.executable, "-m", "tide_apps", *args, "--help"], env)
        assert r.returncode == 0, f"{where}: `tide {args[0]} --help`: {r.stderr[-2000:]}"
        if args[0] == "plan" and len(args) > 1:  # cheap: run it as written
            r = _run([sys.executable, "-m", "tide_apps", *args], env)
            assert r.returncode == 0 and "TIDE plan:" in r.stdout, f"{where}: {r.stderr[-2000:]}"
    elif exe == ".venv/bin/python":
        script = ROOT / args[0]
        assert script.is_file(), f"{where}: {args[0]} does not exist"
        r = _run([sys.executable, str(script), "--help"], env, timeout=300)
        assert r.returncode == 0, f"{where}: `{args[0]} --help`: {r.stderr[-2000:]}"
    else:
        pytest.fail(f"{where}: a README command of a kind this test does not check ({exe}); "
                    "teach it here")
