// TIDE error handling: one header, one style.
//
// Contract: the C++ core reports every failure by throwing. Each framework face converts at its
// boundary (nanobind maps PlanError -> tide.PlanError, Error -> RuntimeError; XLA FFI handlers
// return ffi::Error). Nothing in TIDE calls exit() or abort() on bad input.
//   PlanError   — bad input or an unsupported configuration, found before any data moves. The
//                 message names the field, parameter, rank or op at fault.
//   TimeoutError — a wait passed its deadline (fail-stop); the message names rank, op, sequence.
//   Error       — everything else (a CUDA/NCCL failure, detected corruption).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

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

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  append(os, args...);
  return os.str();
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
