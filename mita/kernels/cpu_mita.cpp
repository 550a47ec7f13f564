// MiTA on CPU: cache-blocked kernels for the expert-grouped computation (arXiv:2602.01219,
// §3.2, eqs. 6-12). Built on first use by mita/kernels/cpu.py (torch.utils.cpp_extension).
//
// Matrix products go through the BLAS torch links (sgemm_/dgemm_, single-threaded inside the
// OpenMP work items); exponentials use ATen's vectorised exp_u20 for float32 (about 1e-6
// relative error) and the exact std::exp for float64, so the float64 path matches the
// PyTorch reference to rounding.
//
// Every output element is computed by one thread in a fixed order: results do not depend on
// the thread count or on the other sequences of the batch.

// The headers of what is used, not <torch/extension.h> (all of torch and ATen): 8.5 s of
// parsing instead of 26 s, most of a first build on 2 cores.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

// The Fortran BLAS entry points of the BLAS torch links (MKL in the x86 wheels exports them):
// column-major, 32-bit sizes. Called inside OpenMP parallel regions, where MKL runs
// single-threaded.
extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b,
            const int* ldb, const double* beta, double* c, const int* ldc);
}

void blas_gemm(char ta, char tb, int m, int n, int k, const float* a, int lda, const float* b,
               int ldb, float beta, float* c, int ldc) {
  const float one = 1.f;
  sgemm_(&ta, &tb, &m, &n, &k, &one, a, &lda, b, &ldb, &beta, c, &ldc);
}

void blas_gemm(char ta, char tb, int m, int n, int k, const double* a, int lda,
               const double* b, int ldb, double beta, double* c, int ldc) {
  const double one = 1.0;
  dgemm_(&ta, &tb, &m, &n, &k, &one, a, &lda, b, &ldb, &beta, c, &ldc);
}

// Row-major C (M×N) = A (M×K) · Bᵀ with B (N×K) (+ beta·C). BLAS is column-major, so this is
// Cᵀ = B · Aᵀ there.
template <typename T>
void mm_nt(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
           T beta, T* C, int64_t ldc) {
  blas_gemm('T', 'N', N, M, K, B, ldb, A, lda, beta, C, ldc);
}

// Row-major C (M×N) = A (M×K) · B (K×N) (+ beta·C).
template <typename T>
void mm_nn(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
           T beta, T* C, int64_t ldc) {
  blas_gemm('N', 'N', N, M, K, B, ldb, A, lda, beta, C, ldc);
}

// Row-major C (M×N) = Aᵀ · B with A (K×M), B (K×N) (+ beta·C).
template <typename T>
void mm_tn(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
           T beta, T* C, int64_t ldc) {
  blas_gemm('N', 'T', N, M, K, B, ldb, A, lda, beta, C, ldc);
}

template <typename T>
T row_max(const T* x, int64_t n) {
  using V = at::vec::Vectorized<T>;
  int64_t i = 0;
  T mx = -std::numeric_limits<T>::infinity();
  if (n >= V::size()) {
    V acc = V::loadu(x);
    for (i = V::size(); i + V::size() <= n; i += V::size()) acc = at::vec::maximum(acc, V::loadu(x + i));
    mx = at::vec::vec_reduce_all<T>([](V a, V b) { return at::vec::maximum(a, b); }, acc);
  }
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// x ← exp(x − mx) in place; returns the sum. mx must be finite.
template <typename T>
T exp_sub_sum(T* x, int64_t n, T mx);

template <>
float exp_sub_sum<float>(float* x, int64_t n, float mx) {
  using V = at::vec::Vectorized<float>;
  const V vmx(mx);
  V vsum(0.f);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    V e = (V::loadu(x + i) - vmx).exp_u20();
    e.store(x + i);
    vsum = vsum + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](V a, V b) { return a + b; }, vsum);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  return sum;
}

template <>
double exp_sub_sum<double>(double* x, int64_t n, double mx) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  return sum;
}

// x ← exp(x − shift) in place (the probabilities of a row from its log-sum-exp).
template <typename T>
void exp_sub(T* x, int64_t n, T shift);

