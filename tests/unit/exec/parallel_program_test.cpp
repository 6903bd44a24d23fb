// Tensor parallelism planned without GPUs (docs/parallel.md): the Llama and GPT-2 MLP blocks and the
// post-attention half with column-/row-parallel linears, with and without sequence parallelism, at world
// sizes 1, 2, 4 and 8, against golden programs (tests/golden/programs/parallel.txt; JITFUSE_UPDATE_GOLDEN=1
// rewrites it): every collective where Megatron puts it, forward and backward; the errors of comm ops and
// parallel linears.
#include <catch2/catch.hpp>

#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "common/env.hpp"
#include "common/error.hpp"
#include "common/json_util.hpp"
#include "exec/lower/compile.hpp"
#include "fuser/explain.hpp"
#include "jitfuse/jitfuse.h"
#include "rules/rule.hpp"
#include "support/scoped_env.hpp"

using namespace jitfuse;
using nlohmann::json;

namespace {

const rules::RuleSet& builtins() {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  return rs;
}

std::string read(const std::string& path) { return json_util::read_file(path); }

// The example's linears made parallel: the first column-parallel, the last row-parallel.
std::string parallel_block(const std::string& file, bool sp) {
  json j = json::parse(read(std::string(JF_SOURCE_DIR) + "/tools/examples/" + file));
  std::vector<size_t> linears;
  for (size_t i = 0; i < j["ops"].size(); ++i)
    if (j["ops"][i]["op"] == "linear") linears.push_back(i);
  REQUIRE(linears.size() == 2);
  j["ops"][linears[0]]["tensor_parallel"] = "column";
  j["ops"][linears[1]]["tensor_parallel"] = "row";
  for (size_t i : linears) j["ops"][i]["sequence_parallel"] = sp;
  return j.dump();
}

std::shared_ptr<const exec::Program> program_of(const std::string& text, const std::string& recipe, bool training,
                                                const ops::Shape& shape, int world, int rank = 0, bool fuse = true) {
  auto def = ops::parse_sequence(text, "<test>", builtins().registry());
  auto r = ops::parse_recipe(recipe);
  ops::apply_recipe(def, r);
  exec::CompileOptions o;
  o.arch = 90;
  o.training = training;
  o.disable_fusion = !fuse;
  ops::Parallel par;
  par.world_size = world;
  par.rank = rank;
  return exec::compile(ops::infer(def, shape, par), def.name, r, o, builtins());
}

// One line per step: what runs, in order, with the shapes that say where each collective sits.
std::string steps_text(const exec::Program& p) {
  std::string out;
  for (const auto* dir : {&p.forward, &p.backward}) {
    if (dir == &p.backward && !p.training) break;
    out += dir == &p.forward ? "  forward:\n" : "  backward:\n";
    auto name = [&](int id) { return id >= 0 ? p.buffer(id).name : std::string("-"); };
    for (const auto& s : *dir) {
      if (s.peer_path != 0) out += s.peer_path > 0 ? "  peers" : "  nccl ";
      if (s.kind == exec::Step::Kind::comm)
        out += fmt::format("    comm {} {} -> {} count {}{}{}\n", exec::collective_name(s.comm.op), name(s.comm.send),
                           name(s.comm.recv), s.comm.count, s.comm.root >= 0 ? fmt::format(" root {}", s.comm.root) : "",
                           s.stream ? " (side)" : "");
      else if (s.kind == exec::Step::Kind::gemm)
        out += fmt::format("    gemm {} m={} n={} k={} {}\n", s.what.substr(0, s.what.find(':')), s.gemm.call.m,
                           s.gemm.call.n, s.gemm.call.k, cuda::epilogue_name(s.gemm.call.epilogue));
      else if (s.kind == exec::Step::Kind::kernel)
        out += fmt::format("    kernel {} rows={}\n", s.kernel->gen.kernel, s.kernel->rows);
      else  // its finalize and FP8 update steps
        out += fmt::format("    {} {}\n", exec::step_kind_name(s.kind), s.what);
    }
  }
  return out;
}

int count_comm(const std::vector<exec::Step>& steps, exec::Collective c) {
  int n = 0;
  for (const auto& s : steps) n += s.kind == exec::Step::Kind::comm && s.comm.op == c;
  return n;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("parallel MLP blocks and the post-attention half plan as their golden programs at world sizes 1-8",
          "[exec][parallel][golden]") {
  const std::string golden_path = JF_SOURCE_DIR "/tests/golden/programs/parallel.txt";
  std::string text;
  struct Case {
    const char* name;
    std::string seq;
  };
  std::vector<Case> cases;
  for (bool sp : {true, false}) {
    cases.push_back({sp ? "llama_mlp_block sp" : "llama_mlp_block", parallel_block("llama_mlp_block.json", sp)});
    cases.push_back({sp ? "gpt2_mlp_block sp" : "gpt2_mlp_block", parallel_block("gpt2_mlp_block.json", sp)});
  }
  cases.push_back({"tp_mlp", read(JF_SOURCE_DIR "/tools/examples/tp_mlp.json")});
  cases.push_back({"tp_attn_out", read(JF_SOURCE_DIR "/tools/examples/tp_attn_out.json")});
  for (const auto& c : cases)
    for (int world : {1, 2, 4, 8}) {
      const bool sp = c.seq.find("\"sequence_parallel\":true") != std::string::npos ||
                      c.seq.find("\"sequence_parallel\": true") != std::string::npos;
      // The sequence's input: this rank's shard of 4096 tokens with SP, all of them without; the
      // post-attention half takes this rank's heads (1024 / world columns).
      const int64_t rows = sp ? 4096 / world : 4096;
      const int64_t cols = std::string(c.name) == "tp_attn_out" ? 1024 / world : 1024;
      auto p = program_of(c.seq, "bf16", true, {rows, cols}, world, world - 1);
      text += fmt::format("===== {} bf16 training, world size {}, rank {}, input {}x{}\n", c.name, world, world - 1,
                          rows, cols);
      std::string groups;
      for (const auto& g : p->plan.forward)
        groups += " [" + fuser::group_ops(g, p->ops) + (g.rule.empty() ? "" : " = " + g.rule) + "]";
      text += "  groups:" + groups + "\n" + steps_text(*p);
    }
  if (env::flag("JITFUSE_UPDATE_GOLDEN")) {
    std::ofstream(golden_path, std::ios::binary) << text;
    WARN("golden programs rewritten: " << golden_path);
    return;
  }
  INFO(text);
  CHECK(read(golden_path) == text);
}

TEST_CASE("the collectives sit where Megatron puts them", "[exec][parallel]") {
  using exec::Collective;
  const std::string llama_sp = parallel_block("llama_mlp_block.json", true);
  const std::string llama = parallel_block("llama_mlp_block.json", false);
  for (int world : {2, 4, 8}) {
    // Column + SP: all-gather before the GEMM, reduce-scatter of its dgrad; row + SP: reduce-scatter after
    // the GEMM, all-gather of dy. The residual add and the norm run on the sequence shard. (Unfused: the
    // collectives themselves, not their pipelined chunks.)
    auto p = program_of(llama_sp, "bf16", true, {4096 / world, 1024}, world, 1, false);
    CHECK(count_comm(p->forward, Collective::all_gather) == 1);
    CHECK(count_comm(p->forward, Collective::reduce_scatter) == 1);
    CHECK(count_comm(p->backward, Collective::all_gather) == 1);
    CHECK(count_comm(p->backward, Collective::reduce_scatter) == 1);
    CHECK(count_comm(p->forward, Collective::all_reduce) + count_comm(p->backward, Collective::all_reduce) == 0);
    CHECK(p->buffer(p->output).rows == 4096 / world);
    for (const auto& op : p->ops)
      if (op.kind == "linear") CHECK(ops::rows_of(op.in) == 4096);  // the GEMMs see the whole sequence
    // No SP: the column linear's input is copied (its dgrad all-reduced), the row linear's output all-reduced.
    auto q = program_of(llama, "bf16", true, {4096, 1024}, world, 0, false);
    CHECK(count_comm(q->forward, Collective::all_reduce) == 1);
    CHECK(count_comm(q->backward, Collective::all_reduce) == 1);
    CHECK(count_comm(q->forward, Collective::all_gather) + count_comm(q->forward, Collective::reduce_scatter) == 0);
    // The identity halves cost nothing: the forward's copy to the tensor-parallel region is the same buffer.
    CHECK(q->forward.size() == p->forward.size() - 1);
    // The reduction runs before the residual add: the down projection no longer folds the add into its
    // GEMM (the residual would be added on every rank).
    for (const auto& s : q->forward) CHECK((s.kind != exec::Step::Kind::gemm || s.gemm.call.beta == 0.f));
    // Shards: gate_up [2 * 2816 / W, 1024], down [1024, 2816 / W].
    CHECK(q->ops[3].params[0].shape == ops::Shape{5632 / world, 1024});
    CHECK(q->ops[5].params[0].shape == ops::Shape{1024, 2816 / world});
  }
}

TEST_CASE("the tail after a reduction fuses into one kernel", "[exec][parallel]") {
  // all_reduce -> add -> fork -> rmsnorm (vLLM's fusion after a row-parallel linear, decode): one kernel reads
  // every rank's partial sums over NVLink and writes the new residual and the normalised output
  // (allreduce_fork_norm); NCCL's all-reduce and then the fork_norm kernel are the group's other way, which
  // prepare picks where the ranks cannot map each other's buffers (Step::peer_path).
  const std::string seq = R"({"format": "jitfuse.sequence/1", "name": "t", "input_channels": ["residual"], "ops": [
      {"op": "linear", "in_features": 1024, "out_features": 1024, "tensor_parallel": "row"},
      {"op": "add_extra_input", "channel": "residual"},
      {"op": "make_extra_output", "channel": "next", "returned": true},
      {"op": "rmsnorm"}]})";
  for (bool training : {false, true}) {
    auto p = program_of(seq, "bf16", training, {8, 512}, 2, 1);
    REQUIRE(p->forward.size() == 4);
    CHECK(p->forward[0].kind == exec::Step::Kind::gemm);
    CHECK(p->forward[0].peer_path == 0);
    REQUIRE(p->forward[1].kind == exec::Step::Kind::kernel);
    CHECK(p->forward[1].peer_path == 1);
    CHECK(p->forward[1].kernel->spec.peers == 2);
    CHECK(p->forward[1].kernel->gen.launch.max_grid == codegen::kPeerMaxBlocks);
    CHECK(p->forward[1].kernel->launch.vec.gx == 8);  // one block per row, at most kPeerMaxBlocks
    bool binds_peers = false;
    for (const auto& a : p->forward[1].kernel->args) binds_peers = binds_peers || a.kind == exec::KArg::Kind::peers;
    CHECK(binds_peers);
    CHECK(p->forward[2].kind == exec::Step::Kind::comm);
    CHECK(p->forward[2].comm.op == exec::Collective::all_reduce);
    CHECK(p->forward[2].peer_path == -1);
    REQUIRE(p->forward[3].kind == exec::Step::Kind::kernel);
    CHECK(p->forward[3].peer_path == -1);
    CHECK(p->forward[3].kernel->spec.peers == 0);
    CHECK(p->plan.forward.back().rule == "allreduce_fork_norm");
    CHECK(p->plan.forward.back().begin == 1);  // the all-reduce, add, fork and norm in one group
    CHECK(p->plan.forward.back().end == 5);
    // Both ways write the same outputs and saved context (the norm's input and statistics).
    const auto& a = p->forward[1].kernel->args;
    const auto& b = p->forward[3].kernel->args;
    CHECK(a.back().buffer == b.back().buffer);
    // The backward is the ops' own: no collective (the forward all-reduce's backward is the identity).
    if (training) CHECK(count_comm(p->backward, exec::Collective::all_reduce) == 0);
  }
  // More than the staging regions hold (128 blocks, 32 KiB each): NCCL's way alone, said in explain.
  CHECK(codegen::peer_rows_fit(128, 8192 * 4));
  CHECK(codegen::peer_rows_fit(256, 8192 * 2));
  CHECK_FALSE(codegen::peer_rows_fit(129, 8192 * 4));
  CHECK(codegen::peer_rows_fit(128, 8192 * 2, 100));        // a device of 100 SMs: 2 rows per block
  CHECK_FALSE(codegen::peer_rows_fit(128, 8192 * 4, 100));  // ... of 32 KiB each
  auto big = program_of(seq, "fp32", false, {2048, 512}, 2, 0);
  REQUIRE(big->forward.size() == 3);
  CHECK(big->forward[1].kind == exec::Step::Kind::comm);
  CHECK(big->forward[1].peer_path == 0);
  CHECK(big->forward[2].peer_path == 0);
  CHECK_THAT(big->forward[2].what, Catch::Contains("more than the one-shot all-reduce stages"));
  // At world size 1 the all-reduce is the identity: the norm kernel reads the linear's output.
  auto one = program_of(seq, "bf16", false, {8, 1024}, 1, 0);
  REQUIRE(one->forward.size() == 2);
  CHECK(one->forward[1].kind == exec::Step::Kind::kernel);
  CHECK(one->forward[1].kernel->spec.peers == 0);
  // reduce_scatter -> bias -> dropout -> add: one kernel after the collective.
  // With the GEMM and its reduce-scatter pipelined, the tail is still one kernel after them.
  auto q = program_of(read(JF_SOURCE_DIR "/tools/examples/tp_attn_out.json"), "bf16", true, {4096 / 2, 1024 / 2}, 2, 1);
  REQUIRE(q->plan.forward.size() >= 2);
  CHECK(q->plan.forward[0].rule == "linear_reduce_scatter_overlap");
  CHECK(q->plan.forward[1].rule == "bias_dropout_add_joint");
  size_t tail = 0;
  while (tail < q->forward.size() && q->forward[tail].group == 0) ++tail;
  REQUIRE(tail < q->forward.size());
  CHECK(q->forward[tail - 1].kind == exec::Step::Kind::comm);
  CHECK(q->forward[tail].kind == exec::Step::Kind::kernel);
  CHECK(q->forward[tail].group == 1);
}

