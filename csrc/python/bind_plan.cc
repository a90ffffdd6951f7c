// Bindings for csrc/plan (owner: planner). tide/plan.py is the Python face; a Plan crosses into
// Python as tide._core.Plan, and the schedule/solver/memory sections come out as plain dicts so
// that the CLI can print them and dump them as JSON without knowing every field.
#include <algorithm>

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "tide/plan.h"
#include "tide/session.h"  // program_counters: the pulled arena's counters

namespace nb = nanobind;
using namespace tide;

namespace {

nb::dict options_dict(const Plan& p) {
  const Options& o = p.opt;
  nb::dict d;
  d["mode"] = mode_name(o.mode);
  d["w_wave"] = o.w_wave;
  d["k"] = o.k;
  d["n_part"] = o.n_part;
  d["n_stg"] = o.n_stg;
  d["chunk_bytes"] = o.chunk_bytes;
  d["sum_ctas"] = o.sum_ctas;
  d["land_ctas"] = o.land_ctas;
  d["ag_head_bytes"] = o.ag_head_bytes;
  return d;
}

nb::dict ag_dict(const AgSchedule& ag) {
  nb::dict d;
  d["rounds"] = ag.rounds;
  d["c"] = ag.c;
  d["stage_slots"] = ag.stage_slots;
  d["stage_bytes"] = ag.stage_bytes;
  d["descriptors_per_rank"] = ag.descriptors_per_rank;
  d["flat_descriptors_per_rank"] = ag.flat_descriptors_per_rank;
  return d;
}

nb::dict rs_dict(const RsSchedule& rs) {
  nb::dict d;
  d["w_wave"] = rs.w_wave;
  d["waves"] = rs.waves;
  d["n_par"] = rs.n_par;
  d["n_out"] = rs.n_out;
  d["n_part"] = rs.n_part;
  d["k"] = rs.k;
  d["E_stg"] = rs.E_stg;
  d["E_sub"] = rs.E_sub;
  d["block_bytes"] = rs.block_bytes;
  d["direct"] = rs.direct;
  d["E_span"] = rs.E_span;
  d["E_chunk"] = rs.E_chunk;
  d["n_chunks"] = rs.n_chunks;
  d["l1_descriptors_per_rank"] = rs.l1_descriptors_per_rank;
  d["l1_flat_descriptors_per_rank"] = rs.l1_flat_descriptors_per_rank;
  return d;
}

nb::dict solver_dict(const SolverResult& s) {
  nb::dict d;
  d["k"] = s.k;
  d["sum_ctas"] = s.sum_ctas;
  d["land_ctas"] = s.land_ctas;
  d["n_part"] = s.n_part;
  d["t_nic_s"] = s.t_nic;
  d["rounds"] = s.rounds;
  d["k_given"] = s.k_given;
  d["sum_ctas_given"] = s.sum_ctas_given;
  d["land_ctas_given"] = s.land_ctas_given;
  return d;
}

nb::dict memory_dict(const Plan& p) {
  const MemoryModel& m = p.memory;
  const double ns = static_cast<double>(m.ns_bytes);
  nb::dict d;
  d["mode"] = mode_name(p.opt.mode);
  d["NS_bytes"] = m.ns_bytes;
  auto both = [&](const char* key, int64_t bytes) {
    d[(std::string(key) + "_bytes").c_str()] = bytes;
    d[(std::string(key) + "_ns").c_str()] = bytes / ns;
  };
  both("staging_slot", m.staging_slot_bytes);
  both("staging", m.staging_bytes);
  both("inbox", m.inbox_bytes);
  both("outbox", m.outbox_bytes);
  both("spare", m.spare_bytes);
  both("area_rs", m.area_rs_bytes);
  auto bound = [&](const char* key, double v) {
    d[(std::string(key) + "_ns").c_str()] = v;
    d[(std::string(key) + "_bytes").c_str()] = static_cast<int64_t>(v * ns + 0.5);
  };
  bound("area_rs_bound", m.area_rs_bound_ns);
  bound("area_inplace_bound", m.area_inplace_bound_ns);
  bound("area_slot_bound", m.area_slot_bound_ns);
  both("ring", m.ring_bytes);
  both("stage", m.stage_bytes);
  both("prev_grad", m.prev_grad_bytes);
  both("live_tide", m.live_tide_bytes);
  d["live_tide_bound_ns"] = m.live_tide_bound_ns;
  both("live_fsdp2", m.live_fsdp2_bytes);
  both("arena", m.arena_bytes);
  nb::list arena;
  for (const auto& r : m.arena) {
    nb::dict e;
    e["name"] = r.name;
    e["offset"] = r.offset;
    e["bytes"] = r.bytes;
    arena.append(e);
  }
  d["arena"] = arena;
  // [Note: pulled arena]: the arena of a session whose TIDE-AG pulls (tide_xla's, with a cast),
  // its counters the one-sided pull programs'; None where the plan cannot pull (no cast across nodes).
  if (p.sig.needs_cast() || p.topo.nodes == 1) {
    nb::list pulled;
    int64_t end = 0;
    for (const auto& r : pull_arena(p, program_counters(p, Collective::kAllGather, Rails::kOneSided, true))) {
      nb::dict e;
      e["name"] = r.name;
      e["offset"] = r.offset;
      e["bytes"] = r.bytes;
      pulled.append(e);
      end = std::max(end, r.offset + r.bytes);
    }
    d["pull_arena"] = pulled;
    both("pull_arena", end);
  } else {
    d["pull_arena"] = nb::none();
    d["pull_arena_bytes"] = nb::none();
    d["pull_arena_ns"] = nb::none();
  }
  return d;
}

}  // namespace

