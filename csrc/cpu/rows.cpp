// CPU row kernels of the fused log-prob / policy loss (docs/concepts.md section 4): cod_fast._cpp.
//
// The fused loss walks the tokens in chunks of C rows; torch does the GEMMs (z = h W^T, then
// dh = dz W and dW += dz^T h) and these kernels do everything else on the chunk's [C, V] float32
// logits, in place:
//   forward   : x = z / T; lse, logp = x_y - lse and H = -sum p log p, z untouched;
//   backward_ : z <- dL/dz from given dL/dlogp and dL/dH;
//   fused_    : forward, then the per-token loss head (loss_head.h), then backward_ with the
//               head's gradients: each row is read once for its statistics and once for dz.
//
// Numerics. Per row, with x = inv_temp z and m = max x: s = sum exp(x - m),
// u = sum exp(x - m) (x - m); lse = m + log s and H = log s - u / s (never lse - sum p x, which
// cancels badly for peaked rows). x - m is formed as (z - max z) inv_temp, so its error is
// relative to x - m (eager torch rounds x itself, an absolute error of half an ulp of x). The row
// is scanned in L1-sized blocks with an online maximum: a block whose maximum beats m rescales s
// and u by exp(m - m') (u' = exp(m - m') (u + (m - m') s)), so the row streams from memory once.
// exp is a Cody-Waite + degree-6 polynomial (Cephes expf, ~1 ulp) written as straight-line float
// code the compiler vectorises; it is only ever called on arguments <= 0 and flushes below -87 to
// 0 (a p < 2^-125 contributes nothing at float precision). NaN in a row propagates to its outputs.
//
// Vectorisation without -march=native: the row functions carry COD_CLONES (cpu/common.h).
// The module also holds the kernels of layers.cpp and attention.cpp (bind_layers, bind_attention).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "cpu/common.h"
#include "loss_head.h"

namespace {

using namespace cod_cpu;

constexpr int64_t kBlock = 2048;  // 8 KiB of logits: the online-max block stays in L1

struct Stats {
  float zmax;  // max of the raw logits z (x = inv_temp z, so max x = inv_temp zmax)
  float logs;  // log sum exp(x - max x)
  float entropy;
};

// Differences to the maximum are formed in z space, d = (z - zmax) inv_temp, never as
// inv_temp z - max x: with multiply-add contraction the latter would subtract a rounded max from an
// unrounded product, and the argmax would no longer give exactly d = 0.
COD_CLONES
Stats row_stats(const float* z, int64_t V, float inv_temp) {
  float zm = -INFINITY, s = 0.0f, u = 0.0f;
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    const float* zb = z + b0;
    const int64_t n = std::min(kBlock, V - b0);
    const float bm = block_max(zb, n);
    if (bm > zm) {
      if (zm != -INFINITY) {
        const float dm = (zm - bm) * inv_temp;
        const float scale = exp_nonpos(dm);
        u = scale * (u + dm * s);
        s *= scale;
      }
      zm = bm;
    }
    // While zm is -inf every logit so far is -inf (or NaN): any finite reference gives them
    // exp = 0 (and keeps NaN), where zm itself would give -inf - -inf = NaN.
    const float ref = zm == -INFINITY ? 0.0f : zm;
    float bs = 0.0f, bu = 0.0f;
#pragma omp simd reduction(+ : bs, bu)
    for (int64_t i = 0; i < n; ++i) {
      float dc;
      const float e = exp_nonpos((zb[i] - ref) * inv_temp, dc);
      bs += e;
      bu += e * dc;
    }
    s += bs;
    u += bu;
  }
  const float logs = std::log(s);
  return {zm, logs, logs - u / s};
}

// log p_v in the row's own frame: (z_v - zmax) inv_temp - log s, accurate relative to log p_v.
struct RowFrame {
  float zmax, inv_temp, logs;
  COD_INLINE float operator()(float z) const { return (z - zmax) * inv_temp - logs; }
};

