// CPU varlen attention of a packed training micro-batch, forward and backward (bound into
// cod_fast._cpp): causal attention within blocks of queries, each block over its own keys.
//
// Layout (cod_fast.attention, docs/concepts.md section 5): q [T, Hq, d], k and v [Tk, Hkv, d];
// block b holds queries cu_q[b]..cu_q[b+1] and keys cu_k[b]..cu_k[b+1] - or, with a shared-prefix
// tree, the key rows kv_index[cu_k[b]..cu_k[b+1]] (a prefix's rows serve every block under it). A
// block of lq queries and lk >= lq keys is causal aligned at the end: query t sees keys j <= lk -
// lq + t. Hq is a multiple of Hkv (grouped-query heads).
//
// Why not torch: on a small model the per-block SDPA calls (one per sequence and layer, forward
// and backward) and the key gathers of the tree layout cost several times their arithmetic.
// Here one call per layer does every block: per (key-value head, block) the keys are gathered
// once into scratch, transposed (so the score loop runs along the keys, a vector lane each, with
// no horizontal sums), and every query of the head group is served from there. The backward pass
// recomputes the probabilities from the saved log-sum-exp (flash attention's scheme) and
// scatter-adds the key and value gradients back through kv_index. Threads split the key-value
// heads, so no two threads write the same gradient row.
//
// Numerics: float32 with float accumulation over lanes, exp from common.h (~1 ulp), lse in float.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/common.h"

namespace {

using namespace cod_cpu;

struct Blocks {
  const int32_t* cu_q;
  const int32_t* cu_k;
  const int64_t* kv_index;  // nullptr: block b's keys are rows cu_k[b]..cu_k[b+1]
  int64_t count;
  int64_t max_k;
  int64_t key_row(int64_t j) const { return kv_index ? kv_index[j] : j; }
};

// Per-thread scratch for one (key-value head, block): the block's keys and values transposed
// ([d, pitch], zero past the block's keys, so the loops along the keys need no remainder) and
// row-major (contiguous copies: the weighted row sums vectorise over them), the rows' offsets in
// k and v, scores (twice: the backward pass keeps two), and the block's key/value gradients.
struct Scratch {
  int64_t pitch;
  std::vector<float> kt, vt, kr, vr, s, dk, dv;
  std::vector<int64_t> off;
  explicit Scratch(int64_t lk, int64_t d)
      : pitch(padded(lk)),
        kt(pitch * d),
        vt(pitch * d),
        kr(lk * d),
        vr(lk * d),
        s(2 * pitch),
        dk(lk * d),
        dv(lk * d),
        off(lk) {}
};

// What a pass reads of a block: the forward pass the keys transposed and the values by row,
// the backward pass the keys both ways and the values transposed.
enum class Pass { kForward, kBackward };

void gather_block(const float* k, const float* v, const Blocks& bl, int64_t b, int64_t h,
                  int64_t Hkv, int64_t d, Pass pass, Scratch& sc) {
  const int64_t k0 = bl.cu_k[b], lk = bl.cu_k[b + 1] - k0, pitch = sc.pitch;
  const bool backward = pass == Pass::kBackward;
  for (int64_t j = 0; j < lk; ++j) {
    const int64_t row = (bl.key_row(k0 + j) * Hkv + h) * d;
    sc.off[j] = row;
    if (backward) {
      std::copy(k + row, k + row + d, sc.kr.data() + j * d);
    } else {
      std::copy(v + row, v + row + d, sc.vr.data() + j * d);
    }
  }
  for (int64_t i = 0; i < d; ++i) {
    float* kt = sc.kt.data() + i * pitch;
    for (int64_t j = 0; j < lk; ++j) kt[j] = k[sc.off[j] + i];
    std::fill(kt + lk, kt + padded(lk), 0.0f);
    if (!backward) continue;
    float* vt = sc.vt.data() + i * pitch;
    for (int64_t j = 0; j < lk; ++j) vt[j] = v[sc.off[j] + i];
    std::fill(vt + lk, vt + padded(lk), 0.0f);
  }
}

// s[j] = scale * q . K[j] for j < n and -inf for n <= j < padded(n), from the keys transposed
// kt [d, pitch]; returns padded(n).
COD_INLINE int64_t scores(const float* q, const float* kt, int64_t n, int64_t pitch, int64_t d,
                          float scale, float* s) {
  const int64_t span = padded(n);
  weighted_rows(q, kt, pitch, d, span, s);
#pragma omp simd
  for (int64_t j = 0; j < span; ++j) s[j] = j < n ? s[j] * scale : -INFINITY;
  return span;
}

// One query: o = softmax(s) V over n keys; returns lse.
COD_CLONES
float attend_query(const float* q, Scratch& sc, int64_t n, int64_t d, float scale, float* o) {
  float* s = sc.s.data();
  const int64_t span = scores(q, sc.kt.data(), n, sc.pitch, d, scale, s);
  const float m = block_max(s, span);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < span; ++j) {
    const float p = exp_nonpos(s[j] - m);
    s[j] = p;
    total += p;
  }
  weighted_rows(s, sc.vr.data(), d, n, d, o);
  const float inv = 1.0f / total;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  return m + std::log(total);
}