TEST_CASE("a GEMM and its collective are pipelined in row chunks on two streams", "[exec][parallel]") {
  using exec::Collective;
  const std::string llama_sp = parallel_block("llama_mlp_block.json", true);
  // "local" (JITFUSE_OVERLAP=local; the NCCL way beside copy's): one all-gather / reduce-scatter each, beside the
  // GEMMs that do not need it.
  for (int world : {2, 4, 8}) {
    for (int rank : {0, 1, world - 1}) {
      INFO("world size " << world << ", rank " << rank);
      test::ScopedEnv local("JITFUSE_OVERLAP", "local");
      const int64_t shard = 4096 / world;
      auto p = program_of(llama_sp, "bf16", true, {shard, 1024}, world, rank);
      CHECK(count_comm(p->forward, Collective::broadcast) + count_comm(p->forward, Collective::reduce) == 0);
      CHECK(count_comm(p->backward, Collective::broadcast) + count_comm(p->backward, Collective::reduce) == 0);
      CHECK(count_comm(p->forward, Collective::all_gather) == 1);
      CHECK(count_comm(p->forward, Collective::reduce_scatter) == 1);
      CHECK(count_comm(p->backward, Collective::all_gather) == 1);
      CHECK(count_comm(p->backward, Collective::reduce_scatter) == 1);
      // Forward: the all-gather on the side stream, then this rank's rows' GEMM, waiting for nothing (issued after
      // it: the side stream forks from the caller's where the collective is issued);
      // the other rows' GEMMs (one at the first and last rank, two between) wait for it and cover the rest.
      int gather = -1, waiting = 0;
      int64_t rows_after = 0;
      bool own_first = false;
      for (size_t i = 0; i < p->forward.size(); ++i) {
        const auto& s = p->forward[i];
        if (s.kind == exec::Step::Kind::comm && s.comm.op == Collective::all_gather) {
          CHECK(s.stream == 1);
          gather = static_cast<int>(i);
          REQUIRE(i + 1 < p->forward.size());
          const auto& own = p->forward[i + 1];  // issued after the collective: the side stream forks first
          own_first = own.kind == exec::Step::Kind::gemm && own.waits.empty() && own.gemm.call.m == shard &&
                      own.gemm.d_offset == rank * shard * (5632 / world);  // gate_up: 5632 / W columns
        }
        if (s.kind == exec::Step::Kind::gemm && !s.waits.empty()) {
          CHECK(s.waits == std::vector<int>{gather});
          CHECK(s.stream == 0);
          ++waiting;
          rows_after += s.gemm.call.m;
        }
        if (s.kind == exec::Step::Kind::comm && s.comm.op == Collective::reduce_scatter) CHECK(s.stream == 0);
      }
      CHECK(own_first);
      CHECK(waiting == (rank == 0 || rank == world - 1 ? 1 : 2));
      CHECK(rows_after == 4096 - shard);
      // Backward: the reduce-scatter of dx on the side stream right after the dgrad, the wgrad after it on the
      // caller's stream (beside it); the all-gather of dy beside this rank's rows' dgrad.
      bool rs_beside_wgrad = false, ag_beside_dgrad = false;
      for (size_t i = 0; i + 1 < p->backward.size(); ++i) {
        const auto& s = p->backward[i];
        if (s.kind != exec::Step::Kind::comm) continue;
        CHECK(s.stream == 1);
        const auto& next = p->backward[i + 1];
        if (s.comm.op == Collective::reduce_scatter)
          rs_beside_wgrad = s.waits.size() == 1 && p->backward[static_cast<size_t>(s.waits[0])].kind ==
                            exec::Step::Kind::gemm && next.kind == exec::Step::Kind::gemm &&
                            next.gemm.call.kind == cuda::GemmKind::wgrad && next.waits.empty();
        if (s.comm.op == Collective::all_gather)
          ag_beside_dgrad = s.waits.empty() && next.kind == exec::Step::Kind::gemm &&
                            next.gemm.call.m == shard && next.waits.empty() && i + 2 < p->backward.size() &&
                            p->backward[i + 2].gemm.call.kind == cuda::GemmKind::wgrad &&
                            p->backward[i + 2].gemm.call.m == shard;  // the own rows' wgrad beside it too
      }
      CHECK(rs_beside_wgrad);
      CHECK(ag_beside_dgrad);
      CHECK(exec::program_text(*p, 3350).find("no transfer") != std::string::npos);
    }
  }
  // Tensor parallelism without SP: the all-reduce of the column-parallel linear's dx beside its wgrad
  // (all_reduce_linear_overlap); not where a bias follows the linear (GPT-2: its GEMMs keep their epilogues).
  for (int world : {1, 4}) {
    INFO("TP, world size " << world);
    auto p = program_of(parallel_block("llama_mlp_block.json", false), "bf16", true, {4096, 1024}, world, 0);
    bool beside = false;
    for (size_t i = 0; i + 1 < p->backward.size(); ++i) {
      const auto& s = p->backward[i];
      if (s.kind != exec::Step::Kind::comm || s.comm.op != Collective::all_reduce || s.stream != 1) continue;
      const auto& next = p->backward[i + 1];
      beside = s.waits.size() == 1 && p->backward[static_cast<size_t>(s.waits[0])].gemm.call.kind == cuda::GemmKind::dgrad &&
               next.kind == exec::Step::Kind::gemm && next.gemm.call.kind == cuda::GemmKind::wgrad && next.waits.empty();
    }
    CHECK(beside);
    CHECK(p->plan.forward[1].rule == "all_reduce_linear_overlap");
    auto q = program_of(parallel_block("gpt2_mlp_block.json", false), "bf16", true, {4096, 1024}, world, 0);
    bool said = false;
    for (const auto& d : q->plan.decisions)
      said = said || (d.rule == "all_reduce_linear_overlap" && d.reason.find("bias folds") != std::string::npos);
    CHECK(said);
    for (const auto& st : q->backward) CHECK(st.stream == 0);
  }
  // JITFUSE_OVERLAP picks either way at any world size; another value warns and takes auto.
  {
    test::ScopedEnv env("JITFUSE_OVERLAP", "chunks");
    auto p = program_of(llama_sp, "bf16", true, {1024, 1024}, 4, 1);
    CHECK(count_comm(p->forward, Collective::broadcast) == 4);
  }
  {
    test::ScopedEnv env("JITFUSE_OVERLAP", "local,chunks");  // the all-gather window local, the reduce-scatter's chunked
    auto p = program_of(llama_sp, "bf16", true, {1024, 1024}, 4, 1);
    CHECK(count_comm(p->forward, Collective::all_gather) == 1);
    CHECK(count_comm(p->forward, Collective::reduce) == 4);
    CHECK(count_comm(p->backward, Collective::broadcast) == 4);
    CHECK(count_comm(p->backward, Collective::reduce_scatter) == 1);
  }
  for (const char* v : {"local", "nonsense\n", "local,nonsense"}) {
    test::ScopedEnv env("JITFUSE_OVERLAP", v);
    auto p = program_of(llama_sp, "bf16", true, {1024, 1024}, 4, 1);
    CHECK(count_comm(p->forward, Collective::broadcast) == 0);
    CHECK(count_comm(p->forward, Collective::all_gather) == 1);
  }
  {
    test::ScopedEnv env("JITFUSE_OVERLAP", nullptr);  // the default from 2 ranks: copy, with local's NCCL way beside
    auto p = program_of(llama_sp, "bf16", true, {2048, 1024}, 2, 0);
    CHECK(count_comm(p->forward, Collective::broadcast) == 0);
    CHECK(count_comm(p->backward, Collective::reduce_scatter) == 1);
    CHECK(count_comm(p->forward, Collective::peer_push) == 2);
  }
  for (int world : {1, 2}) {
    INFO("world size " << world);
    test::ScopedEnv env("JITFUSE_OVERLAP", world == 1 ? "auto" : "chunks");  // the default at one rank
    auto p = program_of(llama_sp, "bf16", true, {4096 / world, 1024}, world, world - 1);
    const int chunks = std::max(world, 4);
    // all_gather + gate_up: one broadcast per chunk (rank r's rows), each chunk's GEMM after its broadcast.
    CHECK(count_comm(p->forward, Collective::broadcast) == chunks);
    CHECK(count_comm(p->forward, Collective::reduce) == chunks);  // down + reduce_scatter
    CHECK(count_comm(p->forward, Collective::all_gather) + count_comm(p->forward, Collective::reduce_scatter) == 0);
    CHECK(count_comm(p->backward, Collective::broadcast) == chunks);
    CHECK(count_comm(p->backward, Collective::reduce) == chunks);
    int64_t gathered_rows = 0;
    for (size_t i = 0; i < p->forward.size(); ++i) {
      const auto& s = p->forward[i];
      if (s.kind == exec::Step::Kind::comm) {
        CHECK(s.stream == 1);
        if (s.comm.op == Collective::broadcast) {
          CHECK(s.comm.root == static_cast<int>(gathered_rows / (4096 / world)));  // the owner of the rows
          CHECK(s.comm.recv_offset == gathered_rows * 1024);
          gathered_rows += s.comm.count / 1024;
        }
      }
      if (s.kind == exec::Step::Kind::gemm && !s.waits.empty()) {
        REQUIRE(s.waits.size() == 1);
        CHECK(p->forward[static_cast<size_t>(s.waits[0])].kind == exec::Step::Kind::comm);  // its chunk's transfer
        CHECK(s.stream == 0);
      }
    }
    CHECK(gathered_rows == 4096);  // every row gathered once
    CHECK(exec::program_text(*p, 3350).find("on the side stream") != std::string::npos);
  }
  // FP8 GEMMs are not chunked (each chunk would need its own scaled operands): the plain collectives run.
  auto q = program_of(llama_sp, "fp8_delayed", true, {1024, 1024}, 4, 0);
  CHECK(count_comm(q->forward, Collective::all_gather) == 1);
  // Rows that do not split: one chunk per rank at world size 2 (2 chunks), none at world size 1.
  auto odd = program_of(llama_sp, "bf16", true, {33, 1024}, 1, 0);
  CHECK(count_comm(odd->forward, Collective::all_gather) == 1);
}