template <>
void exp_sub<float>(float* x, int64_t n, float shift) {
  using V = at::vec::Vectorized<float>;
  const V vs(shift);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) (V::loadu(x + i) - vs).exp_u20().store(x + i);
  for (; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

template <>
void exp_sub<double>(double* x, int64_t n, double shift) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

// Top-k of a stream of (value, index) with indices arriving in ascending order, ties broken by
// the lowest index: a binary min-heap on "worse" = lower value, or equal value and higher
// index. A later element with a value equal to the heap's worst is worse than it, so it enters
// only with a strictly larger value.
template <typename T>
struct TopK {
  int64_t k;
  std::vector<std::pair<T, int64_t>> heap;
  explicit TopK(int64_t k_) : k(k_) { heap.reserve(k_); }
  // std heap functions build a max-heap on the comparator; with cmp(a, b) = "b is worse than
  // a", the front is the worst element.
  static bool cmp(const std::pair<T, int64_t>& a, const std::pair<T, int64_t>& b) {
    return b.first < a.first || (b.first == a.first && b.second > a.second);
  }
  void push_row(const T* x, int64_t n, int64_t offset) {
    int64_t i = 0;
    for (; i < n && static_cast<int64_t>(heap.size()) < k; ++i) {
      heap.emplace_back(x[i], offset + i);
      std::push_heap(heap.begin(), heap.end(), cmp);
    }
    if (i == n) return;
    using V = at::vec::Vectorized<T>;
    T thr = heap.front().first;
    for (; i < n; ++i) {
      // Most keys lose to the current k-th best: skip whole vectors of them at once.
      while (i + V::size() <= n && (V::loadu(x + i) > V(thr)).zero_mask() == (1 << V::size()) - 1)
        i += V::size();
      if (i == n) break;
      if (x[i] > thr) {
        std::pop_heap(heap.begin(), heap.end(), cmp);
        heap.back() = {x[i], offset + i};
        std::push_heap(heap.begin(), heap.end(), cmp);
        thr = heap.front().first;
      }
    }
  }
  void write_sorted_indices(int64_t* out) {
    std::sort(heap.begin(), heap.end(),
              [](const auto& a, const auto& b) { return a.second < b.second; });
    for (size_t j = 0; j < heap.size(); ++j) out[j] = heap[j].second;
  }
};

constexpr int64_t kLandmarkRows = 128;  // landmarks per work item
constexpr int64_t kKeyChunk = 256;      // keys per score tile (128 × 256 float32 = 128 KiB)
constexpr int64_t kQueryBlock = 256;    // queries per route tile
constexpr int64_t kAttentionTile = 256; // queries per attention tile (all of one expert)

template <typename T>
void landmark_pass_impl(const at::Tensor& lm, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& token_valid, int64_t topk, at::Tensor& index,
                        at::Tensor& shared) {
  const int64_t B = k.size(0), H = k.size(1), N = k.size(2), d = k.size(3);
  const int64_t m = lm.size(2), dv = v.size(3);
  // Up to 128 landmarks per item (their key tiles are packed once), fewer when there would
  // be fewer items than threads.
  int64_t rows_per_item = kLandmarkRows;
  while (rows_per_item > 16 &&
         B * H * ((m + rows_per_item - 1) / rows_per_item) < at::get_num_threads())
    rows_per_item /= 2;
  const int64_t blocks = (m + rows_per_item - 1) / rows_per_item;
  const T* L = lm.data_ptr<T>();
  const T* K = k.data_ptr<T>();
  const T* Vp = v.data_ptr<T>();
  const bool* valid = token_valid.defined() ? token_valid.data_ptr<bool>() : nullptr;
  int64_t* I = index.data_ptr<int64_t>();
  T* S_out = shared.data_ptr<T>();
  const T neg_inf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> S(kLandmarkRows * kKeyChunk), acc(kLandmarkRows * dv);
    std::vector<T> mx(kLandmarkRows), sum(kLandmarkRows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / blocks, b = bh / H;
      const int64_t r0 = (item % blocks) * rows_per_item;
      const int64_t R = std::min(rows_per_item, m - r0);
      const T* Lr = L + (bh * m + r0) * d;
      const T* Kb = K + bh * N * d;
      const T* Vb = Vp + bh * N * dv;
      const bool* vb = valid ? valid + b * N : nullptr;
      std::fill(acc.begin(), acc.end(), T(0));
      std::fill(mx.begin(), mx.end(), neg_inf);
      std::fill(sum.begin(), sum.end(), T(0));
      std::vector<TopK<T>> tops;
      tops.reserve(R);
      for (int64_t r = 0; r < R; ++r) tops.emplace_back(topk);
      for (int64_t c0 = 0; c0 < N; c0 += kKeyChunk) {
        const int64_t cn = std::min(kKeyChunk, N - c0);
        mm_nt<T>(R, cn, d, Lr, d, Kb + c0 * d, d, T(0), S.data(), kKeyChunk);
        bool any_valid = true;
        if (vb) {
          any_valid = false;
          for (int64_t j = 0; j < cn; ++j) any_valid |= vb[c0 + j];
          for (int64_t r = 0; r < R; ++r)
            for (int64_t j = 0; j < cn; ++j)
              if (!vb[c0 + j]) S[r * kKeyChunk + j] = neg_inf;
        }
        for (int64_t r = 0; r < R; ++r) {
          T* s = S.data() + r * kKeyChunk;
          tops[r].push_row(s, cn, c0);  // eq. 7: before the softmax overwrites the scores
          if (!any_valid) {
            std::fill(s, s + cn, T(0));
            continue;
          }
          // eq. 8 as an online softmax over key chunks: rescale the running sum and values
          // when the running maximum grows.
          const T cmax = row_max(s, cn);
          if (cmax > mx[r]) {
            const T f = mx[r] == neg_inf ? T(0) : std::exp(mx[r] - cmax);
            sum[r] *= f;
            for (int64_t j = 0; j < dv; ++j) acc[r * dv + j] *= f;
            mx[r] = cmax;
          }
          sum[r] += exp_sub_sum(s, cn, mx[r]);
        }
        if (any_valid) mm_nn<T>(R, dv, cn, S.data(), kKeyChunk, Vb + c0 * dv, dv, T(1), acc.data(), dv);
      }
      for (int64_t r = 0; r < R; ++r) {
        tops[r].write_sorted_indices(I + (bh * m + r0 + r) * topk);
        T* dst = S_out + (bh * m + r0 + r) * dv;
        for (int64_t j = 0; j < dv; ++j) dst[j] = acc[r * dv + j] / sum[r];
      }
    }
  });
}

