// CUDA kernels for the per-token loss head and the segment reductions (docs/concepts.md sec. 4).
//
// The head itself is the shared `cod::loss_head` (csrc/loss_head.h), so the CPU row kernels and
// these kernels cannot drift apart. The library is plain CUDA with a C ABI (no torch headers):
// cod_fast/ops/cuda_head.py compiles it with nvcc on first use and calls it through ctypes with
// tensor data pointers and the current CUDA stream.
#include <cuda_runtime.h>
#include <stdint.h>

#include "loss_head.h"

namespace {

constexpr int kThreads = 256;

inline int blocks_for(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

__global__ void loss_head_kernel(int64_t n, cod::HeadParams params, const float* __restrict__ logp,
                                 const float* __restrict__ entropy, const float* __restrict__ adv,
                                 const float* __restrict__ old, const float* __restrict__ ref,
                                 const float* __restrict__ teach, const float* __restrict__ corr,
                                 const float* __restrict__ weight,
                                 const float* __restrict__ seq_ratio,
                                 const float* __restrict__ seq_grad, float entropy_coef,
                                 const float* __restrict__ ent_coef, float* __restrict__ loss,
                                 float* __restrict__ g_logp, float* __restrict__ g_entropy,
                                 float* __restrict__ clipped) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  cod::HeadInputs in;
  in.logp = logp[t];
  in.entropy = entropy[t];
  in.adv = adv[t];
  // Optional inputs may be null pointers; the head reads them only when the params ask for them.
  in.old = old ? old[t] : 0.0f;
  in.ref = ref ? ref[t] : 0.0f;
  in.teach = teach ? teach[t] : 0.0f;
  in.corr = corr[t];
  in.weight = weight[t];
  in.seq_ratio = seq_ratio ? seq_ratio[t] : 1.0f;
  in.seq_grad = seq_grad ? seq_grad[t] : 0.0f;
  // Per-token entropy weights when given, else the one scalar weight.
  in.entropy_coef = ent_coef ? ent_coef[t] : entropy_coef;
  const cod::HeadOutputs out = cod::loss_head(params, in);
  loss[t] = out.loss;
  g_logp[t] = out.g_logp;
  g_entropy[t] = out.g_entropy;
  clipped[t] = out.clipped ? 1.0f : 0.0f;
}

// sums[seg[t]] += values[t]. Segments are contiguous runs in packed data, so neighbouring threads
// mostly hit the same address: each warp reduces every run of equal ids it holds (a segmented
// tree reduction bounded by the run's end), then issues one atomic per run. Ids need not be
// sorted: a segment split over several runs gets one atomic per run.
__global__ void segment_sum_kernel(int64_t n, const float* __restrict__ values,
                                   const int64_t* __restrict__ seg, float* __restrict__ sums) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const unsigned lane = threadIdx.x & 31u;
  const bool active = t < n;
  const int64_t s = active ? seg[t] : -1;
  float v = active ? values[t] : 0.0f;
  const int64_t prev_seg = __shfl_up_sync(0xffffffffu, s, 1);
  const bool run_start = lane == 0 || prev_seg != s;
  // Lanes of this run: up to (not including) the next run start above this lane.
  const unsigned starts = __ballot_sync(0xffffffffu, run_start);
  const unsigned above = lane == 31u ? 0u : starts & ~((2u << lane) - 1u);
  const unsigned run_end = above ? static_cast<unsigned>(__ffs(above) - 1) : 32u;
  for (unsigned offset = 1; offset < 32; offset <<= 1) {
    const float other = __shfl_down_sync(0xffffffffu, v, offset);
    if (lane + offset < run_end) v += other;
  }
  if (active && run_start) atomicAdd(&sums[s], v);
}

// out[t] = sums[seg[t]] / counts[seg[t]]: a segment mean broadcast back to its tokens.
__global__ void segment_broadcast_mean_kernel(int64_t n, const float* __restrict__ sums,
                                              const int64_t* __restrict__ counts,
                                              const int64_t* __restrict__ seg,
                                              float* __restrict__ out) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  const int64_t s = seg[t];
  out[t] = sums[s] / static_cast<float>(counts[s]);
}

}  // namespace

extern "C" {

// Every launcher returns the cudaError_t of its launch (0 on success).

int cod_loss_head(int64_t n, int policy, int seq_level, int on_policy, float eps_low,
                  float eps_high, int kl, float beta, float entropy_coef, float opd_coef,
                  const float* logp, const float* entropy, const float* adv, const float* old,
                  const float* ref, const float* teach, const float* corr, const float* weight,
                  const float* seq_ratio, const float* seq_grad, const float* ent_coef,
                  float* loss, float* g_logp, float* g_entropy, float* clipped, void* stream) {
  if (n == 0) return 0;
  const cod::HeadParams params{policy, seq_level, on_policy, eps_low, eps_high, kl, beta, opd_coef};
  loss_head_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      n, params, logp, entropy, adv, old, ref, teach, corr, weight, seq_ratio, seq_grad,
      entropy_coef, ent_coef, loss, g_logp, g_entropy, clipped);
  return static_cast<int>(cudaGetLastError());
}

// `sums` must be zeroed by the caller (it has one entry per segment).
int cod_segment_sum(int64_t n, const float* values, const int64_t* seg, float* sums,
                    void* stream) {
  if (n == 0) return 0;
  segment_sum_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      n, values, seg, sums);
  return static_cast<int>(cudaGetLastError());
}

int cod_segment_broadcast_mean(int64_t n, const float* sums, const int64_t* counts,
                               const int64_t* seg, float* out, void* stream) {
  if (n == 0) return 0;
  segment_broadcast_mean_kernel<<<blocks_for(n), kThreads, 0,
                                  static_cast<cudaStream_t>(stream)>>>(n, sums, counts, seg, out);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