TEST_CASE("from 2 ranks the SP collectives run by copy engines, NCCL's way beside them", "[exec][parallel]") {
  using exec::Collective;
  const std::string llama_sp = parallel_block("llama_mlp_block.json", true);
  for (int world : {2, 4, 8}) {
    for (int rank : {0, 1, world - 1}) {
      INFO("world size " << world << ", rank " << rank);
      const int64_t shard = 4096 / world;
      auto p = program_of(llama_sp, "bf16", true, {shard, 1024}, world, rank);
      for (const auto* dir : {&p->forward, &p->backward}) {
        const bool fwd = dir == &p->forward;
        INFO((fwd ? "forward" : "backward"));
        int push = 0, take_peer = 0, take_own = 0, wait = 0, ack = 0, sums = 0, nccl = 0;
        int64_t gathered_rows = 0;
        for (size_t i = 0; i < dir->size(); ++i) {
          const auto& s = (*dir)[i];
          const bool comm = s.kind == exec::Step::Kind::comm;
          const bool peer_op = comm && (s.comm.op == Collective::peer_push || s.comm.op == Collective::peer_take ||
                                        s.comm.op == Collective::peer_wait || s.comm.op == Collective::peer_ack);
          if (peer_op) CHECK(s.peer_path == 1);  // the copy way's only
          if (comm && !peer_op) {
            CHECK(s.peer_path == -1);  // NCCL's collectives run on its way only
            ++nccl;
          }
          if (s.kind == exec::Step::Kind::kernel && s.kernel->gen.kernel.find("peer_sum") != std::string::npos) {
            CHECK(s.peer_path == 1);
            CHECK(s.kernel->rows == shard);
            ++sums;
          }
          if (!comm) continue;
          switch (s.comm.op) {
            case Collective::peer_push:
              ++push;
              CHECK(s.stream == 1);  // the copy engine's work beside the caller's GEMMs
              CHECK(s.comm.root != rank);
              CHECK(s.comm.count == shard * 1024);
              break;
            case Collective::peer_take:
              CHECK(s.stream == 1);
              if (s.comm.root == rank) {
                ++take_own;
                break;
              }
              ++take_peer;
              // The GEMM over those rows waits for this take, and reads them where it put them.
              for (size_t k = i + 1; k < dir->size(); ++k) {
                const auto& g = (*dir)[k];
                if (g.kind != exec::Step::Kind::gemm || g.waits != std::vector<int>{static_cast<int>(i)}) continue;
                CHECK(g.gemm.a == s.comm.recv);
                CHECK(g.gemm.a_offset == s.comm.recv_offset);
                CHECK(g.gemm.call.m == shard);
                gathered_rows += g.gemm.call.m;
                break;
              }
              break;
            case Collective::peer_wait: ++wait; CHECK(s.stream == 0); break;
            case Collective::peer_ack: ++ack; CHECK(s.stream == 0); break;
            default: break;
          }
        }
        // Each direction: one all-gather ((W - 1) pushes of this rank's shard, W - 1 takes) and one reduce-scatter
        // ((W - 1) pushes of the other ranks' blocks, one wait, the sum, one ack); the forward keeps its gathered
        // input (this rank's rows copied in too); NCCL's way: one all-gather and one reduce-scatter.
        // Every buffer a side-stream step touches is live from the group's fork (its first side-stream step) to
        // its end, so no step of the group in between (a GEMM's workspace) is packed over it.
        std::map<int, int> fork;  // group -> its first side-stream step
        for (size_t i = 0; i < dir->size(); ++i)
          if ((*dir)[i].stream == 1 && !fork.count((*dir)[i].group)) fork[(*dir)[i].group] = static_cast<int>(i);
        for (size_t i = 0; i < dir->size(); ++i) {
          const auto& s = (*dir)[i];
          if (s.stream != 1 || s.kind != exec::Step::Kind::comm) continue;
          for (int id : {s.comm.send, s.comm.recv})
            if (id >= 0 && p->buffer(id).storage != exec::Storage::caller) {
              INFO("buffer " << p->buffer(id).name);
              CHECK(p->buffer(id).first <= fork[s.group]);
            }
        }
        CHECK(push == 2 * (world - 1));
        CHECK(take_peer == world - 1);
        CHECK(take_own == (fwd ? 1 : 0));
        CHECK(gathered_rows == (world - 1) * shard);
        CHECK(wait == 1);
        CHECK(ack == 1);
        CHECK(sums == 1);
        CHECK(nccl == 2);
      }
    }
  }
  // At one rank, no copy way.
  auto one = program_of(llama_sp, "bf16", true, {4096, 1024}, 1, 0);
  CHECK(count_comm(one->forward, Collective::peer_push) == 0);
}

