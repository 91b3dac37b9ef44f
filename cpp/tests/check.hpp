// A tiny, self-contained test harness for the C++ unit tests (ctest): no framework.
//
//   #include "check.hpp"
//   TEST_CASE(sums_add_up) { CHECK_EQ(1 + 1, 2); CHECK_THROWS_AS(f(), std::invalid_argument); }
//   int main(int argc, char** argv) { return dflop_test::run_all(argc, argv); }
//
// Every macro exists as DFLOP_CHECK... and, unless a macro of that name is already defined
// or DFLOP_CHECK_NO_SHORT_NAMES is defined before the include, as the short CHECK... name.
// A failed check prints file:line and what went wrong, counts a failure and carries on;
// run_all() runs every registered case (or those whose name contains argv[1]), catches
// stray exceptions, prints a summary and returns non-zero if anything failed.
//
// KNOWN_BUG(cond, text) documents a known bug without failing the run: it prints
// "KNOWN BUG still present" while cond is false and "KNOWN BUG FIXED" once it holds.
#pragma once

#include <cmath>
#include <cstdio>
#include <exception>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace dflop_test {

struct State {
  int failures = 0;
  int checks = 0;
  int known_bugs = 0;
  const char* current = "";
};

inline State& state() {
  static State s;
  return s;
}

template <typename T, typename = void>
struct Printable : std::false_type {};
template <typename T>
struct Printable<T,
                 std::void_t<decltype(std::declval<std::ostream&>() << std::declval<const T&>())>>
    : std::true_type {};

// Best-effort text of a value for failure messages.
template <typename T>
std::string show(const T& v) {
  if constexpr (std::is_floating_point_v<T>) {
    std::ostringstream s;
    s.precision(17);
    s << v;
    return s.str();
  } else if constexpr (Printable<T>::value) {
    std::ostringstream s;
    s << v;
    return s.str();
  } else {
    return "<unprintable>";
  }
}

inline void fail(const char* file, int line, const std::string& what) {
  ++state().failures;
  std::printf("%s:%d: [%s] FAILED: %s\n", file, line, state().current, what.c_str());
  std::fflush(stdout);
}

inline bool check(bool ok, const char* file, int line, const std::string& what) {
  ++state().checks;
  if (!ok) fail(file, line, what);
  return ok;
}

// |a - b| <= tol * max(1, |a|, |b|): relative for large values, absolute near zero.
inline bool near(double a, double b, double tol) {
  if (a == b) return true;  // also equal infinities
  const double scale = std::fmax(1.0, std::fmax(std::fabs(a), std::fabs(b)));
  return std::fabs(a - b) <= tol * scale;
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

inline void known_bug(bool ok, const char* file, int line, const char* expr, const char* text) {
  if (ok) {
    std::printf("%s:%d: KNOWN BUG FIXED (make it a CHECK): %s [%s]\n", file, line, text, expr);
  } else {
    ++state().known_bugs;
    std::printf("%s:%d: KNOWN BUG still present: %s [%s]\n", file, line, text, expr);
  }
  std::fflush(stdout);
}

using TestFn = void (*)();

inline std::vector<std::pair<const char*, TestFn>>& registry() {
  static std::vector<std::pair<const char*, TestFn>> cases;
  return cases;
}

struct Registrar {
  Registrar(const char* name, TestFn fn) { registry().emplace_back(name, fn); }
};

inline int run_all(int argc, char** argv) {
  const std::string filter = argc > 1 ? argv[1] : "";
  int ran = 0;
  for (const auto& [name, fn] : registry()) {
    if (!filter.empty() && !contains(name, filter)) continue;
    state().current = name;
    const int before = state().failures;
    try {
      fn();
    } catch (const std::exception& e) {
      fail(__FILE__, __LINE__, std::string("uncaught exception: ") + e.what());
    } catch (...) {
      fail(__FILE__, __LINE__, "uncaught non-standard exception");
    }
    std::printf("%s %s\n", state().failures == before ? "ok  " : "FAIL", name);
    std::fflush(stdout);
    ++ran;
  }
  std::printf("%d cases, %d checks, %d failures, %d known bugs\n", ran, state().checks,
              state().failures, state().known_bugs);
  if (ran == 0) {
    std::printf("no test case matched \"%s\"\n", filter.c_str());
    return 1;
  }
  return state().failures == 0 ? 0 : 1;
}

}  // namespace dflop_test

