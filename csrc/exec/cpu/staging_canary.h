// The CPU executor's staging race canary (csrc/exec/cpu only): defence in depth behind the static
// checker for the RS Level-1 staging slots (paper §4.1, invariant I3).
//
// Contract
//   - Every COPY/PUT row into a rank's staging slot is recorded as a piece [a, b) of that slot
//     with the (call seq, unit) it carries (Op::round: the Level-1 unit u of builder_rs.cc), first
//     as being written, then as written; every SUM term reading staging is checked to be covered by
//     written pieces of its own (seq, unit), and the pieces it read are then marked read.
//   - A push over a piece of another (seq, unit) that no SUM has read yet is an early staging
//     reuse; a SUM over bytes of another unit, never written or still being written is a missing
//     push fence. Either is returned as a message naming ranks, slot, bytes and units (the
//     executor fails the call with it); correct programs never trigger it, whatever the timing.
//   - It sees what one process executes: the virtual cluster with ranks as threads, where every
//     rank's pushes and sums pass through it. Ranks as processes rely on the checker alone.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace tide {

class StagingCanary {
 public:
  struct Unit {
    int64_t seq = 0;
    int32_t unit = -1;
    bool operator==(const Unit& o) const { return seq == o.seq && unit == o.unit; }
  };
  // A push row [a, b) of (owner, slot) by `writer` starts: "" or why it is an early reuse.
  std::string begin_write(int owner, int slot, int64_t a, int64_t b, Unit u, int writer);
  void end_write(int owner, int slot, int64_t a, int64_t b, Unit u);
  // A SUM term of `owner` reads [a, b) of its slot: "" or why its data is not its unit's.
  std::string check_read(int owner, int slot, int64_t a, int64_t b, Unit u);
  void mark_read(int owner, int slot, int64_t a, int64_t b, Unit u);

 private:
  enum State : int8_t { kWriting, kWritten, kRead };
  struct Piece {
    int64_t end;
    Unit u;
    State state;
    int writer;
  };
  using Slot = std::map<int64_t, Piece>;  // start -> piece, disjoint
  Slot& slot(int owner, int s) { return slots_[{owner, s}]; }
  std::mutex mu_;
  std::map<std::pair<int, int>, Slot> slots_;
};

}  // namespace tide