TEST_CASE("under per-tensor FP8 the SP windows cast once and reduce-scatter FP8 row blocks by copy engines",
          "[exec][parallel][fp8]") {
  using exec::Collective;
  const std::string llama_sp = parallel_block("llama_mlp_block.json", true);
  for (const char* recipe : {"fp8_current", "fp8_delayed"})
    for (int world : {2, 4}) {
      const int rank = world - 1;
      INFO(recipe << ", world size " << world << ", rank " << rank);
      const int64_t shard = 4096 / world;
      auto p = program_of(llama_sp, recipe, true, {shard, 1024}, world, rank);
      std::set<std::string> taken;
      for (const auto& d : p->plan.decisions)
        if (d.taken) taken.insert(d.rule);
      CHECK(taken.count("all_gather_linear_overlap") == 1);
      // The SwiGLU before the row-parallel linear joins its window: its forward runs in the linear's input cast.
      CHECK(taken.count("gated_linear_reduce_scatter_overlap") == 1);
      CHECK(taken.count("linear_reduce_scatter_overlap") == 0);
      int gated_fwd = 0, gated_bwd = 0;
      for (const auto* dir : {&p->forward, &p->backward})
        for (const auto& s : *dir)
          if (s.kind == exec::Step::Kind::kernel && s.kernel->spec.skeleton == codegen::Skeleton::gated)
            (dir == &p->forward ? gated_fwd : gated_bwd) += 1;
      CHECK(gated_fwd == (std::string(recipe) == "fp8_current" ? 2 : 1));  // the codes (current: after an amax pass)
      CHECK(gated_bwd == 1);
      for (const auto& s : p->forward)
        if (s.kind == exec::Step::Kind::kernel && s.kernel->spec.skeleton == codegen::Skeleton::gated)
          CHECK(s.kernel->spec.fp8.has_value());  // no bf16 SwiGLU output
      for (const auto* dir : {&p->forward, &p->backward}) {
        const bool fwd = dir == &p->forward;
        INFO((fwd ? "forward" : "backward"));
        std::set<int64_t> block_offsets;  // the row-block GEMMs' A offsets (codes of the one cast)
        int pushes = 0, nccl = 0, gathers = 0;
        for (const auto& s : *dir) {
          if (s.kind == exec::Step::Kind::gemm) {
            CHECK(s.gemm.call.fp8.has_value());  // every GEMM of the block on FP8 operands
            if (s.peer_path == 1 && s.what.find("wgrad") == std::string::npos) {  // the wgrad runs beside
              CHECK(s.gemm.call.m == shard);
              block_offsets.insert(s.gemm.a_offset);
            }
          }
          // The casts run before both ways: each way reads the same codes and scale.
          if (s.kind == exec::Step::Kind::kernel && s.kernel->spec.fp8) CHECK(s.peer_path == 0);
          if (s.kind == exec::Step::Kind::comm && s.comm.op == Collective::peer_push) ++pushes;
          if (s.kind == exec::Step::Kind::comm && s.peer_path == -1) ++nccl;
          // The all-gather half (nothing beside it: the operand is cast once it is whole) is NCCL's, both ways.
          if (s.kind == exec::Step::Kind::comm && s.comm.op == Collective::all_gather) {
            CHECK(s.peer_path == 0);
            ++gathers;
          }
        }
        CHECK(pushes == world - 1);  // every other rank's block of the reduce-scatter half
        CHECK(nccl == 1);            // NCCL's reduce-scatter on the other way
        CHECK(gathers == 1);
        // The reduce-scatter half: one FP8 GEMM per rank's rows, A at that rank's rows of the codes (forward: the
        // down projection's input; backward: the gate/up projection's output gradient).
        const auto& lin = p->ops[fwd ? 5 : 3];
        const int64_t a_cols = fwd ? ops::cols_of(lin.in) : ops::cols_of(lin.out);
        std::set<int64_t> want;
        for (int r = 0; r < world; ++r) want.insert(r * shard * a_cols);
        CHECK(block_offsets == want);
      }
    }
  // fp8_block keeps the plain collectives (block scales are not row offsets), and so does the chunked mode.
  auto blk = program_of(llama_sp, "fp8_block", true, {1024, 1024}, 2, 0);
  CHECK(count_comm(blk->forward, Collective::peer_push) == 0);
  test::ScopedEnv env("JITFUSE_OVERLAP", "chunks");
  auto chunked = program_of(llama_sp, "fp8_current", true, {1024, 1024}, 2, 0);
  CHECK(count_comm(chunked->forward, Collective::broadcast) == 0);
  CHECK(count_comm(chunked->forward, Collective::all_gather) == 1);
}