void bind_plan(nb::module_& m) {
  nb::class_<ParamLayout>(m, "ParamLayout")
      .def_ro("D", &ParamLayout::D).def_ro("K", &ParamLayout::K).def_ro("R", &ParamLayout::R)
      .def_ro("s", &ParamLayout::s).def_ro("o", &ParamLayout::o).def_ro("e", &ParamLayout::e)
      .def_ro("o32", &ParamLayout::o32);
  nb::class_<GroupLayout>(m, "GroupLayout")
      .def_ro("P", &GroupLayout::P).def_ro("N", &GroupLayout::N)
      .def_ro("params", &GroupLayout::params).def_ro("S", &GroupLayout::S)
      .def_ro("S_grad", &GroupLayout::S_grad).def_ro("S_fp32", &GroupLayout::S_fp32)
      .def_ro("E", &GroupLayout::E).def_ro("B_pack", &GroupLayout::B_pack)
      .def_prop_ro("NS", &GroupLayout::unsharded_bytes)
      .def_prop_ro("R", [](const GroupLayout& g) {
        std::vector<int64_t> v;
        for (const auto& p : g.params) v.push_back(p.R);
        return v;
      })
      .def_prop_ro("s", [](const GroupLayout& g) {
        std::vector<int64_t> v;
        for (const auto& p : g.params) v.push_back(p.s);
        return v;
      })
      .def_prop_ro("o", [](const GroupLayout& g) {
        std::vector<int64_t> v;
        for (const auto& p : g.params) v.push_back(p.o);
        return v;
      })
      .def("landing", &GroupLayout::landing, nb::arg("p"), nb::arg("r"),
           "Landing(p, r) = o_p*N + r*s_p (Eq. 2): byte offset of rank r's shard of p in NS.")
      .def("valid_rows", &GroupLayout::valid_rows, nb::arg("p"), nb::arg("r"),
           "Rows of I_{p,r} below D_p.")
      .def("rows", [](const GroupLayout& g, int p, int r) {
        const int64_t R = g.params.at(p).R;
        return std::make_pair(r * R, (r + 1) * R);
      }, nb::arg("p"), nb::arg("r"), "I_{p,r} = [r*R_p, (r+1)*R_p) as (start, stop).");

  nb::class_<Plan>(m, "Plan")
      .def_ro("layout", &Plan::layout)
      .def_prop_ro("hash", [](const Plan& p) { return p.hash; })
      .def_prop_ro("nodes", [](const Plan& p) { return p.topo.nodes; })
      .def_prop_ro("gpus_per_node", [](const Plan& p) { return p.topo.gpus_per_node; })
      .def_prop_ro("world", [](const Plan& p) { return p.topo.world(); })
      .def_prop_ro("mode", [](const Plan& p) { return std::string(mode_name(p.opt.mode)); })
      .def_prop_ro("ag_dtype", [](const Plan& p) { return std::string(dtype_name(p.sig.ag_dtype)); })
      .def_prop_ro("grad_dtype",
                   [](const Plan& p) { return std::string(dtype_name(p.sig.grad_dtype)); })
      .def_prop_ro("shard_dtype",
                   [](const Plan& p) { return std::string(dtype_name(p.sig.shard_dtype)); })
      .def_prop_ro("names", [](const Plan& p) {
        std::vector<std::string> v;
        for (const auto& ps : p.sig.params) v.push_back(ps.name);
        return v;
      })
      .def_prop_ro("shapes", [](const Plan& p) {
        std::vector<std::vector<int64_t>> v;
        for (const auto& ps : p.sig.params) v.push_back(ps.shape);
        return v;
      })
      .def_prop_ro("options", &options_dict, "Resolved options (every 0 = auto filled in).")
      .def_prop_ro("ag", [](const Plan& p) { return ag_dict(p.ag); }, "TIDE-AG schedule fields.")
      .def_prop_ro("rs", [](const Plan& p) { return rs_dict(p.rs); }, "TIDE-RS schedule fields.")
      .def_prop_ro("rs_sizing", [](const Plan& p) { return p.rs_sizing; },
                   "Why the planner chose the RS pass count and staging chunk.")
      .def_prop_ro("solver", [](const Plan& p) { return solver_dict(p.solver); },
                   "Sizing-solver choices (Eqs. 13-14, App. G).")
      .def("memory", &memory_dict,
           "Memory-model terms (Eqs. 10-12) in bytes and NS units, the arena table, and the pulled TIDE-AG's "
           "arena (pull_arena, pull_arena_bytes: one-sided counters; None where the plan cannot pull).")
      .def("__repr__", [](const Plan& p) {
        return TIDE_STR_CAT("<tide.Plan M=", p.topo.nodes, " L=", p.topo.gpus_per_node,
                            " P=", p.layout.P, " S=", p.layout.S, " ", mode_name(p.opt.mode),
                            " hash=0x", std::hex, p.hash, ">");
      })
      .def("region", [](const Plan& p, const std::string& name) {
        const ArenaRegion& r = p.memory.region(name);
        return std::make_pair(r.offset, r.bytes);
      }, nb::arg("name"), "(offset, bytes) of a named arena region; raises if absent.");

  m.def(
      "make_plan",
      [](const std::vector<std::vector<int64_t>>& shapes, const std::vector<std::string>& names,
         const std::string& ag_dtype, const std::string& grad_dtype, const std::string& shard_dtype,
         int nodes, int gpus_per_node, const std::string& mode, int w_wave, int k, int n_part,
         int n_stg, int64_t chunk_bytes, int sum_ctas, int land_ctas, int64_t ag_head_bytes,
         const nb::dict& calibration) {
        GroupSignature sig;
        for (size_t i = 0; i < shapes.size(); ++i)
          sig.params.push_back({i < names.size() ? names[i] : std::string(), shapes[i]});
        sig.ag_dtype = parse_dtype(ag_dtype, "GroupSignature.ag_dtype");
        sig.grad_dtype = parse_dtype(grad_dtype, "GroupSignature.grad_dtype");
        sig.shard_dtype = parse_dtype(shard_dtype, "GroupSignature.shard_dtype");
        Topology topo{nodes, gpus_per_node};
        Options opt;
        opt.mode = parse_mode(mode);
        opt.w_wave = w_wave; opt.k = k; opt.n_part = n_part; opt.n_stg = n_stg;
        opt.chunk_bytes = chunk_bytes; opt.sum_ctas = sum_ctas; opt.land_ctas = land_ctas;
        opt.ag_head_bytes = ag_head_bytes;
        Calibration cal;
        for (auto [key, value] : calibration) {
          const std::string kname = nb::cast<std::string>(key);
          if (kname == "bw_nic") cal.bw_nic = nb::cast<double>(value);
          else if (kname == "bw_sum") cal.bw_sum = nb::cast<double>(value);
          else if (kname == "bw_land") cal.bw_land = nb::cast<double>(value);
          else if (kname == "bw_cap") cal.bw_cap = nb::cast<double>(value);
          else if (kname == "t_rnd") cal.t_rnd = nb::cast<double>(value);
          else if (kname == "gamma_skew") cal.gamma_skew = nb::cast<double>(value);
          else if (kname == "eta_tail") cal.eta_tail = nb::cast<double>(value);
          else if (kname == "k_max") cal.k_max = nb::cast<int>(value);
          else if (kname == "bw_push") cal.bw_push = nb::cast<double>(value);
          else if (kname == "bw_hbm") cal.bw_hbm = nb::cast<double>(value);
          else throw PlanError(TIDE_STR_CAT("calibration: unknown field '", kname, "'"));
        }
        return make_plan(sig, topo, opt, cal);
      },
      nb::arg("shapes"), nb::arg("names"), nb::arg("ag_dtype"), nb::arg("grad_dtype"),
      nb::arg("shard_dtype"), nb::arg("nodes"), nb::arg("gpus_per_node"), nb::arg("mode"),
      nb::arg("w_wave") = 0, nb::arg("k") = 0, nb::arg("n_part") = 0, nb::arg("n_stg") = 2,
      nb::arg("chunk_bytes") = 0, nb::arg("sum_ctas") = 0, nb::arg("land_ctas") = 0,
      nb::arg("ag_head_bytes") = Options().ag_head_bytes, nb::arg("calibration") = nb::dict());

  m.def(
      "make_layout",
      [](const std::vector<std::vector<int64_t>>& shapes, int world, const std::string& ag_dtype,
         const std::string& grad_dtype) {
        GroupSignature sig;
        for (const auto& s : shapes) sig.params.push_back({std::string(), s});
        sig.ag_dtype = parse_dtype(ag_dtype, "ag_dtype");
        sig.grad_dtype = parse_dtype(grad_dtype, "grad_dtype");
        sig.shard_dtype = sig.ag_dtype;
        validate_signature(sig, world);
        return build_layout(sig, Topology{1, world});  // the layout depends on N only
      },
      nb::arg("shapes"), nb::arg("world"), nb::arg("ag_dtype") = "bfloat16", nb::arg("grad_dtype") = "bfloat16",
      "The planner's per-parameter layout (Section 2.1, Eqs. 2-3) of a group sharded over `world` ranks.");

  m.def("n_rounds", &n_rounds, nb::arg("nodes"), nb::arg("k"), nb::arg("w_wave"),
        "N_rounds(M-1, k, W_wave): network rounds of one reduce-scatter (App. G).");
  m.def("recoverable_overhead_fraction", &recoverable_overhead_fraction, nb::arg("psi_total"),
        nb::arg("psi_active"), nb::arg("tokens_per_gpu"),
        "Eq. 1: Psi_total / (Psi_active * T_tok/gpu), proportionality constant 1.");
  m.def("calibration_defaults", []() {
    Calibration c;
    nb::dict d;
    d["bw_nic"] = c.bw_nic; d["bw_sum"] = c.bw_sum; d["bw_land"] = c.bw_land;
    d["bw_cap"] = c.bw_cap; d["t_rnd"] = c.t_rnd; d["gamma_skew"] = c.gamma_skew;
    d["eta_tail"] = c.eta_tail; d["k_max"] = c.k_max; d["bw_push"] = c.bw_push; d["bw_hbm"] = c.bw_hbm;
    return d;
  });
}