// log p_v = inv_temp z_v - lse from a caller's lse. Formed in double: in float, the rounding of
// inv_temp z alone (half an ulp of a logit of 50 is 2e-6) would shift p_v by more than eager torch
// does when its own division happens to be exact.
struct AbsoluteFrame {
  double inv_temp, lse;
  COD_INLINE float operator()(float z) const {
    return static_cast<float>(static_cast<double>(z) * inv_temp - lse);
  }
};

// z <- p * (a + b log p): dL/dz without the target's one-hot term (kEntropy = false: b = 0).
template <bool kEntropy, typename Frame>
COD_INLINE void dz_loop(float* z, int64_t V, Frame log_p, float a, float b) {
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) {
    float dc;
    const float p = exp_nonpos(log_p(z[v]), dc);
    z[v] = kEntropy ? p * (a + b * dc) : a * p;
  }
}

COD_CLONES
void row_dz(float* z, int64_t V, RowFrame f, float a, float b, bool with_b) {
  with_b ? dz_loop<true>(z, V, f, a, b) : dz_loop<false>(z, V, f, a, b);
}

COD_CLONES
void row_dz(float* z, int64_t V, AbsoluteFrame f, float a, float b, bool with_b) {
  with_b ? dz_loop<true>(z, V, f, a, b) : dz_loop<false>(z, V, f, a, b);
}

// dL/dz_v = inv_temp (g (onehot_v - p_v) - gH p_v (log p_v + H)).
template <typename Frame>
void row_backward(float* z, int64_t V, int64_t y, double inv_temp, Frame log_p, float entropy,
                  float g, float gh, bool with_entropy) {
  const double a = -inv_temp * (g + (with_entropy ? double(gh) * entropy : 0.0));
  const double b = -inv_temp * gh;
  row_dz(z, V, log_p, float(a), float(b), with_entropy && gh != 0.0f);
  z[y] = float(z[y] + inv_temp * g);
}


struct Logits {
  float* z;
  int64_t C, V;
};

Logits logits_of(const py::object& obj, bool writable) {
  if (!py::isinstance<py::array>(obj) || py::reinterpret_borrow<py::array>(obj).ndim() != 2) {
    throw std::invalid_argument("z must be a 2-d float32 array [C, V]");
  }
  py::array a = py::reinterpret_borrow<py::array>(obj);
  const int64_t C = a.shape(0), V = a.shape(1);
  if (V == 0 && C > 0) throw std::invalid_argument("z must have at least one column (V >= 1)");
  return {data_of<float>(obj, "z", C, V, writable), C, V};
}

const int64_t* targets_of(const py::object& obj, int64_t C, int64_t V) {
  const int64_t* y = data_of<int64_t>(obj, "targets", C, -1, false);
  for (int64_t t = 0; t < C; ++t) {
    if (y[t] < 0 || y[t] >= V) {
      throw std::invalid_argument("targets[" + std::to_string(t) + "] = " + std::to_string(y[t]) +
                                  " is outside [0, " + std::to_string(V) + ")");
    }
  }
  return y;
}

void check_inv_temp(double inv_temp) {
  if (!(inv_temp > 0.0 && inv_temp < 1e30)) {
    throw std::invalid_argument("inv_temp must be a finite number > 0, got " +
                                std::to_string(inv_temp));
  }
}


// ---- bound functions ----