TEST_CASE("a user rule running [gated, linear, reduce_scatter] outside FP8 is refused with the fix",
          "[exec][parallel][fp8][errors]") {
  rules::RuleSet rs = rules::RuleSet::with_builtins();
  REQUIRE(rs.load_text(R"({"format": "jitfuse.rules/1", "rules": [
    {"name": "u_gated_rs", "math": "user", "pass": "joint", "priority": 90,
     "pattern": ["@gated", "linear", "reduce_scatter"], "conditions": {"recipes": ["bf16"]},
     "impl": {"kind": "joint", "strategy": "overlap_collective", "saves": ["input of linear"]}}]})",
                       "user.json", "").empty());
  const std::string text = R"({"format": "jitfuse.sequence/1", "name": "u", "ops": [{"op": "swiglu"},
    {"op": "linear", "in_features": 256, "out_features": 128, "tensor_parallel": "row", "sequence_parallel": true}]})";
  auto def = ops::parse_sequence(text, "<user>", rs.registry());
  auto recipe = ops::parse_recipe("bf16");
  ops::apply_recipe(def, recipe);
  exec::CompileOptions o;
  o.arch = 90;
  o.training = true;
  ops::Parallel par;
  par.world_size = 2;
  const std::string why = error_of([&] { exec::compile(ops::infer(def, {64, 256}, par), "u", recipe, o, rs); });
  CHECK_THAT(why, Catch::Contains("rule 'u_gated_rs'") && Catch::Contains("under the FP8 recipes only") &&
                      Catch::Contains("fp8_current"));
}

