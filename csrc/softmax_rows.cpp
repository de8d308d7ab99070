// Per-row softmax statistics and softmax gradients, vectorised with GNU vector extensions and compiled
// once per x86 ISA level (runtime dispatch; see softmax_rows.h). The ISA is set per function with
// target attributes, not per file: a `#pragma GCC target` or per-file -mavx512f would also compile the
// inline functions of the headers for AVX-512, and the linker may keep that copy for every caller.
// The templates below are force-inlined into each level's entry points so they get that level's ISA.

#include "softmax_rows.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#if !(defined(__GNUC__) || defined(__clang__))
#error "csrc/softmax_rows.cpp needs GNU vector extensions (GCC or Clang)"
#endif

// Passing wide vectors between always-inline helpers triggers ABI notes that do not apply here.
#pragma GCC diagnostic ignored "-Wpsabi"

#define OL_INLINE inline __attribute__((always_inline))

namespace openrlhf_lopti {
namespace {

template <int W>
struct Vec {
  typedef float f __attribute__((vector_size(W * 4)));
  typedef int32_t i __attribute__((vector_size(W * 4)));
  typedef uint32_t u __attribute__((vector_size(W * 4)));
  typedef uint16_t h __attribute__((vector_size(W * 2)));
};

template <class V, class S>
OL_INLINE V splat(S s) {
  V v = {};
  return v + s;
}

template <int W>
OL_INLINE typename Vec<W>::f select(typename Vec<W>::i cond, typename Vec<W>::f yes, typename Vec<W>::f no) {
  using I = typename Vec<W>::i;
  using F = typename Vec<W>::f;
  return (F)(((I)yes & cond) | ((I)no & ~cond));
}

template <int W>
OL_INLINE typename Vec<W>::f vmax(typename Vec<W>::f a, typename Vec<W>::f b) {
  return select<W>(a > b, a, b);
}

// exp(x) for x <= 88 in fp32 (relative error < 1e-7 on [-87, 0], checked in tests/test_ops_cpp.py):
// x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial (Cephes expf coefficients), 2^n by an
// integer add into the exponent bits. Results below exp(-87) (< 2e-38) are flushed to exactly 0 so 2^n
// never leaves the normal range. NaN stays NaN.
template <int W>
OL_INLINE typename Vec<W>::f vexp(typename Vec<W>::f x) {
  using F = typename Vec<W>::f;
  using I = typename Vec<W>::i;
  const I underflow = x < splat<F>(-87.0f);
  x = select<W>(x > splat<F>(88.0f), splat<F>(88.0f), x);
  x = select<W>(underflow, splat<F>(0.0f), x);
  // Round x / ln2 to the nearest integer with the 1.5 * 2^23 trick (no rounding instruction needed).
  const F magic = splat<F>(12582912.0f);
  F kf = x * 1.44269504088896341f + magic;
  const I n = (I)kf - (I)magic;
  kf = kf - magic;
  F r = x - kf * 0.693359375f;
  r = r - kf * -2.12194440e-4f;
  F p = splat<F>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const I bits = (I)p + (n << 23);
  return (F)(bits & ~underflow);
}

template <int W>
OL_INLINE float hsum(typename Vec<W>::f v) {
  float s = 0.0f;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
}

template <int W>
OL_INLINE float hmax(typename Vec<W>::f v) {
  float m = v[0];
  for (int l = 1; l < W; ++l) m = v[l] > m ? v[l] : m;
  return m;
}

// Loads and stores of W elements of a row, widened to / narrowed from fp32.
template <int W>
struct Float32IO {
  using T = float;
  using F = typename Vec<W>::f;
  static OL_INLINE F load(const T* p) {
    F v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static OL_INLINE void store(T* p, F v) { std::memcpy(p, &v, sizeof(v)); }
};

template <int W>
struct BFloat16IO {
  using T = uint16_t;
  using F = typename Vec<W>::f;
  using U = typename Vec<W>::u;
  using H = typename Vec<W>::h;
  static OL_INLINE F load(const T* p) {
    H h;
    std::memcpy(&h, p, sizeof(h));
    return (F)(__builtin_convertvector(h, U) << 16);
  }
  // Round to nearest even; NaN becomes the canonical quiet NaN (as c10::BFloat16 does).
  static OL_INLINE void store(T* p, F v) {
    using I = typename Vec<W>::i;
    const U bits = (U)v;
    const U rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const I is_nan = v != v;
    const U out = ((U)is_nan & 0x7FC0u) | (rounded & ~(U)is_nan);
    const H h = __builtin_convertvector(out, H);
    std::memcpy(p, &h, sizeof(h));
  }
};

// A partial vector for a row's tail: the first `count` lanes from `p`, the others `fill`.
template <class IO, int W>
OL_INLINE typename Vec<W>::f load_tail(const typename IO::T* p, int64_t count, typename IO::T fill) {
  typename IO::T buf[W];
  for (int l = 0; l < W; ++l) buf[l] = l < count ? p[l] : fill;
  return IO::load(buf);
}

template <int W>
OL_INLINE typename Vec<W>::i lanes_below(int64_t count) {
  typename Vec<W>::i lane;
  for (int l = 0; l < W; ++l) lane[l] = l;
  return lane < splat<typename Vec<W>::i>((int32_t)count);
}

template <class IO, int W>
OL_INLINE RowSoftmaxStats stats_impl(const void* row_ptr, int64_t v, float inv_t, bool with_entropy) {
  using F = typename Vec<W>::f;
  using T = typename IO::T;
  const T* row = static_cast<const T*>(row_ptr);
  const int64_t body = v - v % W;
  const int64_t rest = v - body;

  // Pass 1: the max (memory bound; the row stays in cache for pass 2).
  F m0 = splat<F>(-std::numeric_limits<float>::infinity());
  F m1 = m0;
  int64_t j = 0;
  for (; j + 2 * W <= body; j += 2 * W) {
    m0 = vmax<W>(m0, IO::load(row + j));
    m1 = vmax<W>(m1, IO::load(row + j + W));
  }
  for (; j < body; j += W) m0 = vmax<W>(m0, IO::load(row + j));
  float mx = hmax<W>(vmax<W>(m0, m1));
  if (rest) {
    const float tail = hmax<W>(load_tail<IO, W>(row + body, rest, row[0]));
    mx = tail > mx ? tail : mx;
  }
  mx *= inv_t;  // monotone: max(z) * inv_t == max(z * inv_t)

  // Pass 2: sum of exp(t) and, for the entropy, of exp(t) * t. A NaN t flags the row (a NaN logit, which
  // the max may have skipped): one compare per vector, no extra pass over the row.
  // exp(t) * t is taken with t floored at -88: a -inf logit has exp(t) = 0, and 0 * -inf would be NaN.
  using I = typename Vec<W>::i;
  const F it = splat<F>(inv_t);
  const F mv = splat<F>(mx);
  const F floor = splat<F>(-88.0f);
  F s = {}, q = {};
  I nan = {};
  if (with_entropy) {
    for (j = 0; j < body; j += W) {
      const F t = IO::load(row + j) * it - mv;
      const F e = vexp<W>(t);
      nan |= t != t;
      s += e;
      q += e * vmax<W>(t, floor);
    }
  } else {
    for (j = 0; j < body; j += W) {
      const F t = IO::load(row + j) * it - mv;
      nan |= t != t;
      s += vexp<W>(t);
    }
  }
  if (rest) {
    const I valid = lanes_below<W>(rest);
    const F t = select<W>(valid, load_tail<IO, W>(row + body, rest, row[0]) * it - mv, splat<F>(0.0f));
    const F e = select<W>(valid, vexp<W>(t), splat<F>(0.0f));
    nan |= t != t;
    s += e;
    q += e * vmax<W>(t, floor);
  }
  // A non-finite max catches the rest: every entry -inf, a +inf, or an overflow of z * inv_t (with fused
  // multiply-adds, t = fma(z, inv_t, -inf) is -inf rather than NaN there).
  bool finite = std::isfinite(mx);
  for (int l = 0; l < W; ++l) finite = finite && nan[l] == 0;
  return {mx, hsum<W>(s), with_entropy ? hsum<W>(q) : 0.0f, finite};
}

// Without an entropy gradient (b == 0) the b * u term is left out, not multiplied by zero. With it, u is
// floored at -88 inside that term: u is -inf for a -inf logit, where p = 0 and the gradient must be 0, not
// 0 * -inf = NaN (below -87 exp is flushed to 0, so the floor changes no other value).
template <int W, bool kWithEntropy>
OL_INLINE typename Vec<W>::f grad_lanes(typename Vec<W>::f z, typename Vec<W>::f inv_t, typename Vec<W>::f max,
                                        typename Vec<W>::f log_sum, typename Vec<W>::f a, typename Vec<W>::f b) {
  using F = typename Vec<W>::f;
  const F u = (z * inv_t - max) - log_sum;
  return kWithEntropy ? -vexp<W>(u) * (a + b * vmax<W>(u, splat<F>(-88.0f))) : -vexp<W>(u) * a;
}

template <class IO, int W, bool kWithEntropy>
OL_INLINE void grad_loop(const typename IO::T* row, int64_t v, float inv_t, float max, float log_sum, float a,
                         float b, typename IO::T* out) {
  using F = typename Vec<W>::f;
  using T = typename IO::T;
  const int64_t body = v - v % W;
  const int64_t rest = v - body;
  const F it = splat<F>(inv_t), mv = splat<F>(max), ls = splat<F>(log_sum);
  const F av = splat<F>(a), bv = splat<F>(b);
  for (int64_t j = 0; j < body; j += W) {
    IO::store(out + j, grad_lanes<W, kWithEntropy>(IO::load(row + j), it, mv, ls, av, bv));
  }
  if (rest) {
    T buf[W];
    IO::store(buf, grad_lanes<W, kWithEntropy>(load_tail<IO, W>(row + body, rest, row[0]), it, mv, ls, av, bv));
    for (int64_t l = 0; l < rest; ++l) out[body + l] = buf[l];
  }
}

template <class IO, int W>
OL_INLINE void grad_impl(
    const void* row_ptr, int64_t v, float inv_t, float max, float log_sum, float a, float b, void* out_ptr) {
  const auto* row = static_cast<const typename IO::T*>(row_ptr);
  auto* out = static_cast<typename IO::T*>(out_ptr);
  if (b == 0.0f) {
    grad_loop<IO, W, false>(row, v, inv_t, max, log_sum, a, b, out);
  } else {
    grad_loop<IO, W, true>(row, v, inv_t, max, log_sum, a, b, out);
  }
}

struct Kernels {
  RowSoftmaxStats (*stats_f32)(const void*, int64_t, float, bool);
  RowSoftmaxStats (*stats_bf16)(const void*, int64_t, float, bool);
  void (*grad_f32)(const void*, int64_t, float, float, float, float, float, void*);
  void (*grad_bf16)(const void*, int64_t, float, float, float, float, float, void*);
  const char* isa;
};

// One set of entry points per ISA level; TARGET is a GCC target attribute (empty for the baseline).
#define OL_DEFINE_KERNELS(NAME, TARGET, W)                                                                   \
  TARGET RowSoftmaxStats stats_f32_##NAME(const void* r, int64_t v, float it, bool ent) {                    \
    return stats_impl<Float32IO<W>, W>(r, v, it, ent);                                                       \
  }                                                                                                          \
  TARGET RowSoftmaxStats stats_bf16_##NAME(const void* r, int64_t v, float it, bool ent) {                   \
    return stats_impl<BFloat16IO<W>, W>(r, v, it, ent);                                                      \
  }                                                                                                          \
  TARGET void grad_f32_##NAME(const void* r, int64_t v, float it, float m, float ls, float a, float b, void* o) { \
    grad_impl<Float32IO<W>, W>(r, v, it, m, ls, a, b, o);                                                    \
  }                                                                                                          \
  TARGET void grad_bf16_##NAME(const void* r, int64_t v, float it, float m, float ls, float a, float b, void* o) { \
    grad_impl<BFloat16IO<W>, W>(r, v, it, m, ls, a, b, o);                                                   \
  }                                                                                                          \
  const Kernels kernels_##NAME = {stats_f32_##NAME, stats_bf16_##NAME, grad_f32_##NAME, grad_bf16_##NAME, #NAME};

