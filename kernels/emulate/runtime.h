// The emulator's scheduler: runs a grid block after block, the threads of a block as cooperative fibers.
//
// A fiber runs until it reaches __syncthreads, a warp collective it cannot complete, or its end; then it switches
// straight to the next ready fiber in the launch's schedule order (forward, reverse, or a fresh random
// permutation per round). Control returns to the launching (main) context only when the block is finished, stuck
// or failed. Everything a GPU would report as a hang or undefined behaviour that we can see (deadlock, divergent
// barrier, device assert, warp collective with a bad mask) ends the launch with an error message; the Python
// side raises it as EmulationError and the process lives on.
#pragma once
#ifndef CUFLASH_EMULATE_RUNTIME_H_
#define CUFLASH_EMULATE_RUNTIME_H_
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fiber.h"

namespace cuflash_emu {

enum State : int { kReady, kBarrier, kWarp, kDone };
enum Schedule : int { kForward = 0, kReverse = 1, kRandom = 2 };

// Computes a warp collective once for all participating lanes: reads each lane's `win`, writes its `wout`.
// `lanes[i]` is null for lanes outside `active`.
using WarpFn = void (*)(Fiber* const* lanes, uint32_t active);

struct PendingCopy {  // an emulated cp.async, performed at the matching wait
  void* dst;
  unsigned char bytes[16];
  unsigned group;
};

// The first cache line holds everything a barrier touches: with 128 fibers per block, the scheduler's speed is
// bounded by how many cache lines each switch brings in.
struct alignas(64) Fiber {
  Context ctx;
  uint3 tid;
  unsigned linear = 0, lane = 0, warp = 0;
  int state = kReady;
  int bar_result = 0;  // __syncthreads_count/and/or result handed to this thread at release
  int wait_line = 0;
  const char* wait_file = "";
  const char* wait_what = "";  // where the thread waits, for deadlock reports
  // warp collective slot
  uint32_t wmask = 0;
  bool waligned = false;
  WarpFn wfn = nullptr;
  const void* win = nullptr;
  void* wout = nullptr;
  std::vector<PendingCopy> copies;
  std::vector<uintptr_t> copy_rows;  // shared addresses of this thread's cp.async since the last barrier
  unsigned committed = 0;  // cp.async groups committed so far
  char* stack_lo = nullptr;
  size_t stack_size = 0;
#if CUFLASH_EMU_ASAN
  void* fake_stack = nullptr;
#endif
};

struct Launch {
  std::vector<Fiber> fibers;
  unsigned nthreads = 0, nwarps = 0;
  unsigned nready = 0, exited = 0;
  Context main;  // the launching context
  StackPool stacks;
  std::vector<uint32_t> warp_exists, warp_exited;
  std::vector<unsigned> warp_waiting;
  std::vector<unsigned> order;  // this round's run order
  int pos = 0;                  // position in `order`
  // the barrier being gathered
  unsigned bar_waiting = 0;
  const char* bar_file = "";
  int bar_line = 0;
  int bar_count = 0, bar_and = 1, bar_or = 0;
  int schedule = kForward;
  uint64_t rng = 0;
  bool failed = false;
  bool interrupted = false;       // stopped because `cancel` was set (Ctrl-C in Python)
  const int* cancel = nullptr;    // set to nonzero by another OS thread to stop the launch at the next switch
  bool hw_math = false;           // GPU-like fp32: flush-to-zero, ex2.approx errors (intrinsics.h)
  std::string error;
  int err_block[3] = {-1, -1, -1}, err_thread[3] = {-1, -1, -1};
  void (*thunk)(void*) = nullptr;
  void* thunk_ctx = nullptr;
#if CUFLASH_EMU_ASAN
  const void* main_stack_bottom = nullptr;
  size_t main_stack_size = 0;
  void* main_fake_stack = nullptr;
#endif
};

inline Launch g;

// Shared-memory bank conflicts of the accesses the emulator sees warp-wide. A request of (up to) 8 rows of 16 bytes
// (one 8x8 matrix of an ldmatrix; one quarter-warp of 16-byte cp.async stores) is served in as many wavefronts as
// the most distinct 4-byte words that fall in one of the 32 banks: 1 when conflict-free.
struct BankStats {
  unsigned long long requests[2] = {0, 0}, wavefronts[2] = {0, 0};  // [0] ldmatrix, [1] cp.async
};
inline BankStats g_banks;

inline void count_wavefronts(int kind, const uintptr_t* rows, int n) {
  uintptr_t words[32];
  int nwords = 0, worst = 1;
  for (int r = 0; r < n; ++r)
    for (int w = 0; w < 4; ++w) {
      uintptr_t word = rows[r] / 4 + w;
      bool seen = false;
      for (int i = 0; i < nwords; ++i) seen |= words[i] == word;
      if (!seen) words[nwords++] = word;
    }
  for (int i = 0; i < nwords; ++i) {
    int same_bank = 0;
    for (int j = 0; j < nwords; ++j) same_bank += words[j] % 32 == words[i] % 32;
    worst = same_bank > worst ? same_bank : worst;
  }
  g_banks.requests[kind] += 1, g_banks.wavefronts[kind] += unsigned(worst);
}
inline Fiber* g_cur = nullptr;  // the running fiber; null in the main context
inline uint3 g_block_idx;
inline dim3 g_block_dim, g_grid_dim;
inline void* g_dyn_smem = nullptr;
inline size_t g_dyn_smem_bytes = 0;

// All-ones bytes are NaN in f32, f16 and bf16 (and -1 in integers), so stale reads stand out.
inline void poison_bytes(void* p, size_t n) { memset(p, 0xff, n); }

// Static __shared__ variables: cuflash.emulate rewrites `__shared__ T name[N];` into a reference to storage
// from shared_var<T[N]>(lambda). The closure type is unique per declaration and per template instantiation, as
// CUDA's per-kernel shared variables are. Each variable gets its own exactly-sized heap block (so ASan sees
// overflows) and is registered, so every block starts with all of them NaN-filled.
struct SharedVar {
  void* p;
  size_t n;
};
inline std::vector<SharedVar>& shared_vars() {
  static std::vector<SharedVar> vars;
  return vars;
}
inline void* alloc_shared(size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, 128, n ? n : 1) != 0) abort();
  poison_bytes(p, n);
  shared_vars().push_back({p, n});
  return p;
}
template <typename T, typename Tag>
inline T& shared_var(Tag) {
  static T* p = static_cast<T*>(alloc_shared(sizeof(T)));
  return *p;
}

