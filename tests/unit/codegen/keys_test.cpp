// Typed keys (issue 41 item 5): parameters, saved context, partial sums and a channel's gradient are named by
// codegen::Key from the emitters to the program builder (runtime/exec/lower/builder.cpp); no binding by string.
#include <catch2/catch.hpp>

#include <set>
#include <stdexcept>

#include "exec/lower/compile.hpp"
#include "jitfuse/codegen/kernel_spec.hpp"
#include "support/builtin_cases.hpp"

using namespace jitfuse;
using codegen::Arg;
using codegen::Key;

TEST_CASE("every key has one name and parses back, and unknown names do not parse", "[codegen][keys]") {
  std::set<std::string> names;
  for (int k = static_cast<int>(Key::input); k <= static_cast<int>(Key::channel); ++k) {
    const auto key = static_cast<Key>(k);
    const std::string n = codegen::key_name(key);
    INFO(k);
    CHECK_FALSE(n.empty());
    CHECK(names.insert(n).second);
    REQUIRE(codegen::parse_key(n));
    CHECK(*codegen::parse_key(n) == key);
  }
  CHECK(std::string(codegen::key_name(Key::none)).empty());
  CHECK_FALSE(codegen::parse_key("gamma"));
  CHECK_FALSE(codegen::parse_key(""));
  CHECK_FALSE(codegen::parse_key("Weight"));
}

TEST_CASE("the keyed arguments of every built-in kernel carry their key, and the builder binds them by it",
          "[codegen][keys][exec]") {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  int keyed = 0;
  for (const auto& c : test::builtin_cases()) {
    if (c.recipe != "bf16" && c.recipe != "fp8_current") continue;
    auto p = test::case_program(c, rs);
    for (const auto* steps : {&p->forward, &p->backward})
      for (const auto& s : *steps) {
        if (s.kind != exec::Step::Kind::kernel) continue;
        const auto& k = *s.kernel;
        for (size_t i = 0; i < k.gen.args.size(); ++i) {
          const Arg& a = k.gen.args[i];
          INFO(c.id() << " " << k.gen.kernel << " argument " << i << " " << a.name);
          const bool must = a.role == Arg::Role::param || a.role == Arg::Role::saved || a.role == Arg::Role::partials;
          if (must) {
            ++keyed;
            REQUIRE(a.key != Key::none);
            CHECK(a.name == codegen::key_name(a.key));
          }
          if (!must && a.role != Arg::Role::grad_extra_out) CHECK(a.key == Key::none);
          if (a.role == Arg::Role::partials)  // a scratch buffer named by its key
            CHECK(p->buffer(k.args[i].buffer).name ==
                  "partials op" + std::to_string(a.op) + "." + codegen::key_name(a.key));
          // What the builder bound: the op's parameter or saved context of that key, or for saved context a
          // value buffer the forward kept (an alias: the op's input or output between groups), or one the backward
          // recomputed (provide_saved: a joint strategy's temp).
          if (a.role != Arg::Role::param && a.role != Arg::Role::saved) continue;
          const auto& b = p->buffer(k.args[i].buffer);
          if (a.role == Arg::Role::param) {
            CHECK(b.role == exec::BufferRole::param);
            CHECK(b.op == a.op);
            CHECK(b.key == codegen::key_name(a.key));
          }
          if (a.role == Arg::Role::saved && b.role == exec::BufferRole::saved_context) {
            CHECK(b.op == a.op);
            CHECK(b.key == codegen::key_name(a.key));
          } else if (a.role == Arg::Role::saved) {
            CHECK((a.key == Key::input || a.key == Key::output));
            const bool value = b.role == exec::BufferRole::activation || b.role == exec::BufferRole::input ||
                               b.role == exec::BufferRole::output || b.role == exec::BufferRole::extra_in ||
                               b.role == exec::BufferRole::temp;
            CHECK(value);
          }
        }
      }
  }
  CHECK(keyed > 50);
}
