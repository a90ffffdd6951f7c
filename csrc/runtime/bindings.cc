// User-buffer bindings (contract in tide/bindings.h).
#include "tide/bindings.h"

#include "tide/errors.h"

namespace tide {

void RankBindings::bind(BufKind kind, int index, void* data, int64_t bytes) {
  const int k = static_cast<int>(kind);
  TIDE_PLAN_CHECK(is_user_buffer(kind), "bind: ", buf_kind_name(kind), " is an arena region, not a user buffer");
  TIDE_PLAN_CHECK(index >= -1, "bind: ", buf_kind_name(kind), " index ", index, " (-1: the whole buffer, or p >= 0)");
  auto& v = by_kind[k];
  if (static_cast<int>(v.size()) < index + 2) v.resize(index + 2);
  v[index + 1] = {data, bytes};
}

const UserBuffer* RankBindings::find(BufKind kind, int index) const {
  if (!is_user_buffer(kind)) return nullptr;
  if (kind == BufKind::kOut) index = -1;
  const auto& v = by_kind[static_cast<int>(kind)];
  const size_t slot = static_cast<size_t>(index + 1);
  return index >= -1 && slot < v.size() && v[slot].data != nullptr ? &v[slot] : nullptr;
}

RankBindings to_rank_bindings(const RankBindingList& l) {
  RankBindings b;
  for (const Binding& x : l) {
    TIDE_PLAN_CHECK(is_user_buffer(x.kind), "bindings: ", buf_kind_name(x.kind), " is an arena region, not a user "
                    "buffer");
    TIDE_PLAN_CHECK(x.bytes >= 0, "bindings: ", buf_kind_name(x.kind), "[", x.index, "] has negative size ", x.bytes);
    b.bind(x.kind, x.kind == BufKind::kOut ? -1 : x.index, x.data, x.bytes);
  }
  return b;
}

}  // namespace tide