// Stages landmark_scores + topk + shared_compress (eqs. 6-8) in one pass over the keys:
// the (m × N) score matrix is never stored. lm: (B, H, m, d) landmarks already scaled by
// 1/√d; k: (B, H, N, d); v: (B, H, N, dv); token_valid: (B, N) bool or None.
// Returns expert_index (B, H, m, topk) int64 ascending and shared_values (B, H, m, dv).
std::vector<at::Tensor> landmark_pass(at::Tensor lm, at::Tensor k, at::Tensor v,
                                      c10::optional<at::Tensor> token_valid, int64_t topk) {
  TORCH_CHECK(lm.dim() == 4 && k.dim() == 4 && v.dim() == 4, "expected 4-D tensors");
  TORCH_CHECK(topk >= 1 && topk <= k.size(2), "topk must be in [1, N]");
  lm = lm.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  at::Tensor valid;
  if (token_valid.has_value()) valid = token_valid->contiguous();
  auto index = at::empty({k.size(0), k.size(1), lm.size(2), topk}, k.options().dtype(at::kLong));
  auto shared = at::empty({k.size(0), k.size(1), lm.size(2), v.size(3)}, v.options());
  AT_DISPATCH_FLOATING_TYPES(k.scalar_type(), "landmark_pass", [&] {
    landmark_pass_impl<scalar_t>(lm, k, v, valid, topk, index, shared);
  });
  return {index, shared};
}

template <typename T>
void route_shared_impl(const at::Tensor& q, const at::Tensor& lm,
                       const at::Tensor& landmark_valid,
                       const at::Tensor& sv, double c_shared, const at::Tensor& token_valid,
                       at::Tensor& experts, at::Tensor& acc, at::Tensor& mx_out,
                       at::Tensor& sum_out) {
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), d = q.size(3), m = lm.size(2);
  const int64_t dv = sv.size(3);
  const int64_t blocks = (N + kQueryBlock - 1) / kQueryBlock;
  const T* Q = q.data_ptr<T>();
  const T* L = lm.data_ptr<T>();
  const T* SV = sv.data_ptr<T>();
  const bool* lm_valid = landmark_valid.data_ptr<bool>();
  const bool* qv = token_valid.defined() ? token_valid.data_ptr<bool>() : nullptr;
  int64_t* E = experts.data_ptr<int64_t>();
  T* ACC = acc.data_ptr<T>();
  T* MX = mx_out.data_ptr<T>();
  T* SUM = sum_out.data_ptr<T>();
  const T c = static_cast<T>(c_shared);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> A(kQueryBlock * m);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / blocks, b = bh / H;
      const int64_t n0 = (item % blocks) * kQueryBlock;
      const int64_t n = std::min(kQueryBlock, N - n0);
      // Affinities q·q̃ (eq. 9); times c they are the shared logits of eq. 11.
      mm_nt<T>(n, m, d, Q + (bh * N + n0) * d, d, L + bh * m * d, d, T(0), A.data(), m);
      const bool* l = lm_valid + b * m;
      bool all_valid = true;
      for (int64_t e = 0; e < m; ++e) all_valid &= l[e];
      for (int64_t i = 0; i < n; ++i) {
        T* a = A.data() + i * m;
        const int64_t row = bh * N + n0 + i;
        if (!all_valid)
          for (int64_t e = 0; e < m; ++e)
            if (!l[e]) a[e] = neg_inf;
        const T best_value = row_max(a, m);
        int64_t best = 0;  // the first maximum (lowest index) wins, as torch.argmax
        while (best < m - 1 && a[best] != best_value) ++best;  // bounded: NaN rows
        E[row] = best;
        if (qv && !qv[b * N + n0 + i]) {  // padded query: no weight, output stays zero
          MX[row] = neg_inf;
          SUM[row] = T(0);
          std::fill(a, a + m, T(0));
          continue;
        }
        for (int64_t e = 0; e < m; ++e) a[e] *= c;
        MX[row] = best_value * c;
        SUM[row] = exp_sub_sum(a, m, MX[row]);
      }
      // Unnormalised shared-branch values Σ_i exp(ℓ_i − max) ṽ_i.
      mm_nn<T>(n, dv, m, A.data(), m, SV + bh * m * dv, dv, T(0), ACC + (bh * N + n0) * dv, dv);
    }
  });
}

