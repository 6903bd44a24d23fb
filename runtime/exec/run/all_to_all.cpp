#include "exec/run/all_to_all.hpp"

#include <cstdint>

#include "common/error.hpp"
#include "cuda/driver.hpp"

namespace jitfuse::exec {
namespace {

// Who sends what this call, from every rank's rows per expert (rank s, expert x: at(s, x)) and every rank's two
// bounds: its permuted rows and the rows its experts may receive (ranks may run different token counts).
struct Counts {
  int w = 1, me = 0;
  int64_t e = 0, local = 0;  // E, and E / W experts per rank
  std::vector<int32_t> table;        // [W (E + 2)]: rank s's E counts, then its token and expert bounds
  std::vector<int64_t> token_start;  // this rank's permuted rows: expert x's start
  std::vector<int64_t> expert_at;    // the expert side: rows of (local expert l, source s) start at [l W + s]
  std::vector<int32_t> route;        // this rank's experts: splits [local], starts [local + 1]
  int32_t at(int s, int64_t x) const { return table[static_cast<size_t>(s * (e + 2) + x)]; }
};

// Every rank's counts and bounds on the host: in the dispatch's forward, this rank's splits and bounds are put into
// its slot of the counts buffer and all-gathered (in place); otherwise (the backward, the combine) the buffer holds
// them already.
std::vector<int32_t> read_counts(const cuda::Communicator& comm, const CommStep& c, const std::vector<void*>& ptr,
                                 CUstream stream) {
  const auto& a = c.a2a;
  const auto& d = cuda::driver();
  const auto counts = reinterpret_cast<CUdeviceptr>(ptr[static_cast<size_t>(a.counts)]);
  const size_t per = static_cast<size_t>(a.experts + 2);
  std::vector<int32_t> table(static_cast<size_t>(comm.world_size()) * per);
  if (a.route >= 0) {
    const CUdeviceptr mine = counts + static_cast<CUdeviceptr>(comm.rank()) * per * 4u;
    const auto splits = reinterpret_cast<CUdeviceptr>(ptr[static_cast<size_t>(a.route)]) + static_cast<CUdeviceptr>(a.route_splits) * 4u;
    cuda::check(d.cuMemcpyDtoDAsync(mine, splits, static_cast<size_t>(a.experts) * 4u, stream),
                "cuMemcpyDtoDAsync(rows per expert)");
    const int32_t bounds[2] = {static_cast<int32_t>(a.token_rows), static_cast<int32_t>(a.expert_rows)};
    cuda::check(d.cuMemcpyHtoDAsync(mine + static_cast<CUdeviceptr>(a.experts) * 4u, bounds, sizeof bounds, stream),
                "cuMemcpyHtoDAsync(bounds)");  // pageable: staged before the call returns
    cuda::check_nccl(cuda::nccl().ncclAllGather(reinterpret_cast<const void*>(mine), reinterpret_cast<void*>(counts),
                                                per, ncclInt32, comm.comm(), stream),
                     "ncclAllGather(rows per expert)");
  }
  cuda::check(d.cuMemcpyDtoHAsync(table.data(), counts, table.size() * 4u, stream), "cuMemcpyDtoHAsync(rows per expert)");
  cuda::check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(rows per expert)");
  return table;
}

// The padded exchange's table: `capacity` rows per (rank, expert), every rank the same bounds.
std::vector<int32_t> fixed_counts(const cuda::Communicator& comm, const CommStep& c) {
  const auto& a = c.a2a;
  const size_t per = static_cast<size_t>(a.experts + 2);
  std::vector<int32_t> table(static_cast<size_t>(comm.world_size()) * per,
                             static_cast<int32_t>(a.token_rows / a.experts));
  for (int s = 0; s < comm.world_size(); ++s) {
    table[s * per + per - 2] = static_cast<int32_t>(a.token_rows);
    table[s * per + per - 1] = static_cast<int32_t>(a.expert_rows);
  }
  return table;
}

// Checks every rank's counts against that rank's bounds (every rank checks all: they fail together) and lays out
// both sides.
Counts plan(const cuda::Communicator& comm, const CommStep& c, std::vector<int32_t> table) {
  Counts k;
  k.w = comm.world_size();
  k.me = comm.rank();
  k.e = c.a2a.experts;
  k.local = k.e / k.w;
  k.table = std::move(table);
  for (int s = 0; s < k.w; ++s) {
    int64_t sent = 0, got = 0;
    for (int64_t x = 0; x < k.e; ++x) {
      if (k.at(s, x) < 0) fail(Status::internal, "op {}: rank {} routed {} rows to expert {}", c.op_index, s, k.at(s, x), x);
      sent += k.at(s, x);
      for (int r = 0; r < k.w; ++r) got += x / k.local == s ? k.at(r, x) : 0;
    }
    const int64_t tokens = k.at(s, k.e), bound = k.at(s, k.e + 1);
    if (sent > tokens)
      fail(Status::internal, "op {} (all_to_all): rank {} routed {} rows, more than its {} permuted rows", c.op_index,
           s, sent, tokens);
    if (got > bound)
      fail(Status::invalid_argument, "op {} (all_to_all): rank {}'s experts got {} rows this call, more than the "
           "moe_dispatch's \"max_rows\" on that rank ({}): raise it, or leave it -1 (world size x the permuted rows; with "
           "token counts that differ between the ranks, set it for the largest)", c.op_index, s, got, bound);
  }
  k.token_start.assign(static_cast<size_t>(k.e), 0);
  for (int64_t x = 1; x < k.e; ++x) k.token_start[x] = k.token_start[x - 1] + k.at(k.me, x - 1);
  k.expert_at.assign(static_cast<size_t>(k.local * k.w), 0);
  k.route.assign(static_cast<size_t>(2 * k.local + 1), 0);
  int64_t row = 0;
  for (int64_t l = 0; l < k.local; ++l) {
    k.route[k.local + l] = static_cast<int32_t>(row);
    for (int s = 0; s < k.w; ++s) {
      k.expert_at[l * k.w + s] = row;
      row += k.at(s, k.me * k.local + l);
    }
    k.route[l] = static_cast<int32_t>(row - k.route[k.local + l]);
  }
  k.route[2 * k.local] = static_cast<int32_t>(row);
  return k;
}

void exchange(const cuda::Communicator& comm, const CommStep& c, const Counts& k, const std::vector<void*>& ptr,
              CUstream stream) {
  const auto& a = c.a2a;
  const auto& n = cuda::nccl();
  const size_t row_bytes = static_cast<size_t>(a.row * ops::dtype_bytes(c.dtype));
  const ncclDataType_t dt = cuda::nccl_dtype(c.dtype);
  char* token = static_cast<char*>(ptr[static_cast<size_t>(a.to_experts ? c.send : c.recv)]);
  char* expert = static_cast<char*>(ptr[static_cast<size_t>(a.to_experts ? c.recv : c.send)]);
  cuda::NcclGroup group;
  for (int r = 0; r < k.w; ++r) {
    for (int64_t l = 0; l < k.local; ++l) {
      const int64_t mine = k.at(k.me, r * k.local + l), theirs = k.at(r, k.me * k.local + l);
      char* t = token + static_cast<size_t>(k.token_start[static_cast<size_t>(r * k.local + l)]) * row_bytes;
      char* x = expert + static_cast<size_t>(k.expert_at[static_cast<size_t>(l * k.w + r)]) * row_bytes;
      if (r == k.me) {  // this rank's own experts: a copy
        if (mine == 0) continue;
        const auto from = reinterpret_cast<CUdeviceptr>(a.to_experts ? t : x), to = reinterpret_cast<CUdeviceptr>(a.to_experts ? x : t);
        cuda::check(cuda::driver().cuMemcpyDtoDAsync(to, from, static_cast<size_t>(mine) * row_bytes, stream),
                    "cuMemcpyDtoDAsync(own experts' rows)");
        continue;
      }
      const size_t to_r = static_cast<size_t>(mine * a.row), from_r = static_cast<size_t>(theirs * a.row);
      if (a.to_experts) {
        if (mine) cuda::check_nccl(n.ncclSend(t, to_r, dt, r, comm.comm(), stream), "ncclSend(rows to an expert)");
        if (theirs) cuda::check_nccl(n.ncclRecv(x, from_r, dt, r, comm.comm(), stream), "ncclRecv(an expert's rows)");
      } else {
        if (theirs) cuda::check_nccl(n.ncclSend(x, from_r, dt, r, comm.comm(), stream), "ncclSend(an expert's rows back)");
        if (mine) cuda::check_nccl(n.ncclRecv(t, to_r, dt, r, comm.comm(), stream), "ncclRecv(rows back)");
      }
    }
  }
  group.end();
}

}  // namespace

void run_all_to_all(const cuda::Communicator& comm, const CommStep& c, const std::vector<void*>& ptr,
                    CUstream stream, HostRoutes& routes) {
  const auto& a = c.a2a;
  if (a.experts < 1 || a.experts % comm.world_size() != 0 || a.token_rows < 0 || a.expert_rows < 0)
    fail(Status::internal, "op {}: {} experts over {} ranks", c.op_index, a.experts, comm.world_size());
  if (a.counts < 0)  // padded: capacity rows per (rank, expert), fixed: nothing read, a CUDA graph replays it
    return exchange(comm, c, plan(comm, c, fixed_counts(comm, c)), ptr, stream);
  if (cuda::stream_capturing(stream))
    fail(Status::unsupported, "op {} (moe_dispatch / moe_combine) sends as many rows to each rank as the routing "
         "chose this call, which the host reads: a CUDA graph capture cannot; capture the expert block with a "
         "padded moe_permute (\"layout\": \"padded\", a \"capacity\": fixed rows per rank and expert), or run "
         "it outside the graph", c.op_index);
  const Counts k = plan(comm, c, read_counts(comm, c, ptr, stream));
  const auto& d = cuda::driver();
  if (a.route >= 0) {  // the routing the grouped linears and the backward read (pageable: staged before return)
    const auto at = reinterpret_cast<CUdeviceptr>(ptr[static_cast<size_t>(a.counts)]) + static_cast<CUdeviceptr>(k.w * (k.e + 2)) * 4u;
    cuda::check(d.cuMemcpyHtoDAsync(at, k.route.data(), k.route.size() * 4u, stream), "cuMemcpyHtoDAsync(routing)");
  }
  routes.put(a.counts, k.route);
  exchange(comm, c, k, ptr, stream);
  // The receiving side past the rows it got: zero (as moe_permute's rows past the kept ones).
  const int64_t got = a.to_experts ? k.route[static_cast<size_t>(2 * k.local)] : k.token_start.back() + k.at(k.me, k.e - 1);
  const int64_t bound = a.to_experts ? a.expert_rows : a.token_rows;
  const size_t row_bytes = static_cast<size_t>(a.row * ops::dtype_bytes(c.dtype));
  if (got < bound)
    cuda::check(d.cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(ptr[static_cast<size_t>(c.recv)]) + got * row_bytes, 0,
                                  static_cast<size_t>(bound - got) * row_bytes, stream),
                "cuMemsetD8Async(rows past the received)");
}

}  // namespace jitfuse::exec
