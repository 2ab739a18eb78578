// One-pass AdamW for fp32 CPU master weights that also writes each parameter's compute-precision mirror.
//
// rpcompile keeps fp32 masters (and the Adam moments) in host memory and uploads a bf16/fp16 copy of every
// trainable parameter to the GPUs. torch's fused AdamW followed by `copy.copy_(param)` reads the fresh fp32
// parameter a second time; here the loop that updates p, m and v also stores the cast of the new p, so the
// master weights stream through memory once per step.
//
// Per element (the same expression and order as torch.optim.AdamW's single-tensor and fused CPU paths; the host
// computes the per-tensor scalars in double and rounds them to float once, as torch does):
//   g  = maximize ? -grad : grad
//   p  = p * decay                                  decay = float(1 - lr * weight_decay)
//   m  = lerp(m, g, w1)                             w1 = float(1 - beta1), torch's two-sided lerp formula
//   v  = v * beta2 + (1 - beta2) * g * g
//   vm = max(vm, v)                                 amsgrad only; the denominator then uses vm
//   p  = p + neg_step_size * m / (sqrt(v) / bc2_sqrt + eps)
//   mirror = cast(p)                                c10::BFloat16 / c10::Half: round to nearest even, as torch
// Built by rpcompile/runtime/optim.py with torch.utils.cpp_extension.load (-O3, OpenMP for at::parallel_for); on x86
// the loop also has an AVX2 build, picked at run time.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// Elements per work item: 64 KiB of each fp32 stream, small enough to balance threads over a few large tensors.
constexpr int64_t kChunk = 16384;

enum class MirrorKind { kNone, kBFloat16, kHalf, kFloat, kDouble };

struct Coeffs {
  float sign;           // -1 with maximize
  float decay;          // 1 - lr * weight_decay
  float w1;             // 1 - beta1, the lerp weight
  float one_minus_w1;   // 1 - w1 in float, as torch's lerp takes it
  bool w1_small;        // |w1| < 0.5: which side torch's lerp starts from
  float beta2;
  float one_minus_beta2;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
};

struct Work {
  float* p;
  const float* g;
  float* m;
  float* v;
  float* vmax;
  void* mirror;
  MirrorKind kind;
  Coeffs c;
};

// Elements per block when the mirror is written after the block's update (fp16 everywhere: c10::Half's conversion
// branches, which keeps the compiler from vectorising a loop that contains it; bf16 and fp16 in the AVX2 build):
// the block's parameters are cast from L1 right after they are stored, so memory is still streamed once.
constexpr int64_t kBlock = 256;

// The loop, inlined into one plain and (on x86) one AVX2 entry point below. Every operation rounds on its own
// (no FMA contraction: -ffp-contract=off), so both entry points give the same bits on every machine.
template <typename Mirror, bool kAmsgrad>
__attribute__((always_inline)) inline void update_body(const Work& w, int64_t begin, int64_t end) {
  float* __restrict__ p = w.p;
  const float* __restrict__ g = w.g;
  float* __restrict__ m = w.m;
  float* __restrict__ v = w.v;
  float* __restrict__ vmax = w.vmax;
  Mirror* __restrict__ out = static_cast<Mirror*>(w.mirror);
  const Coeffs c = w.c;
  for (int64_t i = begin; i < end; ++i) {
    const float grad = c.sign * g[i];
    const float param = p[i] * c.decay;
    const float mi = m[i];
    const float diff = grad - mi;
    const float m_new = c.w1_small ? mi + c.w1 * diff : grad - diff * c.one_minus_w1;
    const float v_new = v[i] * c.beta2 + c.one_minus_beta2 * grad * grad;
    float second = v_new;
    if constexpr (kAmsgrad) {
      second = std::max(vmax[i], v_new);
      vmax[i] = second;
    }
    const float denom = std::sqrt(second) / c.bc2_sqrt + c.eps;
    const float p_new = param + c.neg_step_size * m_new / denom;
    m[i] = m_new;
    v[i] = v_new;
    p[i] = p_new;
    if constexpr (!std::is_same_v<Mirror, void>) {
      out[i] = static_cast<Mirror>(p_new);
    }
  }
}

