/* Links against the installed libjitfuse through find_package(jitfuse) and uses the C ABI. */
#include <jitfuse/jitfuse.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  if (jf_abi_version() != JF_ABI_VERSION) {
    fprintf(stderr, "ABI mismatch: header %d, library %d\n", JF_ABI_VERSION, jf_abi_version());
    return 1;
  }
  jf_context ctx = NULL;
  if (jf_context_create(&ctx) != JF_OK) {
    fprintf(stderr, "jf_context_create: %s\n", jf_last_error());
    return 1;
  }
  jf_sequence seq = NULL;
  const char* bad = "{\"ops\": [{\"op\": \"geluu\"}]}";
  jf_status st = jf_sequence_create(ctx, bad, "bf16", &seq);
  if (st != JF_ERR_INVALID_ARGUMENT || strstr(jf_last_error(), "unknown op 'geluu'") == NULL) {
    fprintf(stderr, "expected an unknown-op error, got %d: %s\n", (int)st, jf_last_error());
    return 1;
  }
  jf_context_destroy(ctx);
  printf("consumer ok: jitfuse %s, ABI %d\n", jf_version(), jf_abi_version());
  return 0;
}
