// One token per row drawn from softmax(logits / temperature), cut to its min-p, top-k and top-p where the row asks, by
// inverse CDF with the row's own uniform: what plain decoding and every one-hot verification of a sampled request
// draw (sampling.draw, sample_rows). And the same distributions whole (probability_rows): what a sampled draft's q
// and the rows verifying it take (sampling.probabilities_for), so that a round's p and q are cut the same way
// plain decoding cuts. And each row's argmax (argmax_rows): what greedy decoding and every greedy verification
// take, in two vector passes where torch's reduction walks the row scalar by scalar.
//
// Why. The torch version divides the logits by the temperature, takes the softmax, sums the probabilities into
// a float64 running sum and searches it: four passes over [rows, vocabulary], three new tensors, and a running
// sum that is a scalar loop over every token. A row with top-k or top-p sorts its whole vocabulary first, which
// cost more than the step's forward. Here each row takes three passes over its logits, a selection of its best
// tokens where it is cut, and the running sum runs over one block of tokens only.
//
// Numbers, per row (each row on its own: its token never depends on the other rows of the call or on threads):
//   y_j = x_j / t (float32, as torch divides), m = max_j y_j, e_j = exp(y_j - m) (float32, within 2 ulp: the
//   vectorized exp_u20, faster than the exp torch's softmax takes);
//   min-p (q > 0, vLLM's order: before top-k and top-p): e_j = 0 where y_j < m + log(q) (float32, as torch's
//   sampling.probabilities compares), the tokens below q times the likeliest one's probability;
//   top-k (k > 0): the k tokens of largest logit are kept (among equal logits the lower ids first; torch's sort
//   breaks such ties its own way), the others' e_j set to 0; top-p (p < 1): the kept tokens in that order, each
//   kept while the mass of those before it (float64, over the kept tokens' total) is below p, the first always;
//   block sums: e over blocks of kBlock tokens, each summed in float64 over kLanes lanes in a fixed order;
//   total = the block sums added in order (float64); target = u * total;
//   the token: walking the blocks, running sums before each block, the first block whose end passes the target;
//   then in it the first token whose running sum (float64, from the block's start) passes the target.
// The softmax's normalisation is left out: it scales every e_j alike, and the search is on u * total. A token of
// zero probability (e_j = 0) never passes a target its predecessor did not, so it is never drawn; where rounding
// leaves the target at or past a sum's end, the last token of any mass before it is drawn.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

namespace {

using specstream_kernels::Vec;

constexpr int64_t kBlock = 64;
constexpr int64_t kLanes = 4;

// The last index in [begin, end) with e > 0, or -1.
inline int64_t last_with_mass(const float* e, int64_t begin, int64_t end) {
  for (int64_t j = end - 1; j >= begin; --j)
    if (e[j] > 0.f) return j;
  return -1;
}

// A candidate token: its logit and id, ordered best first (the larger logit; of equal logits, the lower id).
struct Candidate {
  float logit;
  int32_t id;
  bool operator<(const Candidate& o) const { return logit > o.logit || (logit == o.logit && id < o.id); }
};

// Sets e_j to 0 for the tokens that top-k (k > 0) and top-p (p < 1) cut (see above). x orders the tokens (the
// logits: the same order as x / t), e holds their masses; cand is scratch.
void cut_row(const float* x, int64_t vocab, int64_t k, float p, float* e, std::vector<Candidate>& cand) {
  cand.clear();
  for (int64_t j = 0; j < vocab; ++j)
    if (e[j] > 0.f) cand.push_back({x[j], static_cast<int32_t>(j)});  // a token of no mass is never drawn either way
  // The candidates from `keep` on are cut: their masses go to 0.
  const auto cut_from = [&](size_t keep) {
    for (size_t i = keep; i < cand.size(); ++i) e[cand[i].id] = 0.f;
    cand.resize(keep);
  };
  if (k > 0 && static_cast<size_t>(k) < cand.size()) {
    std::nth_element(cand.begin(), cand.begin() + k, cand.end());
    cut_from(static_cast<size_t>(k));
  }
  const size_t keep = cand.size();
  if (p < 1.f && keep > 1) {
    double total = 0.0;
    for (const Candidate& c : cand) total += static_cast<double>(e[c.id]);
    // The best tokens in order, a growing prefix at a time: top-p usually keeps few of them.
    size_t sorted = 0, n = std::min<size_t>(64, keep), cut = keep;
    double before = 0.0;
    while (cut == keep && sorted < keep) {
      std::partial_sort(cand.begin() + sorted, cand.begin() + n, cand.end());
      for (size_t i = sorted; i < n; ++i) {
        if (i > 0 && before / total >= static_cast<double>(p)) {
          cut = i;
          break;
        }
        before += static_cast<double>(e[cand[i].id]);
      }
      sorted = n;
      n = std::min(keep, n * 4);
    }
    cut_from(cut);
  }
}

// Each token's mass e_j = exp(x_j / t - m), 0 for the tokens the row's min-p, top-k and top-p cut (see above).
void masses_row(const float* x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p, float* e,
                std::vector<Candidate>& cand) {
  const int64_t body = vocab / Vec::size() * Vec::size();
  const Vec vt(temperature);
  Vec vmax(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < body; j += Vec::size()) {
    const Vec y = Vec::loadu(x + j) / vt;
    y.store(e + j);
    vmax = at::vec::maximum(vmax, y);
  }
  float top = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (int64_t j = body; j < vocab; ++j) {
    e[j] = x[j] / temperature;
    top = std::max(top, e[j]);
  }
  // min_p 0 cuts nothing: a floor of -inf. min_p 1 keeps the likeliest tokens alone.
  const float floor = min_p > 0.f ? top + std::log(min_p) : -std::numeric_limits<float>::infinity();
  const Vec vtop(top), vfloor(floor), zero(0.f);
  for (int64_t j = 0; j < body; j += Vec::size()) {
    const Vec y = Vec::loadu(e + j);
    Vec::blendv((y - vtop).exp_u20(), zero, y < vfloor).store(e + j);
  }
  for (int64_t j = body; j < vocab; ++j) e[j] = e[j] < floor ? 0.f : std::exp(e[j] - top);
  if ((top_k > 0 && top_k < vocab) || top_p < 1.f) cut_row(x, vocab, top_k, top_p, e, cand);
}

// The masses' sums over blocks of kBlock tokens (float64, kLanes lanes in a fixed order) into sums; their total.
double block_sums(const float* e, int64_t vocab, double* sums) {
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = std::min(begin + kBlock, vocab);
    double lane[kLanes] = {0.0, 0.0, 0.0, 0.0};
    int64_t j = begin;
    for (; j + kLanes <= end; j += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) lane[l] += static_cast<double>(e[j + l]);
    for (; j < end; ++j) lane[(j - begin) % kLanes] += static_cast<double>(e[j]);
    sums[b] = (lane[0] + lane[1]) + (lane[2] + lane[3]);
    total += sums[b];
  }
  return total;
}

