// Number formatting for error messages (private to the core).
#pragma once

#include <sstream>
#include <string>

namespace dflop::detail {

// `v` with `digits` significant digits: 17 (the default) prints every double exactly,
// so a message shows the offending value as the caller passed it.
inline std::string format_number(double v, int digits = 17) {
  std::ostringstream s;
  s.precision(digits);
  s << v;
  return s.str();
}

}  // namespace dflop::detail
