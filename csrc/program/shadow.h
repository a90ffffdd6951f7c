// Checker internals: data provenance labels and shadow memory (csrc/program only).
//
// [Note: provenance labels] A label says what a byte range holds, symbolically: "the sum over
// terms of source element (term.offset + k*term.src_elem) of call seq", for output element k
// of size `elem`. A byte copy keeps the label, a CAST halves `elem`, a SUM/LAND concatenates
// the terms of its operands. Canonical form: one term with src_elem == elem is a plain byte copy
// (elem = src_elem = 1). No terms = zeros; `garbage` = never written (or a dtype confusion).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "tide/program.h"

namespace tide {
namespace shadow {

struct Term {
  int32_t group = 0, rank = 0, index = -1;
  int8_t kind = 0;
  int32_t src_elem = 1;
  int64_t seq = 0, offset = 0;
  bool operator<(const Term& o) const {
    return std::tie(group, rank, kind, index, seq, offset, src_elem) <
           std::tie(o.group, o.rank, o.kind, o.index, o.seq, o.offset, o.src_elem);
  }
  bool operator==(const Term& o) const { return !(*this < o) && !(o < *this); }
};

struct Label {
  bool garbage = true;
  int32_t elem = 1;
  std::vector<Term> terms;  // sorted

  static Label zero() { Label l; l.garbage = false; return l; }
  void canonical() {
    std::sort(terms.begin(), terms.end());
    if (terms.size() == 1 && terms[0].src_elem == elem && elem != 1) {
      terms[0].src_elem = 1;
      elem = 1;
    }
    if (terms.empty() && !garbage) elem = 1;
  }
  // The label of the byte `delta` bytes further on.
  Label shifted(int64_t delta) const {
    if (garbage || delta == 0) return *this;
    Label l = *this;
    if (delta % elem != 0) return Label();  // misaligned: garbage
    const int64_t k = delta / elem;
    for (auto& t : l.terms) t.offset += k * t.src_elem;
    return l;
  }
  // The same value viewed as elements of `b` bytes (garbage if incompatible).
  Label as_elems(int32_t b) const {
    if (garbage || terms.empty()) { Label z = *this; z.elem = b; return z; }
    if (elem == b) return *this;
    if (elem == 1 && terms.size() == 1 && terms[0].src_elem == 1) {
      Label l = *this;
      l.elem = b;
      l.terms[0].src_elem = b;
      return l;
    }
    return Label();
  }
  bool operator==(const Label& o) const {
    return garbage == o.garbage && (garbage || (elem == o.elem && terms == o.terms));
  }
};

struct OpId {
  int32_t rank = -1, call = -1, op = -1;
};

struct Epoch {
  uint32_t gid = 0, clock = 0;  // clock 0 = none
  OpId who;
};

struct Seg {
  int64_t end = 0;
  Label label;
  Epoch w;
  int32_t wgroup = -1;  // call (group, seq) of the last exclusive write (landings: once per call)
  int64_t wseq = -1;
  std::vector<Epoch> reads;
};

// Interval map over one buffer/region: [start, end) -> Seg, covering only touched bytes.
class Region {
 public:
  // Splits so that a and b are segment boundaries within touched space; fills holes with fresh
  // (garbage, unwritten) segments. Returns the iterator at a.
  std::map<int64_t, Seg>::iterator carve(int64_t a, int64_t b) {
    split(a);
    split(b);
    // fill holes in [a, b)
    int64_t pos = a;
    auto it = segs_.lower_bound(a);
    while (pos < b) {
      if (it == segs_.end() || it->first > pos) {
        const int64_t stop = it == segs_.end() ? b : std::min(b, it->first);
        Seg s;
        s.end = stop;
        it = segs_.emplace_hint(it, pos, s);
      }
      pos = it->second.end;
      ++it;
    }
    return segs_.find(a);
  }
  std::map<int64_t, Seg>& segs() { return segs_; }

 private:
  void split(int64_t x) {
    auto it = segs_.upper_bound(x);
    if (it == segs_.begin()) return;
    --it;
    if (it->first < x && it->second.end > x) {
      Seg right = it->second;
      right.label = it->second.label.shifted(x - it->first);
      it->second.end = x;
      segs_.emplace(x, right);
    }
  }
  std::map<int64_t, Seg> segs_;
};

}  // namespace shadow
}  // namespace tide
