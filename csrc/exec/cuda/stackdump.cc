// Native stack dump on a signal (debugging hangs on machines without gdb; tools/gpu/hang.py).
// install_stack_dump(sig): the thread the signal lands on (the main thread for a process-
// directed signal it does not block) writes its backtrace to stderr, then forwards the signal
// once to every registered thread (the watchdogs), which write theirs. Best effort: backtrace()
// is not async-signal-safe, which a hang report can afford.
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>

#include "exec/cuda/runtime.h"
#include "tide/errors.h"

namespace tide::cuda {
namespace {

constexpr int kMaxThreads = 64;
// A slot is free (0), being claimed (1) or holds a thread (2); only state 2 is signalled.
pthread_t g_threads[kMaxThreads];
std::atomic<int> g_state[kMaxThreads];

void write_str(const char* s) {
  if (write(2, s, std::strlen(s)) < 0) return;
}

void handler(int sig) {
  char head[96];
  std::snprintf(head, sizeof(head), "\n-- tide native stack, pid %d thread %lu --\n", static_cast<int>(getpid()),
                static_cast<unsigned long>(pthread_self()));
  write_str(head);
  void* frames[48];
  const int n = backtrace(frames, 48);
  backtrace_symbols_fd(frames, n, 2);
  const pthread_t self = pthread_self();
  for (int i = 0; i < kMaxThreads; ++i)
    if (g_state[i].load() == 2 && pthread_equal(g_threads[i], self)) return;  // forwarded: stop here
  for (int i = 0; i < kMaxThreads; ++i)
    if (g_state[i].load() == 2) pthread_kill(g_threads[i], sig);
}

}  // namespace

void install_stack_dump(int sig) {
  struct sigaction sa {};
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  TIDE_PLAN_CHECK(sigaction(sig, &sa, nullptr) == 0, "install_stack_dump: sigaction(", sig, ") failed");
}

void register_dump_thread(bool on) {
  const pthread_t self = pthread_self();
  for (int i = 0; i < kMaxThreads; ++i) {
    int free_slot = 0;
    if (on && g_state[i].compare_exchange_strong(free_slot, 1)) {
      g_threads[i] = self;
      g_state[i] = 2;
      return;
    }
    if (!on && g_state[i].load() == 2 && pthread_equal(g_threads[i], self)) {
      g_state[i] = 0;
      return;
    }
  }
}

}  // namespace tide::cuda
