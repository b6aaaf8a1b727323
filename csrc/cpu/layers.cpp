// CPU layer kernels of a decoder's training step and decode step (bound into cod_fast._cpp):
//   rms_norm_forward / rms_norm_backward : y = w * (x * r), r = 1 / sqrt(mean(x^2) + eps), and
//                                          its gradients (dx, and dw summed over the rows);
//   swiglu_forward / swiglu_backward_    : SiLU(g) * u, and its gradients (with the product
//                                          itself for down_proj's weight gradient);
//   decode_attention_                    : a decode step's attention after the projections: the
//                                          per-head norms and rotary of q and k, the new cache
//                                          column, one query per (row, head) against the first
//                                          col + 1 columns of the cache (keys stored transposed),
//                                          under a key mask.
// On a small model every one of these is a chain of 4-12 torch ops, each a pass over memory plus
// a dispatch; here each is one pass (cod_fast.ops.layers wraps them; the torch code there is the
// reference). All float32, C-contiguous, rows split over OpenMP threads.
//
// Numerics: sums over a row (mean of squares, dot products) accumulate in float over vector
// lanes, as torch's CPU reductions do; the weight gradient of the norm, a sum over every row of
// the batch, accumulates in double. sigmoid(g) is 1 / (1 + e) or e / (1 + e) with e = exp(-|g|)
// from common.h's exp_nonpos (~1 ulp, 0 below -87, where sigmoid is 0 or 1 in float anyway).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/common.h"

namespace {

using namespace cod_cpu;

constexpr int64_t kParallelFloor = 1 << 15;  // elements below which one thread does the work
constexpr int64_t kMaxHead = 1024;           // the largest head size the decode step takes

COD_INLINE float sigmoid(float g) {
  const float e = exp_nonpos(-std::fabs(g));
  const float inv = 1.0f / (1.0f + e);
  return g >= 0.0f ? inv : e * inv;
}

// y = w * (x * r) with r = 1 / sqrt(mean(x^2) + eps); returns r.
COD_INLINE float rms_row(const float* x, const float* w, int64_t H, float eps, float* y) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) y[i] = w[i] * (x[i] * r);
  return r;
}

COD_CLONES
void rms_row_forward(const float* x, const float* w, int64_t H, float eps, float* y, float* rstd) {
  *rstd = rms_row(x, w, H, eps, y);
}

// dx = r (gw - xhat mean(gw xhat)) with gw = g * w, xhat = x r; dw_acc += g xhat (when given).
COD_CLONES
void rms_row_backward(const float* g, const float* x, const float* w, float r, int64_t H, float* dx,
                      double* dw_acc) {
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < H; ++i) dot += g[i] * w[i] * (x[i] * r);
  const float mean = dot / static_cast<float>(H);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) dx[i] = r * (g[i] * w[i] - (x[i] * r) * mean);
  if (dw_acc == nullptr) return;
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) dw_acc[i] += static_cast<double>(g[i] * (x[i] * r));
}

COD_CLONES
void swiglu_span_forward(const float* g, const float* u, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] * sigmoid(g[i]) * u[i];
}

// In: dp = dL/d(SiLU(g) u). Out: dp <- dL/dg, du = dL/du, prod = SiLU(g) u (kProduct).
template <bool kProduct>
COD_INLINE void swiglu_backward_loop(float* dp, const float* g, const float* u, float* du,
                                     float* prod, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(g[i]);
    const float silu = g[i] * s;
    const float d = dp[i];
    if (kProduct) prod[i] = silu * u[i];
    du[i] = d * silu;
    // d SiLU(g) / dg = s (1 + g (1 - s))
    dp[i] = d * u[i] * (s * (1.0f + g[i] * (1.0f - s)));
  }
}

COD_CLONES
void swiglu_span_backward(float* dp, const float* g, const float* u, float* du, float* prod,
                          int64_t n) {
  prod ? swiglu_backward_loop<true>(dp, g, u, du, prod, n)
       : swiglu_backward_loop<false>(dp, g, u, du, prod, n);
}