TEST_CASE("comm steps report their bytes over the links", "[exec][parallel]") {
  auto p = program_of(read(JF_SOURCE_DIR "/tools/examples/tp_mlp.json"), "bf16", true, {1024, 1024}, 4, 3, false);
  json j = exec::program_json(*p, 3350);
  CHECK(j["parallel"]["world_size"] == 4);
  CHECK(j["parallel"]["rank"] == 3);
  bool saw = false;
  for (const auto& s : j["forward"])
    if (s["kind"] == "comm" && s["collective"] == "all_gather") {
      saw = true;
      // Each rank sends its 1024x1024 bf16 shard to the 3 others.
      CHECK(s["wire_bytes"].get<int64_t>() == int64_t{1024} * 1024 * 2 * 3);
      CHECK(s["bytes_written"].get<int64_t>() == int64_t{4096} * 1024 * 2);
      CHECK(s["link_us"].get<double>() > 0);
    }
  CHECK(saw);
  CHECK(exec::program_text(*p, 3350).find("rank 3 of 4") != std::string::npos);
  // One rank: NCCL copies locally, nothing crosses a link.
  auto one = program_of(read(JF_SOURCE_DIR "/tools/examples/tp_mlp.json"), "bf16", true, {1024, 1024}, 1);
  const json one_json = exec::program_json(*one, 3350);  // kept: a range over a temporary's member dangles
  for (const auto& s : one_json["forward"])
    if (s["kind"] == "comm") CHECK(s["wire_bytes"] == 0);
}

TEST_CASE("comm ops and parallel linears name what is wrong", "[exec][parallel][errors]") {
  auto parse = [](const std::string& ops) {
    return ops::parse_sequence(R"({"format": "jitfuse.sequence/1", "name": "t", "ops": )" + ops + "}", "<t>",
                               builtins().registry());
  };
  // Mixed groups in one sequence.
  std::string e = error_of([&] {
    parse(R"([{"op": "all_gather", "group": "tp"}, {"op": "linear", "in_features": 8, "out_features": 8,
              "tensor_parallel": "row", "group": "tp2"}])");
  });
  CHECK_THAT(e, Catch::Contains("group 'tp2', but an earlier op of this sequence uses group 'tp'"));
  CHECK_THAT(e, Catch::Contains("<t>:1:92: op 1 (linear)"));
  // A group name that is no name.
  e = error_of([&] { parse(R"([{"op": "all_reduce", "group": "a b"}])"); });
  CHECK_THAT(e, Catch::Contains("group 'a b'"));
  // sequence_parallel alone.
  e = error_of([&] { parse(R"([{"op": "linear", "in_features": 8, "out_features": 8, "sequence_parallel": true}])"); });
  CHECK_THAT(e, Catch::Contains("needs \"tensor_parallel\""));
  e = error_of([&] { parse(R"([{"op": "linear", "in_features": 8, "out_features": 8, "tensor_parallel": "rows"}])"); });
  CHECK_THAT(e, Catch::Contains("none|column|row"));
  e = error_of([&] { parse(R"([{"op": "all_reduce", "direction": "sideways"}])"); });
  CHECK_THAT(e, Catch::Contains("forward|backward"));
  // Shards that do not divide.
  auto col = parse(R"([{"op": "linear", "in_features": 64, "out_features": 100, "tensor_parallel": "column"}])");
  e = error_of([&] { ops::infer(col, {16, 64}, {8, 0}); });
  CHECK_THAT(e, Catch::Contains("op 1 (linear)"));
  CHECK_THAT(e, Catch::Contains("out_features = 100 is not divisible by the world size 8"));
  auto row = parse(R"([{"op": "linear", "in_features": 64, "out_features": 64, "tensor_parallel": "row"}])");
  e = error_of([&] { ops::infer(row, {16, 64}, {4, 0}); });
  CHECK_THAT(e, Catch::Contains("input columns, the input's last dim is 64"));
  auto rs = parse(R"([{"op": "reduce_scatter"}])");
  e = error_of([&] { ops::infer(rs, {6, 64}, {4, 1}); });
  CHECK_THAT(e, Catch::Contains("op 0 (reduce_scatter)"));
  CHECK_THAT(e, Catch::Contains("dim 0 (6) is not divisible by the world size 4"));
  e = error_of([&] { ops::infer(rs, {8, 64}, {4, 4}); });
  CHECK_THAT(e, Catch::Contains("rank 4 of world size 4"));
  e = error_of([&] { ops::infer(rs, {8, 64}, {0, 0}); });
  CHECK_THAT(e, Catch::Contains("world size 0"));
  // A collective has no float64 reference on more than one rank; one rank's is the identity.
  CHECK(ops::infer(rs, {8, 64}, {1, 0}).at(0).out == ops::Shape{8, 64});
}

