// The CPU executor's staging race canary (csrc/exec/cpu only): defence in depth behind the static
// checker for the RS Level-1 staging slots (paper §4.1, invariant I3).
//
// Contract
//   - One table per run, in a shared anonymous mapping that run_cpu makes before it starts the
//     ranks: worker threads and forked rank processes update the same words, so ranks as threads
//     and ranks as processes are checked by one mechanism. The mapping has no name (nothing can
//     outlive the run) and is not arena memory: CpuArena::bytes_per_rank, the plan's memory model
//     and the arena regions are untouched; bytes() says what the table costs.
//   - Per (owner, staging slot, pusher) one record, claimed by the pusher's first push into that
//     slot: the (call seq, unit) it last pushed there (Op::round: the Level-1 unit u of
//     builder_rs.cc), whether that push is being written or written, the byte hull [lo, hi) of
//     its rows, and the (seq, unit) the owner's SUM last read from it. Every field is a lock-free
//     atomic; a record's push fields have one writer (its pusher), its read field one writer
//     (the owner), so correct programs — whose pushes into a slot wait for the owner's credit
//     and whose SUMs wait for the pushes' signals — never see a record change under them.
//   - A push row over a record of another (seq, unit) that no SUM has read yet is an early
//     staging reuse; a SUM term over bytes that no written push of its own (seq, unit) covers, or
//     that a push of its unit is still writing, is a missing push fence. Either is returned as a
//     message naming ranks, slot, bytes and units (the executor fails the call with it). The
//     granularity is a pusher's unit in a slot (its rows' hull; a unit counts as read once a SUM
//     of it read any of those bytes), so correct programs never trigger it, whatever the timing.
//   - Tracked: `writers` pushers per (owner, slot) (a node's ranks: the Level-1 pushers of a
//     slot are the owner's node peers) and slots [0, slots); a push beyond them is not tracked.
//     RankExecutor runs without it (its segments belong to the caller).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace tide {

class StagingCanary {
 public:
  struct Unit {
    int64_t seq = 0;
    int32_t unit = -1;
  };
  StagingCanary(int world, int slots, int writers);
  ~StagingCanary();
  StagingCanary(const StagingCanary&) = delete;
  StagingCanary& operator=(const StagingCanary&) = delete;
  int64_t bytes() const { return bytes_; }

  // A push row [a, b) of (owner, slot) by `writer` starts: "" or why it is an early reuse.
  std::string begin_write(int owner, int slot, int64_t a, int64_t b, Unit u, int writer);
  void end_write(int owner, int slot, Unit u, int writer);
  // A SUM term of `owner` reads [a, b) of its slot: "" or why its data is not its unit's.
  std::string check_read(int owner, int slot, int64_t a, int64_t b, Unit u);
  void mark_read(int owner, int slot, int64_t a, int64_t b, Unit u);

  struct Record {
    std::atomic<int32_t> writer;  // pusher rank + 1; 0: free
    std::atomic<int32_t> unused;
    std::atomic<uint64_t> tag;    // key(seq, unit) | state (1 being written, 2 written); 0: none
    std::atomic<int64_t> lo, hi;  // the hull of the unit's rows
    std::atomic<uint64_t> read;   // key of the unit the owner's SUM last read here
  };

 private:
  Record* records(int owner, int slot) const;  // `writers_` records; nullptr outside the table
  Record* claim(int owner, int slot, int writer) const;
  int world_, slots_, writers_;
  int64_t bytes_ = 0;
  Record* table_ = nullptr;
};

}  // namespace tide
