// TIDE error handling: one header, one style.
//
// Contract: the C++ core reports every failure by throwing. Each framework face converts at its
// boundary (nanobind maps PlanError -> tide.PlanError, Error -> RuntimeError; XLA FFI handlers
// return ffi::Error). Nothing in TIDE calls exit() or abort() on bad input.
//   PlanError   — bad input or an unsupported configuration, found before any data moves. The
//                 message names the field, parameter, rank or op at fault.
//   TimeoutError — a wait passed its deadline (fail-stop); the message names rank, op, sequence.
//   Interrupted — the caller asked a blocked call to stop (Ctrl-C: the faces raise
//                 KeyboardInterrupt); the ranks were stopped, the call's outputs are undefined.
//   Error       — everything else (a CUDA/NCCL failure, detected corruption).
#pragma once

#include <charconv>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace tide {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct PlanError : Error {
  using Error::Error;
};
struct TimeoutError : Error {
  using Error::Error;
};
struct Interrupted : Error {
  using Error::Error;
};

namespace detail {
// Message formatting without iostreams for the common cases (strings, characters, integers,
// floating point as "%g"): no locale is touched, so building an error message cannot fail on a
// toolchain whose iostream/locale state is broken (seen on the GPU image, 2026-11-29: the first
// ostream number insertion in a module crashed). Other types fall back to operator<<.
inline void append_one(std::string& s, const std::string& v) { s += v; }
inline void append_one(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void append_one(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void append_one(std::string& s, char v) { s += v; }
inline void append_one(std::string& s, signed char v) { s += static_cast<char>(v); }
inline void append_one(std::string& s, unsigned char v) { s += static_cast<char>(v); }
inline void append_one(std::string& s, bool v) { s += v ? '1' : '0'; }  // as ostream prints it
template <typename T>
void append_one(std::string& s, const T& v) {
  if constexpr (std::is_integral_v<T>) {
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof(buf), v);
    s.append(buf, r.ptr);
  } else if constexpr (std::is_floating_point_v<T>) {
    char buf[64];
    const int n = std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));  // ostream's default
    s.append(buf, n > 0 ? static_cast<size_t>(n) : 0);
  } else {
    std::ostringstream os;
    os << v;
    s += os.str();
  }
}
inline void append(std::string&) {}
template <typename T, typename... Rest>
void append(std::string& s, const T& v, const Rest&... rest) {
  append_one(s, v);
  append(s, rest...);
}
template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  append(s, args...);
  return s;
}
}  // namespace detail

}  // namespace tide

#define TIDE_STR_CAT(...) ::tide::detail::cat(__VA_ARGS__)

// Invariant of TIDE itself (a bug if it fires): carries file:line.
#define TIDE_CHECK(cond, ...)                                                           \
  do {                                                                                  \
    if (!(cond))                                                                        \
      throw ::tide::Error(TIDE_STR_CAT(__FILE__, ":", __LINE__, ": check failed: " #cond \
                                       " ",                                             \
                                       ##__VA_ARGS__));                                 \
  } while (0)

// Bad user input or unsupported configuration: the message must name the field at fault.
#define TIDE_PLAN_CHECK(cond, ...)                                   \
  do {                                                               \
    if (!(cond)) throw ::tide::PlanError(TIDE_STR_CAT(__VA_ARGS__)); \
  } while (0)

#if defined(__CUDACC__) || defined(TIDE_WITH_CUDA)
#include <cuda_runtime_api.h>
// Every CUDA runtime return code is checked; `what` names rank/op/sequence where known.
#define TIDE_CHECK_CUDA(expr, ...)                                                          \
  do {                                                                                      \
    cudaError_t tide_err_ = (expr);                                                         \
    if (tide_err_ != cudaSuccess)                                                           \
      throw ::tide::Error(TIDE_STR_CAT(__FILE__, ":", __LINE__, ": CUDA error ",            \
                                       cudaGetErrorName(tide_err_), " (",                   \
                                       cudaGetErrorString(tide_err_), ") in " #expr " ", \
                                       ##__VA_ARGS__));                                     \
  } while (0)
#endif
