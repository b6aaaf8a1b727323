// Shared pieces of the C++ CPU kernels (rows.cpp, layers.cpp, attention.cpp): the target_clones macro, the
// vectorisable exp of non-positive arguments, argument checking of numpy views, thread counts.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;

// Vectorisation without -march=native: functions marked COD_CLONES are compiled three times
// (x86-64-v4 = AVX-512, x86-64-v3 = AVX2 + FMA, baseline SSE2) and picked at load time by GCC's
// target_clones; other compilers get the portable build.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define COD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define COD_CLONES
#endif

#if defined(__GNUC__)
#define COD_INLINE inline __attribute__((always_inline))
#else
#define COD_INLINE inline
#endif

namespace cod_cpu {

constexpr float kExpFloor = -87.0f;  // exp(-87) ~ 1.6e-38, just above FLT_MIN

// exp(d) for d <= 0 (or NaN); 0 below kExpFloor. `dc` is d clamped to the floor (NaN kept), so
// callers can form exp(d) * d without 0 * -inf.
COD_INLINE float exp_nonpos(float d, float& dc) {
  dc = d < kExpFloor ? kExpFloor : d;
  // Round dc / ln2 to the nearest integer n with the 1.5 * 2^23 trick: no float->int conversion,
  // so the loop vectorises, and the integer sits in t's low mantissa bits.
  const float magic = 12582912.0f;
  const float t = dc * 1.44269504088896341f + magic;
  const float n = t - magic;
  float r = dc - n * 0.693359375f;  // Cody-Waite: ln2 = 0.693359375 - 2.12194440e-4
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.0f;
  uint32_t bits;  // unsigned: NaN's bits wrap harmlessly (the result is NaN through y anyway)
  std::memcpy(&bits, &t, sizeof bits);
  const uint32_t scale_bits = (bits - 0x4B400000u + 127u) << 23;  // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  const float e = y * scale;  // computed unconditionally so the select below is a blend
  return d < kExpFloor ? 0.0f : e;
}

COD_INLINE float exp_nonpos(float d) {
  float dc;
  return exp_nonpos(d, dc);
}

// max of z[0, n), NaN ignored (the exp pass propagates it). Written with explicit lanes: compilers
// do not vectorise a plain float max reduction without -ffinite-math-only (NaN ordering), but
// this select-per-lane form becomes vmaxps-like blends.
COD_INLINE float block_max(const float* z, int64_t n) {
  constexpr int kLanes = 32;
  float lane[kLanes];
  for (int j = 0; j < kLanes; ++j) lane[j] = -INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lane[j] = z[i + j] > lane[j] ? z[i + j] : lane[j];
  }
  float m = -INFINITY;
  for (; i < n; ++i) m = z[i] > m ? z[i] : m;
  // The lanes halve pairwise (no NaN is ever stored in them): 5 dependent steps, not 32, which
  // matters for the short rows of attention scores.
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int j = 0; j < w; ++j) lane[j] = lane[j + w] > lane[j] ? lane[j + w] : lane[j];
  }
  return lane[0] > m ? lane[0] : m;
}

// ---- small attention blocks: keys along vector lanes, accumulators in registers ----

constexpr int64_t kLanes = 16;  // a 512-bit vector of floats

inline int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// out[j] = sum_r c[r] M[r stride + j] for j < kWidth: kWidth / kLanes vectors of columns, each
// with two accumulators (even and odd r), so 2 kWidth / kLanes independent multiply-add chains
// held in registers (a running sum in memory would wait on each store).
template <int64_t kWidth>
COD_INLINE void weighted_rows_block(const float* c, const float* M, int64_t stride, int64_t rows,
                                    float* out) {
  float even[kWidth] = {}, odd[kWidth] = {};
  int64_t r = 0;
  for (; r + 1 < rows; r += 2) {
    const float ce = c[r], co = c[r + 1];
    const float* me = M + r * stride;
    const float* mo = me + stride;
#pragma omp simd
    for (int64_t j = 0; j < kWidth; ++j) {
      even[j] += ce * me[j];
      odd[j] += co * mo[j];
    }
  }
  if (r < rows) {
    const float ce = c[r];
    const float* me = M + r * stride;
#pragma omp simd
    for (int64_t j = 0; j < kWidth; ++j) even[j] += ce * me[j];
  }
  for (int64_t j = 0; j < kWidth; ++j) out[j] = even[j] + odd[j];
}