// Stage route for s = 1 (eq. 9) and the shared half of the joint softmax (eq. 11), from the
// same q·q̃ products — the paper's cost model reuses them the same way (§3.2).
// q: (B, H, N, d); lm: (B, H, m, d) landmarks (unscaled); landmark_valid: (B, m) bool with
// ≥ 1 True per row; shared_values: (B, H, m, dv); c_shared: shared logit scale; token_valid:
// (B, N) bool or None. Returns experts (B, H, N) int64 (the valid landmark with the largest q·q̃, first on
// ties), and per query the shared branch's unnormalised values (B, H, N, dv), logit maximum
// (B, H, N) and sum of exp(logit − maximum) (B, H, N); padded queries get (0, −inf, 0).
std::vector<at::Tensor> route_shared(at::Tensor q, at::Tensor lm, at::Tensor landmark_valid,
                                     at::Tensor shared_values, double c_shared,
                                     c10::optional<at::Tensor> token_valid) {
  q = q.contiguous();
  lm = lm.contiguous();
  landmark_valid = landmark_valid.contiguous();
  shared_values = shared_values.contiguous();
  at::Tensor qv;
  if (token_valid.has_value()) qv = token_valid->contiguous();
  const auto B = q.size(0), H = q.size(1), N = q.size(2);
  auto experts = at::empty({B, H, N}, q.options().dtype(at::kLong));
  auto acc = at::empty({B, H, N, shared_values.size(3)}, q.options());
  auto mx = at::empty({B, H, N}, q.options());
  auto sum = at::empty({B, H, N}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "route_shared", [&] {
    route_shared_impl<scalar_t>(q, lm, landmark_valid, shared_values, c_shared, qv, experts,
                                acc, mx, sum);
  });
  return {experts, acc, mx, sum};
}

struct Tile {
  int64_t bh, expert, start, len;  // start: into the head's expert-sorted query list
};

// Each head's valid queries sorted by expert (counting sort, query order within an expert), cut
// into tiles of at most kAttentionTile queries of one expert. order: (B·H·N) query indices,
// head by head; tiles in (head, expert) order.
void expert_sorted_tiles(const int64_t* E, const bool* qv, int64_t B, int64_t H, int64_t N,
                         int64_t m, std::vector<int64_t>& order, std::vector<Tile>& tiles) {
  order.assign(B * H * N, 0);
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H;
    std::vector<int64_t> start(m + 1, 0);
    for (int64_t n = 0; n < N; ++n)
      if (!qv || qv[b * N + n]) ++start[E[bh * N + n] + 1];
    for (int64_t e = 0; e < m; ++e) {
      for (int64_t t = 0; t < start[e + 1]; t += kAttentionTile)
        tiles.push_back({bh, e, start[e] + t, std::min(kAttentionTile, start[e + 1] - t)});
      start[e + 1] += start[e];
    }
    for (int64_t n = 0; n < N; ++n)
      if (!qv || qv[b * N + n]) order[bh * N + start[E[bh * N + n]]++] = n;
  }
}

