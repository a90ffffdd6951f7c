// The CUDA executors' shared streams, watchdog and fail-stop (contract in fail_stop.h).
#include "exec/cuda/fail_stop.h"

#include <utility>

namespace tide::cuda {

FailStopStreams::FailStopStreams(std::string who, std::vector<int> devices, double timeout_s)
    : who_(std::move(who)), devices_(std::move(devices)) {
  TIDE_CHECK(!devices_.empty(), who_, ": no local ranks");
  streams_.resize(devices_.size());
  joined_.resize(devices_.size());
  const std::string prefix = who_ + ": ";
  for (size_t i = 0; i < devices_.size(); ++i) {
    DeviceGuard guard(devices_[i], prefix.c_str());
    cudaEvent_t e = nullptr;
    TIDE_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), who_, " rank slot ", i, " completion event");
    done_.push_back(e);
  }
  watchdog_ = std::make_unique<Watchdog>(devices_[0], timeout_s);
}

void FailStopStreams::quiesce() noexcept {
  for (size_t i = 0; i < streams_.size(); ++i) {
    cudaSetDevice(devices_[i]);
    for (auto s : streams_[i]) cudaStreamSynchronize(s);  // stuck waits are released by the watchdog
  }
  watchdog_.reset();
}

FailStopStreams::~FailStopStreams() {
  quiesce();
  for (size_t i = 0; i < streams_.size(); ++i) {
    cudaSetDevice(devices_[i]);
    for (auto s : streams_[i]) cudaStreamDestroy(s);
    for (auto e : joined_[i]) cudaEventDestroy(e);
    if (i < done_.size() && done_[i]) cudaEventDestroy(done_[i]);
  }
}

void FailStopStreams::ensure_streams(size_t slot, size_t n) {
  auto& v = streams_[slot];
  if (v.size() >= n) return;
  const std::string prefix = who_ + ": ";
  DeviceGuard guard(devices_[slot], prefix.c_str());
  while (v.size() < n) {
    // [Note: internal streams]
    cudaStream_t s = nullptr;
    TIDE_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), who_, " rank slot ", slot, " stream");
    v.push_back(s);
    if (v.size() > 1) {
      cudaEvent_t e = nullptr;
      TIDE_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), who_, " rank slot ", slot, " join event");
      joined_[slot].push_back(e);
    }
  }
}

void FailStopStreams::join_caller(size_t slot, size_t n, cudaStream_t caller, bool check, const std::string& what) {
  auto ok = [&](cudaError_t r, const char* step) {
    if (check) TIDE_CHECK_CUDA(r, what, ": ", step);
  };
  const auto& st = streams_[slot];
  ok(cudaSetDevice(devices_[slot]), "setting the device");
  for (size_t s = 1; s < n; ++s) {
    ok(cudaEventRecord(joined_[slot][s - 1], st[s]), "joining an internal stream");
    ok(cudaStreamWaitEvent(st[0], joined_[slot][s - 1], 0), "joining an internal stream");
  }
  ok(cudaEventRecord(done_[slot], st[0]), "recording the call's completion");
  ok(cudaStreamWaitEvent(caller, done_[slot], 0), "the caller stream waiting for the call");
}

void FailStopStreams::sync_all() noexcept {
  for (auto& v : streams_)
    for (auto s : v) cudaStreamSynchronize(s);
}

void FailStopStreams::check_usable() {
  if (!failed_.empty()) throw Error(who_ + " failed earlier (fail-stop): " + failed_);
  try {
    watchdog_->check();  // a timeout seen since the last call
  } catch (const TimeoutError& e) {
    fail(e.what());
    throw;
  }
}

void FailStopStreams::drain_and_sync(const std::string& what) {
  watchdog_->drain();
  for (auto& v : streams_)
    for (auto s : v) TIDE_CHECK_CUDA(cudaStreamSynchronize(s), what);
}

void FailStopStreams::synchronize(const std::string& what) {
  try {
    watchdog_->drain();
  } catch (const TimeoutError& e) {
    fail(e.what());
    sync_all();  // released waits let the streams drain
    throw;
  }
  for (auto& v : streams_)
    for (auto s : v) TIDE_CHECK_CUDA(cudaStreamSynchronize(s), what);
}

}  // namespace tide::cuda