inline void half_block(const float* p, c10::Half* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<c10::Half>(p[i]);
}

// update_body with the mirror written per block: the update vectorised over the block, then the block's cast
// (`cast`) from the parameters just stored, still in L1.
template <bool kAmsgrad, typename Mirror, void (*cast)(const float*, Mirror*, int64_t)>
__attribute__((always_inline)) inline void update_blocked(const Work& w, int64_t begin, int64_t end) {
  Mirror* out = static_cast<Mirror*>(w.mirror);
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t e = std::min(b + kBlock, end);
    update_body<void, kAmsgrad>(w, b, e);
    cast(w.p + b, out + b, e - b);
  }
}

template <typename Mirror, bool kAmsgrad>
void update(const Work& w, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<Mirror, c10::Half>) {
    update_blocked<kAmsgrad, c10::Half, half_block>(w, begin, end);
  } else {
    update_body<Mirror, kAmsgrad>(w, begin, end);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same loop compiled for AVX2 (8 floats a vector instead of SSE2's 4): the divisions and the square root
// make the step compute-bound at 4 lanes on a machine with a fast memory system. The mirror is written per L1
// block with non-temporal stores: nothing on the CPU reads it before the next step (the GPUs upload it), so the
// stores skip the read-for-ownership of every mirror line and leave the caches to p, m and v.
//
// bf16: c10::BFloat16's rounding, eight lanes at a time: NaN -> 0x7FC0, else (u + 0x7FFF + ((u >> 16) & 1)) >> 16.
__attribute__((target("avx2"))) inline __m128i bf16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // all lanes < 2^16
}

// fp16: F16C's conversion rounds to nearest even, as c10::Half does (and torch's own vectorised cast).
__attribute__((target("avx2,f16c"))) inline __m128i halfx8(__m256 x) {
  return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// p[0, n) cast into out[0, n): plain stores up to a 16-byte boundary of out (a mirror may be a view into a larger
// buffer), then eight lanes a non-temporal store, then the tail.
template <typename Mirror>
__attribute__((target("avx2,f16c"))) void mirror_block_avx2(const float* p, Mirror* out, int64_t n) {
  int64_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(out + i) & 15) != 0; ++i) out[i] = static_cast<Mirror>(p[i]);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(p + i);
    if constexpr (std::is_same_v<Mirror, c10::Half>) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), halfx8(x));
    } else {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), bf16x8(x));
    }
  }
  for (; i < n; ++i) out[i] = static_cast<Mirror>(p[i]);
}

template <typename Mirror, bool kAmsgrad>
__attribute__((target("avx2,f16c"))) void update_avx2(const Work& w, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<Mirror, c10::Half> || std::is_same_v<Mirror, c10::BFloat16>) {
    update_blocked<kAmsgrad, Mirror, mirror_block_avx2<Mirror>>(w, begin, end);
    _mm_sfence();  // the non-temporal stores are visible before the step returns
  } else {
    update_body<Mirror, kAmsgrad>(w, begin, end);
  }
}

const bool kHasAvx2 = [] {
  __builtin_cpu_init();  // this runs among the static initialisers, possibly before libgcc's
  return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("f16c") != 0;
}();
#define RPCOMPILE_UPDATE(M, A) (kHasAvx2 ? update_avx2<M, A>(w, begin, end) : update<M, A>(w, begin, end))
#else
#define RPCOMPILE_UPDATE(M, A) update<M, A>(w, begin, end)
#endif