template <typename T>
void routed_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& expert_index, const at::Tensor& landmark_valid,
                 const at::Tensor& token_valid, const at::Tensor& experts, double scale_,
                 at::Tensor& acc, const at::Tensor& mx, const at::Tensor& sum,
                 const at::Tensor& lse) {
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), d = q.size(3);
  const int64_t m = expert_index.size(2), topk = expert_index.size(3), dv = v.size(3);
  const T scale = static_cast<T>(scale_);
  const int64_t* E = experts.data_ptr<int64_t>();
  const bool* qv = token_valid.defined() ? token_valid.data_ptr<bool>() : nullptr;
  // Each head's queries sorted by expert (padded queries left out: their output stays zero).
  std::vector<int64_t> order;
  std::vector<Tile> tiles;
  expert_sorted_tiles(E, qv, B, H, N, m, order, tiles);
  const T* Q = q.data_ptr<T>();
  const T* K = k.data_ptr<T>();
  const T* Vp = v.data_ptr<T>();
  const int64_t* I = expert_index.data_ptr<int64_t>();
  const bool* lm_valid = landmark_valid.data_ptr<bool>();
  T* ACC = acc.data_ptr<T>();
  const T* MX = mx.data_ptr<T>();
  const T* SUM = sum.data_ptr<T>();
  T* LSE = lse.defined() ? lse.data_ptr<T>() : nullptr;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  // Tiles differ in size (an expert's last tile is partial): hand them out dynamically.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<T> qbuf(kAttentionTile * d), kbuf(topk * d), vbuf(topk * dv),
        logits(kAttentionTile * topk), obuf(kAttentionTile * dv), rmx(kAttentionTile),
        rsum(kAttentionTile);
    std::vector<char> key_ok(topk);
    int64_t loaded = -1;  // (bh, expert) whose keys sit in kbuf/vbuf
    bool masked = false;  // some of them are padding, or the expert's landmark is empty
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tiles; ++t) {
      const Tile& tile = tiles[t];
      const int64_t bh = tile.bh, b = bh / H, e = tile.expert, n = tile.len;
      const int64_t* rows = order.data() + bh * N + tile.start;
      if (loaded != bh * m + e) {  // stage gather (eq. 10), fused: expert e's k raw pairs
        const int64_t* idx = I + (bh * m + e) * topk;
        masked = false;
        for (int64_t j = 0; j < topk; ++j) {
          std::copy(K + (bh * N + idx[j]) * d, K + (bh * N + idx[j] + 1) * d, kbuf.data() + j * d);
          std::copy(Vp + (bh * N + idx[j]) * dv, Vp + (bh * N + idx[j] + 1) * dv,
                    vbuf.data() + j * dv);
          key_ok[j] = lm_valid[b * m + e] && (!qv || qv[b * N + idx[j]]);
          masked |= !key_ok[j];
        }
        loaded = bh * m + e;
      }
      for (int64_t i = 0; i < n; ++i) {
        const T* src = Q + (bh * N + rows[i]) * d;
        for (int64_t j = 0; j < d; ++j) qbuf[i * d + j] = src[j] * scale;
      }
      mm_nt<T>(n, topk, d, qbuf.data(), d, kbuf.data(), d, T(0), logits.data(), topk);
      for (int64_t i = 0; i < n; ++i) {
        T* row = logits.data() + i * topk;
        if (masked)
          for (int64_t j = 0; j < topk; ++j)
            if (!key_ok[j]) row[j] = neg_inf;
        rmx[i] = row_max(row, topk);
        if (rmx[i] == neg_inf) {  // every key of the expert is padding: no routed weight
          std::fill(row, row + topk, T(0));
          rsum[i] = T(0);
        } else {
          rsum[i] = exp_sub_sum(row, topk, rmx[i]);
        }
      }
      mm_nn<T>(n, dv, topk, logits.data(), topk, vbuf.data(), dv, T(0), obuf.data(), dv);
      // eq. 12: one softmax over [shared ; routed] = the log-sum-exp merge of the two branches.
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = bh * N + rows[i];
        const T top = std::max(MX[row], rmx[i]);
        const T ws = std::exp(MX[row] - top);
        const T wr = rmx[i] == neg_inf ? T(0) : std::exp(rmx[i] - top);
        const T total = ws * SUM[row] + wr * rsum[i];
        const T inv = T(1) / total;
        if (LSE) LSE[row] = top + std::log(total);  // the joint softmax's log-sum-exp
        T* o = ACC + row * dv;
        const T* r = obuf.data() + i * dv;
        for (int64_t j = 0; j < dv; ++j) o[j] = (ws * o[j] + wr * r[j]) * inv;
      }
    }
  }
}

// Stages gather + attention for s = 1 (eqs. 10-12), expert-grouped: each tile of up to 256
// queries of one expert attends to the expert's k routed keys, read from k and v by index into
// a per-thread buffer; the result is merged in place with the shared branch from
// route_shared (one softmax over m + k entries, by log-sum-exp).
// q, k: (B, H, N, d); v: (B, H, N, dv); expert_index: (B, H, m, k) int64 from landmark_pass;
// landmark_valid: (B, m) bool; token_valid: (B, N) bool or None (keys and queries); experts:
// (B, H, N) int64; scale: routed logit scale (1/√d); acc, mx, sum: route_shared's outputs — acc
// (B, H, N, dv) is overwritten with the attention output (zero at padded queries); lse:
// optional contiguous (B, H, N) in q's dtype, written at every valid query with the log-sum-exp
// of its m + k joint logits (mita/joint.py's backward recomputes the probabilities from it).
void routed_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor expert_index,
                      at::Tensor landmark_valid, c10::optional<at::Tensor> token_valid,
                      at::Tensor experts,
                      double scale, at::Tensor acc, at::Tensor mx, at::Tensor sum,
                      c10::optional<at::Tensor> lse) {
  TORCH_CHECK(acc.is_contiguous() && mx.is_contiguous() && sum.is_contiguous(),
              "route_shared outputs must be contiguous");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  expert_index = expert_index.contiguous();
  landmark_valid = landmark_valid.contiguous();
  experts = experts.contiguous();
  at::Tensor valid;
  if (token_valid.has_value()) valid = token_valid->contiguous();
  at::Tensor lse_out;
  if (lse.has_value()) {
    TORCH_CHECK(lse->is_contiguous() && lse->scalar_type() == q.scalar_type(),
                "lse must be contiguous and in q's dtype");
    lse_out = *lse;
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "routed_attention", [&] {
    routed_impl<scalar_t>(q, k, v, expert_index, landmark_valid, valid, experts, scale, acc, mx,
                          sum, lse_out);
  });
}