TEST_CASE("the C ABI plans a rank without a GPU and refuses to run without a communicator", "[exec][parallel][abi]") {
  jf_context ctx = nullptr;
  REQUIRE(jf_context_create(&ctx) == JF_OK);
  const std::string text = read(JF_SOURCE_DIR "/tools/examples/tp_mlp.json");
  jf_sequence seq = nullptr;
  REQUIRE(jf_sequence_create(ctx, text.c_str(), "bf16", &seq) == JF_OK);
  const int64_t shape[2] = {512, 1024};
  const char* out = nullptr;
  REQUIRE(jf_sequence_explain_parallel(seq, shape, 2, 1, 90, 4, 2, &out) == JF_OK);
  json j = json::parse(out);
  CHECK(j["program"]["parallel"]["world_size"] == 4);
  CHECK(j["program"]["parallel"]["rank"] == 2);
  CHECK(jf_sequence_explain_parallel(seq, shape, 2, 1, 90, 4, 4, &out) == JF_ERR_INVALID_ARGUMENT);
  CHECK(std::string(jf_last_error()).find("rank 4 of world size 4") != std::string::npos);
  CHECK(jf_sequence_explain_parallel(seq, shape, 2, 1, 90, -1, 0, &out) == JF_ERR_INVALID_ARGUMENT);
  // No communicator: the prepare names the group and what to do, before touching a GPU.
  CHECK(jf_sequence_prepare(seq, shape, 2, 1, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(std::string(jf_last_error()).find("group 'tp' but has no communicator") != std::string::npos);
  CHECK(jf_sequence_set_comm(seq, "tp", nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(jf_comm_create(nullptr, 128, 1, 0, nullptr) == JF_ERR_INVALID_ARGUMENT);
  uint8_t id[128] = {};
  jf_comm c = nullptr;
  CHECK(jf_comm_create(id, 64, 1, 0, &c) == JF_ERR_INVALID_ARGUMENT);
  CHECK(jf_comm_create(id, 128, 2, 2, &c) == JF_ERR_INVALID_ARGUMENT);
  CHECK(c == nullptr);
  CHECK(jf_comm_wrap(nullptr, &c) == JF_ERR_INVALID_ARGUMENT);
  CHECK(jf_comm_info(nullptr, nullptr, nullptr, nullptr) == JF_ERR_INVALID_ARGUMENT);
  CHECK(jf_comm_destroy(nullptr) == JF_OK);
  jf_sequence_destroy(seq);
  jf_context_destroy(ctx);
}

// Expert parallelism (docs/parallel.md#expert-parallelism): moe_dispatch / moe_combine around the dropless
// expert block, planned for a rank of 2 and 4: one all_to_all step each way per pass (the dispatch's forward
// all-gathers the counts first and makes its routing, which the backward reads saved), the grouped linears over
// this rank's E / W experts reading the dispatch's routing, the received rows bounded by max_rows.
namespace {
std::string ep_block(int experts, const std::string& dispatch_attrs = "", const std::string& permute_attrs = "",
                     int world = 2) {
  return fmt::format(R"({{"format": "jitfuse.sequence/1", "name": "ep", "ops": [
    {{"op": "make_extra_output", "channel": "res"}}, {{"op": "rmsnorm"}},
    {{"op": "moe_permute", "num_experts": {0}, "top_k": 2{2}}}, {{"op": "moe_dispatch"{1}}},
    {{"op": "grouped_linear", "num_groups": {3}, "in_features": 64, "out_features": 192}}, {{"op": "swiglu"}},
    {{"op": "grouped_linear", "num_groups": {3}, "in_features": 96, "out_features": 64}},
    {{"op": "moe_combine"}}, {{"op": "moe_unpermute"}}, {{"op": "add_extra_input", "channel": "res"}}]}})",
                     experts, dispatch_attrs, permute_attrs, experts / world);
}
}  // namespace

