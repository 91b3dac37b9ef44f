#include "dflop/rows.hpp"

#include <string>
#include <vector>

#include "dflop/errors.hpp"

namespace dflop {

void check_row_index(const int64_t* index, int64_t count, int64_t rows, bool unique,
                     const char* name) {
  const std::string what = name ? name : "index";
  if (count < 0) throw InvalidArgument(what + ": count must be >= 0, got " + std::to_string(count));
  if (rows < 0) throw InvalidArgument(what + ": rows must be >= 0, got " + std::to_string(rows));
  if (count > 0 && index == nullptr)
    throw InvalidArgument(what + ": no data for " + std::to_string(count) + " entries");
  std::vector<int64_t> first_seen;
  if (unique) first_seen.assign(static_cast<size_t>(rows), -1);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t value = index[i];
    if (value < 0 || value >= rows)
      throw InvalidArgument(what + "[" + std::to_string(i) + "] = " + std::to_string(value) +
                            " is out of range [0, " + std::to_string(rows) + ")");
    if (unique) {
      int64_t& seen = first_seen[static_cast<size_t>(value)];
      if (seen >= 0)
        throw InvalidArgument(what + "[" + std::to_string(i) + "] = " + std::to_string(value) +
                              " repeats " + what + "[" + std::to_string(seen) +
                              "]: a destination row can be written once");
      seen = i;
    }
  }
}

}  // namespace dflop
