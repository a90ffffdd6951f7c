"""A process that dies during tide_xla's cross-process set-up or inside a step (XLA:CPU, 2
jax.distributed processes of 2 devices, init(timeout_s=3)): every survivor raises within its
deadline naming the dead process, and nothing hangs (tests/_xla_mp_worker.py, cases "die_*"); inside
the step the survivors' diagnosis over jax.distributed's store names the rank and process that stopped.

After raising, a survivor's jax.distributed shutdown would wait for the dead process (JAX's own
barrier, shutdown_timeout_seconds); the worker skips it, as a job's launcher kills the rest."""
import re

import pytest

pytest.importorskip("jax")

from xla_mp_helpers import launch

TIMEOUT_S = 3.0


@pytest.mark.parametrize("case,expect", [
    ("die_at_agreement", r"TimeoutError: tide_xla: cross-process call #0 .*process 0 waited 3 s for processes \[1\]"),
    ("die_at_segments", r"TimeoutError: tide_xla: mapping the arena segments of .*process 0 waited 3 s for "
                        r"processes \[1\]"),
    ("die_mid_step", r"DEADLINE_EXCEEDED: tide_all_gather: TIDE timeout after 3 s: rank [01] .*producer: rank ([23]) .*"
                     r"rank \1 (?:is behind|has started run #\d+ and waits in its own process) .*"  # its fence
                     r"ranks 2-3 on process 1\]; survivors' diagnosis: .*"
                     r"rank [23] \(process 1\) stopped \(it posted no timeout diagnosis"),
])
def test_survivors_raise_within_the_deadline_naming_the_dead_process(tmp_path, case, expect):
    res = launch(tmp_path, 2, case, None, dict(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                 wait_s=45.0)
    assert res[1][0] == 3, f"process 1 did not die as planned: {res[1][2]}"
    rc, _, err = res[0]
    assert rc == 1 and re.search(expect, err), err
    took = float(re.search(r"\[raised ([0-9.]+) s after tide_xla.init\]", err).group(1))
    assert TIMEOUT_S <= took < TIMEOUT_S + 5.0, took  # (+ the diagnosis's grace: 1.5 s)
