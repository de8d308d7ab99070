// CPU forward and backward of openrlhf_lopti's fused policy loss, registered as torch ops
// `openrlhf_lopti::policy_loss_fwd` / `policy_loss_bwd` (wrapped in an autograd.Function by
// openrlhf_lopti/ops/cpp_policy_loss.py).
//
// The per-token math is exactly openrlhf_lopti/algo/policy_loss.py (fp32, same operation order), and its
// derivative is the one torch autograd takes through that code, tie rules of min/max/clamp included.
// Per row the logits are read in their own dtype (fp32, bf16; fp16 widened one row at a time): the
// forward keeps only four floats per row, the backward recomputes the softmax from them. Masked rows
// are never read and get exactly zero output and gradient. -inf logits are exact (probability 0, no
// entropy term, zero gradient); a kept row without a finite log-sum-exp (NaN, +inf, all -inf) is flagged
// in the forward's `bad_rows` output, found in the pass that sums the row, for the caller to raise on.

#include <Python.h>  // first, as Python requires; only for the module stub at the end

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "softmax_rows.h"

namespace openrlhf_lopti {
namespace {

constexpr float kLogRatioClamp = 20.0f;  // algo.policy_loss.LOG_RATIO_CLAMP
constexpr float kKlClamp = 10.0f;        // algo.policy_loss.KL_CLAMP
constexpr int64_t kStatsColumns = 4;     // per row: max(z/T), log(sum exp(z/T - max)), entropy, dloss/dlogp
constexpr int64_t kElementsPerTask = 1 << 15;  // a parallel task gets whole rows, about this many logits

enum class KlEstimator { kK1, kK2, kK3 };

struct LossOptions {
  float alpha;
  float one_minus_alpha;
  float clip_low;   // 1 - eps_low
  float clip_high;  // 1 + eps_high
  bool has_dual_clip;
  float dual_clip;
  bool has_ref;
  float kl_coef;
  KlEstimator estimator;
};

struct TokenLoss {
  float loss;
  float kl;
  bool clipped;
  float dloss_dlogp;
};

inline float clampf(float x, float lo, float hi) { return std::min(std::max(x, lo), hi); }

// Share of an upstream gradient that torch.min / torch.max send to one operand: 1 if it is the one
// selected, 1/2 on a tie, else 0.
inline float min_share(float self, float other) { return self < other ? 1.0f : (self == other ? 0.5f : 0.0f); }
inline float max_share(float self, float other) { return self > other ? 1.0f : (self == other ? 0.5f : 0.0f); }
inline float pass(bool inside) { return inside ? 1.0f : 0.0f; }

// One token's loss, KL, clip flag and d loss / d logp, as algo.policy_loss.policy_loss_from_logp.
TokenLoss token_loss(float logp, float old_logp, float adv, float ref_logp, const LossOptions& o) {
  const float weighted_adv = adv * (o.alpha * std::exp(old_logp) + o.one_minus_alpha);
  const float raw_log_ratio = logp - old_logp;
  const float ratio = std::exp(clampf(raw_log_ratio, -kLogRatioClamp, kLogRatioClamp));
  const float surr1 = ratio * weighted_adv;
  const float surr2 = clampf(ratio, o.clip_low, o.clip_high) * weighted_adv;
  float surrogate = std::min(surr1, surr2);
  float dsurr_dratio = min_share(surr1, surr2) * weighted_adv +
                       min_share(surr2, surr1) * weighted_adv * pass(ratio >= o.clip_low && ratio <= o.clip_high);
  if (o.has_dual_clip && weighted_adv < 0.0f) {
    const float floor = o.dual_clip * weighted_adv;
    dsurr_dratio *= max_share(surrogate, floor);
    surrogate = std::max(surrogate, floor);
  }
  const float dratio_dlogp = ratio * pass(raw_log_ratio >= -kLogRatioClamp && raw_log_ratio <= kLogRatioClamp);

  TokenLoss out{-surrogate, 0.0f, surr2 < surr1, -dsurr_dratio * dratio_dlogp};
  if (o.has_ref) {
    float log_ratio = logp - ref_logp;
    float value, dvalue;
    switch (o.estimator) {
      case KlEstimator::kK1:
        value = log_ratio;
        dvalue = 1.0f;
        break;
      case KlEstimator::kK2:
        value = log_ratio * log_ratio / 2.0f;
        dvalue = log_ratio;
        break;
      default: {  // k3; clamped below -10 first so exp stays finite, as the reference does
        const float inside = pass(log_ratio >= -kKlClamp);
        log_ratio = std::max(log_ratio, -kKlClamp);
        const float e = std::exp(-log_ratio);
        value = e - 1.0f + log_ratio;
        dvalue = inside * (1.0f - e);
      }
    }
    out.kl = clampf(value, -kKlClamp, kKlClamp);
    if (o.kl_coef != 0.0f) {
      out.loss += o.kl_coef * out.kl;
      // Added only inside the clamp, not multiplied by 0 outside: with logp = -inf (a -inf logit at the
      // label) k2's dvalue is -inf.
      if (value >= -kKlClamp && value <= kKlClamp) out.dloss_dlogp += o.kl_coef * dvalue;
    }
  }
  return out;
}

KlEstimator parse_estimator(const std::string& name) {
  if (name == "k1") return KlEstimator::kK1;
  if (name == "k2") return KlEstimator::kK2;
  TORCH_CHECK(name == "k3", "kl_estimator must be one of k1, k2, k3, got ", name);
  return KlEstimator::kK3;
}

// How a logits row is handed to the vector kernels.
struct RowAccess {
  at::ScalarType dtype;
  const char* base;
  int64_t row_stride_bytes;
  int64_t v;

