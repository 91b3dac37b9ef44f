// Typed errors of the dflop core. The bindings map them to Python exceptions:
// InvalidArgument -> ValueError, Infeasible -> dflop.InfeasibleError (a ValueError).
#pragma once

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

}  // namespace dflop