// Work items of the backward: a head's tiles cut into `groups` runs of whole experts with about
// equal query counts (more items than heads when there are few heads). An expert's tiles are
// all in one item, so its key and value gradients are summed in one place and order; with
// several items per head they go to per-expert buffers, scattered to the keys in expert order
// afterwards. The result depends on the shapes only, not on the thread count or schedule.
int64_t backward_groups(int64_t heads) {
  return std::max<int64_t>(1, std::min<int64_t>(8, (16 + heads - 1) / heads));
}

template <typename T>
void joint_backward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& lm, const at::Tensor& landmark_valid,
                         const at::Tensor& sv, const at::Tensor& expert_index,
                         const at::Tensor& experts, const at::Tensor& token_valid,
                         const at::Tensor& out, const at::Tensor& lse, const at::Tensor& grad,
                         double c_shared, double scale_, at::Tensor& dq, at::Tensor& dlm,
                         at::Tensor& dsv, at::Tensor& dk, at::Tensor& dv) {
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), d = q.size(3);
  const int64_t m = expert_index.size(2), topk = expert_index.size(3), dvd = v.size(3);
  const int64_t W = m + topk;  // joint entries per query: m shared + k routed (s = 1)
  const T c = static_cast<T>(c_shared), scale = static_cast<T>(scale_);
  const bool* qv = token_valid.defined() ? token_valid.data_ptr<bool>() : nullptr;
  std::vector<int64_t> order;
  std::vector<Tile> tiles;
  expert_sorted_tiles(experts.data_ptr<int64_t>(), qv, B, H, N, m, order, tiles);
  // Items: (head, group) → a run of that head's tiles.
  const int64_t G = backward_groups(B * H);
  std::vector<int64_t> head_first(B * H + 1, 0);
  for (const Tile& t : tiles) ++head_first[t.bh + 1];
  for (int64_t bh = 0; bh < B * H; ++bh) head_first[bh + 1] += head_first[bh];
  std::vector<int64_t> item_first(B * H * G + 1, 0);
  for (int64_t bh = 0; bh < B * H; ++bh) {
    int64_t queries = 0;
    for (int64_t t = head_first[bh]; t < head_first[bh + 1]; ++t) queries += tiles[t].len;
    int64_t t = head_first[bh], seen = 0;
    for (int64_t g = 0; g < G; ++g) {
      item_first[bh * G + g] = t;
      const int64_t goal = queries * (g + 1) / G;  // end the run near this query count
      while (t < head_first[bh + 1] &&
             (g == G - 1 || seen < goal ||
              (t > head_first[bh] && tiles[t].expert == tiles[t - 1].expert)))
        seen += tiles[t++].len;  // never between two tiles of one expert
    }
  }
  item_first[B * H * G] = static_cast<int64_t>(tiles.size());
  const T* Q = q.data_ptr<T>();
  const T* K = k.data_ptr<T>();
  const T* Vp = v.data_ptr<T>();
  const T* L = lm.data_ptr<T>();
  const T* SV = sv.data_ptr<T>();
  const int64_t* I = expert_index.data_ptr<int64_t>();
  const bool* lm_valid = landmark_valid.data_ptr<bool>();
  const T* O = out.data_ptr<T>();
  const T* LSE = lse.data_ptr<T>();
  const T* GO = grad.data_ptr<T>();
  T* DQ = dq.data_ptr<T>();
  // Per-item sums: with one group per head they are the outputs themselves.
  // With several items per head: per-expert key/value gradients (B·H·m·k·(d + dv), freed on
  // return) and per-item landmark/shared-value gradients.
  std::vector<T> expert_k, expert_v, part_lm, part_sv;
  if (G > 1) {
    expert_k.assign(B * H * m * topk * d, T(0));
    expert_v.assign(B * H * m * topk * dvd, T(0));
    part_lm.assign(B * H * G * m * d, T(0));
    part_sv.assign(B * H * G * m * dvd, T(0));
  }
  T* DK = dk.data_ptr<T>();
  T* DV = dv.data_ptr<T>();
  T* DLM = dlm.data_ptr<T>();
  T* DSV = dsv.data_ptr<T>();
  const T neg_inf = -std::numeric_limits<T>::infinity();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<T> kcat(W * d), vcat(W * dvd), qbuf(kAttentionTile * d),
        gbuf(kAttentionTile * dvd), P(kAttentionTile * W), dP(kAttentionTile * W),
        dqb(kAttentionTile * d), gk(W * d), gv(W * dvd), delta(kAttentionTile);
    std::vector<char> ok(W);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * H * G; ++item) {
      const int64_t bh = item / G, b = bh / H;
      T* dlm_i = G > 1 ? part_lm.data() + item * m * d : DLM + bh * m * d;
      T* dsv_i = G > 1 ? part_sv.data() + item * m * dvd : DSV + bh * m * dvd;
      if (item_first[item] < item_first[item + 1]) {  // the head's shared keys and values
        for (int64_t e = 0; e < m; ++e) {
          for (int64_t j = 0; j < d; ++j) kcat[e * d + j] = L[(bh * m + e) * d + j] * c;
          std::copy(SV + (bh * m + e) * dvd, SV + (bh * m + e + 1) * dvd, vcat.data() + e * dvd);
          ok[e] = lm_valid[b * m + e];
        }
      }
      int64_t loaded = -1;
      bool masked = false;
      for (int64_t t = item_first[item]; t < item_first[item + 1]; ++t) {
        const Tile& tile = tiles[t];
        const int64_t e = tile.expert, n = tile.len;
        const int64_t* rows = order.data() + bh * N + tile.start;
        const int64_t* idx = I + (bh * m + e) * topk;
        if (loaded != e) {  // expert e's k raw pairs behind the m shared entries
          masked = false;
          for (int64_t j = 0; j < topk; ++j) {
            for (int64_t x = 0; x < d; ++x) kcat[(m + j) * d + x] = K[(bh * N + idx[j]) * d + x] * scale;
            std::copy(Vp + (bh * N + idx[j]) * dvd, Vp + (bh * N + idx[j] + 1) * dvd,
                      vcat.data() + (m + j) * dvd);
            ok[m + j] = lm_valid[b * m + e] && (!qv || qv[b * N + idx[j]]);
          }
          for (int64_t j = 0; j < W; ++j) masked |= !ok[j];
          loaded = e;
        }
        for (int64_t i = 0; i < n; ++i) {
          const int64_t row = bh * N + rows[i];
          std::copy(Q + row * d, Q + (row + 1) * d, qbuf.data() + i * d);
          std::copy(GO + row * dvd, GO + (row + 1) * dvd, gbuf.data() + i * dvd);
          T acc = 0;  // D = dO·O
          for (int64_t j = 0; j < dvd; ++j) acc += GO[row * dvd + j] * O[row * dvd + j];
          delta[i] = acc;
        }
        // P = exp(ℓ − lse) over [shared ; routed] (eqs. 11-12), recomputed.
        mm_nt<T>(n, W, d, qbuf.data(), d, kcat.data(), d, T(0), P.data(), W);
        for (int64_t i = 0; i < n; ++i) {
          T* p = P.data() + i * W;
          exp_sub(p, W, LSE[bh * N + rows[i]]);
          if (masked)
            for (int64_t j = 0; j < W; ++j)
              if (!ok[j]) p[j] = T(0);
        }
        // dℓ = P ∘ (dO·V*ᵀ − D).
        mm_nt<T>(n, W, dvd, gbuf.data(), dvd, vcat.data(), dvd, T(0), dP.data(), W);
        for (int64_t i = 0; i < n; ++i) {
          T* g = dP.data() + i * W;
          const T* p = P.data() + i * W;
          for (int64_t j = 0; j < W; ++j) g[j] = p[j] * (g[j] - delta[i]);
        }
        // dq = dℓ·K* (both scales folded into K*); each valid query is in one tile (s = 1).
        mm_nn<T>(n, d, W, dP.data(), W, kcat.data(), d, T(0), dqb.data(), d);
        for (int64_t i = 0; i < n; ++i)
          std::copy(dqb.data() + i * d, dqb.data() + (i + 1) * d, DQ + (bh * N + rows[i]) * d);
        // dK* = dℓᵀ·q, dV* = Pᵀ·dO: shared rows to the landmarks / shared values, routed rows
        // to the expert's keys / values.
        mm_tn<T>(W, d, n, dP.data(), W, qbuf.data(), d, T(0), gk.data(), d);
        mm_tn<T>(W, dvd, n, P.data(), W, gbuf.data(), dvd, T(0), gv.data(), dvd);
        for (int64_t e2 = 0; e2 < m; ++e2) {
          for (int64_t x = 0; x < d; ++x) dlm_i[e2 * d + x] += gk[e2 * d + x] * c;
          for (int64_t x = 0; x < dvd; ++x) dsv_i[e2 * dvd + x] += gv[e2 * dvd + x];
        }
        for (int64_t j = 0; j < topk; ++j) {
          T* dst = G > 1 ? expert_k.data() + ((bh * m + e) * topk + j) * d
                         : DK + (bh * N + idx[j]) * d;
          const T* src = gk.data() + (m + j) * d;
          for (int64_t x = 0; x < d; ++x) dst[x] += src[x] * scale;
          T* dstv = G > 1 ? expert_v.data() + ((bh * m + e) * topk + j) * dvd
                          : DV + (bh * N + idx[j]) * dvd;
          const T* srcv = gv.data() + (m + j) * dvd;
          for (int64_t x = 0; x < dvd; ++x) dstv[x] += srcv[x];
        }
      }
    }
  }
  if (G > 1) {  // the items' sums, in a fixed order: the same bits on every run
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh)
        for (int64_t e = 0; e < m; ++e)
          for (int64_t j = 0; j < topk; ++j) {
            const int64_t key = bh * N + I[(bh * m + e) * topk + j];
            const T* sk = expert_k.data() + ((bh * m + e) * topk + j) * d;
            const T* svv = expert_v.data() + ((bh * m + e) * topk + j) * dvd;
            for (int64_t x = 0; x < d; ++x) DK[key * d + x] += sk[x];
            for (int64_t x = 0; x < dvd; ++x) DV[key * dvd + x] += svv[x];
          }
    });
    auto reduce = [&](const std::vector<T>& part, T* dst, int64_t per_head) {
      at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bh = begin; bh < end; ++bh) {
          T* o = dst + bh * per_head;
          for (int64_t g = 0; g < G; ++g) {
            const T* src = part.data() + (bh * G + g) * per_head;
            for (int64_t x = 0; x < per_head; ++x) o[x] += src[x];
          }
        }
      });
    };
    reduce(part_lm, DLM, m * d);
    reduce(part_sv, DSV, m * dvd);
  }
}

