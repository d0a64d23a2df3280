// Cooperative fibers for the CPU emulator: one fiber per CUDA thread, all on the calling OS thread.
//
// The switch is hand-written on x86-64 (callee-saved registers + stack pointer, a few ns) because glibc's
// swapcontext makes a signal-mask syscall per switch (~20x slower per barrier). Other architectures, or
// -DCUFLASH_EMU_UCONTEXT, fall back to ucontext.
#pragma once
#ifndef CUFLASH_EMULATE_FIBER_H_
#define CUFLASH_EMULATE_FIBER_H_
#include <cstddef>
#include <cstdint>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUFLASH_EMU_ASAN 1
#else
#define CUFLASH_EMU_ASAN 0
#endif

#if !defined(__x86_64__) && !defined(CUFLASH_EMU_UCONTEXT)
#define CUFLASH_EMU_UCONTEXT 1
#endif
#if defined(CUFLASH_EMU_UCONTEXT)
#include <ucontext.h>
#endif

namespace cuflash_emu {

struct Fiber;
extern "C" __attribute__((visibility("hidden"), noreturn)) void cuflash_emu_fiber_main(Fiber* f);

// A saved execution context: the stack pointer of a suspended fiber (or of the scheduler).
struct Context {
#if defined(CUFLASH_EMU_UCONTEXT)
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
};

#if !defined(CUFLASH_EMU_UCONTEXT)
extern "C" void cuflash_emu_switch(void** save_sp, void* load_sp);
extern "C" void cuflash_emu_entry();
// switch: push the callee-saved registers, swap stacks, pop them from the other stack, return into it.
// entry: first "return" of a new fiber; rbx holds the Fiber* placed in its initial frame.
asm(R"(
  .text
  .p2align 4
  .hidden cuflash_emu_switch
  .globl cuflash_emu_switch
  .type cuflash_emu_switch, @function
cuflash_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuflash_emu_switch, .-cuflash_emu_switch

  .p2align 4
  .hidden cuflash_emu_entry
  .globl cuflash_emu_entry
  .type cuflash_emu_entry, @function
cuflash_emu_entry:
  movq %rbx, %rdi
  call cuflash_emu_fiber_main
  ud2
  .size cuflash_emu_entry, .-cuflash_emu_entry
)");
#endif

// Stacks for all fibers of a block in one mapping, each with a PROT_NONE guard page below it so an
// overflow faults instead of silently corrupting the neighbouring fiber.
struct StackPool {
  char* base = nullptr;
  size_t len = 0, stride = 0, size = 0;
  unsigned count = 0;

  bool reserve(unsigned n, size_t stack_bytes) {
    size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    size_t size_rounded = (stack_bytes + page - 1) / page * page;
    if (base && n <= count && size_rounded == size) return true;
    release();
    stride = size_rounded + page;
    len = stride * n;
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    base = static_cast<char*>(p);
    for (unsigned i = 0; i < n; ++i) mprotect(base + i * stride, page, PROT_NONE);
    size = size_rounded;
    count = n;
    return true;
  }
  char* low(unsigned i) const { return base + i * stride + (stride - size); }
  void release() {
    if (base) munmap(base, len);
    base = nullptr;
    count = 0;
  }
};

// Prepares `ctx` so that the first switch into it runs cuflash_emu_fiber_main(f) on the given stack.
inline void context_init(Context& ctx, char* stack_lo, size_t stack_size, Fiber* f) {
#if CUFLASH_EMU_ASAN
  // A stack reused after an aborted launch may still carry redzone poison from abandoned frames.
  __asan_unpoison_memory_region(stack_lo, stack_size);
#endif
#if defined(CUFLASH_EMU_UCONTEXT)
  getcontext(&ctx.uc);
  ctx.uc.uc_stack.ss_sp = stack_lo;
  ctx.uc.uc_stack.ss_size = stack_size;
  ctx.uc.uc_link = nullptr;
  uintptr_t p = reinterpret_cast<uintptr_t>(f);
  makecontext(&ctx.uc, reinterpret_cast<void (*)()>(+[](unsigned hi, unsigned lo) {
                cuflash_emu_fiber_main(reinterpret_cast<Fiber*>((uintptr_t(hi) << 32) | lo));
              }),
              2, unsigned(p >> 32), unsigned(p & 0xffffffffu));
#else
  // Frame popped by cuflash_emu_switch: r15 r14 r13 r12 rbx rbp, then the return address. After the
  // `ret` rsp must be 16-byte aligned so that the `call` in the entry stub gives the ABI's alignment.
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack_lo) + stack_size) & ~uintptr_t(15);
  void** frame = reinterpret_cast<void**>(top - 16 - 7 * sizeof(void*));
  for (int i = 0; i < 6; ++i) frame[i] = nullptr;
  frame[4] = f;  // rbx
  frame[6] = reinterpret_cast<void*>(&cuflash_emu_entry);
  ctx.sp = frame;
#endif
}

inline void context_switch(Context& from, Context& to) {
#if defined(CUFLASH_EMU_UCONTEXT)
  swapcontext(&from.uc, &to.uc);
#else
  cuflash_emu_switch(&from.sp, to.sp);
#endif
}

}  // namespace cuflash_emu

#endif  // CUFLASH_EMULATE_FIBER_H_
