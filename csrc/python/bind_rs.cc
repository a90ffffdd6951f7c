// Bindings for the TIDE-RS schedule and validator (owner: TIDE-RS): Plan.rs_schedule (read-only
// view of the RsSchedule), rs_level1_copies(plan, rank) and validate_all(gpus_per_node, max_nodes).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/tuple.h>

#include <chrono>
#include <memory>

#include "python/bind_common.h"
#include "tide/plan.h"
#include "tide/rs_program.h"

namespace nb = nanobind;
using namespace tide;

namespace {

nb::list mask_list(const uint8_t* m, int L) {
  nb::list out;
  for (int j = 0; j < L; ++j) out.append(int(m[j]));
  return out;
}

void bind_rs_types(nb::module_& m) {
  nb::class_<RsSegment>(m, "RsSegment")
      .def_ro("param", &RsSegment::param).def_ro("param_offset", &RsSegment::param_offset)
      .def_ro("out_offset", &RsSegment::out_offset).def_ro("sub_offset", &RsSegment::sub_offset)
      .def_ro("length", &RsSegment::length);
  nb::class_<RsSubslice>(m, "RsSubslice")
      .def_ro("pass_", &RsSubslice::pass).def_ro("s", &RsSubslice::s)
      .def_ro("out_begin", &RsSubslice::out_begin).def_ro("length", &RsSubslice::length)
      .def_ro("seg_begin", &RsSubslice::seg_begin).def_ro("seg_end", &RsSubslice::seg_end);
  nb::class_<RsRound>(m, "RsRound")
      .def_ro("pass_", &RsRound::pass).def_ro("wave", &RsRound::wave)
      .def_ro("c_begin", &RsRound::c_begin).def_ro("c_end", &RsRound::c_end);
  // The masks are per destination GPU; the schedule's L is needed to size them, so waves are
  // exported as dicts by RsSchedule.waves_info.
  nb::class_<RsSchedule>(m, "RsSchedule")
      .def_ro("M", &RsSchedule::M).def_ro("L", &RsSchedule::L)
      .def_ro("w_wave", &RsSchedule::w_wave).def_ro("waves", &RsSchedule::waves)
      .def_ro("n_par", &RsSchedule::n_par).def_ro("n_out", &RsSchedule::n_out)
      .def_ro("n_part", &RsSchedule::n_part).def_ro("k", &RsSchedule::k)
      .def_prop_ro("mode", [](const RsSchedule& r) { return std::string(mode_name(r.mode)); })
      .def_ro("E_stg", &RsSchedule::E_stg).def_ro("E_sub", &RsSchedule::E_sub)
      .def_ro("E_subslice", &RsSchedule::E_subslice)
      .def_ro("block_bytes", &RsSchedule::block_bytes).def_ro("E_chunk", &RsSchedule::E_chunk)
      .def_ro("n_chunks", &RsSchedule::n_chunks).def_ro("direct", &RsSchedule::direct).def_ro("E_span", &RsSchedule::E_span).def_ro("stg_rows", &RsSchedule::stg_rows).def_ro("n_stg", &RsSchedule::n_stg)
      .def_ro("b_grad", &RsSchedule::b_grad).def_ro("stg_slot_bytes", &RsSchedule::stg_slot_bytes)
      .def_ro("n_spare", &RsSchedule::n_spare).def_ro("d_rem", &RsSchedule::d_rem)
      .def_ro("l1_descriptors_per_rank", &RsSchedule::l1_descriptors_per_rank)
      .def_ro("l1_tail_descriptors_per_rank", &RsSchedule::l1_tail_descriptors_per_rank)
      .def_ro("l1_flat_descriptors_per_rank", &RsSchedule::l1_flat_descriptors_per_rank)
      .def_ro("l1_coalesced_formula", &RsSchedule::l1_coalesced_formula)
      .def_ro("segments", &RsSchedule::segments).def_ro("subslices", &RsSchedule::subslices)
      .def_ro("rounds", &RsSchedule::rounds)
      .def_prop_ro("waves_info", [](const RsSchedule& r) {
        nb::list out;
        for (const RsWave& w : r.wave_list) {
          nb::dict d;
          d["pass"] = w.pass; d["w"] = w.w; d["gen"] = w.gen;
          d["c_begin"] = w.c_begin; d["c_end"] = w.c_end; d["own"] = w.own;
          d["round_begin"] = w.round_begin; d["round_end"] = w.round_end;
          d["write_mask"] = mask_list(w.write_mask, r.L);
          d["zero_mask"] = mask_list(w.zero_mask, r.L);
          out.append(d);
        }
        return out;
      });
}

}  // namespace