inline bool in_shared(const void* p, size_t n) {
  auto a = reinterpret_cast<uintptr_t>(p);
  auto within = [&](const void* base, size_t len) {
    auto b = reinterpret_cast<uintptr_t>(base);
    return a >= b && a + n <= b + len;
  };
  if (within(g_dyn_smem, g_dyn_smem_bytes)) return true;
  for (const SharedVar& v : shared_vars())
    if (within(v.p, v.n)) return true;
  return false;
}

// ---------------------------------------------------------------------------------------------- switching

// Without -mpopcnt, __builtin_popcount is a libgcc call; this is on the path of every warp collective.
inline unsigned popc(uint32_t x) {
  x = x - ((x >> 1) & 0x55555555u);
  x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
  return (((x + (x >> 4)) & 0x0f0f0f0fu) * 0x01010101u) >> 24;
}

inline void set_state(Fiber* f, int state) {
  g.nready += (state == kReady) - (f->state == kReady);
  f->state = state;
}

// Suspends `from` (null: the main context) and runs `to` (null: the main context). A dying fiber is never
// resumed, which AddressSanitizer must be told so that it drops the fiber's fake stack.
inline void switch_to(Fiber* from, Fiber* to, bool dying) {
#if CUFLASH_EMU_ASAN
  void** fake = dying ? nullptr : from ? &from->fake_stack : &g.main_fake_stack;
  __sanitizer_start_switch_fiber(fake, to ? to->stack_lo : g.main_stack_bottom,
                                 to ? to->stack_size : g.main_stack_size);
#else
  (void)dying;
#endif
  g_cur = to;
  context_switch(from ? from->ctx : g.main, to ? to->ctx : g.main);
#if CUFLASH_EMU_ASAN
  __sanitizer_finish_switch_fiber(from ? from->fake_stack : g.main_fake_stack, nullptr, nullptr);
#endif
}

