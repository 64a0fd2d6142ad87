// Products of a few float32 rows `x [M, n]` with a weight, as XLA FFI handlers for the CPU,
// compiled at first use by rlhf_eqx/models/_native_rows.py with the machine's own
// instruction set (`-march=native`); see that file. Each reads the weight once for all M
// rows (the bound of a decode step: its weights' bytes over the memory bandwidth).
//
// `RlhfEqxPackedRows`: `y = x @ Wᵀ` with `W` kept in llama.cpp's Q8_0, Q4_0 or Q4_1 blocks
// (`raw [out, n / 32 · bytes]`, one GGUF row per output). Each output row's blocks are
// decoded to floats in registers (ggml's `dequantize_row_q8_0`, `_q4_0`, `_q4_1`:
// w = d·q, d·(q − 8), d·q + m) and multiplied with every row's 32 values (four rows at a
// time). `RlhfEqxDenseRows`: the same with float32 rows `W [out, n]` (a tied LM head's
// embedding table, which XLA's dot reads about twice as slowly for a few rows).
//
// Chunks of output rows are shared between the calling thread and XLA's
// intra-op thread pool. Only the summation order differs from decoding the weight first
// and multiplying.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;
typedef float vf __attribute__((vector_size(64)));
#else
constexpr int W = 8;
typedef float vf __attribute__((vector_size(32)));
#endif
constexpr int V = 32 / W;  // vectors a block

// IEEE float16, little-endian bytes, as float32 (exact)
inline float f16(const uint8_t* p) {
  uint16_t h = static_cast<uint16_t>(p[0] | (p[1] << 8));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    float f = static_cast<float>(man) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// W signed bytes as floats
inline vf signed_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  vf r;
  for (int j = 0; j < W; ++j) r[j] = static_cast<float>(static_cast<int8_t>(p[j]));
  return r;
#endif
}

// the nibbles (low for shift 0, high for shift 4) of W bytes as floats
inline vf nibbles(const uint8_t* p, int shift) {
#if defined(__AVX512F__)
  __m128i a = _mm_loadu_si128((const __m128i*)p);
  a = _mm_and_si128(_mm_srl_epi16(a, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(15));
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(a));
#elif defined(__AVX2__)
  __m128i a = _mm_loadl_epi64((const __m128i*)p);
  a = _mm_and_si128(_mm_srl_epi16(a, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(15));
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
#else
  vf r;
  for (int j = 0; j < W; ++j) r[j] = static_cast<float>((p[j] >> shift) & 15);
  return r;
#endif
}

inline float lanes_sum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX__)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
#else
  float s = 0;
  for (int j = 0; j < W; ++j) s += v[j];
  return s;
#endif
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}

constexpr int64_t kMinChunk = 128;  // output rows a task takes at the least
constexpr int64_t kTile = 64;       // output rows multiplied by every row of x in turn

enum Kind : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kF32 = 3 };

// bytes of a block of 32 values
constexpr int64_t BlockBytes(int64_t kind) {
  return kind == kQ8_0 ? 34 : (kind == kQ4_0 ? 18 : (kind == kQ4_1 ? 20 : 128));
}

// y[m, o] for o in [o0, o1), M rows of x at a time
template <int64_t KIND, int M>
void Rows(const float* x, const uint8_t* raw, float* y, int64_t n, int64_t out, int64_t o0,
          int64_t o1) {
  constexpr int64_t size = BlockBytes(KIND);
  const int64_t nb = n / 32, row_bytes = nb * size;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = raw + o * row_bytes;
    vf acc[M][V];
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] = vf{};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * size;
      const float d = KIND == kF32 ? 0.0f : f16(blk);
      vf w[V];
      for (int v = 0; v < V; ++v) {
        const int j = v * W;  // first value of this vector in the block
        if (KIND == kF32) {
          w[v] = load(reinterpret_cast<const float*>(blk) + j);
        } else if (KIND == kQ8_0) {
          w[v] = signed_bytes(blk + 2 + j) * d;
        } else {
          const uint8_t* qs = blk + (KIND == kQ4_0 ? 2 : 4) + (j % 16);
          const vf q = nibbles(qs, j < 16 ? 0 : 4);
          w[v] = KIND == kQ4_0 ? (q - 8.0f) * d : q * d + f16(blk + 2);
        }
      }
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * n + b * 32;
        for (int v = 0; v < V; ++v) acc[m][v] += w[v] * load(xb + v * W);
      }
    }
    for (int m = 0; m < M; ++m) {
      vf s = acc[m][0];
      for (int v = 1; v < V; ++v) s += acc[m][v];
      y[m * out + o] = lanes_sum(s);
    }
  }
}

