// The in-process rendezvous: the ranks of one group, each on its own thread of one process (a
// framework's per-device launch threads), meet at every call so that one thread runs the group's
// call for every rank (a cluster executor steps all ranks itself), then each finishes its own part.
//
// Contract
//   - A meeting is keyed by (run_id, group, op_id, seq): run_id one launch of the caller's program,
//     group which group of the job, op_id the call site (fixed when the caller's program is
//     built), seq the call's ordinal at that site (next_rendezvous_seq). Every rank of the group
//     joins with the same key, world and plan hash, and hands in its own buffers (`mine`, opaque
//     here: the face's per-rank record, visible to every rank of the group: one address space).
//   - Three phases, each with its own deadline of `timeout_ms`: join (every rank present, plan
//     hashes equal), rank 0 runs `group_body` (the group's call), every rank runs `rank_body`
//     (its completion work), then a completion fence: a rank returns only once every rank
//     finished, since until then peers may still touch its buffers.
//   - Errors: a phase past its deadline is TimeoutError naming the missing ranks; a plan-hash
//     mismatch is PlanError; a body that throws fails the meeting for every rank (TimeoutError
//     and PlanError keep their type on every rank, so all ranks map to the same code); a rank that
//     posted a failure before joining (rendezvous_fail) fails the others at once, naming it.
//   - Thread-safe; the meetings are process-wide. Nothing here knows a framework.
//
// [Note: rendezvous lifetime] A meeting lives in the table from the first arrival until every
// rank of the group has left it. A rank leaves after the completion fence (success), or at once
// when the meeting failed (timeout, plan mismatch, a rank's body threw, a rank posted a failure
// before joining). A failed meeting whose missing rank never comes stays in the table (a few
// hundred bytes per failed call): a late rank then fails at once with the meeting's error instead
// of waiting for peers that already gave up.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tide {

struct RendezvousKey {
  int64_t run_id = 0;
  int64_t group = 0;
  int64_t op_id = 0;
  int64_t seq = 0;
  bool operator<(const RendezvousKey& o) const;
};

// Per-(device, op_id) call counter, reset when run_id changes: a launch may replay one call site
// several times (a loop, a recomputation), and every device replays it in the same order.
int64_t next_rendezvous_seq(int32_t device, int64_t op_id, int64_t run_id);

// Every rank's `mine` (index = rank), as the bodies see them.
using RendezvousBody = std::function<void(const std::vector<const void*>&)>;

// Joins the meeting of `key` as `rank` of `world` (see the contract).
void rendezvous_and_run(const RendezvousKey& key, int world, int rank, const void* mine, uint64_t plan_hash,
                        int64_t timeout_ms, const RendezvousBody& group_body, const RendezvousBody& rank_body);

// Posts a failure into the meeting of `key` on behalf of `rank`, which will not join (its call
// failed before the rendezvous): every rank of the meeting fails at once naming it. bad_input:
// the cause is the caller's input, so every rank raises PlanError, whichever rank's error the
// caller reports.
void rendezvous_fail(const RendezvousKey& key, int world, int rank, const std::string& why, bool bad_input = false);

}  // namespace tide