inline uint64_t next_random() {  // splitmix64: tiny and good enough to permute threads
  uint64_t z = (g.rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline void make_order(std::vector<unsigned>& order, unsigned n) {
  order.resize(n);
  for (unsigned i = 0; i < n; ++i) order[i] = g.schedule == kReverse ? n - 1 - i : i;
  if (g.schedule == kRandom)
    for (unsigned i = n - 1; i > 0 && n > 1; --i) std::swap(order[i], order[next_random() % (i + 1)]);
}

// The next ready fiber of this round in schedule order, starting a new round past the end; null if none is ready.
inline Fiber* pick_next() {
  if (g.nready == 0) return nullptr;
  for (;;) {
    while (++g.pos < int(g.nthreads)) {
      Fiber* f = &g.fibers[g.order[g.pos]];
      if (f->state == kReady) return f;
    }
    make_order(g.order, g.nthreads);
    g.pos = -1;
  }
}

inline bool cancel_requested() { return g.cancel && __atomic_load_n(g.cancel, __ATOMIC_RELAXED) != 0; }

[[noreturn]] inline void fail(const char* fmt, ...);

// Gives up the processor: to the next ready fiber, or to the main context when none is (block done or stuck).
// Every barrier and waiting warp collective passes here, so this is where a launch notices a cancellation: a
// block is abandoned as on an error, and the launch returns within one barrier round.
inline void yield(bool dying = false) {
  if (cancel_requested()) {
    g.interrupted = true;
    fail("launch interrupted");
  }
  Fiber* self = g_cur;
  Fiber* next = pick_next();
  if (next != self) switch_to(self, next, dying);
}

// ---------------------------------------------------------------------------------------------- errors

inline void set_error(const char* fmt, va_list ap) {
  if (g.failed) return;  // keep the first error: later ones are consequences
  char buf[1024];
  vsnprintf(buf, sizeof buf, fmt, ap);
  g.failed = true;
  g.error = buf;
  g.err_block[0] = int(g_block_idx.x), g.err_block[1] = int(g_block_idx.y), g.err_block[2] = int(g_block_idx.z);
  if (g_cur) {
    g.err_thread[0] = int(g_cur->tid.x), g.err_thread[1] = int(g_cur->tid.y), g.err_thread[2] = int(g_cur->tid.z);
  }
}

// Reports an error from inside a fiber and abandons the whole block (no fiber is resumed).
[[noreturn]] __attribute__((format(printf, 1, 2))) inline void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error(fmt, ap);
  va_end(ap);
  if (!g_cur) {  // not in a fiber: nothing sensible to unwind to
    fprintf(stderr, "cuflash emulator: %s\n", g.error.c_str());
    abort();
  }
  switch_to(g_cur, nullptr, true);
  __builtin_unreachable();
}

inline void main_error(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error(fmt, ap);
  va_end(ap);
}

// ---------------------------------------------------------------------------------------------- barriers

// The k-th cp.async of each lane since the last barrier is one warp instruction (load loops are warp-uniform), and
// 16-byte stores are served a quarter-warp at a time.
inline void count_copy_wavefronts() {
  for (unsigned w = 0; w < g.nwarps; ++w)
    for (unsigned quarter = 0; quarter < 4; ++quarter) {
      Fiber* lanes = &g.fibers[32 * w + 8 * quarter];
      for (size_t k = 0;; ++k) {
        uintptr_t rows[8];
        int n = 0;
        for (unsigned l = 0; l < 8 && 32 * w + 8 * quarter + l < g.nthreads; ++l)
          if (k < lanes[l].copy_rows.size()) rows[n++] = lanes[l].copy_rows[k];
        if (n == 0) break;
        count_wavefronts(1, rows, n);
      }
    }
  for (unsigned i = 0; i < g.nthreads; ++i) g.fibers[i].copy_rows.clear();
}

inline int syncthreads_at(const char* file, int line, int pred = 0, int reduce = 0) {
  Fiber* f = g_cur;
  if (g.exited)
    fail("__syncthreads at %s:%d can never complete: %u thread(s) of the block already exited (deadlock)", file,
         line, g.exited);
  if (g.bar_waiting == 0) {
    g.bar_file = file, g.bar_line = line;
    g.bar_count = 0, g.bar_and = 1, g.bar_or = 0;
  } else if (line != g.bar_line || (file != g.bar_file && strcmp(file, g.bar_file) != 0)) {
    fail("divergent __syncthreads: this thread is at %s:%d while %u thread(s) wait at %s:%d", file, line,
         g.bar_waiting, g.bar_file, g.bar_line);
  }
  g.bar_count += pred != 0, g.bar_and &= pred != 0, g.bar_or |= pred != 0;
  set_state(f, kBarrier);
  f->wait_what = "__syncthreads", f->wait_file = file, f->wait_line = line;
  if (++g.bar_waiting == g.nthreads) {
    count_copy_wavefronts();
    int result = reduce == 1 ? g.bar_count : reduce == 2 ? g.bar_and : g.bar_or;
    for (unsigned i = 0; i < g.nthreads; ++i) g.fibers[i].state = kReady, g.fibers[i].bar_result = result;
    g.nready = g.nthreads;
    g.bar_waiting = 0;
  }
  yield();  // even the last arrival yields, so the schedule decides who runs first after the barrier
  return f->bar_result;
}

// ---------------------------------------------------------------------------------------------- warp collectives

// Completes the collective `f` waits in if every live lane of its mask has arrived with the same mask.
inline bool try_complete(Fiber* f) {
  unsigned w = f->warp;
  uint32_t need = f->wmask & g.warp_exists[w] & ~g.warp_exited[w];
  if (popc(need) > g.warp_waiting[w]) return false;
  Fiber* base = &g.fibers[w * 32];
  Fiber* lanes[32] = {};
  for (uint32_t m = need; m; m &= m - 1) {
    Fiber* t = base + __builtin_ctz(m);
    if (t->state != kWarp || t->wmask != f->wmask) return false;
    if (t->wfn != f->wfn)
      fail("divergent warp collectives in warp %u: lane %u is in %s, lane %u in %s (same mask 0x%08x)", w, t->lane,
           t->wait_what, f->lane, f->wait_what, f->wmask);
    lanes[t->lane] = t;
  }
  if (f->waligned && need != 0xffffffffu)
    fail("%s needs all 32 lanes of warp %u, but only lanes 0x%08x are present (mask 0x%08x)", f->wait_what, w, need,
         f->wmask);
  f->wfn(lanes, need);
  for (uint32_t m = need; m; m &= m - 1) set_state(base + __builtin_ctz(m), kReady);
  g.warp_waiting[w] -= popc(need);
  return true;
}

// Deposits this lane's operands and waits until the collective has been computed for the whole mask.
// The lane that completes the set computes it and continues without a switch (thousands of mma per block).
inline void warp_collective(const char* what, uint32_t mask, WarpFn fn, const void* in, void* out,
                            bool aligned = false) {
  Fiber* f = g_cur;
  if (!(mask & (1u << f->lane)))
    fail("%s: mask 0x%08x does not include the calling lane %u", what, mask, f->lane);
  f->wmask = mask, f->wfn = fn, f->win = in, f->wout = out, f->waligned = aligned;
  f->wait_what = what, f->wait_file = "", f->wait_line = 0;
  set_state(f, kWarp);
  g.warp_waiting[f->warp]++;
  if (!try_complete(f)) yield();
}

// ---------------------------------------------------------------------------------------------- fiber life

inline void thread_exit(Fiber* f) {
  set_state(f, kDone);
  g.exited++;
  g.warp_exited[f->warp] |= 1u << f->lane;
  if (g.bar_waiting)
    fail("__syncthreads at %s:%d can never complete: this thread exited while %u thread(s) wait there (deadlock)",
         g.bar_file, g.bar_line, g.bar_waiting);
  // Lanes waiting for this one in a shuffle may now be complete (exited lanes do not participate).
  Fiber* base = &g.fibers[f->warp * 32];
  for (unsigned l = 0; l < 32 && f->warp * 32 + l < g.nthreads; ++l)
    if (base[l].state == kWarp) try_complete(base + l);
}

// Not inline: only the assembly entry stub calls it, which does not count as a use for the compiler.
extern "C" __attribute__((visibility("hidden"), noreturn, used)) void cuflash_emu_fiber_main(Fiber* f) {
#if CUFLASH_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  g.thunk(g.thunk_ctx);
  thread_exit(f);
  Fiber* next = pick_next();
  switch_to(f, next, true);  // never resumed
  __builtin_unreachable();
}

// ---------------------------------------------------------------------------------------------- scheduling

// Appends "a-b" / "a" runs of the thread indices in `ids` to `out`.
inline void format_ranges(std::string& out, const std::vector<unsigned>& ids) {
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    char buf[48];
    snprintf(buf, sizeof buf, i == j ? "%s%u" : "%s%u-%u", i ? "," : "", ids[i], ids[j]);
    out += buf;
    i = j + 1;
  }
}

