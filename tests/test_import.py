import subprocess
import sys


def test_import_without_frameworks():
    """`import tide` works with neither torch nor jax importable."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['jax'] = None; "
            "import tide; print(tide.plan.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=".")
    assert out.returncode == 0, out.stderr
    assert "plan" in out.stdout