  const void* row(int64_t i) const { return base + i * row_stride_bytes; }

  float at(const void* row, int64_t j) const {
    switch (dtype) {
      case at::kFloat:
        return static_cast<const float*>(row)[j];
      case at::kBFloat16:
        return static_cast<float>(static_cast<const c10::BFloat16*>(row)[j]);
      default:
        return static_cast<float>(static_cast<const c10::Half*>(row)[j]);
    }
  }

  bool widened() const { return dtype == at::kHalf; }
  RowDtype kernel_dtype() const { return dtype == at::kBFloat16 ? RowDtype::kBFloat16 : RowDtype::kFloat32; }

  // fp16 has no direct kernel: widen the row into `buf` (one row, not [N, V]) and read that instead.
  const void* kernel_row(int64_t i, std::vector<float>& buf) const {
    if (!widened()) return row(i);
    buf.resize(v);
    const c10::Half* src = static_cast<const c10::Half*>(row(i));
    for (int64_t j = 0; j < v; ++j) buf[j] = static_cast<float>(src[j]);
    return buf.data();
  }
};

RowAccess check_logits(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), "openrlhf_lopti C++ policy loss: logits must be a CPU tensor");
  TORCH_CHECK(logits.dim() == 2, "logits must be [N, V], got ", logits.sizes());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "logits must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(logits.size(1) > 0, "logits must have a non-empty vocab dimension V");
  TORCH_CHECK(logits.size(1) == 1 || logits.stride(1) == 1, "logits rows must be contiguous (stride(1) == 1)");
  return {dtype, static_cast<const char*>(logits.const_data_ptr()), logits.stride(0) * logits.element_size(),
          logits.size(1)};
}

void check_per_token(const at::Tensor& t, const char* name, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, name, " must have shape [N]=[", n, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Labels of unmasked rows must index the vocab; checked before any row is touched.
void check_labels(const int64_t* labels, const bool* mask, int64_t n, int64_t v) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(!mask[i] || (labels[i] >= 0 && labels[i] < v), "labels must be token ids in [0, V) = [0, ", v,
                ") on unmasked rows; row ", i, " has ", labels[i]);
  }
}

int64_t rows_per_task(int64_t v) { return std::max<int64_t>(1, kElementsPerTask / v); }