#define DFLOP_TEST_CONCAT_(a, b) a##b
#define DFLOP_TEST_CONCAT(a, b) DFLOP_TEST_CONCAT_(a, b)

#define DFLOP_TEST_CASE(name)                                                              \
  static void name();                                                                      \
  static const ::dflop_test::Registrar DFLOP_TEST_CONCAT(name, _registrar_){#name, &name}; \
  static void name()

#define DFLOP_CHECK(cond) ::dflop_test::check(static_cast<bool>(cond), __FILE__, __LINE__, #cond)

#define DFLOP_CHECK_MSG(cond, msg)                                                            \
  do {                                                                                        \
    std::ostringstream dflop_check_msg_;                                                      \
    dflop_check_msg_ << #cond << " -- " << msg;                                               \
    ::dflop_test::check(static_cast<bool>(cond), __FILE__, __LINE__, dflop_check_msg_.str()); \
  } while (0)

#define DFLOP_CHECK_OP_(a, op, b)                                                                \
  do {                                                                                           \
    const auto& dflop_a_ = (a);                                                                  \
    const auto& dflop_b_ = (b);                                                                  \
    ::dflop_test::check(dflop_a_ op dflop_b_, __FILE__, __LINE__,                                \
                        std::string(#a " " #op " " #b " with ") + ::dflop_test::show(dflop_a_) + \
                            " vs " + ::dflop_test::show(dflop_b_));                              \
  } while (0)

#define DFLOP_CHECK_EQ(a, b) DFLOP_CHECK_OP_(a, ==, b)
#define DFLOP_CHECK_NE(a, b) DFLOP_CHECK_OP_(a, !=, b)
#define DFLOP_CHECK_LT(a, b) DFLOP_CHECK_OP_(a, <, b)
#define DFLOP_CHECK_LE(a, b) DFLOP_CHECK_OP_(a, <=, b)
#define DFLOP_CHECK_GT(a, b) DFLOP_CHECK_OP_(a, >, b)
#define DFLOP_CHECK_GE(a, b) DFLOP_CHECK_OP_(a, >=, b)

#define DFLOP_CHECK_NEAR(a, b, tol)                                                         \
  do {                                                                                      \
    const double dflop_a_ = (a), dflop_b_ = (b);                                            \
    ::dflop_test::check(::dflop_test::near(dflop_a_, dflop_b_, (tol)), __FILE__, __LINE__,  \
                        std::string(#a " ~= " #b " with ") + ::dflop_test::show(dflop_a_) + \
                            " vs " + ::dflop_test::show(dflop_b_));                         \
  } while (0)

// Expects `expr` to throw an exception of type `type` (or derived) whose what() contains
// `needle` ("" matches anything).
#define DFLOP_CHECK_THROWS_WITH(expr, type, needle)                                           \
  do {                                                                                        \
    std::string dflop_what_;                                                                  \
    bool dflop_right_type_ = false, dflop_threw_ = false;                                     \
    try {                                                                                     \
      (void)(expr);                                                                           \
    } catch (const type& e) {                                                                 \
      dflop_threw_ = dflop_right_type_ = true;                                                \
      dflop_what_ = e.what();                                                                 \
    } catch (const std::exception& e) {                                                       \
      dflop_threw_ = true;                                                                    \
      dflop_what_ = e.what();                                                                 \
    } catch (...) {                                                                           \
      dflop_threw_ = true;                                                                    \
    }                                                                                         \
    if (!dflop_threw_)                                                                        \
      ::dflop_test::check(false, __FILE__, __LINE__, #expr " did not throw " #type);          \
    else if (!dflop_right_type_)                                                              \
      ::dflop_test::check(false, __FILE__, __LINE__,                                          \
                          #expr " threw another type than " #type ": " + dflop_what_);        \
    else                                                                                      \
      ::dflop_test::check(                                                                    \
          ::dflop_test::contains(dflop_what_, (needle)), __FILE__, __LINE__,                  \
          std::string(#expr ": message \"") + dflop_what_ + "\" lacks \"" + (needle) + "\""); \
  } while (0)

#define DFLOP_CHECK_THROWS_AS(expr, type) DFLOP_CHECK_THROWS_WITH(expr, type, "")

#define DFLOP_CHECK_THROWS(expr)                                                   \
  do {                                                                             \
    bool dflop_threw_ = false;                                                     \
    try {                                                                          \
      (void)(expr);                                                                \
    } catch (...) {                                                                \
      dflop_threw_ = true;                                                         \
    }                                                                              \
    ::dflop_test::check(dflop_threw_, __FILE__, __LINE__, #expr " did not throw"); \
  } while (0)

#define DFLOP_CHECK_NOTHROW(expr)                                                               \
  do {                                                                                          \
    try {                                                                                       \
      (void)(expr);                                                                             \
      ::dflop_test::check(true, __FILE__, __LINE__, "");                                        \
    } catch (const std::exception& e) {                                                         \
      ::dflop_test::check(false, __FILE__, __LINE__, std::string(#expr " threw: ") + e.what()); \
    } catch (...) {                                                                             \
      ::dflop_test::check(false, __FILE__, __LINE__, #expr " threw a non-standard exception");  \
    }                                                                                           \
  } while (0)

#define DFLOP_KNOWN_BUG(cond, text) \
  ::dflop_test::known_bug(static_cast<bool>(cond), __FILE__, __LINE__, #cond, text)

#ifndef DFLOP_CHECK_NO_SHORT_NAMES
#ifndef TEST_CASE
#define TEST_CASE(name) DFLOP_TEST_CASE(name)
#endif
#ifndef CHECK
#define CHECK(cond) DFLOP_CHECK(cond)
#endif
#ifndef CHECK_MSG
#define CHECK_MSG(cond, msg) DFLOP_CHECK_MSG(cond, msg)
#endif
#ifndef CHECK_EQ
#define CHECK_EQ(a, b) DFLOP_CHECK_EQ(a, b)
#endif
#ifndef CHECK_NE
#define CHECK_NE(a, b) DFLOP_CHECK_NE(a, b)
#endif
#ifndef CHECK_LT
#define CHECK_LT(a, b) DFLOP_CHECK_LT(a, b)
#endif
#ifndef CHECK_LE
#define CHECK_LE(a, b) DFLOP_CHECK_LE(a, b)
#endif
#ifndef CHECK_GT
#define CHECK_GT(a, b) DFLOP_CHECK_GT(a, b)
#endif
#ifndef CHECK_GE
#define CHECK_GE(a, b) DFLOP_CHECK_GE(a, b)
#endif
#ifndef CHECK_NEAR
#define CHECK_NEAR(a, b, tol) DFLOP_CHECK_NEAR(a, b, tol)
#endif
#ifndef CHECK_THROWS
#define CHECK_THROWS(expr) DFLOP_CHECK_THROWS(expr)
#endif
#ifndef CHECK_THROWS_AS
#define CHECK_THROWS_AS(expr, type) DFLOP_CHECK_THROWS_AS(expr, type)
#endif
#ifndef CHECK_THROWS_WITH
#define CHECK_THROWS_WITH(expr, type, needle) DFLOP_CHECK_THROWS_WITH(expr, type, needle)
#endif
#ifndef CHECK_NOTHROW
#define CHECK_NOTHROW(expr) DFLOP_CHECK_NOTHROW(expr)
#endif
#ifndef KNOWN_BUG
#define KNOWN_BUG(cond, text) DFLOP_KNOWN_BUG(cond, text)
#endif
#endif