void forward(py::object z_obj, py::object y_obj, double inv_temp, py::object logp_obj,
             py::object entropy_obj, py::object lse_obj, int num_threads) {
  check_inv_temp(inv_temp);
  const float it = static_cast<float>(inv_temp);
  const Logits L = logits_of(z_obj, false);
  const int64_t* y = targets_of(y_obj, L.C, L.V);
  float* logp = data_of<float>(logp_obj, "logp", L.C, -1, true);
  float* entropy = data_of<float>(entropy_obj, "entropy", L.C, -1, true);
  float* lse = data_of<float>(lse_obj, "lse", L.C, -1, true);
  py::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(threads_for(num_threads))
  for (int64_t t = 0; t < L.C; ++t) {
    const float* row = L.z + t * L.V;
    const Stats st = row_stats(row, L.V, it);
    // Per-row scalars in double: lse keeps the full inv_temp, logp the exact z_y - zmax.
    lse[t] = static_cast<float>(st.zmax * inv_temp + st.logs);
    logp[t] = static_cast<float>((double(row[y[t]]) - st.zmax) * inv_temp - st.logs);
    entropy[t] = st.entropy;
  }
}

void backward_(py::object z_obj, py::object y_obj, py::object lse_obj, py::object entropy_obj,
               py::object g_logp_obj, py::object g_entropy_obj, double inv_temp, int num_threads) {
  check_inv_temp(inv_temp);
  const Logits L = logits_of(z_obj, true);
  const int64_t* y = targets_of(y_obj, L.C, L.V);
  const float* lse = data_of<float>(lse_obj, "lse", L.C, -1, false);
  const float* g_logp = data_of<float>(g_logp_obj, "g_logp", L.C, -1, false);
  const float* g_entropy = optional_data<float>(g_entropy_obj, "g_entropy", L.C, false, "");
  const float* entropy =
      optional_data<float>(entropy_obj, "entropy", L.C, g_entropy != nullptr, "g_entropy is given");
  py::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(threads_for(num_threads))
  for (int64_t t = 0; t < L.C; ++t) {
    const bool with_h = g_entropy != nullptr;
    row_backward(L.z + t * L.V, L.V, y[t], inv_temp, AbsoluteFrame{inv_temp, lse[t]},
                 with_h ? entropy[t] : 0.0f, g_logp[t], with_h ? g_entropy[t] : 0.0f, with_h);
  }
}

