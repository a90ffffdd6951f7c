"""The survivors' diagnosis (tide/diagnosis.py) over an in-process key-value store: each
survivor's posted root leads to the rank that stopped, a cycle is named as one, and a timeout
with no store or no root comes back unchanged."""
import time

import pytest

torch = pytest.importorskip("torch")
import tide  # noqa: E402
from tide import diagnosis  # noqa: E402


def _err(text):
    return tide.TimeoutError(text)


def test_roots_are_read_from_the_wait_chains():
    assert diagnosis.root_of("rank 0 op 4 ... wait chain: rank 0 op 4 [read] seq 1 is in rail group 2 with "
                             "rank 2, which has not completed: root: rank 2 never posted its matching group", 0) == 2
    assert diagnosis.root_of("rank 1 call seq 1: entry fence (before op 0) waits for rank 3 to start run #1 "
                             "(it has started 0): rank 3 is behind (still in an earlier collective)", 1) == 3
    assert diagnosis.root_of("rank 2 op 7 waits for counter 3 (a dropped signal)", 2) is None
    # The rank executor reads a remote producer's entry fence: behind (the root), or in the call.
    assert diagnosis.root_of("rank 2 ... producer: rank 3 op 10 SIGNAL [readiness]; root: rank 3 is behind (it "
                             "has not started run #1: still in an earlier collective, stalled or dead)", 2) == 3
    assert diagnosis.root_of("rank 0 ... producer: rank 1 op 10 SIGNAL [readiness]; rank 1 has started run #1 "
                             "and waits in its own process (its waits are not visible here)", 0) == 1


def test_the_chain_reaches_the_rank_that_stopped():
    store = torch.distributed.HashStore()
    store.set("tide/timeout/2", '{"root": 3, "head": "rank 2 ..."}')
    t0 = time.monotonic()
    got = diagnosis.survivors_diagnosis(_err("wait chain: ... root: rank 2 never posted its matching group"), 0,
                                        grace_s=0.3, store=store)
    assert got.startswith("rank 2 (timed out, waits for rank 3) -> rank 3 stopped (it posted no timeout"), got
    assert 0.25 < time.monotonic() - t0 < 2.0  # waited its grace for rank 3, no longer
    assert store.get("tide/timeout/0").decode().startswith('{"root": 2')  # its own root, posted


def test_a_cycle_is_named():
    store = torch.distributed.HashStore()
    store.set("tide/timeout/1", '{"root": 0, "head": ""}')
    got = diagnosis.survivors_diagnosis(_err("root: rank 1 never posted its matching group"), 0, 0.2, store)
    assert got == "rank 1 (timed out, waits for rank 0) -> rank 0 (a cycle: these ranks wait for each other)", got


def test_without_a_store_or_a_root_the_error_is_unchanged():
    with pytest.raises(tide.TimeoutError) as e:
        diagnosis.diagnosed(lambda: (_ for _ in ()).throw(_err("rank 0: root: rank 1 never posted")), 0, 2.0,
                            lambda: None)
    assert "survivors' diagnosis" not in str(e.value)  # no store
    assert diagnosis.survivors_diagnosis(_err("no root in here"), 0, 0.1, torch.distributed.HashStore()) == ""


class _KeyValueClient:
    """jax.distributed's client as DirStore sees it: key_value_set (once per key) and key_value_dir_get."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value):
        if key in self.kv:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def test_a_dir_store_over_a_key_value_client_names_the_rank_and_its_process():
    client = _KeyValueClient()
    client.key_value_set("tide_xla/timeout/1/3", '{"root": 2, "head": "rank 3 ..."}')
    client.key_value_set("tide_xla/timeout/10/2", '{"root": null, "head": "another group"}')  # not group 1's
    owners = [0, 0, 1, 1]
    got = diagnosis.appended("rank 0 ... root: rank 3 never posted", 0, 0.5, diagnosis.DirStore(client),
                             prefix="tide_xla/timeout/1/", name=lambda r: f"rank {r} (process {owners[r]})")
    assert got == ("; survivors' diagnosis: rank 3 (process 1) (timed out, waits for rank 2) -> rank 2 (process 1) "
                   "stopped (it posted no timeout diagnosis: dead, hung outside TIDE, or it never made this call)"), got
    assert client.kv["tide_xla/timeout/1/0"].startswith('{"root": 3')
    store = diagnosis.DirStore(client)
    assert store.check(["tide_xla/timeout/1/0"]) and not store.check(["tide_xla/timeout/1/9"])
    with pytest.raises(ValueError):
        store.get("tide_xla/timeout/1/9")
    # A second timeout of the same rank cannot post again (write-once keys): no diagnosis, no error.
    assert diagnosis.appended("root: rank 3 never posted", 0, 0.5, store, prefix="tide_xla/timeout/1/") == ""