int64_t draw_row(const float* x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p, double u,
                 float* e, double* sums, std::vector<Candidate>& cand) {
  masses_row(x, vocab, temperature, top_k, top_p, min_p, e, cand);
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  const double total = block_sums(e, vocab, sums);
  const double target = u * total;
  double before = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (before + sums[b] <= target) {
      before += sums[b];
      continue;
    }
    const int64_t begin = b * kBlock, end = std::min(begin + kBlock, vocab);
    double running = before;
    for (int64_t j = begin; j < end; ++j) {
      running += static_cast<double>(e[j]);
      if (running > target) return j;
    }
    const int64_t last = last_with_mass(e, begin, end);  // the block's own sum ended a rounding short
    if (last >= 0) return last;
    before += sums[b];
  }
  const int64_t last = last_with_mass(e, 0, vocab);  // u * total rounded up to the total
  return last >= 0 ? last : vocab - 1;
}

// The checks both ops make of their arguments: float32 logits [rows, vocab] with a unit last stride, [rows]
// temperature (float32, > 0), top_k (int64, 0: none), top_p (float32, 1: none) and min_p (float32, 0: none).
void check_rows(const char* op, const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                const at::Tensor& top_p, const at::Tensor& min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat, op,
              ": float32 logits [rows, vocab] with a unit last stride");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab <= std::numeric_limits<int32_t>::max(), op, ": a vocabulary of 1 to 2^31 - 1");
  const auto per_row = [rows](const at::Tensor& t, at::ScalarType type) {
    return t.dim() == 1 && t.size(0) == rows && t.scalar_type() == type;
  };
  TORCH_CHECK(per_row(temperature, at::kFloat) && per_row(top_k, at::kLong) && per_row(top_p, at::kFloat) &&
                  per_row(min_p, at::kFloat),
              op, ": [rows] temperature (float32), top_k (int64), top_p and min_p (float32)");
}