// One query's backward: dq = scale sum_j ds_j K_j, dK_j += scale ds_j q, dV_j += p_j dO, with
// p_j = exp(s_j - lse), ds_j = p_j (dO . V_j - dO . O).
COD_CLONES
void attend_query_backward(const float* q, const float* o, const float* dout, float lse,
                           Scratch& sc, int64_t n, int64_t d, float scale, float* dq) {
  float* s = sc.s.data();
  const int64_t span = scores(q, sc.kt.data(), n, sc.pitch, d, scale, s);
  float delta = 0.0f;
#pragma omp simd reduction(+ : delta)
  for (int64_t i = 0; i < d; ++i) delta += dout[i] * o[i];
  // s <- p; ds <- dO . V_j, accumulated along the keys from the transposed values, then ds.
#pragma omp simd
  for (int64_t j = 0; j < span; ++j) s[j] = exp_nonpos(s[j] - lse);
  float* ds = s + sc.pitch;
  weighted_rows(dout, sc.vt.data(), sc.pitch, d, span, ds);
#pragma omp simd
  for (int64_t j = 0; j < span; ++j) ds[j] = s[j] * (ds[j] - delta) * scale;
  weighted_rows(ds, sc.kr.data(), d, n, d, dq);
  float* dk = sc.dk.data();
  float* dv = sc.dv.data();
  for (int64_t j = 0; j < n; ++j) {
    const float g = ds[j], p = s[j];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      dk[j * d + i] += g * q[i];
      dv[j * d + i] += p * dout[i];
    }
  }
}

struct Shapes {
  int64_t T, Hq, d, Tk, Hkv;
};

Shapes check(const py::object& q_obj, const py::object& k_obj, const py::object& v_obj) {
  const auto nd = [](const py::object& obj, const char* name) {
    if (!py::isinstance<py::array>(obj) || py::reinterpret_borrow<py::array>(obj).ndim() != 3) {
      throw std::invalid_argument(std::string(name) + " must be a 3-d float32 numpy array");
    }
    return py::reinterpret_borrow<py::array>(obj);
  };
  const py::array q = nd(q_obj, "q"), k = nd(k_obj, "k");
  (void)nd(v_obj, "v");
  const Shapes sh{q.shape(0), q.shape(1), q.shape(2), k.shape(0), k.shape(1)};
  if (sh.Hkv < 1 || sh.Hq % sh.Hkv != 0 || k.shape(2) != sh.d) {
    throw std::invalid_argument("q " + shape_str(q) + " and k " + shape_str(k) +
                                ": query heads must be a multiple of key-value heads and the "
                                "head sizes equal");
  }
  return sh;
}

