// Per-step batch balancing: assign N samples with D-dimensional costs to
// B = num_microbatches x dp_size bins so that the largest load is as small as possible.
//
// Bin b is microbatch b / dp_size on data-parallel rank b % dp_size. The load of a
// dimension is summed per bin, except for "microbatch dimensions", whose load is summed
// over the whole microbatch (all dp_size bins of it): an encoder whose replicas share
// each microbatch evenly. Every bin receives at least one sample.
#pragma once

#include <cstdint>
#include <vector>

#include "dflop/errors.hpp"

namespace dflop {

// The largest work budget a search runs under (larger ones are capped to it).
constexpr int64_t kMaxWorkBudget = int64_t{1} << 50;

struct BalanceOptions {
  int64_t num_microbatches = 1;
  int64_t dp_size = 1;
  // Dimensions whose load is summed over a microbatch instead of per bin.
  std::vector<int64_t> microbatch_dims;
  // Empty, or one upper bound per dimension on a bin's (microbatch's) load; +inf = none.
  std::vector<double> capacity;
  // The last num_limit_dims columns are limits only (tokens, visual units: a memory
  // budget): their capacities constrain the schedule, but they are neither balanced nor
  // part of the makespan or the lower bound. Needs capacity; at least one column remains.
  int64_t num_limit_dims = 0;
  uint64_t seed = 0;
  // Search effort in work units (one unit ~ one candidate move evaluated). The search
  // counts work instead of reading a clock so that results are reproducible. Without
  // capacities a larger budget continues the same trajectory, so it is never worse; with
  // capacities it need not be (the repair attempts start where the budget runs out, so a
  // larger budget can take another path, rarely to a worse or infeasible end). Negative =
  // default by size; budgets above kMaxWorkBudget (hours of search) count as
  // kMaxWorkBudget.
  int64_t work_budget = -1;
  // Optional wall-clock limit in seconds (negative = none): past it the search returns the
  // best schedule found so far. Results then depend on machine speed and load, so this is
  // for callers that need an answer by a deadline (the asynchronous front end), not for
  // reproducible runs.
  double time_limit_s = -1.0;
  // Optional cooperative interruption (see InterruptCheck).
  InterruptCheck interrupted;
};

struct BalanceStats {
  double initial_makespan = 0.0;  // after the constructive start
  int64_t work_used = 0;          // work units spent in the improving search
  int64_t work_budget = 0;        // the budget the search ran under
  int64_t improving_moves = 0;
  int64_t perturbations = 0;
  bool stopped_by_time_limit = false;
  bool seeded_by_first_fit = false;  // the search started again from a first-fit packing
};

struct BalanceResult {
  std::vector<int64_t> assignment;       // num_items: bin of each sample
  std::vector<double> bin_loads;         // num_bins x num_dims, row-major
  std::vector<double> microbatch_loads;  // num_microbatches x num_dims, row-major
  double makespan = 0.0;                 // largest bin load (microbatch load for microbatch dims)
  double lower_bound = 0.0;              // max over dims of total/count and of the largest item
  BalanceStats stats;
};

// Checks every argument and throws InvalidArgument naming the first problem
// (argument, index, value), or Infeasible when the capacities cannot be met by any
// schedule for a reason that is cheap to prove (a sample over a bound; a total over the
// bins' bounds).
void validate_balance_input(const double* costs, int64_t num_items, int64_t num_dims,
                            const BalanceOptions& options);

// Validates, then solves. `costs` is row-major num_items x num_dims. With capacities,
// a search that ends over one starts again from a first-fit-decreasing packing (so a bin
// count that FFD fills is never reported infeasible), then from a balance that ignores
// them, repaired; a call does at most 2x its work budget (plus FFD's O(N B D) pass),
// feasible or not. Throws Infeasible if no schedule within the capacities was found.
BalanceResult balance(const double* costs, int64_t num_items, int64_t num_dims,
                      const BalanceOptions& options);

// How many bins first-fit decreasing packs the items into within `limits` (one bound per
// column of the row-major num_items x num_cols `used`; +inf = none): items by decreasing
// largest share of a bound, each into the first bin it fits. Throws Infeasible naming
// the item when one alone is over a bound, InvalidArgument for bad input.
int64_t first_fit_decreasing_bins(const double* used, int64_t num_items, int64_t num_cols,
                                  const std::vector<double>& limits);

// Work units the search gets by default for a problem of this size.
int64_t default_work_budget(int64_t num_items, int64_t num_bins, int64_t num_dims);

// Converts a time budget to work units with a fixed calibration (about the speed of one
// current x86 core), so that a given budget gives the same schedule on every machine.
int64_t work_budget_for_ms(double time_budget_ms);

}  // namespace dflop
