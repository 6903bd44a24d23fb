// What a compiled kernel costs an SM, read from its CUBIN without a GPU or cuobjdump: registers per
// thread, the stack frame (local memory: spills and dynamically indexed arrays) and static shared
// memory of every entry point. The CUBIN is an ELF64 file; the figures are the attributes ptxas writes
// into its `.nv.info.<function>` sections (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and the sizes of its
// `.nv.shared.<function>` sections. Used by `jitfuse cache show` (docs/cli.md).
//
// The input is untrusted (a cache file): every offset and size is checked against the buffer, a bad
// file gives `error` and whatever was read before it, never a crash or an unbounded loop.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace jitfuse::cuda {

struct KernelResources {
  std::string name;
  int registers = -1;            // per thread; -1: not recorded
  int64_t frame_bytes = -1;      // stack frame per thread; -1: not recorded
  int64_t static_shared_bytes = 0;  // the section's size: on sm_80+ it includes the 1 KiB the system reserves
};

struct CubinResources {
  std::vector<KernelResources> kernels;  // entry points (.text.<name>), in section order
  std::string error;                     // empty when the whole file was read
};

CubinResources read_cubin_resources(std::string_view elf);

}  // namespace jitfuse::cuda
