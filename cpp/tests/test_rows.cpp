// Unit tests of the pack / unpack index check (dflop/rows.hpp): valid indices pass, the
// first bad position and value are named, repeats are caught only where they matter.
#include <cstdint>
#include <string>
#include <vector>

#include "check.hpp"
#include "dflop/errors.hpp"
#include "dflop/rows.hpp"

namespace {

using Ints = std::vector<int64_t>;

std::string error_of(const Ints& index, int64_t rows, bool unique) {
  try {
    dflop::check_row_index(index.data(), static_cast<int64_t>(index.size()), rows, unique, "idx");
  } catch (const dflop::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST_CASE(valid_indices_pass) {
  CHECK_EQ(error_of({0, 3, 1, 2}, 4, true), std::string());
  CHECK_EQ(error_of({2, 2, 0}, 3, false), std::string());  // gather may repeat a row
  CHECK_EQ(error_of({}, 0, true), std::string());
}

TEST_CASE(out_of_range_names_position_and_value) {
  CHECK_EQ(error_of({0, 5, 9}, 5, false), std::string("idx[1] = 5 is out of range [0, 5)"));
  CHECK_EQ(error_of({-1}, 5, true), std::string("idx[0] = -1 is out of range [0, 5)"));
  CHECK_EQ(error_of({0}, 0, false), std::string("idx[0] = 0 is out of range [0, 0)"));
}

TEST_CASE(repeats_are_errors_only_when_unique) {
  CHECK_EQ(error_of({1, 0, 1}, 3, true),
           std::string("idx[2] = 1 repeats idx[0]: a destination row can be written once"));
}

TEST_CASE(bad_sizes_are_named) {
  CHECK_THROWS_AS(dflop::check_row_index(nullptr, -1, 3, false, "idx"), dflop::InvalidArgument);
  CHECK_THROWS_AS(dflop::check_row_index(nullptr, 2, 3, false, "idx"), dflop::InvalidArgument);
  CHECK_THROWS_AS(dflop::check_row_index(nullptr, 0, -3, false, "idx"), dflop::InvalidArgument);
}

}  // namespace

int main(int argc, char** argv) { return dflop_test::run_all(argc, argv); }