void bind_rs(nb::module_& m) {
  if (!nb::type<RsSchedule>().is_valid()) bind_rs_types(m);
  // Plan.rs_schedule: the full RsSchedule (segment table, waves, masks, rounds) as an object;
  // bound here so the RS section stays in one file (bind_plan.cc binds Plan and its `rs` dict).
  nb::object property = nb::module_::import_("builtins").attr("property");
  nb::setattr(nb::type<Plan>(), "rs_schedule",
              property(nb::cpp_function([](const Plan& p) -> const RsSchedule& { return p.rs; },
                                        nb::is_method(), nb::rv_policy::reference_internal)));

  m.def(
      "rs_level1_copies",
      [](const Plan& plan, int rank) {
        TIDE_PLAN_CHECK(rank >= 0 && rank < plan.topo.world(), "rank: ", rank,
                        " is outside [0, ", plan.topo.world(), ")");
        nb::list out;
        for (const RsL1Copy& c : rs_level1_copies(plan.layout, plan.rs, rank)) {
          nb::dict d;
          d["c"] = c.c; d["t"] = c.t; d["owner"] = c.owner; d["pass"] = c.pass; d["s"] = c.s;
          d["chunk"] = c.chunk; d["tail"] = c.tail; d["param"] = c.copy.param;
          d["src_offset"] = c.copy.src_offset; d["src_pitch"] = c.copy.src_pitch;
          d["dst_offset"] = c.copy.dst_offset; d["dst_pitch"] = c.copy.dst_pitch;
          d["width"] = c.copy.width; d["height"] = c.copy.height;
          out.append(d);
        }
        return out;
      },
      nb::arg("plan"), nb::arg("rank"),
      "Level-1 pushes of one rank for one call, in issue order (byte offsets, grad dtype).");

  m.def(
      "build_rs_programs",
      [](const Plan& plan, int bank, float alpha, bool accumulate, int group, bool expert_lane,
         nb::object arena, int64_t counter_base) {
        RsCallOptions o;
        o.bank = bank; o.alpha = alpha; o.accumulate = accumulate; o.group = group;
        o.expert_lane = expert_lane;
        auto ps = std::make_shared<ProgramSet>();
        ps->progs = build_rs_programs(plan, o);
        RegionTable regions;
        ArenaBindOptions b;
        if (!arena.is_none()) { regions = regions_from_python(arena); b.regions = &regions; }
        b.counter_base = counter_base;
        bind_programs_to_arena(ps->progs, b);
        ps->arena_bound = b.regions != nullptr;
        return ps;
      },
      nb::arg("plan"), nb::arg("bank") = 0, nb::arg("alpha") = 1.0f, nb::arg("accumulate") = false,
      nb::arg("group") = 0, nb::arg("expert_lane") = false, nb::arg("arena") = nb::none(),
      nb::arg("counter_base") = 0,
      "One TIDE-RS Program per rank for one call (bank b = e mod 2; expert_lane: L_sub = 1). "
      "arena={name: (offset, nbytes)} binds the programs to the caller's arena layout; counter_base "
      "offsets every counter index.");
  m.def(
      "generate_rs_programs",
      [](const Plan& plan, int bank, float alpha, bool accumulate, int group) {
        RsCallOptions o;
        o.bank = bank; o.alpha = alpha; o.accumulate = accumulate; o.group = group;
        auto generator = std::make_shared<RsProgramGenerator>(std::make_shared<const Plan>(plan), o);
        auto ps = std::make_shared<ProgramSet>();
        ps->progs.reserve(static_cast<size_t>(plan.topo.world()));
        for (int r = 0; r < plan.topo.world(); ++r) ps->progs.push_back(generator->header(r, false));
        ps->generator = generator;
        return ps;
      },
      nb::arg("plan"), nb::arg("bank") = 0, nb::arg("alpha") = 1.0f, nb::arg("accumulate") = false,
      nb::arg("group") = 0,
      "TIDE-RS programs generated while they run (scale runs): per-rank headers and a generator "
      "that emits each stream's ops in steps, op for op what build_rs_programs builds. The CPU "
      "executor runs them (threads mode); the checker and fault injection need built programs.");
  m.def(
      "rs_program_stats",
      [](const ProgramSet& ps, int rank) {
        const RsProgramStats st = rs_program_stats(ps.program(rank));
        nb::dict d;
        d["l1_descriptors"] = st.l1_descriptors; d["puts"] = st.puts; d["sums"] = st.sums;
        d["lands"] = st.lands; d["zeros"] = st.zeros; d["ops"] = st.ops;
        return d;
      },
      nb::arg("programs"), nb::arg("rank"));
  m.def(
      "rs_arena_needs",
      [](const Plan& plan) {
        const RsArenaNeeds a = rs_arena_needs(plan);
        return std::make_tuple(a.staging, a.outbox, a.inbox, a.spare);
      },
      nb::arg("plan"), "(staging, outbox, inbox, spare) bytes the RS programs address.");
  m.def(
      "rs_fold_alpha",
      [](const std::string& op, int world, double premul, double predivide, double postdivide) {
        RsReduceOp o = RsReduceOp::kSum;
        if (op == "avg") o = RsReduceOp::kAvg;
        else if (op == "premul_sum") o = RsReduceOp::kPremulSum;
        else TIDE_PLAN_CHECK(op == "sum", "op: expected sum, avg or premul_sum, got '", op, "'");
        return rs_fold_alpha(o, world, premul, predivide, postdivide);
      },
      nb::arg("op"), nb::arg("world"), nb::arg("premul") = 1.0, nb::arg("predivide") = 1.0,
      nb::arg("postdivide") = 1.0, "FSDP2's reduce op and divide factors folded into one alpha.");
  nb::dict tags;
  for (int t = 100; t <= 123; ++t) {
    static const char* names[] = {"BankWait", "StagingWait", "Push", "PushSignal", "PushWait",
                                  "Sum", "StagingFree", "Progress", "OutboxWait", "GenWait",
                                  "Zero", "InboxCredit", "SumWait", "Put", "Sent", "SpareCopy",
                                  "Ready", "ReadyWait", "Land", "Landed", "RailDone", "SpareWait",
                                  "PushStart", "Pushed"};
    tags[names[t - 100]] = t;
  }
  m.attr("rs_op_tags") = tags;
  m.def(
      "validate_all",
      [](int gpus_per_node, int max_nodes, int min_nodes) {
        const auto t0 = std::chrono::steady_clock::now();
        ValidateAllResult r;
        {
          nb::gil_scoped_release unlocked;
          r = validate_all(gpus_per_node, max_nodes, min_nodes);
        }
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        nb::dict d;
        d["accepted"] = r.accepted;
        d["rejected"] = r.rejected;
        d["accepted_pairs"] = r.accepted_pairs;
        d["rejected_pairs"] = r.rejected_pairs;
        d["n_part_ok"] = r.n_part_ok;
        d["n_part_checked"] = r.n_part_checked;
        d["n_part_failure"] = r.first_n_part_failure;
        d["seconds"] = secs;
        // Compact views for printing: rejected M per W_wave, and a one-line summary.
        nb::dict by_w;
        for (const auto& pr : r.rejected_pairs) {
          nb::object key = nb::int_(pr.second);
          if (!by_w.contains(key)) by_w[key] = nb::list();
          nb::cast<nb::list>(by_w[key]).append(pr.first);
        }
        d["rejected_by_w_wave"] = by_w;
        d["summary"] = TIDE_STR_CAT(
            r.accepted, " accepted and ", r.rejected, " rejected base plans (M in [", min_nodes, ", ", max_nodes,
            "], W_wave in [1, ", gpus_per_node, "], k in [1, ", kMaxRoundWidth, "], In-Place and Slot-Reuse); ",
            r.accepted_pairs.size(), " accepted and ", r.rejected_pairs.size(),
            " rejected (M, W_wave) pairs; n_part in {2, 3, 4} ",
            r.n_part_ok ? "valid" : "INVALID", " over ", r.n_part_checked, " checks");
        return d;
      },
      nb::arg("gpus_per_node"), nb::arg("max_nodes"), nb::arg("min_nodes") = 2,
      "Exhaustive RS validator regression (App. D): every base plan (M in [min_nodes, max_nodes], "
      "W_wave in [1, L], k in [1, 32], In-Place and Slot-Reuse) is simulated; returns accepted "
      "and rejected counts, the (M, W_wave) pairs, and whether n_part in {2, 3, 4} is valid for "
      "every accepted base plan.");
  m.def(
      "check_rs_shape",
      [](int M, int L, int w_wave, int n_part, int k, const std::string& mode,
         const std::string& fault) {
        RsSchedule rs;
        build_rs_waves(rs, M, L, w_wave, n_part);
        // Validator negative tests: corrupt the schedule the way a planner bug would.
        if (fault == "skip_zeroing") {
          bool dropped = false;
          for (RsWave& w : rs.wave_list)
            for (int j = 0; j < L && !dropped; ++j)
              if (w.zero_mask[j]) {
                w.zero_mask[j] = 0;
                dropped = true;
              }
        } else if (fault == "single_generation") {
          for (RsWave& w : rs.wave_list) w.gen = 0;
          rs.n_par = 1;
        } else if (fault == "zero_written_block") {
          rs.wave_list.back().zero_mask[0] |= rs.wave_list.back().write_mask[0];
        } else if (!fault.empty()) {
          throw PlanError(TIDE_STR_CAT("fault: unknown schedule fault '", fault, "'"));
        }
        std::string why = check_rs_waves(rs);
        if (why.empty()) {
          build_rs_rounds(rs, k, parse_mode(mode));
          why = check_rs_rounds(rs);
        }
        return why;
      },
      nb::arg("M"), nb::arg("L"), nb::arg("w_wave"), nb::arg("n_part") = 1, nb::arg("k") = 4,
      nb::arg("mode") = "in_place", nb::arg("fault") = "",
      "Validate one schedule shape without a parameter group; '' when valid, else why not.");
}