// The backward of stages route + gather + attention for s = 1 (eqs. 11-12), expert-grouped
// as the forward: per tile of one expert's queries, P = exp(ℓ − lse) is recomputed over the
// m shared + k routed entries and dℓ = P ∘ (dO·V*ᵀ − D), D = dO·O.
// q, k: (B, H, N, d); v: (B, H, N, dv); landmarks: (B, H, m, d) unscaled; landmark_valid:
// (B, m) bool; shared_values: (B, H, m, dv); expert_index: (B, H, m, k) int64; experts:
// (B, H, N) int64; token_valid: (B, N) bool or None; out: the forward's output; lse: (B, H, N);
// grad: dO (B, H, N, dv); c_shared, scale: the shared and routed logit scales. Returns dq, and
// the gradients of the landmarks, shared values, k and v (zero at padded queries' dq).
std::vector<at::Tensor> joint_backward(at::Tensor q, at::Tensor k, at::Tensor v,
                                       at::Tensor landmarks, at::Tensor landmark_valid,
                                       at::Tensor shared_values, at::Tensor expert_index,
                                       at::Tensor experts, c10::optional<at::Tensor> token_valid,
                                       at::Tensor out, at::Tensor lse, at::Tensor grad,
                                       double c_shared, double scale) {
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  landmarks = landmarks.contiguous();
  landmark_valid = landmark_valid.contiguous();
  shared_values = shared_values.contiguous();
  expert_index = expert_index.contiguous();
  experts = experts.contiguous();
  out = out.contiguous();
  lse = lse.contiguous();
  grad = grad.contiguous();
  TORCH_CHECK(experts.dim() == 3, "joint_backward handles s = 1: experts (B, H, N)");
  at::Tensor valid;
  if (token_valid.has_value()) valid = token_valid->contiguous();
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  auto dlm = at::zeros_like(landmarks), dsv = at::zeros_like(shared_values);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "joint_backward", [&] {
    joint_backward_impl<scalar_t>(q, k, v, landmarks, landmark_valid, shared_values,
                                  expert_index, experts, valid, out, lse, grad, c_shared, scale,
                                  dq, dlm, dsv, dk, dv);
  });
  return {dq, dlm, dsv, dk, dv};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Named arguments: the Python launcher (kernels/cpu.py) passes every tensor by name.
  m.def("landmark_pass", &landmark_pass, py::arg("landmarks"), py::arg("k"), py::arg("v"),
        py::arg("token_valid"), py::arg("topk"));
  m.def("route_shared", &route_shared, py::arg("q"), py::arg("landmarks"),
        py::arg("landmark_valid"), py::arg("shared_values"), py::arg("c_shared"),
        py::arg("token_valid"));
  m.def("routed_attention", &routed_attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("expert_index"), py::arg("landmark_valid"), py::arg("token_valid"),
        py::arg("experts"), py::arg("scale"), py::arg("acc"), py::arg("mx"), py::arg("sum"),
        py::arg("lse") = py::none());
  m.def("joint_backward", &joint_backward, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("landmarks"), py::arg("landmark_valid"), py::arg("shared_values"),
        py::arg("expert_index"), py::arg("experts"), py::arg("token_valid"), py::arg("out"),
        py::arg("lse"), py::arg("grad"), py::arg("c_shared"), py::arg("scale"));
}