// No fiber can run but some have not finished: say who waits where.
inline void report_stuck() {
  std::string msg = "deadlock: no thread can proceed;";
  std::vector<const Fiber*> groups;
  const Fiber* end = g.fibers.data() + g.nthreads;
  auto same = [](const Fiber& a, const Fiber& b) {
    return a.state == b.state && a.wait_what == b.wait_what &&
           (a.state != kWarp || (a.wmask == b.wmask && a.warp == b.warp));
  };
  for (const Fiber* tp = g.fibers.data(); tp != end; ++tp) {
    const Fiber& t = *tp;
    if (t.state == kDone) continue;
    bool seen = false;
    for (const Fiber* h : groups) seen |= same(*h, t);
    if (seen) continue;
    groups.push_back(&t);
    std::vector<unsigned> ids;
    for (const Fiber* u = g.fibers.data(); u != end; ++u)
      if (same(*u, t)) ids.push_back(u->linear);
    char buf[160];
    if (t.state == kBarrier)
      snprintf(buf, sizeof buf, " threads ");
    else
      snprintf(buf, sizeof buf, " warp %u threads ", t.warp);
    msg += buf;
    format_ranges(msg, ids);
    if (t.state == kBarrier)
      snprintf(buf, sizeof buf, " wait at __syncthreads (%s:%d);", t.wait_file, t.wait_line);
    else
      snprintf(buf, sizeof buf, " wait in %s with mask 0x%08x;", t.wait_what, t.wmask);
    msg += buf;
  }
  if (g.exited) msg += " " + std::to_string(g.exited) + " thread(s) exited";
  main_error("%s", msg.c_str());
}