template <int64_t KIND>
void RowsOf(int64_t M, const float* x, const uint8_t* raw, float* y, int64_t n, int64_t out,
            int64_t o0, int64_t o1) {
  // groups of up to 4 rows share each decoded block; with more rows, a tile of output
  // rows stays in cache while every group passes over it
  for (int64_t t0 = o0; t0 < o1; t0 += kTile) {
    const int64_t t1 = std::min(o1, t0 + kTile);
    for (int64_t m = 0; m < M; m += 4) {
      const float* xm = x + m * n;
      float* ym = y + m * out;
      switch (M - m < 4 ? M - m : 4) {
        case 1: Rows<KIND, 1>(xm, raw, ym, n, out, t0, t1); break;
        case 2: Rows<KIND, 2>(xm, raw, ym, n, out, t0, t1); break;
        case 3: Rows<KIND, 3>(xm, raw, ym, n, out, t0, t1); break;
        default: Rows<KIND, 4>(xm, raw, ym, n, out, t0, t1); break;
      }
    }
  }
}

// Runs `run(begin, end)` over [0, total) in chunks of at least `min_chunk`, on this
// thread and XLA's intra-op pool. Chunks are claimed from a shared
// counter by this thread and by tasks on the pool; this thread claims whatever the pool
// has not started and then waits for the claimed chunks only, so a busy pool (all its
// threads inside such calls) never blocks it. The state is shared, not on this stack: a
// task that starts after the call has returned finds no chunk left and touches nothing
// else.
template <typename Run>
void Parallel(ffi::ThreadPool& pool, int64_t total, int64_t min_chunk, Run run) {
  const int64_t threads = pool.num_threads();
  if (threads < 2 || total < 2 * min_chunk) {
    run(0, total);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  const int64_t chunk = std::max<int64_t>(min_chunk, (total + threads - 1) / threads);
  const int64_t chunks = (total + chunk - 1) / chunk;
  auto shared = std::make_shared<Shared>();
  auto drain = [shared, run, chunk, chunks, total]() {
    for (int64_t c; (c = shared->next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      run(c * chunk, std::min(total, (c + 1) * chunk));
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads && t < chunks; ++t) pool.Schedule([drain]() { drain(); });
  drain();
  while (shared->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

using Rows32 = ffi::Buffer<ffi::F32, 2>;
using PackedBytes = ffi::Buffer<ffi::U8, 2>;

ffi::Error PackedRowsImpl(ffi::ThreadPool pool, Rows32 x, PackedBytes raw,
                          ffi::Result<Rows32> y, int64_t kind) {
  const auto xd = x.dimensions(), rd = raw.dimensions();
  const int64_t M = xd[0], n = xd[1], out = rd[0];
  if (kind < kQ8_0 || kind > kQ4_1) return ffi::Error::InvalidArgument("packed_rows: unknown kind");
  if (n % 32 || rd[1] != n / 32 * BlockBytes(kind))
    return ffi::Error::InvalidArgument("packed_rows: raw's row bytes do not match x's columns");
  const float* xp = x.typed_data();
  const uint8_t* rp = raw.typed_data();
  float* yp = y->typed_data();
  Parallel(pool, out, kMinChunk, [=](int64_t o0, int64_t o1) {
    if (kind == kQ8_0) RowsOf<kQ8_0>(M, xp, rp, yp, n, out, o0, o1);
    else if (kind == kQ4_0) RowsOf<kQ4_0>(M, xp, rp, yp, n, out, o0, o1);
    else RowsOf<kQ4_1>(M, xp, rp, yp, n, out, o0, o1);
  });
  return ffi::Error::Success();
}

// `y = x @ Wᵀ` with a float32 `W [out, n]` stored by output row (a tied LM head's table)
ffi::Error DenseRowsImpl(ffi::ThreadPool pool, Rows32 x, Rows32 w, ffi::Result<Rows32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  const int64_t M = xd[0], n = xd[1], out = wd[0];
  if (n % 32 || wd[1] != n)
    return ffi::Error::InvalidArgument("dense_rows: w's columns do not match x's (a multiple of 32)");
  const float* xp = x.typed_data();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.typed_data());
  float* yp = y->typed_data();
  Parallel(pool, out, kMinChunk,
           [=](int64_t o0, int64_t o1) { RowsOf<kF32>(M, xp, wp, yp, n, out, o0, o1); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlhfEqxPackedRows, PackedRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows32>()
                                  .Arg<PackedBytes>()
                                  .Ret<Rows32>()
                                  .Attr<int64_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlhfEqxDenseRows, DenseRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows32>()
                                  .Arg<Rows32>()
                                  .Ret<Rows32>());