template <bool kAmsgrad>
void dispatch(const Work& w, int64_t begin, int64_t end) {
  switch (w.kind) {
    case MirrorKind::kNone: RPCOMPILE_UPDATE(void, kAmsgrad); break;
    case MirrorKind::kBFloat16: RPCOMPILE_UPDATE(c10::BFloat16, kAmsgrad); break;
    case MirrorKind::kHalf: RPCOMPILE_UPDATE(c10::Half, kAmsgrad); break;
    case MirrorKind::kFloat: RPCOMPILE_UPDATE(float, kAmsgrad); break;
    case MirrorKind::kDouble: RPCOMPILE_UPDATE(double, kAmsgrad); break;
  }
}

MirrorKind mirror_kind(const std::optional<at::Tensor>& mirror, const at::Tensor& param) {
  if (!mirror.has_value()) return MirrorKind::kNone;
  const at::Tensor& t = *mirror;
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == param.numel(),
              "adamw mirror: a contiguous CPU tensor with the parameter's numel is required");
  switch (t.scalar_type()) {
    case at::kBFloat16: return MirrorKind::kBFloat16;
    case at::kHalf: return MirrorKind::kHalf;
    case at::kFloat: return MirrorKind::kFloat;
    case at::kDouble: return MirrorKind::kDouble;
    default: TORCH_CHECK(false, "adamw mirror: dtype ", t.scalar_type(), " is not a floating dtype");
  }
  return MirrorKind::kNone;
}

float* fp32(const at::Tensor& t, const at::Tensor& param, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.numel() == param.numel(),
              "adamw: ", what, " must be a contiguous CPU float32 tensor shaped like its parameter");
  return t.data_ptr<float>();
}

// Steps every tensor of one parameter group. neg_step_sizes and bc2_sqrts are per tensor (steps may differ).
void adamw_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<std::optional<at::Tensor>>& mirrors,
                const std::vector<double>& neg_step_sizes, const std::vector<double>& bc2_sqrts, double lr,
                double beta1, double beta2, double weight_decay, double eps, bool amsgrad, bool maximize) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && mirrors.size() == n &&
                  neg_step_sizes.size() == n && bc2_sqrts.size() == n && (!amsgrad || max_exp_avg_sqs.size() == n),
              "adamw: the tensor lists differ in length");
  const float w1 = static_cast<float>(1.0 - beta1);
  std::vector<Work> work;
  work.reserve(n);
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (work index, first element)
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    Work w{};
    w.p = fp32(p, p, "a parameter");
    w.g = fp32(grads[i], p, "a gradient");
    w.m = fp32(exp_avgs[i], p, "exp_avg");
    w.v = fp32(exp_avg_sqs[i], p, "exp_avg_sq");
    w.vmax = amsgrad ? fp32(max_exp_avg_sqs[i], p, "max_exp_avg_sq") : nullptr;
    w.kind = mirror_kind(mirrors[i], p);
    w.mirror = w.kind == MirrorKind::kNone ? nullptr : mirrors[i]->data_ptr();
    w.c.sign = maximize ? -1.0f : 1.0f;
    w.c.decay = static_cast<float>(1.0 - lr * weight_decay);
    w.c.w1 = w1;
    w.c.one_minus_w1 = 1.0f - w1;
    w.c.w1_small = std::abs(w1) < 0.5f;
    w.c.beta2 = static_cast<float>(beta2);
    w.c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    w.c.eps = static_cast<float>(eps);
    w.c.neg_step_size = static_cast<float>(neg_step_sizes[i]);
    w.c.bc2_sqrt = static_cast<float>(bc2_sqrts[i]);
    for (int64_t start = 0; start < p.numel(); start += kChunk) chunks.emplace_back(static_cast<int64_t>(i), start);
    work.push_back(w);
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const Work& w = work[chunks[k].first];
      const int64_t begin = chunks[k].second;
      const int64_t end = std::min(begin + kChunk, params[chunks[k].first].numel());
      if (amsgrad) {
        dispatch<true>(w, begin, end);
      } else {
        dispatch<false>(w, begin, end);
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rpcompile's one-pass CPU AdamW (fp32 masters, moments and the compute-precision mirror together)";
  m.def("adamw_step", &adamw_step, "AdamW step over one parameter group, writing each mirror in the same loop");
}
