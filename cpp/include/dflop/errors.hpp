// Typed errors of the dflop core. The bindings map them to Python exceptions:
// InvalidArgument -> ValueError, Infeasible -> dflop.InfeasibleError (a ValueError),
// Interrupted -> the caller's pending KeyboardInterrupt (or KeyboardInterrupt).
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

namespace dflop {

// An argument is malformed or out of range; the message names the argument and,
// where there is one, the first offending index and value.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The arguments are well formed but the constraints (capacities, memory) cannot be met.
class Infeasible : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A long search was stopped by its InterruptCheck (Ctrl-C in the bindings).
class Interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Polled by long searches now and then (balance, pipeline_schedule: about every 15,000
// work units; the planner: between waves of candidates). Returning true stops the search,
// which throws Interrupted. Empty: never interrupted. It runs on the calling thread.
using InterruptCheck = std::function<bool()>;

// Calls `check` once per `every` units of a search's work counter.
class InterruptPoller {
 public:
  InterruptPoller(const InterruptCheck& check, int64_t every) : check_(check), every_(every) {}
  void poll(int64_t work) {
    if (!check_ || work < next_) return;
    next_ = work + every_;
    if (check_()) throw Interrupted("interrupted");
  }

 private:
  const InterruptCheck& check_;
  int64_t every_;
  int64_t next_ = 0;
};

}  // namespace dflop