// The vector kernels' ISA level, picked on the first call (outside any parallel_for); a bad
// OPENRLHF_LOPTI_CPU_ISA becomes a Python ValueError naming it.
const char* selected_isa() {
  try {
    return row_kernels_isa();
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, e.what());
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_fwd(
    const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& old_log_probs,
    const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& ref_log_probs,
    double alpha, double eps_low, double eps_high, std::optional<double> dual_clip, double kl_coef,
    const std::string& kl_estimator, double temperature, bool return_entropy) {
  const RowAccess rows = check_logits(logits);
  const int64_t n = logits.size(0), v = rows.v;
  check_per_token(labels, "labels", n, at::kLong);
  check_per_token(old_log_probs, "old_log_probs", n, at::kFloat);
  check_per_token(advantages, "advantages", n, at::kFloat);
  check_per_token(mask, "mask", n, at::kBool);
  const bool has_ref = ref_log_probs.has_value() && ref_log_probs->defined();
  if (has_ref) check_per_token(*ref_log_probs, "ref_log_probs", n, at::kFloat);
  TORCH_CHECK(temperature > 0.0, "temperature must be > 0, got ", temperature);
  TORCH_CHECK(kl_coef == 0.0 || has_ref, "ref_log_probs is required when kl_coef != 0");
  selected_isa();

  // Scalars enter the reference's fp32 ops as float, computed from the Python floats like it does.
  const LossOptions opt{static_cast<float>(alpha),
                        static_cast<float>(1.0 - alpha),
                        static_cast<float>(1.0 - eps_low),
                        static_cast<float>(1.0 + eps_high),
                        dual_clip.has_value(),
                        static_cast<float>(dual_clip.value_or(0.0)),
                        has_ref,
                        static_cast<float>(kl_coef),
                        parse_estimator(kl_estimator)};
  const float inv_t = static_cast<float>(1.0 / temperature);

  const auto f32 = old_log_probs.options();
  at::Tensor loss = at::empty({n}, f32), logp = at::empty({n}, f32), kl = at::empty({n}, f32);
  at::Tensor clipped = at::empty({n}, f32.dtype(at::kBool));
  at::Tensor entropy = at::empty({return_entropy ? n : 0}, f32);
  at::Tensor stats = at::empty({n, kStatsColumns}, f32);
  at::Tensor bad_rows = at::empty({n}, f32.dtype(at::kBool));

  const int64_t* label_p = labels.const_data_ptr<int64_t>();
  const bool* mask_p = mask.const_data_ptr<bool>();
  check_labels(label_p, mask_p, n, v);
  const float* old_p = old_log_probs.const_data_ptr<float>();
  const float* adv_p = advantages.const_data_ptr<float>();
  const float* ref_p = has_ref ? ref_log_probs->const_data_ptr<float>() : nullptr;
  float* loss_p = loss.mutable_data_ptr<float>();
  float* logp_p = logp.mutable_data_ptr<float>();
  float* kl_p = kl.mutable_data_ptr<float>();
  bool* clipped_p = clipped.mutable_data_ptr<bool>();
  float* entropy_p = return_entropy ? entropy.mutable_data_ptr<float>() : nullptr;
  float* stats_p = stats.mutable_data_ptr<float>();
  bool* bad_p = bad_rows.mutable_data_ptr<bool>();

  at::parallel_for(0, n, rows_per_task(v), [&](int64_t begin, int64_t end) {
    std::vector<float> widened;
    for (int64_t i = begin; i < end; ++i) {
      float* st = stats_p + i * kStatsColumns;
      if (!mask_p[i]) {
        loss_p[i] = logp_p[i] = kl_p[i] = 0.0f;
        clipped_p[i] = bad_p[i] = false;
        if (entropy_p) entropy_p[i] = 0.0f;
        std::fill(st, st + kStatsColumns, 0.0f);
        continue;
      }
      const RowSoftmaxStats s =
          row_softmax_stats(rows.kernel_dtype(), rows.kernel_row(i, widened), v, inv_t, return_entropy);
      const float log_sum = std::log(s.sum_exp);
      const float token_logp = (rows.at(rows.row(i), label_p[i]) * inv_t - s.max) - log_sum;
      const float token_entropy = return_entropy ? log_sum - s.sum_exp_t / s.sum_exp : 0.0f;
      const TokenLoss t = token_loss(token_logp, old_p[i], adv_p[i], has_ref ? ref_p[i] : 0.0f, opt);
      loss_p[i] = t.loss;
      logp_p[i] = token_logp;
      kl_p[i] = t.kl;
      clipped_p[i] = t.clipped;
      if (entropy_p) entropy_p[i] = token_entropy;
      bad_p[i] = !s.finite;
      st[0] = s.max;
      st[1] = log_sum;
      st[2] = token_entropy;
      st[3] = t.dloss_dlogp;
    }
  });
  return {loss, logp, kl, clipped, entropy, stats, bad_rows};
}

// Optional upstream gradient of an [N] output, or nullptr when autograd passed none.
const float* upstream(const std::optional<at::Tensor>& grad, const char* name, int64_t n, at::Tensor& keep) {
  if (!grad.has_value() || !grad->defined() || grad->numel() == 0) return nullptr;
  keep = grad->to(at::kFloat).contiguous();
  check_per_token(keep, name, n, at::kFloat);
  return keep.const_data_ptr<float>();
}

// d/dlogits_ij = (g_i (onehot_ij - p_ij) - e_i p_ij (log p_ij + H_i)) / T, with
// g_i = grad_logp_i + grad_loss_i * dloss/dlogp_i and e_i = grad_entropy_i, on unmasked rows; written into `grad`
// [N, V] of the logits' dtype, which may be `logits` itself (each element's gradient reads only its own logit and
// the row's statistics, and the label's logit is read before its row is overwritten).
void fill_policy_loss_grad(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& mask,
                           const at::Tensor& stats, const std::optional<at::Tensor>& grad_loss,
                           const std::optional<at::Tensor>& grad_logp, const std::optional<at::Tensor>& grad_entropy,
                           double temperature, at::Tensor& grad) {
  const RowAccess rows = check_logits(logits);
  const int64_t n = logits.size(0), v = rows.v;
  check_per_token(labels, "labels", n, at::kLong);
  check_per_token(mask, "mask", n, at::kBool);
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == n && stats.size(1) == kStatsColumns &&
                  stats.scalar_type() == at::kFloat && stats.is_contiguous(),
              "stats must be the contiguous float32 [N, 4] tensor policy_loss_fwd returned");
  TORCH_CHECK(temperature > 0.0, "temperature must be > 0, got ", temperature);
  selected_isa();
  at::Tensor keep_loss, keep_logp, keep_entropy;
  const float* g_loss = upstream(grad_loss, "grad_loss", n, keep_loss);
  const float* g_logp = upstream(grad_logp, "grad_logp", n, keep_logp);
  const float* g_ent = upstream(grad_entropy, "grad_entropy", n, keep_entropy);
  const float inv_t = static_cast<float>(1.0 / temperature);

  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == n && grad.size(1) == v && grad.scalar_type() == rows.dtype &&
                  (v == 1 || grad.stride(1) == 1),
              "grad must be an [N, V] tensor of the logits' dtype with contiguous rows");
  const int64_t* label_p = labels.const_data_ptr<int64_t>();
  const bool* mask_p = mask.const_data_ptr<bool>();
  check_labels(label_p, mask_p, n, v);
  const float* stats_p = stats.const_data_ptr<float>();
  char* grad_base = static_cast<char*>(grad.mutable_data_ptr());
  const int64_t grad_row_bytes = v * grad.element_size();
  const int64_t grad_stride_bytes = grad.stride(0) * grad.element_size();
  const at::ScalarType dtype = rows.dtype;

  at::parallel_for(0, n, rows_per_task(v), [&](int64_t begin, int64_t end) {
    std::vector<float> widened, widened_grad;
    for (int64_t i = begin; i < end; ++i) {
      char* out = grad_base + i * grad_stride_bytes;
      const float* st = stats_p + i * kStatsColumns;
      const float g = (g_logp ? g_logp[i] : 0.0f) + (g_loss ? g_loss[i] * st[3] : 0.0f);
      const float e = g_ent ? g_ent[i] : 0.0f;
      if (!mask_p[i] || (g == 0.0f && e == 0.0f)) {
        std::memset(out, 0, grad_row_bytes);  // all-zero bits are +0 in every float dtype
        continue;
      }
      const float max = st[0], log_sum = st[1], entropy = st[2];
      const float a = inv_t * (g + e * entropy), b = inv_t * e;
      const int64_t label = label_p[i];
      const float u = (rows.at(rows.row(i), label) * inv_t - max) - log_sum;  // before `out` may overwrite it
      const void* row = rows.kernel_row(i, widened);
      void* kernel_out = out;
      if (rows.widened()) {
        widened_grad.resize(v);
        kernel_out = widened_grad.data();
      }
      row_softmax_grad(rows.kernel_dtype(), row, v, inv_t, max, log_sum, a, b, kernel_out);

      const float p = std::exp(u);  // 0 for a -inf label logit, whose b * u term is then skipped, not 0 * -inf
      const float at_label = (p > 0.0f ? -p * (b == 0.0f ? a : a + b * u) : 0.0f) + g * inv_t;
      if (dtype == at::kFloat) {
        reinterpret_cast<float*>(out)[label] = at_label;
      } else if (dtype == at::kBFloat16) {
        reinterpret_cast<c10::BFloat16*>(out)[label] = c10::BFloat16(at_label);
      } else {
        widened_grad[label] = at_label;
        c10::Half* dst = reinterpret_cast<c10::Half*>(out);
        for (int64_t j = 0; j < v; ++j) dst[j] = c10::Half(widened_grad[j]);
      }
    }
  });
}