// out = softmax(scale q K^T, masked) V for one query q [d] against the first n keys, stored
// transposed (KT [d, W]: the score loop runs over keys, a vector lane each, with no horizontal
// sum), and values V [W, d]. The loops along the keys run over `span` >= n columns (n rounded up
// to whole vectors where the cache is that wide: no scalar remainder), those past n masked.
COD_CLONES
void attend_one(const float* q, const float* KT, const float* V, const uint8_t* mask, int64_t n,
                int64_t span, int64_t W, int64_t d, float scale, float* scores, float* out) {
  weighted_rows(q, KT, W, d, span, scores);
#pragma omp simd
  for (int64_t l = 0; l < span; ++l) {
    scores[l] = (l < n) & (mask[l] != 0) ? scores[l] * scale : -INFINITY;
  }
  const float m = block_max(scores, span);
  if (m == -INFINITY) {  // no key: zeros, as torch's CPU SDPA returns
    for (int64_t i = 0; i < d; ++i) out[i] = 0.0f;
    return;
  }
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t l = 0; l < span; ++l) {
    const float p = exp_nonpos(scores[l] - m);  // -inf - m: 0
    scores[l] = p;
    total += p;
  }
  weighted_rows(scores, V, d, n, d, out);
  const float inv = 1.0f / total;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] *= inv;
}

// One head's vector for a decode step, into y [d]: weight * x / rms(x) when `w` is given (Qwen3's
// per-head q_norm / k_norm), then the rotary embedding y * cos + rotate_half(y) * sin (halves
// layout: rotate_half(y) = [-y[d/2:], y[:d/2]]), as transformers computes them.
COD_CLONES
void position_head(const float* x, const float* w, float eps, const float* cos, const float* sin,
                   int64_t d, float* y) {
  float normed[kMaxHead];
  if (w != nullptr) {
    rms_row(x, w, d, eps, normed);
  } else {
    std::copy(x, x + d, normed);
  }
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    y[i] = normed[i] * cos[i] - normed[i + half] * sin[i];
    y[i + half] = normed[i + half] * cos[i + half] + normed[i] * sin[i + half];
  }
}

int64_t dim(const py::object& obj, const char* name, int ndim, int axis) {
  if (!py::isinstance<py::array>(obj) || py::reinterpret_borrow<py::array>(obj).ndim() != ndim) {
    throw std::invalid_argument(std::string(name) + " must be a " + std::to_string(ndim) +
                                "-d float32 numpy array");
  }
  return py::reinterpret_borrow<py::array>(obj).shape(axis);
}

// ---- bound functions ----

void rms_norm_forward(py::object x_obj, py::object w_obj, double eps, py::object y_obj,
                      py::object rstd_obj, int num_threads) {
  const int64_t N = dim(x_obj, "x", 2, 0), H = dim(x_obj, "x", 2, 1);
  const float* x = array_data<float>(x_obj, "x", {N, H}, false);
  const float* w = array_data<float>(w_obj, "weight", {H}, false);
  float* y = array_data<float>(y_obj, "y", {N, H}, true);
  float* rstd = array_data<float>(rstd_obj, "rstd", {N}, true);
  const float e = static_cast<float>(eps);
  py::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(threads_for(num_threads)) \
    if (N * H >= kParallelFloor)
  for (int64_t t = 0; t < N; ++t) rms_row_forward(x + t * H, w, H, e, y + t * H, rstd + t);
}

void rms_norm_backward(py::object g_obj, py::object x_obj, py::object w_obj, py::object rstd_obj,
                       py::object dx_obj, py::object dw_obj, int num_threads) {
  const int64_t N = dim(x_obj, "x", 2, 0), H = dim(x_obj, "x", 2, 1);
  const float* g = array_data<float>(g_obj, "grad", {N, H}, false);
  const float* x = array_data<float>(x_obj, "x", {N, H}, false);
  const float* w = array_data<float>(w_obj, "weight", {H}, false);
  const float* rstd = array_data<float>(rstd_obj, "rstd", {N}, false);
  float* dx = array_data<float>(dx_obj, "dx", {N, H}, true);
  float* dw = dw_obj.is_none() ? nullptr : array_data<float>(dw_obj, "dw", {H}, true);
  py::gil_scoped_release release;
  const int threads = N * H >= kParallelFloor ? threads_for(num_threads) : 1;
  std::vector<double> partial(dw ? static_cast<size_t>(threads) * H : 0, 0.0);
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int me = omp_get_thread_num();
#else
    const int me = 0;
#endif
    double* acc = dw ? partial.data() + static_cast<size_t>(me) * H : nullptr;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N; ++t) rms_row_backward(g + t * H, x + t * H, w, rstd[t], H, dx + t * H, acc);
  }
  if (dw) {
    for (int64_t i = 0; i < H; ++i) {
      double s = 0.0;
      for (int k = 0; k < threads; ++k) s += partial[static_cast<size_t>(k) * H + i];
      dw[i] = static_cast<float>(s);
    }
  }
}