// logits [rows, vocab] float32 (unit last stride), temperature [rows] float32 (> 0), top_k [rows] int64 (0: none),
// top_p [rows] float32 (1: none), min_p [rows] float32 (0: none), uniforms [rows] float64 in [0, 1). Returns [rows]
// int64.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniforms) {
  check_rows("sample_rows", logits, temperature, top_k, top_p, min_p);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == rows && uniforms.scalar_type() == at::kDouble,
              "sample_rows: [rows] uniforms (float64)");
  const at::Tensor t = temperature.contiguous(), k = top_k.contiguous(), p = top_p.contiguous(), u = uniforms.contiguous();
  const at::Tensor q = min_p.contiguous();
  const float* qp = q.data_ptr<float>();
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  const float* pp = p.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    // A thread's buffers, kept from call to call (a call a decoding step): made for each call, the masses' row
    // (196 KB at the bundled model's vocabulary) was mapped, zeroed and unmapped again every step, and top-k's and
    // top-p's candidates regrown. Every mass is written before it is read (masses_row), so none is cleared.
    thread_local std::vector<float> e;
    thread_local std::vector<double> sums;
    thread_local std::vector<Candidate> cand;
    if (static_cast<int64_t>(e.size()) < vocab) e.resize(vocab);
    if (static_cast<int64_t>(sums.size()) < (vocab + kBlock - 1) / kBlock) sums.resize((vocab + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r)
      op[r] = draw_row(x + r * stride, vocab, tp[r], kp[r], pp[r], qp[r], up[r], e.data(), sums.data(), cand);
  });
  return out;
}

// The rows' distributions: softmax(logits / temperature) cut to each row's min-p, top-k and top-p, as sample_rows draws
// from (the masses over their block sums' total, each mass then scaled by the total's float32 reciprocal). Same
// arguments as sample_rows, without the uniforms; returns [rows, vocab] float32.
at::Tensor probability_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                            const at::Tensor& top_p, const at::Tensor& min_p) {
  check_rows("probability_rows", logits, temperature, top_k, top_p, min_p);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const at::Tensor t = temperature.contiguous(), k = top_k.contiguous(), p = top_p.contiguous(), q = min_p.contiguous();
  const float* qp = q.data_ptr<float>();
  at::Tensor out = at::empty({rows, vocab}, logits.options());
  const float* x = logits.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  const float* pp = p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<double> sums;  // kept from call to call, as sample_rows keeps its buffers
    thread_local std::vector<Candidate> cand;
    if (static_cast<int64_t>(sums.size()) < (vocab + kBlock - 1) / kBlock) sums.resize((vocab + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r) {
      float* e = op + r * vocab;
      masses_row(x + r * stride, vocab, tp[r], kp[r], pp[r], qp[r], e, cand);
      const float scale = static_cast<float>(1.0 / block_sums(e, vocab, sums.data()));
      const int64_t body = vocab / Vec::size() * Vec::size();
      for (int64_t j = 0; j < body; j += Vec::size()) (Vec::loadu(e + j) * Vec(scale)).store(e + j);
      for (int64_t j = body; j < vocab; ++j) e[j] *= scale;
    }
  });
  return out;
}

// A row's index of its largest value, the first of equal ones, as torch.argmax answers: a pass for the largest
// value (at::vec::maximum keeps a NaN, which torch.argmax counts as the largest), then one for its first index,
// which stops there. A row holding a NaN answers its first NaN's index.
int64_t argmax_row(const float* x, int64_t n) {
  const int64_t body = n / Vec::size() * Vec::size(), wide = n / (4 * Vec::size()) * (4 * Vec::size());
  const Vec lowest(-std::numeric_limits<float>::infinity());
  Vec m[4] = {lowest, lowest, lowest, lowest};  // four independent chains: one waits on its maximum's latency
  for (int64_t j = 0; j < wide; j += 4 * Vec::size())
    for (int64_t c = 0; c < 4; ++c) m[c] = at::vec::maximum(m[c], Vec::loadu(x + j + c * Vec::size()));
  for (int64_t j = wide; j < body; j += Vec::size()) m[0] = at::vec::maximum(m[0], Vec::loadu(x + j));
  const Vec vmax = at::vec::maximum(at::vec::maximum(m[0], m[1]), at::vec::maximum(m[2], m[3]));
  float top = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (int64_t j = body; j < n; ++j) top = std::isnan(x[j]) || std::isnan(top) ? NAN : std::max(top, x[j]);
  if (std::isnan(top)) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const Vec vtop(top);
  for (int64_t j = 0; j < body; j += Vec::size()) {
    // lanes equal to top: all bits set, the others zero (zero_mask: a bit for each lane that is zero)
    const int hits = ~(Vec::loadu(x + j) == vtop).zero_mask() & ((1 << Vec::size()) - 1);
    if (hits) return j + __builtin_ctz(static_cast<unsigned>(hits));
  }
  for (int64_t j = body; j < n; ++j)
    if (x[j] == top) return j;
  return 0;  // not reached: top is one of the row's values
}

// logits [rows, vocab] float32 (unit last stride). Returns [rows] int64: each row's argmax (argmax_row).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat,
              "argmax_rows: float32 logits [rows, vocab] with a unit last stride");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "argmax_rows: a vocabulary of one token or more");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  // a row takes a few microseconds: a thread takes four or more, so that one or two rows stay on the caller's
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(x + r * stride, vocab);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specstream, CPU, m) {
  m.impl("sample_rows", &sample_rows);
  m.impl("probability_rows", &probability_rows);
  m.impl("argmax_rows", &argmax_rows);
}