Blocks blocks_of(const py::object& cu_q_obj, const py::object& cu_k_obj,
                 const py::object& index_obj, const Shapes& sh) {
  if (!py::isinstance<py::array>(cu_q_obj)) throw std::invalid_argument("cu_q must be an array");
  const int64_t count = py::reinterpret_borrow<py::array>(cu_q_obj).shape(0) - 1;
  Blocks bl{array_data<int32_t>(cu_q_obj, "cu_q", {count + 1}, false),
            array_data<int32_t>(cu_k_obj, "cu_k", {count + 1}, false), nullptr, count, 0};
  int64_t keys = sh.Tk;
  if (!index_obj.is_none()) {
    if (!py::isinstance<py::array>(index_obj)) throw std::invalid_argument("kv_index: an array");
    keys = py::reinterpret_borrow<py::array>(index_obj).shape(0);
    bl.kv_index = array_data<int64_t>(index_obj, "kv_index", {keys}, false);
    for (int64_t j = 0; j < keys; ++j) {
      if (bl.kv_index[j] < 0 || bl.kv_index[j] >= sh.Tk) {
        throw std::invalid_argument("kv_index[" + std::to_string(j) + "] = " +
                                    std::to_string(bl.kv_index[j]) + " is outside [0, " +
                                    std::to_string(sh.Tk) + ")");
      }
    }
  }
  if (count < 0 || bl.cu_q[0] != 0 || bl.cu_k[0] != 0 || bl.cu_q[count] != sh.T ||
      bl.cu_k[count] != keys) {
    throw std::invalid_argument("cu_q must run from 0 to the " + std::to_string(sh.T) +
                                " queries and cu_k from 0 to the " + std::to_string(keys) +
                                " keys");
  }
  for (int64_t b = 0; b < count; ++b) {
    const int64_t lq = bl.cu_q[b + 1] - bl.cu_q[b], lk = bl.cu_k[b + 1] - bl.cu_k[b];
    if (lq < 0 || lk < lq) {
      throw std::invalid_argument("block " + std::to_string(b) + " has " + std::to_string(lq) +
                                  " queries and " + std::to_string(lk) +
                                  " keys; every block needs at least as many keys as queries");
    }
    bl.max_k = std::max(bl.max_k, lk);
  }
  return bl;
}

int64_t threads_over_heads(int64_t Hkv, int num_threads) {
  return std::max<int64_t>(1, std::min<int64_t>(Hkv, threads_for(num_threads)));
}

// ---- bound functions ----

void varlen_attention_forward(py::object q_obj, py::object k_obj, py::object v_obj,
                              py::object cu_q_obj, py::object cu_k_obj, py::object index_obj,
                              double scale, py::object out_obj, py::object lse_obj,
                              int num_threads) {
  const Shapes sh = check(q_obj, k_obj, v_obj);
  const Blocks bl = blocks_of(cu_q_obj, cu_k_obj, index_obj, sh);
  const float* q = array_data<float>(q_obj, "q", {sh.T, sh.Hq, sh.d}, false);
  const float* k = array_data<float>(k_obj, "k", {sh.Tk, sh.Hkv, sh.d}, false);
  const float* v = array_data<float>(v_obj, "v", {sh.Tk, sh.Hkv, sh.d}, false);
  float* out = array_data<float>(out_obj, "out", {sh.T, sh.Hq, sh.d}, true);
  float* lse = array_data<float>(lse_obj, "lse", {sh.Hq, sh.T}, true);
  const int64_t group = sh.Hq / sh.Hkv, d = sh.d;
  const float sc = static_cast<float>(scale);
  py::gil_scoped_release release;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_over_heads(sh.Hkv, num_threads))
  for (int64_t h = 0; h < sh.Hkv; ++h) {
    Scratch scratch(bl.max_k, d);
    for (int64_t b = 0; b < bl.count; ++b) {
      const int64_t q0 = bl.cu_q[b], lq = bl.cu_q[b + 1] - q0, lk = bl.cu_k[b + 1] - bl.cu_k[b];
      if (lq == 0) continue;
      gather_block(k, v, bl, b, h, sh.Hkv, d, Pass::kForward, scratch);
      for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
        for (int64_t t = 0; t < lq; ++t) {
          const int64_t row = (q0 + t) * sh.Hq + hq;
          lse[hq * sh.T + q0 + t] =
              attend_query(q + row * d, scratch, lk - lq + t + 1, d, sc, out + row * d);
        }
      }
    }
  }
}

