// Vectorised per-row softmax kernels of the fused policy loss (one vocab row at a time, no [N, V] buffer).
//
// The bodies are written once with GNU vector extensions and compiled for several x86 ISAs (generic
// x86-64, AVX2+FMA, AVX-512) in one binary; the best one the CPU supports is chosen at run time, so the
// build needs no -march flag and the wheel runs on any x86-64 machine. Other architectures get the
// generic build (the compiler maps the vectors onto NEON etc.).
#pragma once

#include <cstdint>

namespace openrlhf_lopti {

// Storage type of a logits row the kernels read directly; fp16 rows are widened to fp32 by the caller.
enum class RowDtype { kFloat32, kBFloat16 };

// Softmax statistics of one row of z' = z * inv_t:
//   max     = max_j z'_j
//   sum_exp = sum_j exp(t_j),        t_j = z'_j - max
//   sum_exp_t = sum_j exp(t_j) * t_j  (only when with_entropy; else 0)
// so log-sum-exp = max + log(sum_exp) and entropy = log(sum_exp) - sum_exp_t / sum_exp. A -inf entry has
// exp(t) = 0 and adds exactly 0 to both sums. `finite` is false when the log-sum-exp is not finite: some
// z' is NaN or +inf, or every z' is -inf (found by the passes that compute the max and the sums).
struct RowSoftmaxStats {
  float max;
  float sum_exp;
  float sum_exp_t;
  bool finite;
};

// `row` points at `v` elements of `dtype` (contiguous); inv_t = 1 / temperature (> 0).
RowSoftmaxStats row_softmax_stats(RowDtype dtype, const void* row, int64_t v, float inv_t, bool with_entropy);

// out_j = -p_j * (a + b * u_j) for every j, with u_j = (z_j * inv_t - max) - log_sum = log p_j (max and
// log_sum as in RowSoftmaxStats: log_sum = log(sum_exp)); b == 0 gives exactly -p_j * a. `out` has `v`
// elements of `dtype` (bf16 rounded to nearest even). The label's one-hot term is the caller's job.
void row_softmax_grad(
    RowDtype dtype, const void* row, int64_t v, float inv_t, float max, float log_sum, float a, float b,
    void* out);

// Name of the instruction set the kernels run with: "avx512", "avx2" or "generic". The first call picks it
// (reading OPENRLHF_LOPTI_CPU_ISA); an unknown value of that variable throws std::invalid_argument.
const char* row_kernels_isa();

}  // namespace openrlhf_lopti
