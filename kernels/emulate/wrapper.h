// Support for the launch wrapper that cuflash.emulate appends to each kernel source: it describes the kernel's
// parameter types to Python (so arguments are checked before the call) and unpacks the argument buffer.
#pragma once
#ifndef CUFLASH_EMULATE_WRAPPER_H_
#define CUFLASH_EMULATE_WRAPPER_H_
#include <cstddef>
#include <cstdio>
#include <type_traits>
#include <utility>

#include "runtime.h"

namespace cuflash_emu {

enum ParamKind : int { kOther = 0, kPointer = 1, kSigned = 2, kUnsigned = 3, kFloat = 4, kBool = 5 };

template <typename T, typename = void>
struct Underlying {
  using type = T;
};
template <typename T>
struct Underlying<T, std::enable_if_t<std::is_enum<T>::value>> {
  using type = std::underlying_type_t<T>;
};

template <typename T>
constexpr int kind_of() {
  using U = typename Underlying<std::remove_cv_t<T>>::type;
  if (std::is_pointer<U>::value) return kPointer;
  if (std::is_same<U, bool>::value) return kBool;
  if (std::is_floating_point<U>::value) return kFloat;
  if (std::is_integral<U>::value) return std::is_signed<U>::value ? kSigned : kUnsigned;
  return kOther;
}

template <typename T, typename = void>
struct SizeIfComplete {  // void and incomplete types: unknown (0)
  static constexpr int value = 0;
};
template <typename T>
struct SizeIfComplete<T, std::void_t<decltype(sizeof(T))>> {
  static constexpr int value = int(sizeof(T));
};

// "... [with T = const __half*]": Python cuts the spelled type out of this for its error messages.
template <typename T>
const char* type_name() {
  return __PRETTY_FUNCTION__;
}

template <typename F>
struct Signature;

template <typename... A>
struct Signature<void (*)(A...)> {
  // Four ints per parameter: kind, size, pointee kind, pointee size.
  static int describe(int* desc, const char** names, int max) {
    int i = 0;
    auto one = [&](int kind, int size, int pkind, int psize, const char* name) {
      if (i < max) desc[4 * i] = kind, desc[4 * i + 1] = size, desc[4 * i + 2] = pkind, desc[4 * i + 3] = psize,
                   names[i] = name;
      ++i;
    };
    (one(kind_of<A>(), int(sizeof(A)), kind_of<std::remove_cv_t<std::remove_pointer_t<A>>>(),
         SizeIfComplete<std::remove_cv_t<std::remove_pointer_t<A>>>::value, type_name<A>()),
     ...);
    return int(sizeof...(A));
  }
  template <size_t... I>
  static void call_impl(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
  }
  static void call(void (*kernel)(A...), void** args) {
    call_impl(kernel, args, std::index_sequence_for<A...>());
  }
};

inline int launch_entry(void** args, const unsigned* grid, const unsigned* block, size_t shared_bytes, int schedule,
                        unsigned long long seed, size_t stack_bytes, const int* cancel, int hw_math,
                        void (*thunk)(void*), char* err, size_t err_len, int* where) {
  int rc = run_grid(dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]), shared_bytes, schedule,
                    seed, stack_bytes, thunk, args, cancel, hw_math != 0);
  if (rc) {
    snprintf(err, err_len, "%s", g.error.c_str());
    for (int i = 0; i < 3; ++i) where[i] = g.err_block[i], where[3 + i] = g.err_thread[i];
  }
  return rc;
}

}  // namespace cuflash_emu

#endif  // CUFLASH_EMULATE_WRAPPER_H_
