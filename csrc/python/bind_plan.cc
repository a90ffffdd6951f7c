// Bindings for csrc/plan (owner: planner). Minimal surface; tide/plan.py is the Python face.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "tide/plan.h"

namespace nb = nanobind;
using namespace tide;

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
      .def("landing", &GroupLayout::landing, nb::arg("p"), nb::arg("r"))
      .def("valid_rows", &GroupLayout::valid_rows, nb::arg("p"), nb::arg("r"));
  nb::class_<Plan>(m, "Plan")
      .def_ro("layout", &Plan::layout)
      .def_prop_ro("hash", [](const Plan& p) { return p.hash; })
      .def_prop_ro("nodes", [](const Plan& p) { return p.topo.nodes; })
      .def_prop_ro("gpus_per_node", [](const Plan& p) { return p.topo.gpus_per_node; })
      .def_prop_ro("mode", [](const Plan& p) { return std::string(mode_name(p.opt.mode)); });

  m.def(
      "make_plan",
      [](const std::vector<std::vector<int64_t>>& shapes, const std::vector<std::string>& names,
         const std::string& ag_dtype, const std::string& grad_dtype, const std::string& shard_dtype,
         int nodes, int gpus_per_node, const std::string& mode, int w_wave, int k, int n_part,
         int n_stg, int64_t chunk_bytes, int sum_ctas, int land_ctas) {
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
        return make_plan(sig, topo, opt);
      },
      nb::arg("shapes"), nb::arg("names"), nb::arg("ag_dtype"), nb::arg("grad_dtype"),
      nb::arg("shard_dtype"), nb::arg("nodes"), nb::arg("gpus_per_node"), nb::arg("mode"),
      nb::arg("w_wave"), nb::arg("k"), nb::arg("n_part"), nb::arg("n_stg"),
      nb::arg("chunk_bytes"), nb::arg("sum_ctas"), nb::arg("land_ctas"));
}
