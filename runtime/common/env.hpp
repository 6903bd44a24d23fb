// Every JITFUSE_* variable the library and the CLI read, in one place (docs/environment.md lists these and
// the rest of the tree's; tests/docs/test_environment_doc.py keeps both true).
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace jitfuse::env {

// JITFUSE_RULE_PATH        extra rule/template directories, ':'-separated
// JITFUSE_CACHE_DIR        kernel cache directory (default $XDG_CACHE_HOME/jitfuse, else ~/.cache/jitfuse)
// JITFUSE_CACHE_MAX_BYTES  disk cache cap, LRU eviction beyond it
// JITFUSE_LOG_LEVEL        trace|debug|info|warn|error|off (default warn)
// JITFUSE_DISABLE_FUSION   1: every op runs unfused (kill switch)
// JITFUSE_VERIFY           1: run the unfused ops beside each fused group and compare
// JITFUSE_ALL_VARIANTS     1: prepare loads every kernel variant (no compile in a call, even misaligned)
// JITFUSE_GEMM_TUNING      0: cuBLASLt's first heuristic choice for every GEMM (no timing at prepare)
// JITFUSE_GEMM_TUNING_MAX_BYTES  largest scratch a GEMM is timed on at prepare (default 256M; 0: no cap)
// JITFUSE_NCCL_LIBRARY     absolute path of the libnccl.so.2 to load (default: the loader's, then CUDA's)
// JITFUSE_GROUPED_GEMM     lt|cublas|auto: how a dropless MoE grouped linear runs its experts' GEMMs
// JITFUSE_OVERLAP          auto|chunks|local|copy: how an SP linear overlaps its all-gather / reduce-scatter
//                          (read when a program is planned; every rank the same)
// JITFUSE_PEER_ALLREDUCE   0: all_reduce + residual + norm groups take NCCL's all-reduce, never the one-shot
//                          kernel over peer-mapped buffers (read when a program is prepared)
// JITFUSE_PEER_COPY        0: the SP linears' collectives by copy engines take NCCL's way (read at each prepare)
std::optional<std::string> get(const char* name);
bool flag(const char* name);  // set and not "0"/"false"/"off"/""
bool falsy(const std::string& value);  // "0", "false" or "off": a switch turned off (flag's false values but "")
std::vector<std::string> split_path(const std::string& s);

}  // namespace jitfuse::env
