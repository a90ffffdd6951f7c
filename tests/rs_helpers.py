"""TIDE-RS test helpers shared by the CPU and GPU staging-canary tests."""
from tide import _core


def programs_without_waits(plan, who, tag: str) -> dict:
    """Both banks' TIDE-RS program sets with every `tag` wait of the ranks in `who` dropped
    (fault injection); asserts that at least one wait was dropped."""
    bad = {b: _core.build_rs_programs(plan, bank=b) for b in (0, 1)}
    dropped = 0
    for ps in bad.values():
        for r in who:
            while ps.inject_fault(_core.fault_kinds["drop_wait"], r, _core.rs_op_tags[tag]):
                dropped += 1
    assert dropped > 0, f"no {tag} wait of ranks {list(who)} to drop"
    return bad