inline void init_block(unsigned n, size_t stack_bytes) {
  g.exited = 0, g.bar_waiting = 0, g.nready = n;
  std::fill(g.warp_exited.begin(), g.warp_exited.end(), 0u);
  std::fill(g.warp_waiting.begin(), g.warp_waiting.end(), 0u);
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = g.fibers[i];
    f.state = kReady;
    f.copies.clear();
    f.committed = 0;
    // Stagger the stack tops: at identical offsets modulo the page size, all fibers' hot frames would compete
    // for the same L1/L2 cache sets.
    f.stack_lo = g.stacks.low(i), f.stack_size = stack_bytes - (i * 576) % 4096;
    context_init(f.ctx, f.stack_lo, f.stack_size, &f);
  }
  for (const SharedVar& v : shared_vars()) poison_bytes(v.p, v.n);
  poison_bytes(g_dyn_smem, g_dyn_smem_bytes);
}

// Runs one block to completion (or failure) and returns to the main context.
inline void run_block() {
  g.pos = int(g.nthreads);  // the first pick starts a round
  Fiber* first = pick_next();
  switch_to(nullptr, first, false);
  if (!g.failed && g.exited != g.nthreads) report_stuck();
}

inline void setup_threads(const dim3& block) {
  unsigned n = block.x * block.y * block.z;
  g.nthreads = n;
  g.nwarps = (n + 31) / 32;
  if (g.fibers.size() < size_t(g.nwarps) * 32) g.fibers.resize(size_t(g.nwarps) * 32);
  g.warp_exists.assign(g.nwarps, 0u);
  g.warp_exited.assign(g.nwarps, 0u);
  g.warp_waiting.assign(g.nwarps, 0u);
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = g.fibers[i];
    f.linear = i, f.lane = i % 32, f.warp = i / 32;
    f.tid = make_uint3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
    g.warp_exists[f.warp] |= 1u << f.lane;
  }
}

