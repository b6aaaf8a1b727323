// The per-token loss head of docs/concepts.md section 4, shared by the CPU and the CUDA kernels.
//
// Given one token's log-prob and entropy under the current policy (and the detached per-token
// inputs the caller prepared), it returns the token's weighted loss and the gradients of that loss
// with respect to logp and H. The row kernels turn those two scalars into dL/dz over the
// vocabulary, so the head is the only place the policy / KL / entropy algebra lives.
//
// Plain C++17 with float math: no torch, no pybind, host and device alike.
#pragma once

#include <math.h>

#ifdef __CUDACC__
#define COD_HD __host__ __device__
#else
#define COD_HD
#endif

namespace cod {

// Integer codes shared with cod_fast/ops/cpp_rows.py.
enum Policy : int { kPPO = 0, kRecOneSide = 1, kRecOneSideIS = 2, kOPD = 3 };
enum KL : int { kNoKL = 0, kK1 = 1, kK2 = 2, kK3 = 3 };

struct HeadParams {
  int policy;     // a Policy code
  int seq_level;  // GSPO: the ratio is the segment's precomputed geometric mean
  int on_policy;  // no separate old policy: r = 1 (with gradient r, as exp(logp - sg(logp)))
  float eps_low, eps_high;
  int kl;  // a KL code
  float beta, opd_coef;
};

// Per-token inputs; `old`, `ref`, `teach`, `seq_ratio`, `seq_grad` are read only when the
// parameters ask for them.
struct HeadInputs {
  float logp, entropy;
  float adv, old, ref, teach;
  float corr;       // rollout-correction weight (tis / mis), 1 when there is none
  float weight;     // aggregation weight w_t / D
  float seq_ratio;  // sequence level: exp(mean over the segment of logp - old)
  float seq_grad;   // sequence level: d(loss)/d(logp_t) through the segment's ratio
  float entropy_coef;  // alpha_t of the entropy bonus -alpha_t H_t (per token: update episodes
                       // may have their own)
};

struct HeadOutputs {
  float loss, g_logp, g_entropy;
  bool clipped;
};

COD_HD inline HeadOutputs loss_head(const HeadParams& p, const HeadInputs& in) {
  const float logp = in.logp, a = in.adv;
  float r;
  if (p.seq_level) {
    r = in.seq_ratio;
  } else if (p.on_policy) {
    r = 1.0f;
  } else {
    r = expf(logp - in.old);
  }

  bool clipped = false;
  float pol, g;
  if (p.policy == kPPO) {
    const float lo = 1.0f - p.eps_low, hi = 1.0f + p.eps_high;
    const float unc = -a * r;
    const float clp = -a * (r < lo ? lo : (r > hi ? hi : r));
    clipped = clp > unc;
    pol = clipped ? clp : unc;
    // The clipped branch is constant in logp; at sequence level the ratio's gradient is the
    // caller's seq_grad, added below.
    g = (clipped || p.seq_level) ? 0.0f : -a * r;
  } else if (p.policy == kRecOneSide || p.policy == kRecOneSideIS) {
    const bool keep = (a >= 0.0f && r <= 1.0f + p.eps_high) || (a < 0.0f && r >= 1.0f - p.eps_low);
    clipped = !keep;
    const float k = keep ? 1.0f : 0.0f;
    if (p.policy == kRecOneSide) {
      pol = -a * logp * k;
      g = -a * k;
    } else {
      pol = -a * r * k;
      g = p.seq_level ? 0.0f : -a * r * k;
    }
  } else {  // opd: the advantage is the teacher's margin with logp detached inside it
    const float adv = p.opd_coef * (in.teach - logp);
    pol = -adv * logp;
    g = -adv;
  }

  float loss = in.corr * pol;
  g *= in.corr;
  if (p.kl != kNoKL) {
    const float d = logp - in.ref;
    float k, dk;
    if (p.kl == kK1) {
      k = d;
      dk = 1.0f;
    } else if (p.kl == kK2) {
      k = 0.5f * d * d;
      dk = d;
    } else {  // k3 = exp(-d) - 1 + d, with expm1 so it stays accurate for small d
      k = expm1f(-d) + d;
      dk = -expm1f(-d);
    }
    loss += p.beta * k;
    g += p.beta * dk;
  }
  loss -= in.entropy_coef * in.entropy;

  HeadOutputs out;
  out.loss = in.weight * loss;
  out.g_logp = in.weight * g + (p.seq_level ? in.seq_grad : 0.0f);
  out.g_entropy = -in.weight * in.entropy_coef;
  out.clipped = clipped;
  return out;
}

}  // namespace cod