void fused_(py::object z_obj, py::object y_obj, double inv_temp, py::object adv_obj,
            py::object old_obj, py::object ref_obj, py::object teach_obj, py::object corr_obj,
            py::object weight_obj, py::object seq_ratio_obj, py::object seq_grad_obj,
            py::object ent_coef_obj, int policy, bool seq_level, bool on_policy, float eps_low,
            float eps_high, int kl, float beta, float entropy_coef, float opd_coef,
            py::object logp_obj, py::object entropy_obj, py::object loss_obj,
            py::object clipped_obj, int num_threads) {
  check_inv_temp(inv_temp);
  const float it = static_cast<float>(inv_temp);
  if (policy < cod::kPPO || policy > cod::kOPD) {
    throw std::invalid_argument(
        "policy code must be 0 (ppo), 1 (rec_one_side), "
        "2 (rec_one_side_is) or 3 (opd), got " +
        std::to_string(policy));
  }
  if (kl < cod::kNoKL || kl > cod::kK3) {
    throw std::invalid_argument("kl code must be 0 (none), 1 (k1), 2 (k2) or 3 (k3), got " +
                                std::to_string(kl));
  }
  const Logits L = logits_of(z_obj, true);
  const int64_t C = L.C;
  const int64_t* y = targets_of(y_obj, C, L.V);
  const float* adv = data_of<float>(adv_obj, "adv", C, -1, false);
  const float* weight = data_of<float>(weight_obj, "weight", C, -1, false);
  const float* corr = optional_data<float>(corr_obj, "corr", C, false, "");
  const float* old = optional_data<float>(old_obj, "old", C, !on_policy && !seq_level,
                                          "the ratio is token level and not on-policy");
  const float* ref = optional_data<float>(ref_obj, "ref", C, kl != cod::kNoKL, "kl != 0");
  const float* teach =
      optional_data<float>(teach_obj, "teach", C, policy == cod::kOPD, "policy is opd (3)");
  const float* seq_ratio =
      optional_data<float>(seq_ratio_obj, "seq_ratio", C, seq_level, "seq_level is set");
  const float* seq_grad =
      optional_data<float>(seq_grad_obj, "seq_grad", C, seq_level, "seq_level is set");
  // Per-token entropy weights, else `entropy_coef` on every token.
  const float* ent_coef = optional_data<float>(ent_coef_obj, "ent_coef", C, false, "");
  float* logp = data_of<float>(logp_obj, "logp", C, -1, true);
  float* entropy = data_of<float>(entropy_obj, "entropy", C, -1, true);
  float* loss = data_of<float>(loss_obj, "loss", C, -1, true);
  bool* clipped = data_of<bool>(clipped_obj, "clipped", C, -1, true);

  const cod::HeadParams params{policy, seq_level, on_policy, eps_low, eps_high, kl, beta, opd_coef};
  py::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(threads_for(num_threads))
  for (int64_t t = 0; t < C; ++t) {
    float* row = L.z + t * L.V;
    const Stats st = row_stats(row, L.V, it);
    const float lp = static_cast<float>((double(row[y[t]]) - st.zmax) * inv_temp - st.logs);
    cod::HeadInputs in;
    in.logp = lp;
    in.entropy = st.entropy;
    in.adv = adv[t];
    in.old = old ? old[t] : 0.0f;
    in.ref = ref ? ref[t] : 0.0f;
    in.teach = teach ? teach[t] : 0.0f;
    in.corr = corr ? corr[t] : 1.0f;
    in.weight = weight[t];
    in.seq_ratio = seq_ratio ? seq_ratio[t] : 1.0f;
    in.seq_grad = seq_grad ? seq_grad[t] : 0.0f;
    in.entropy_coef = ent_coef ? ent_coef[t] : entropy_coef;
    const cod::HeadOutputs out = cod::loss_head(params, in);
    logp[t] = lp;
    entropy[t] = st.entropy;
    loss[t] = out.loss;
    clipped[t] = out.clipped;
    row_backward(row, L.V, y[t], inv_temp, RowFrame{st.zmax, it, st.logs}, st.entropy, out.g_logp,
                 out.g_entropy, true);
  }
}

}  // namespace

PYBIND11_MODULE(_cpp, m) {
  m.doc() = "CPU row kernels of cod-fast's fused log-prob / policy loss (see csrc/cpu/rows.cpp)";
  py::arg_v nt = py::arg("num_threads") = 0;
  m.def("forward", &forward, py::arg("z"), py::arg("targets"), py::arg("inv_temp"), py::arg("logp"),
        py::arg("entropy"), py::arg("lse"), nt,
        "Row statistics of float32 logits z [C, V]: writes logp, entropy, lse [C]; z untouched.");
  m.def("backward_", &backward_, py::arg("z"), py::arg("targets"), py::arg("lse"),
        py::arg("entropy"), py::arg("g_logp"), py::arg("g_entropy"), py::arg("inv_temp"), nt,
        "Overwrite z [C, V] with dL/dz given dL/dlogp and dL/dH (g_entropy may be None).");
  m.def(
      "fused_", &fused_, py::arg("z"), py::arg("targets"), py::arg("inv_temp"), py::arg("adv"),
      py::arg("old"), py::arg("ref"), py::arg("teach"), py::arg("corr"), py::arg("weight"),
      py::arg("seq_ratio"), py::arg("seq_grad"), py::arg("ent_coef"), py::arg("policy"),
      py::arg("seq_level"), py::arg("on_policy"), py::arg("eps_low"), py::arg("eps_high"),
      py::arg("kl"), py::arg("beta"), py::arg("entropy_coef"), py::arg("opd_coef"),
      py::arg("logp"), py::arg("entropy"), py::arg("loss"), py::arg("clipped"), nt,
      "Row statistics, the loss head and dL/dz in one sweep; z [C, V] is overwritten with dL/dz.");
  bind_layers(m);
  bind_attention(m);
#ifdef _OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
}