at::Tensor policy_loss_bwd(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& mask,
                           const at::Tensor& stats, const std::optional<at::Tensor>& grad_loss,
                           const std::optional<at::Tensor>& grad_logp, const std::optional<at::Tensor>& grad_entropy,
                           double temperature) {
  at::Tensor grad = at::empty({logits.size(0), logits.size(1)}, logits.options());
  fill_policy_loss_grad(logits, labels, mask, stats, grad_loss, grad_logp, grad_entropy, temperature, grad);
  return grad;
}

// The same, written over the logits (the caller's grad_in_logits: one [N, V] buffer less).
at::Tensor& policy_loss_bwd_(at::Tensor& logits, const at::Tensor& labels, const at::Tensor& mask,
                             const at::Tensor& stats, const std::optional<at::Tensor>& grad_loss,
                             const std::optional<at::Tensor>& grad_logp, const std::optional<at::Tensor>& grad_entropy,
                             double temperature) {
  fill_policy_loss_grad(logits, labels, mask, stats, grad_loss, grad_logp, grad_entropy, temperature, logits);
  return logits;
}

std::string cpu_isa() { return selected_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(openrlhf_lopti, m) {
  m.def(
      "policy_loss_fwd(Tensor logits, Tensor labels, Tensor old_log_probs, Tensor advantages, Tensor mask, "
      "Tensor? ref_log_probs, float alpha, float eps_low, float eps_high, float? dual_clip, float kl_coef, "
      "str kl_estimator, float temperature, bool return_entropy) "
      "-> (Tensor loss, Tensor logp, Tensor kl, Tensor clipped, Tensor entropy, Tensor stats, Tensor bad_rows)");
  m.def(
      "policy_loss_bwd(Tensor logits, Tensor labels, Tensor mask, Tensor stats, Tensor? grad_loss, "
      "Tensor? grad_logp, Tensor? grad_entropy, float temperature) -> Tensor");
  m.def(
      "policy_loss_bwd_(Tensor(a!) logits, Tensor labels, Tensor mask, Tensor stats, Tensor? grad_loss, "
      "Tensor? grad_logp, Tensor? grad_entropy, float temperature) -> Tensor(a!)");
  m.def("cpu_isa() -> str", &cpu_isa);
}

TORCH_LIBRARY_IMPL(openrlhf_lopti, CPU, m) {
  m.impl("policy_loss_fwd", &policy_loss_fwd);
  m.impl("policy_loss_bwd", &policy_loss_bwd);
  m.impl("policy_loss_bwd_", &policy_loss_bwd_);
}

}  // namespace openrlhf_lopti

// An empty Python module, so the setup.py build is importable as `openrlhf_lopti._C` (importing it runs
// the registrations above); the JIT build is loaded with torch.ops.load_library instead.
#define OL_CONCAT(a, b) a##b
#define OL_PYINIT(name) OL_CONCAT(PyInit_, name)
#define OL_STR2(x) #x
#define OL_STR(x) OL_STR2(x)
PyMODINIT_FUNC OL_PYINIT(TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, OL_STR(TORCH_EXTENSION_NAME),
                               "openrlhf_lopti C++ CPU kernels (ops in torch.ops.openrlhf_lopti)", -1, nullptr};
  return PyModule_Create(&module);
}
