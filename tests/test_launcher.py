"""`make`'s `tide` command (tools/install_launcher.py): in a fresh virtual environment it writes
bin/tide and puts the checkout on the environment's path, so that the README's
`.venv/bin/tide plan ...` runs from any directory after `make demo` / `make test`; bin/tide is
the console script pip writes for [project.scripts], so `tide demo`'s training step (gloo worker
processes started by multiprocessing's spawn, which re-run the parent's main script) runs."""
import os
import pathlib
import subprocess
import sys
import sysconfig
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _venv_with_launcher(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # numpy and ml_dtypes (tide's dependencies) from the environment running the tests
    pathlib.Path(site, "deps-under-test.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([py, ROOT / "tools" / "install_launcher.py"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    tide = env_dir / "bin" / "tide"
    assert os.access(tide, os.X_OK)
    assert pathlib.Path(site, "tide-checkout.pth").read_text().strip() == str(ROOT)
    return tide, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_launcher_runs_tide_plan_from_anywhere(tmp_path):
    tide, env = _venv_with_launcher(tmp_path)
    r = subprocess.run([tide, "plan", "--model", "llama3.1-70b", "--nodes", "8",
                        "--gpus-per-node", "8"], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "TIDE plan: llama3.1-70b / block" in r.stdout
    r = subprocess.run([tide, "--help"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0 and "demo" in r.stdout and "bench" in r.stdout


def test_console_script_runs_tide_demo_with_its_training_step(tmp_path):
    """Issue 45: the launcher had no `__main__` guard, so a spawned gloo worker re-ran `tide demo`
    itself ("... before the current process has finished its bootstrapping phase", rc 1)."""
    pytest.importorskip("torch")
    tide, env = _venv_with_launcher(tmp_path)
    r = subprocess.run([tide, "demo", "--device", "cpu", "--steps", "2"], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bootstrapping phase" not in r.stderr
    assert ("parameters bitwise equal to stock FSDP2 on every rank: In-Place yes, "
            "Slot-Reuse yes") in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("== Agreement check: PASS") and "FSDP2 training: bitwise" in last, last


def test_launcher_refuses_a_python_outside_a_venv():
    if sys.prefix != sys.base_prefix:
        base = pathlib.Path(sys.base_prefix) / "bin" / "python3"
    else:
        base = pathlib.Path(sys.executable)
    r = subprocess.run([base, ROOT / "tools" / "install_launcher.py"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "not in a virtual environment" in r.stderr
