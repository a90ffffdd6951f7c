// Bindings for the TIDE-AG schedule tables (plan.ag) and Bruck helpers.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "tide/plan.h"

namespace nb = nanobind;
using namespace tide;

void bind_ag_plan_info(nb::module_& m);

void bind_ag(nb::module_& m) {
  bind_ag_plan_info(m);
  nb::class_<AgSchedule>(m, "AgSchedule")
      .def_ro("rounds", &AgSchedule::rounds)
      .def_ro("c", &AgSchedule::c)
      .def_ro("stage_slots", &AgSchedule::stage_slots)
      .def_ro("stage_bytes", &AgSchedule::stage_bytes)
      .def_ro("descriptors_per_rank", &AgSchedule::descriptors_per_rank)
      .def_ro("flat_descriptors_per_rank", &AgSchedule::flat_descriptors_per_rank)
      .def_ro("last_round_groups", &AgSchedule::last_round_groups)
      .def_ro("local_push_descriptors", &AgSchedule::local_push_descriptors);
  m.def("plan_ag", [](const Plan& p) { return p.ag; }, "The plan's TIDE-AG schedule.");
  m.def("ag_scatter_runs", [](const Plan& p, int node) {
    std::vector<std::tuple<int, int, int>> v;
    for (const auto& r : ag_scatter_runs(p.ag, p.topo.nodes, node)) v.emplace_back(r.round, r.first_slot, r.slots);
    return v;
  }, nb::arg("plan"), nb::arg("node"), "(round, first_slot, slots) scatter runs of one node.");
  m.def("ag_scatter_descriptors", [](const Plan& p, int node) {
    return ag_scatter_descriptors(p.ag, p.topo.nodes, p.layout.P, node);
  }, nb::arg("plan"), nb::arg("node"));
  m.def("ag_send_peer", &ag_send_peer, nb::arg("n"), nb::arg("d"), nb::arg("M"));
  m.def("ag_recv_peer", &ag_recv_peer, nb::arg("n"), nb::arg("d"), nb::arg("M"));
  m.def("ag_rounds_for", [](int M) {  // R and c_d for any M (no plan needed)
    TIDE_PLAN_CHECK(M >= 1, "ag_rounds_for: M must be >= 1, got ", M);
    int rounds = 0;
    std::vector<int> c;
    ag_bruck_rounds(M, &rounds, &c);
    return std::make_tuple(rounds, c);
  }, nb::arg("M"));
  m.def("ag_ring_slot_bytes", &ag_ring_slot_bytes, nb::arg("group_ns_bytes"));
}

void bind_ag_plan_info(nb::module_& m) {
  m.def("plan_dtypes", [](const Plan& p) {
    return std::make_tuple(std::string(dtype_name(p.sig.ag_dtype)), std::string(dtype_name(p.sig.grad_dtype)),
                           std::string(dtype_name(p.sig.shard_dtype)));
  }, nb::arg("plan"), "(ag_dtype, grad_dtype, shard_dtype) names.");
  m.def("plan_shapes", [](const Plan& p) {
    std::vector<std::vector<int64_t>> v;
    for (const auto& ps : p.sig.params) v.push_back(ps.shape);
    return v;
  }, nb::arg("plan"), "Unsharded parameter shapes.");
}