inline void find_main_stack() {
#if CUFLASH_EMU_ASAN
  pthread_attr_t attr;
  void* addr = nullptr;
  size_t size = 0;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    pthread_attr_getstack(&attr, &addr, &size);
    pthread_attr_destroy(&attr);
  }
  g.main_stack_bottom = addr, g.main_stack_size = size;
#endif
}

// A fiber that overflows its stack hits the guard page below it (-fstack-clash-protection makes big frames probe
// every page). That cannot be turned into an exception, but it can at least say what happened: this handler
// prints the advice and hands the fault back to whoever handled SIGSEGV before (pytest's faulthandler, or the
// default action) by restoring that handler and returning, which re-executes the faulting access.
struct SegvHook {
  struct sigaction previous;
  stack_t previous_stack;
  bool installed = false;
  alignas(16) char alt_stack[64 * 1024];
};
inline SegvHook g_segv;

inline void on_segv(int, siginfo_t* info, void*) {
  auto a = reinterpret_cast<uintptr_t>(info->si_addr), lo = reinterpret_cast<uintptr_t>(g.stacks.base);
  if (a >= lo && a < lo + g.stacks.len) {
    char msg[320];
    int n = snprintf(msg, sizeof msg,
                     "\ncuflash emulator: fiber stack overflow in block (%u,%u,%u) thread (%u,%u,%u): raise "
                     "CUFLASH_EMULATE_STACK_KIB (now %zu KiB) or launch(..., stack_kib=...)\n",
                     g_block_idx.x, g_block_idx.y, g_block_idx.z, g_cur ? g_cur->tid.x : 0u, g_cur ? g_cur->tid.y : 0u,
                     g_cur ? g_cur->tid.z : 0u, g.stacks.size / 1024);
    if (write(2, msg, size_t(n)) < 0) {
    }
  }
  sigaction(SIGSEGV, &g_segv.previous, nullptr);
}

inline void hook_segv(bool on) {
#if !CUFLASH_EMU_ASAN  // ASan reports stack overflows itself
  if (on) {
    stack_t ss{};
    ss.ss_sp = g_segv.alt_stack, ss.ss_size = sizeof g_segv.alt_stack;
    struct sigaction act{};
    act.sa_sigaction = on_segv;
    act.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&act.sa_mask);
    g_segv.installed = sigaltstack(&ss, &g_segv.previous_stack) == 0 &&
                       sigaction(SIGSEGV, &act, &g_segv.previous) == 0;
  } else if (g_segv.installed) {
    sigaction(SIGSEGV, &g_segv.previous, nullptr);
    sigaltstack(&g_segv.previous_stack, nullptr);
    g_segv.installed = false;
  }