TEST_CASE("the expert-parallel block plans one all_to_all each way and this rank's experts", "[exec][parallel][moe]") {
  using exec::Collective;
  for (bool training : {true, false}) {
    auto p = program_of(ep_block(16), "bf16", training, {100, 64}, 2, 1);
    CHECK(p->group == "ep");
    CHECK(count_comm(p->forward, Collective::all_to_all) == 2);
    const exec::CommStep* dispatch = nullptr;
    for (const auto& s : p->forward)
      if (s.kind == exec::Step::Kind::comm && !dispatch) dispatch = &s.comm;
    REQUIRE(dispatch);
    CHECK(dispatch->a2a.to_experts);
    CHECK(dispatch->a2a.route >= 0);  // the forward all-gathers the permute's counts
    CHECK(dispatch->a2a.experts == 16);
    CHECK(dispatch->a2a.token_rows == 200);
    CHECK(dispatch->a2a.expert_rows == 400);  // W x T k
    CHECK(p->buffer(dispatch->a2a.counts).bytes == (2 * (16 + 2) + 2 * 8 + 1) * 4u);  // counts and bounds, routing
    CHECK(p->ops[3].out == ops::Shape{400, 64});
    CHECK(p->ops[7].out == ops::Shape{200, 64});
    int routed = 0;
    for (const auto* steps : {&p->forward, &p->backward})
      for (const auto& s : *steps)
        if (s.kind == exec::Step::Kind::gemm && s.gemm.routed()) {
          ++routed;
          CHECK(s.gemm.route_experts == 8);
          CHECK(s.gemm.route_splits == 36);  // after every rank's counts and bounds
          CHECK(s.gemm.call.m == 400);
        }
    CHECK(routed == (training ? 6 : 2));
    // The kernels over the received rows (the swiglu, forward and backward) run over this call's rows.
    int per_call = 0;
    for (const auto* steps : {&p->forward, &p->backward})
      for (const auto& s : *steps)
        if (s.kind == exec::Step::Kind::kernel && s.kernel->rows_route >= 0) {
          ++per_call;
          CHECK(s.kernel->rows_route == dispatch->a2a.counts);
          CHECK(s.kernel->rows_route_total == 16);  // after this rank's 8 experts' splits and 8 starts
          CHECK(s.kernel->rows == 400);
        }
    CHECK(per_call >= (training ? 2 : 1));
    if (!training) continue;
    CHECK(count_comm(p->backward, Collective::all_to_all) == 2);
    for (const auto& s : p->backward)
      if (s.kind == exec::Step::Kind::comm) {
        CHECK(s.comm.a2a.route == -1);  // the saved counts: no second all-gather
        CHECK(s.comm.a2a.counts == dispatch->a2a.counts);
      }
    // The first backward exchange is the combine's: it sends the gradients to the experts.
    for (const auto& s : p->backward)
      if (s.kind == exec::Step::Kind::comm) {
        CHECK(s.comm.a2a.to_experts);
        break;
      }
  }
  // After a padded permute: capacity rows per (rank, expert), fixed: no counts, nothing read on the host (a CUDA
  // graph captures it), the grouped linears one strided-batched GEMM over this rank's experts (W C rows each).
  {
    auto pd = program_of(ep_block(16, "", R"(, "layout": "padded", "capacity": 24)"), "bf16", true, {100, 64}, 2, 0);
    CHECK(pd->ops[3].out == ops::Shape{16 * 24, 64});
    for (const auto* steps : {&pd->forward, &pd->backward})
      for (const auto& s : *steps) {
        if (s.kind == exec::Step::Kind::comm) {
          CHECK(s.comm.op == Collective::all_to_all);
          CHECK(s.comm.a2a.counts == -1);
          CHECK(s.comm.a2a.route == -1);
        }
        if (s.kind == exec::Step::Kind::gemm) {
          CHECK_FALSE(s.gemm.routed());
          CHECK(s.gemm.call.batch == 8);
          CHECK(s.gemm.call.m == 2 * 24);
        }
        if (s.kind == exec::Step::Kind::kernel) CHECK(s.kernel->rows_route == -1);
      }
  }
  // max_rows bounds the received rows (and the expert GEMMs' m).
  auto q = program_of(ep_block(8, R"(, "max_rows": 300)", "", 4), "bf16", true, {100, 64}, 4, 3);
  CHECK(q->ops[3].out == ops::Shape{300, 64});
  CHECK(q->ops[4].route_experts == 2);
  // explain names the exchange.
  const std::string text = fuser::op_wiring(q->ops[3], q->ops);
  CHECK_THAT(text, Catch::Contains("sends the rows of 8 experts to the ranks owning them (2 each"));
  CHECK_THAT(text, Catch::Contains("at most 300 rows received"));
}

TEST_CASE("expert-parallel sequences that cannot run are refused with the op and the fix", "[exec][parallel][moe]") {
  auto infer = [](const std::string& text, int world) {
    auto def = ops::parse_sequence(text, "<t>", builtins().registry());
    return ops::infer(def, {100, 64}, {world, 0});
  };
  std::string e = error_of([&] { infer(ep_block(6), 4); });
  CHECK_THAT(e, Catch::Contains("op 3 (moe_dispatch): num_experts = 6 of op 2 (moe_permute) is not a multiple of the world size 4"));
  e = error_of([&] { infer(ep_block(8, R"(, "max_rows": 100)", R"(, "layout": "padded", "capacity": 40)"), 2); });
  CHECK_THAT(e, Catch::Contains("receive exactly num_experts x capacity = 320 rows: leave \"max_rows\" -1"));
  e = error_of([&] { infer(ep_block(8, R"(, "max_rows": 0)"), 2); });
  CHECK_THAT(e, Catch::Contains("max_rows = 0"));
  // Groups of the grouped linear: this rank's experts.
  e = error_of([&] {
    std::string t = ep_block(8);
    t.replace(t.find("\"num_groups\": 4"), 15, "\"num_groups\": 8");
    infer(t, 2);
  });
  CHECK_THAT(e, Catch::Contains("num_groups = 8 but op 3 (moe_dispatch) routes to 4 experts (this rank's"));
  auto seq = [](const std::string& ops) { return R"({"format": "jitfuse.sequence/1", "name": "t", "ops": )" + ops + "}"; };
  e = error_of([&] { infer(seq(R"([{"op": "moe_dispatch"}])"), 2); });
  CHECK_THAT(e, Catch::Contains("op 0 (moe_dispatch): no moe_permute before it"));
  e = error_of([&] { infer(seq(R"([{"op": "moe_permute", "num_experts": 4, "top_k": 1}, {"op": "moe_combine"}])"), 2); });
  CHECK_THAT(e, Catch::Contains("op 1 (moe_combine): no moe_dispatch before it"));
  e = error_of([&] {
    infer(seq(R"([{"op": "moe_permute", "num_experts": 4, "top_k": 1}, {"op": "moe_dispatch"}, {"op": "moe_unpermute"}])"), 2);
  });
  CHECK_THAT(e, Catch::Contains("op 2 (moe_unpermute): op 1 (moe_dispatch) before it sends the rows"));
  CHECK_THAT(e, Catch::Contains("put a moe_combine"));
  e = error_of([&] {
    infer(seq(R"([{"op": "moe_permute", "num_experts": 4, "top_k": 1}, {"op": "moe_dispatch"}, {"op": "moe_combine"},
                  {"op": "moe_combine"}])"), 2);
  });
  CHECK_THAT(e, Catch::Contains("op 3 (moe_combine): no moe_dispatch before it"));
  // A combine of the wrong rows.
  e = error_of([&] {
    infer(seq(R"([{"op": "moe_permute", "num_experts": 4, "top_k": 1}, {"op": "moe_dispatch", "max_rows": 150},
                  {"op": "reshape", "shape": [-1, 32]}, {"op": "moe_combine"}])"), 2);
  });
  CHECK_THAT(e, Catch::Contains("op 3 (moe_combine)"));
  CHECK_THAT(e, Catch::Contains("op 1 (moe_dispatch) received 150 rows"));
  // One rank: the float64 reference exists, the shapes are the block's.
  std::string whole = ep_block(8);
  for (size_t at; (at = whole.find("\"num_groups\": 4")) != std::string::npos;) whole.replace(at, 15, "\"num_groups\": 8");
  auto one = infer(whole, 1);
  CHECK(one.at(3).out == ops::Shape{200, 64});
}