void varlen_attention_backward(py::object q_obj, py::object k_obj, py::object v_obj,
                               py::object out_obj, py::object dout_obj, py::object lse_obj,
                               py::object cu_q_obj, py::object cu_k_obj, py::object index_obj,
                               double scale, py::object dq_obj, py::object dk_obj,
                               py::object dv_obj, int num_threads) {
  const Shapes sh = check(q_obj, k_obj, v_obj);
  const Blocks bl = blocks_of(cu_q_obj, cu_k_obj, index_obj, sh);
  const float* q = array_data<float>(q_obj, "q", {sh.T, sh.Hq, sh.d}, false);
  const float* k = array_data<float>(k_obj, "k", {sh.Tk, sh.Hkv, sh.d}, false);
  const float* v = array_data<float>(v_obj, "v", {sh.Tk, sh.Hkv, sh.d}, false);
  const float* out = array_data<float>(out_obj, "out", {sh.T, sh.Hq, sh.d}, false);
  const float* dout = array_data<float>(dout_obj, "dout", {sh.T, sh.Hq, sh.d}, false);
  const float* lse = array_data<float>(lse_obj, "lse", {sh.Hq, sh.T}, false);
  float* dq = array_data<float>(dq_obj, "dq", {sh.T, sh.Hq, sh.d}, true);
  float* dk = array_data<float>(dk_obj, "dk", {sh.Tk, sh.Hkv, sh.d}, true);
  float* dv = array_data<float>(dv_obj, "dv", {sh.Tk, sh.Hkv, sh.d}, true);
  const int64_t group = sh.Hq / sh.Hkv, d = sh.d;
  const float sc = static_cast<float>(scale);
  py::gil_scoped_release release;
  std::fill(dq, dq + sh.T * sh.Hq * d, 0.0f);  // rows of empty blocks stay zero
  std::fill(dk, dk + sh.Tk * sh.Hkv * d, 0.0f);
  std::fill(dv, dv + sh.Tk * sh.Hkv * d, 0.0f);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_over_heads(sh.Hkv, num_threads))
  for (int64_t h = 0; h < sh.Hkv; ++h) {
    Scratch scratch(bl.max_k, d);
    for (int64_t b = 0; b < bl.count; ++b) {
      const int64_t q0 = bl.cu_q[b], lq = bl.cu_q[b + 1] - q0;
      const int64_t k0 = bl.cu_k[b], lk = bl.cu_k[b + 1] - k0;
      if (lq == 0) continue;
      gather_block(k, v, bl, b, h, sh.Hkv, d, Pass::kBackward, scratch);
      std::fill(scratch.dk.begin(), scratch.dk.begin() + lk * d, 0.0f);
      std::fill(scratch.dv.begin(), scratch.dv.begin() + lk * d, 0.0f);
      for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
        for (int64_t t = 0; t < lq; ++t) {
          const int64_t row = ((q0 + t) * sh.Hq + hq) * d;
          attend_query_backward(q + row, out + row, dout + row, lse[hq * sh.T + q0 + t], scratch,
                                lk - lq + t + 1, d, sc, dq + row);
        }
      }
      for (int64_t j = 0; j < lk; ++j) {
        const int64_t row = scratch.off[j];
        for (int64_t i = 0; i < d; ++i) {
          dk[row + i] += scratch.dk[j * d + i];
          dv[row + i] += scratch.dv[j * d + i];
        }
      }
    }
  }
}

}  // namespace

void bind_attention(py::module_& m) {
  py::arg_v nt = py::arg("num_threads") = 0;
  m.def("varlen_attention_forward", &varlen_attention_forward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("cu_q"), py::arg("cu_k"), py::arg("kv_index"), py::arg("scale"),
        py::arg("out"), py::arg("lse"), nt,
        "Causal attention per block (aligned at the end): writes out [T, Hq, d], lse [Hq, T].");
  m.def("varlen_attention_backward", &varlen_attention_backward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("dout"), py::arg("lse"), py::arg("cu_q"),
        py::arg("cu_k"), py::arg("kv_index"), py::arg("scale"), py::arg("dq"), py::arg("dk"),
        py::arg("dv"), nt, "dq, dk, dv of varlen_attention_forward given dL/dout.");
}
