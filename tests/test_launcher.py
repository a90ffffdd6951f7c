"""`make`'s `tide` command (tools/install_launcher.py): in a fresh virtual environment it writes
bin/tide and puts the checkout on the environment's path, so that the README's
`.venv/bin/tide plan ...` runs from any directory after `make demo` / `make test`."""
import os
import pathlib
import subprocess
import sys
import sysconfig
import venv

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_launcher_runs_tide_plan_from_anywhere(tmp_path):
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
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([tide, "plan", "--model", "llama3.1-70b", "--nodes", "8",
                        "--gpus-per-node", "8"], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "TIDE plan: llama3.1-70b / block" in r.stdout
    r = subprocess.run([tide, "--help"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0 and "demo" in r.stdout and "bench" in r.stdout


def test_launcher_refuses_a_python_outside_a_venv():
    if sys.prefix != sys.base_prefix:
        base = pathlib.Path(sys.base_prefix) / "bin" / "python3"
    else:
        base = pathlib.Path(sys.executable)
    r = subprocess.run([base, ROOT / "tools" / "install_launcher.py"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "not in a virtual environment" in r.stderr