OL_DEFINE_KERNELS(generic, , 8)

#if defined(__x86_64__)
#define OL_HAS_X86_LEVELS 1
OL_DEFINE_KERNELS(avx2, __attribute__((target("avx2,fma"))), 8)
OL_DEFINE_KERNELS(avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), 16)
#endif

// OPENRLHF_LOPTI_CPU_ISA=generic|avx2|avx512 caps the level (tests use it to run every code path); unset
// or empty means no cap, anything else is an error rather than silently ignored.
const Kernels& select_kernels() {
  const char* cap = std::getenv("OPENRLHF_LOPTI_CPU_ISA");
  const bool uncapped = cap == nullptr || *cap == '\0' || std::strcmp(cap, "avx512") == 0;
  if (!uncapped && std::strcmp(cap, "generic") != 0 && std::strcmp(cap, "avx2") != 0) {
    throw std::invalid_argument(std::string("OPENRLHF_LOPTI_CPU_ISA must be one of generic, avx2, avx512 "
                                            "(or unset for the best this CPU supports), got '") + cap + "'");
  }
  const auto allowed = [cap, uncapped](const char* name) {
    if (uncapped) return true;
    if (std::strcmp(cap, "generic") == 0) return false;
    return std::strcmp(name, "avx2") == 0;  // cap == "avx2"
  };
#if defined(OL_HAS_X86_LEVELS)
  __builtin_cpu_init();
  if (allowed("avx512") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return kernels_avx512;
  }
  if (allowed("avx2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return kernels_avx2;
  }
#else
  (void)allowed;
#endif
  return kernels_generic;
}

const Kernels& kernels() {
  static const Kernels& chosen = select_kernels();
  return chosen;
}

}  // namespace

RowSoftmaxStats row_softmax_stats(RowDtype dtype, const void* row, int64_t v, float inv_t, bool with_entropy) {
  const Kernels& k = kernels();
  return dtype == RowDtype::kFloat32 ? k.stats_f32(row, v, inv_t, with_entropy)
                                     : k.stats_bf16(row, v, inv_t, with_entropy);
}

void row_softmax_grad(
    RowDtype dtype, const void* row, int64_t v, float inv_t, float max, float log_sum, float a, float b,
    void* out) {
  const Kernels& k = kernels();
  (dtype == RowDtype::kFloat32 ? k.grad_f32 : k.grad_bf16)(row, v, inv_t, max, log_sum, a, b, out);
}

const char* row_kernels_isa() { return kernels().isa; }

}  // namespace openrlhf_lopti