#else
  (void)on;
#endif
}

// The GPU's fp32 mode under CuPy (-ftz=true): denormal results flushed to zero (MXCSR FTZ, bit 15) and denormal
// operands read as zero (DAZ, bit 6). g++ does float arithmetic with SSE on x86-64, so MXCSR governs it. MXCSR
// is per OS thread and the fibers all run on the launching thread: set once per launch, restored at its end.
struct FloatMode {
  unsigned saved = 0;
  bool ok = true;
  explicit FloatMode(bool hw) {
#if defined(__x86_64__)
    saved = __builtin_ia32_stmxcsr();
    if (hw) __builtin_ia32_ldmxcsr(saved | 0x8040u);
#else
    ok = !hw;  // no flush-to-zero control written for this architecture
#endif
  }
  ~FloatMode() {
#if defined(__x86_64__)
    __builtin_ia32_ldmxcsr(saved);
#endif
  }
};

inline int launch_result() { return g.interrupted ? 2 : g.failed ? 1 : 0; }

// Runs thunk(ctx) as the body of every thread of every block. Returns 0; 1 with g.error set; or 2 when `cancel`
// became nonzero (checked between blocks and at every barrier or warp collective that waits).
inline int run_grid(dim3 grid, dim3 block, size_t shared_bytes, int schedule, uint64_t seed, size_t stack_bytes,
                    void (*thunk)(void*), void* ctx, const int* cancel, bool hw_math) {
  g.failed = g.interrupted = false;
  g.cancel = cancel, g.hw_math = hw_math;
  g.error.clear();
  for (int i = 0; i < 3; ++i) g.err_block[i] = g.err_thread[i] = -1;
  g.schedule = schedule, g.rng = seed, g.thunk = thunk, g.thunk_ctx = ctx;
  g_banks = BankStats{};
  g_grid_dim = grid, g_block_dim = block;
  find_main_stack();
  setup_threads(block);
  if (!g.stacks.reserve(g.nthreads, stack_bytes)) {
    g.failed = true, g.error = "cannot map fiber stacks";
    return 1;
  }
  // Exactly shared_bytes, so that under AddressSanitizer the first byte past it is a reported overflow.
  void* dyn = nullptr;
  if (posix_memalign(&dyn, 128, shared_bytes ? shared_bytes : 1) != 0) {
    g.failed = true, g.error = "cannot allocate dynamic shared memory";
    return 1;
  }
  g_dyn_smem = dyn, g_dyn_smem_bytes = shared_bytes;
  std::vector<unsigned> blocks;
  make_order(blocks, grid.x * grid.y * grid.z);  // blocks are independent: their order follows the schedule too
  FloatMode mode(hw_math);
  if (!mode.ok) main_error("hw_math needs an x86-64 CPU (its flush-to-zero mode is set through MXCSR)");
  hook_segv(true);
  for (unsigned b : blocks) {
    if (g.failed) break;
    if (cancel_requested()) {
      g.interrupted = true;
      main_error("launch interrupted");
      break;
    }
    g_block_idx = make_uint3(b % grid.x, (b / grid.x) % grid.y, b / (grid.x * grid.y));
    init_block(g.nthreads, g.stacks.size);
    run_block();
    count_copy_wavefronts();  // copies after the block's last barrier
  }
  hook_segv(false);
  fflush(stdout);  // device printf output appears before Python's next print
  free(dyn);
  g_dyn_smem = nullptr, g_dyn_smem_bytes = 0;
  // Every kernel library has its own runtime, so stacks kept between launches would stay mapped once per library
  // ever loaded, each guard page splitting the mapping in two: a long test process loading a few hundred libraries
  // ran out of the kernel's 65530 mappings per process (vm.max_map_count) and every later dlopen failed. Mapping
  // them per launch costs one mmap and one mprotect per thread.
  g.stacks.release();
  return launch_result();
}

}  // namespace cuflash_emu

#endif  // CUFLASH_EMULATE_RUNTIME_H_