// Elementwise kernels split the flat range into per-thread spans of whole cache lines.
template <typename F>
void over_spans(int64_t n, int num_threads, F f) {
  const int threads = n >= kParallelFloor ? threads_for(num_threads) : 1;
  const int64_t step = ((n + threads - 1) / threads + 15) / 16 * 16;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int k = 0; k < threads; ++k) {
    const int64_t a = std::min(n, k * step), b = std::min(n, a + step);
    if (b > a) f(a, b - a);
  }
}

void swiglu_forward(py::object g_obj, py::object u_obj, py::object y_obj, int num_threads) {
  const int64_t N = dim(g_obj, "gate", 2, 0), I = dim(g_obj, "gate", 2, 1);
  const float* g = array_data<float>(g_obj, "gate", {N, I}, false);
  const float* u = array_data<float>(u_obj, "up", {N, I}, false);
  float* y = array_data<float>(y_obj, "y", {N, I}, true);
  py::gil_scoped_release release;
  over_spans(N * I, num_threads,
             [&](int64_t a, int64_t n) { swiglu_span_forward(g + a, u + a, y + a, n); });
}

void swiglu_backward_(py::object dp_obj, py::object g_obj, py::object u_obj, py::object du_obj,
                      py::object prod_obj, int num_threads) {
  const int64_t N = dim(g_obj, "gate", 2, 0), I = dim(g_obj, "gate", 2, 1);
  float* dp = array_data<float>(dp_obj, "grad_product", {N, I}, true);
  const float* g = array_data<float>(g_obj, "gate", {N, I}, false);
  const float* u = array_data<float>(u_obj, "up", {N, I}, false);
  float* du = array_data<float>(du_obj, "grad_up", {N, I}, true);
  float* prod = prod_obj.is_none() ? nullptr : array_data<float>(prod_obj, "product", {N, I}, true);
  py::gil_scoped_release release;
  over_spans(N * I, num_threads, [&](int64_t a, int64_t n) {
    swiglu_span_backward(dp + a, g + a, u + a, du + a, prod ? prod + a : nullptr, n);
  });
}

