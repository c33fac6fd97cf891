// Included first by the AVX2-based builds of the CPU inner loops
// (copy_scale_avx2.cpp, copy_scale_avx512bf16.cpp), on x86 only: every
// function after it is built for AVX2+FMA+F16C. g++ (unlike gcc) does not
// define the ISA macros for a target pragma, and the vector headers (ATen's,
// sleef's) select their AVX2 code by those macros, so they are defined here.
// The includer defines CPU_CAPABILITY (the at::vec namespace) and
// CPU_CAPABILITY_AVX2 itself.
//
// The C++ standard library comes first, outside the target: libstdc++ 13 marks
// std::allocator's members always_inline, and a copy of them built for AVX2
// cannot be inlined into the library's own default-target code ("inlining
// failed in call to 'always_inline' ... target specific option mismatch").
// Included here, every standard header the vector headers use is built for
// the default target, as in every other file.
#pragma once
#include <algorithm>
#include <array>
#include <atomic>
#include <bitset>
#include <chrono>
#include <climits>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>
#pragma GCC target("avx2,fma,f16c")
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