// out[j] = sum_r c[r] M[r stride + j] for j < cols: `rows` rows of M weighted by c, up to four
// vectors of columns at a time, columns past the last whole vector one by one. With M the keys
// transposed ([d, pitch]) and c a query this is the query's scores along the keys; with M the
// values by row ([n, d]) and c the probabilities, the attention output.
COD_INLINE void weighted_rows(const float* c, const float* M, int64_t stride, int64_t rows,
                              int64_t cols, float* out) {
  int64_t j0 = 0;
  for (; j0 + 4 * kLanes <= cols; j0 += 4 * kLanes) {
    weighted_rows_block<4 * kLanes>(c, M + j0, stride, rows, out + j0);
  }
  switch ((cols - j0) / kLanes) {
    case 3: weighted_rows_block<3 * kLanes>(c, M + j0, stride, rows, out + j0); break;
    case 2: weighted_rows_block<2 * kLanes>(c, M + j0, stride, rows, out + j0); break;
    case 1: weighted_rows_block<kLanes>(c, M + j0, stride, rows, out + j0); break;
    default: break;
  }
  for (j0 += (cols - j0) / kLanes * kLanes; j0 < cols; ++j0) {
    float acc = 0.0f;
    for (int64_t r = 0; r < rows; ++r) acc += c[r] * M[r * stride + j0];
    out[j0] = acc;
  }
}

// ---- argument checking (all before the GIL is released: nothing throws inside the loops) ----

inline std::string shape_str(const py::array& a) {
  std::string s = "[";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

// The data of a C-contiguous numpy array of dtype T and exactly `shape`.
template <typename T>
T* array_data(const py::object& obj, const char* name, std::initializer_list<int64_t> shape,
              bool writable) {
  if (!py::isinstance<py::array>(obj)) {
    throw std::invalid_argument(std::string(name) + " must be a numpy array, got " +
                                std::string(py::str(py::type::of(obj))));
  }
  py::array a = py::reinterpret_borrow<py::array>(obj);
  if (!a.dtype().is(py::dtype::of<T>())) {
    throw std::invalid_argument(std::string(name) + " must have dtype " +
                                std::string(py::str(py::dtype::of<T>())) + ", got " +
                                std::string(py::str(a.dtype())));
  }
  bool shape_ok = a.ndim() == static_cast<py::ssize_t>(shape.size());
  std::string want = "[";
  py::ssize_t i = 0;
  for (int64_t n : shape) {
    shape_ok = shape_ok && a.shape(i) == n;
    want += (i++ ? ", " : "") + std::to_string(n);
  }
  if (!shape_ok) {
    throw std::invalid_argument(std::string(name) + " must have shape " + want + "], got " +
                                shape_str(a));
  }
  if (!(a.flags() & py::array::c_style)) {
    throw std::invalid_argument(std::string(name) + " must be C-contiguous");
  }
  if (writable && !a.writeable()) throw std::invalid_argument(std::string(name) + " is read-only");
  return static_cast<T*>(const_cast<void*>(a.data()));
}

// [rows] (cols < 0) or [rows, cols].
template <typename T>
T* data_of(const py::object& obj, const char* name, int64_t rows, int64_t cols, bool writable) {
  return cols < 0 ? array_data<T>(obj, name, {rows}, writable)
                  : array_data<T>(obj, name, {rows, cols}, writable);
}

template <typename T>
T* optional_data(const py::object& obj, const char* name, int64_t rows, bool needed,
                 const char* why) {
  if (obj.is_none()) {
    if (needed) throw std::invalid_argument(std::string(name) + " is required when " + why);
    return nullptr;
  }
  return data_of<T>(obj, name, rows, -1, false);
}

// num_threads <= 0: OpenMP's default (OMP_NUM_THREADS, else the core count).
inline int threads_for(int num_threads) {
#ifdef _OPENMP
  return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace cod_cpu

// The kernels of layers.cpp and attention.cpp, added to the module rows.cpp defines.
void bind_layers(py::module_& m);
void bind_attention(py::module_& m);