// The attention of one decode step after the q, k, v projections: per row b, each key-value
// head's k (normalised, rotated) and v go into cache column `col`, then each query head's q
// (normalised, rotated) attends to the first col + 1 columns.
void decode_attention_(py::object q_obj, py::object k_obj, py::object v_obj, py::object qw_obj,
                       py::object kw_obj, double eps, py::object cos_obj, py::object sin_obj,
                       py::object kt_obj, py::object values_obj, py::object mask_obj, int64_t col,
                       double scale, py::object out_obj, int num_threads) {
  const int64_t B = dim(q_obj, "q", 3, 0), Hq = dim(q_obj, "q", 3, 1), d = dim(q_obj, "q", 3, 2);
  const int64_t Hkv = dim(kt_obj, "keys_t", 4, 1), W = dim(kt_obj, "keys_t", 4, 3);
  const int64_t Wm = dim(mask_obj, "mask", 2, 1);
  if (Hkv < 1 || Hq % Hkv != 0) {
    throw std::invalid_argument("query heads (" + std::to_string(Hq) +
                                ") must be a multiple of key-value heads (" + std::to_string(Hkv) +
                                ")");
  }
  if (d % 2 != 0 || d > kMaxHead) {
    throw std::invalid_argument("head size " + std::to_string(d) + " must be even and at most " +
                                std::to_string(kMaxHead));
  }
  const int64_t n = col + 1;
  if (col < 0 || n > W || n > Wm) {
    throw std::invalid_argument("col = " + std::to_string(col) + " must be in [0, min(cache width " +
                                std::to_string(W) + ", mask width " + std::to_string(Wm) + "))");
  }
  const float* q = array_data<float>(q_obj, "q", {B, Hq, d}, false);
  const float* k = array_data<float>(k_obj, "k", {B, Hkv, d}, false);
  const float* v = array_data<float>(v_obj, "v", {B, Hkv, d}, false);
  const float* qw = qw_obj.is_none() ? nullptr : array_data<float>(qw_obj, "q_norm", {d}, false);
  const float* kw = kw_obj.is_none() ? nullptr : array_data<float>(kw_obj, "k_norm", {d}, false);
  const float* cos = array_data<float>(cos_obj, "cos", {B, d}, false);
  const float* sin = array_data<float>(sin_obj, "sin", {B, d}, false);
  float* KT = array_data<float>(kt_obj, "keys_t", {B, Hkv, d, W}, true);
  float* V = array_data<float>(values_obj, "values", {B, Hkv, W, d}, true);
  const auto* mask =
      reinterpret_cast<const uint8_t*>(array_data<bool>(mask_obj, "mask", {B, Wm}, false));
  float* out = array_data<float>(out_obj, "out", {B, Hq, d}, true);
  const int64_t group = Hq / Hkv;
  const int64_t span = std::min({padded(n), W, Wm});
  const float s = static_cast<float>(scale), e = static_cast<float>(eps);
  py::gil_scoped_release release;
  const int threads = B * Hq * n * d >= kParallelFloor ? threads_for(num_threads) : 1;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores(static_cast<size_t>(span));
    float y[kMaxHead];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      const float* c = cos + b * d;
      const float* sn = sin + b * d;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t base = (b * Hkv + h) * W * d;
        position_head(k + (b * Hkv + h) * d, kw, e, c, sn, d, y);
        for (int64_t i = 0; i < d; ++i) {
          KT[base + i * W + col] = y[i];
          V[base + col * d + i] = v[(b * Hkv + h) * d + i];
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const int64_t base = (b * Hkv + hq / group) * W * d;
        position_head(q + (b * Hq + hq) * d, qw, e, c, sn, d, y);
        attend_one(y, KT + base, V + base, mask + b * Wm, n, span, W, d, s, scores.data(),
                   out + (b * Hq + hq) * d);
      }
    }
  }
}

}  // namespace

void bind_layers(py::module_& m) {
  py::arg_v nt = py::arg("num_threads") = 0;
  m.def("rms_norm_forward", &rms_norm_forward, py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("y"), py::arg("rstd"), nt,
        "y [N, H] = weight * x * rstd, rstd [N] = 1 / sqrt(mean(x^2) + eps), for x [N, H].");
  m.def("rms_norm_backward", &rms_norm_backward, py::arg("grad"), py::arg("x"), py::arg("weight"),
        py::arg("rstd"), py::arg("dx"), py::arg("dw"), nt,
        "dx [N, H] and dw [H] (None: not computed) of the RMSNorm given dL/dy `grad`.");
  m.def("swiglu_forward", &swiglu_forward, py::arg("gate"), py::arg("up"), py::arg("y"), nt,
        "y = SiLU(gate) * up, all [N, I].");
  m.def("swiglu_backward_", &swiglu_backward_, py::arg("grad_product"), py::arg("gate"),
        py::arg("up"), py::arg("grad_up"), py::arg("product"), nt,
        "grad_product <- dL/dgate; writes grad_up and product = SiLU(gate) * up (None: skipped).");
  m.def("decode_attention_", &decode_attention_, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("cos"), py::arg("sin"),
        py::arg("keys_t"), py::arg("values"), py::arg("mask"), py::arg("col"), py::arg("scale"),
        py::arg("out"), nt,
        "A decode step's attention from the projections q [B, Hq, d], k, v [B, Hkv, d]: per-head "
        "norms (None: none) and rotary (cos, sin [B, d]); writes cache column col of keys_t "
        "[B, Hkv, d, W] and values [B, Hkv, W, d]; out [B, Hq, d] over columns 0..col where "
        "mask [B, >= col + 1] is true.");
}
