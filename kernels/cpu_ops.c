/*
 * Fused bfloat16 kernels for the CPU decode path (see cpu_ops.py, which builds and loads
 * this file with the system C compiler and calls it through ctypes).
 *
 * Why C: on the CPU a decode step of a small model is dominated not by its matmuls but by
 * the dozens of small element-wise ops around them (RMSNorm alone is eight aten ops on
 * bfloat16), each a pass over memory plus dispatch overhead. Each function here is one pass.
 *
 * Numerics follow HF transformers' bfloat16 modules op by op (the parity reference): every
 * intermediate that HF rounds to bfloat16 is rounded here too, and the reductions run in
 * float32. Attention keeps scores and probabilities in float32 throughout, like PyTorch's
 * CPU flash-attention kernel.
 *
 * Threads: OpenMP, linked against the libgomp that torch has already loaded, so these
 * kernels and torch's share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf2f(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch does; NaN stays a (quiet) NaN. */
static inline bf16 f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;
    return (bf16)(((u & 0x7FFFFFFFu) > 0x7F800000u) ? nan : rounded);
}

static inline float round_bf(float f) { return bf2f(f2bf(f)); }

/* exp for float32, Cephes' polynomial (about 1 ulp), written to vectorise. */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.7f ? 88.7f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = (int32_t)n + 127;
    uint32_t bits = (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/*
 * residual[t] += x[t] (when x is not NULL, rounded to bf16 like HF's `residual + hidden`),
 * then out[t] = weight * bf16(residual[t] * rsqrt(mean(residual[t]^2) + eps)): LlamaRMSNorm.
 */
void hp_add_rms_norm(const bf16 *x, bf16 *residual, const bf16 *weight, bf16 *out, int64_t rows,
                     int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t t = 0; t < rows; ++t) {
        bf16 *r = residual + t * hidden;
        bf16 *o = out + t * hidden;
        if (x) {
            const bf16 *xt = x + t * hidden;
#pragma omp simd
            for (int64_t d = 0; d < hidden; ++d) r[d] = f2bf(bf2f(r[d]) + bf2f(xt[d]));
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < hidden; ++d) sum += bf2f(r[d]) * bf2f(r[d]);
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d)
            o[d] = f2bf(bf2f(weight[d]) * round_bf(bf2f(r[d]) * inv));
    }
}

/* out[t] = bf16(bf16(silu(gate[t])) * up[t]) for gate_up[t] = [gate | up]: HF's LlamaMLP. */
void hp_silu_mul(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= 16384)
    for (int64_t t = 0; t < rows; ++t) {
        const bf16 *g = gate_up + t * 2 * inter;
        const bf16 *u = g + inter;
        bf16 *o = out + t * inter;
#pragma omp simd
        for (int64_t d = 0; d < inter; ++d) {
            float gf = bf2f(g[d]);
            float s = round_bf(gf / (1.0f + exp_f32(-gf)));
            o[d] = f2bf(s * bf2f(u[d]));
        }
    }
}

/* out[t] = table[ids[t]] (rows of `width` bf16): the embedding lookup. Returns how many ids
 * fall outside [0, vocab) (their rows are zeroed), 0 when all are valid. */
int64_t hp_embed(const bf16 *table, int64_t vocab, int64_t width, const int64_t *ids,
                 int64_t rows, bf16 *out) {
    int64_t bad = 0;
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t id = ids[t];
        if (id < 0 || id >= vocab) {
            memset(out + t * width, 0, (size_t)width * sizeof(bf16));
            ++bad;
            continue;
        }
        memcpy(out + t * width, table + id * width, (size_t)width * sizeof(bf16));
    }
    return bad;
}

/* x[i] = bf16(x[i] + y[i]) over n elements: torch's bfloat16 add_ (float32 sum, one rounding). */
void hp_add(bf16 *x, const bf16 *y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
}

/* out[i] = (float)x[i] over n elements: exact, bfloat16 is the top half of a float32. */
void hp_widen(const bf16 *x, float *out, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= 262144)
    for (int64_t i = 0; i < n; ++i) out[i] = bf2f(x[i]);
}

/*
 * RoPE in place on the first `heads` heads of each row of x ([rows, row_stride] bf16, head
 * h of row t at x + t * row_stride + h * dim), HF's half rotation with bf16 tables:
 * out = bf16(bf16(x * cos) + bf16(roll(x) * signed_sin)), signed_sin = [-sin | sin].
 */
void hp_rope(bf16 *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim,
             const int64_t *positions, const bf16 *cos, const bf16 *sin) {
    int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (rows >= 16)
    for (int64_t t = 0; t < rows; ++t) {
        const bf16 *c = cos + positions[t] * dim;
        const bf16 *s = sin + positions[t] * dim;
        for (int64_t h = 0; h < heads; ++h) {
            bf16 *v = x + t * row_stride + h * dim;
            float lo[512], hi[512];  // dim <= 1024, checked by the caller
#pragma omp simd
            for (int64_t d = 0; d < half; ++d) {
                float a = bf2f(v[d]), b = bf2f(v[d + half]);
                lo[d] = round_bf(round_bf(a * bf2f(c[d])) + round_bf(b * bf2f(s[d])));
                hi[d] = round_bf(round_bf(b * bf2f(c[d + half])) +
                                 round_bf(a * bf2f(s[d + half])));
            }
#pragma omp simd
            for (int64_t d = 0; d < half; ++d) {
                v[d] = f2bf(lo[d]);
                v[d + half] = f2bf(hi[d]);
            }
        }
    }
}

/*
 * Store rows of k and v ([rows, kv_heads, dim] at row strides k_stride, v_stride) into the
 * caches ([kv_heads, num_blocks * block_size, dim]) at slots[t].
 */
void hp_write_kv(const bf16 *k, int64_t k_stride, const bf16 *v, int64_t v_stride, int64_t rows,
                 int64_t kv_heads, int64_t dim, const int64_t *slots, bf16 *k_cache,
                 bf16 *v_cache, int64_t slots_per_head) {
    size_t bytes = (size_t)dim * sizeof(bf16);
    /* Each row lands on its own cache lines (and, fresh from the cache's lazy zeroing, on
     * pages not yet faulted in): two threads overlap the misses. */
#pragma omp parallel for schedule(static) if (rows >= 16)
    for (int64_t t = 0; t < rows; ++t) {
        for (int64_t h = 0; h < kv_heads; ++h) {
            int64_t dst = (h * slots_per_head + slots[t]) * dim;
            memcpy(k_cache + dst, k + t * k_stride + h * dim, bytes);
            memcpy(v_cache + dst, v + t * v_stride + h * dim, bytes);
        }
    }
}

/*
 * Decode attention over a paged cache: one query token per sequence.
 *   q        [batch, q_heads, dim] at row stride q_stride (heads contiguous)
 *   caches   [kv_heads, num_blocks, block_size, dim]
 *   tables   [batch, table_width] block ids; seq_lens [batch] (>= 1)
 *   window   a sliding window: the query (at position len - 1) attends the keys
 *            [len - window, len), HF's `p - window < k <= p`; 0 (or less) for none
 *   out      [batch, q_heads, dim] contiguous
 * Query head h reads KV head h / (q_heads / kv_heads). One task per (sequence, KV head):
 * the group's query heads share every key and value read. Blocks wholly before the window
 * are never read (their table entries may hold any id): a windowed layer's cost is bounded
 * by the window, not the context.
 */
typedef struct {
    const bf16 *q;
    int64_t q_stride;
    const bf16 *k_cache, *v_cache;
    int64_t num_blocks, block_size;
    const int64_t *tables;
    int64_t table_width;
    const int64_t *seq_lens;
    int64_t window;
    bf16 *out;
    int64_t q_heads, kv_heads, dim;
    float scale;
} decode_args;

/* The first key sequence b's query attends: keys [first, len) are its window. */
static inline int64_t window_first(const decode_args *a, int64_t b) {
    int64_t len = a->seq_lens[b];
    return a->window > 0 && len > a->window ? len - a->window : 0;
}

/* The portable task: two passes (scores, then a weighted sum of values) in float32. */
static void decode_task_scalar(const decode_args *a, int64_t b, int64_t h) {
    int64_t group = a->q_heads / a->kv_heads, dim = a->dim, block_size = a->block_size;
    int64_t len = a->seq_lens[b], first = window_first(a, b), span = len - first;
    float *qf = malloc(sizeof(float) * (size_t)(group * dim * 2 + dim + group * span));
    float *acc = qf + group * dim;
    float *kf = acc + group * dim;
    float *scores = kf + dim;
    for (int64_t g = 0; g < group; ++g) {
        const bf16 *qh = a->q + b * a->q_stride + (h * group + g) * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) {
            qf[g * dim + d] = bf2f(qh[d]) * a->scale;
            acc[g * dim + d] = 0.0f;
        }
    }
    const int64_t *table = a->tables + b * a->table_width;
    const bf16 *kh = a->k_cache + h * a->num_blocks * block_size * dim;
    const bf16 *vh = a->v_cache + h * a->num_blocks * block_size * dim;
    /* Runs of keys inside one block; only the first run can start mid-block. */
    for (int64_t s0 = first, n; s0 < len; s0 += n) {
        int64_t row = s0 % block_size;
        const bf16 *kb = kh + (table[s0 / block_size] * block_size + row) * dim;
        n = len - s0 < block_size - row ? len - s0 : block_size - row;
        for (int64_t i = 0; i < n; ++i) {
            const bf16 *kr = kb + i * dim;
            /* Widen the key once for the whole group; the dot products then vectorise. */
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) kf[d] = bf2f(kr[d]);
            for (int64_t g = 0; g < group; ++g) {
                const float *qg = qf + g * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; ++d) dot += qg[d] * kf[d];
                scores[g * span + s0 - first + i] = dot;
            }
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float *sg = scores + g * span;
        float m = -INFINITY;
        for (int64_t s = 0; s < span; ++s) m = sg[s] > m ? sg[s] : m;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t s = 0; s < span; ++s) {
            sg[s] = exp_f32(sg[s] - m);
            total += sg[s];
        }
        float inv = 1.0f / total;
#pragma omp simd
        for (int64_t s = 0; s < span; ++s) sg[s] *= inv;
    }
    for (int64_t s0 = first, n; s0 < len; s0 += n) {
        int64_t row = s0 % block_size;
        const bf16 *vb = vh + (table[s0 / block_size] * block_size + row) * dim;
        n = len - s0 < block_size - row ? len - s0 : block_size - row;
        for (int64_t i = 0; i < n; ++i) {
            const bf16 *vr = vb + i * dim;
            for (int64_t g = 0; g < group; ++g) {
                float p = scores[g * span + s0 - first + i];
                float *ag = acc + g * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) ag[d] += p * bf2f(vr[d]);
            }
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        bf16 *o = a->out + (b * a->q_heads + h * group + g) * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] = f2bf(acc[g * dim + d]);
    }
    free(qf);
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* The AVX-512 paths (paged decode and the linear kernels). Their bfloat16 dot products are
 * vdpbf16ps where the CPU has AVX-512 BF16 (HP_NATIVE_BF16), and two float32 FMAs over the
 * words widened by a shift and a mask elsewhere (Skylake-SP to Ice Lake servers): each
 * bfloat16 product is exact in float32, and the FMAs add the odd word's product, then the
 * even's, as vdpbf16ps does, so both give the same sums (but for denormals, which
 * vdpbf16ps flushes). */
#define HP_AVX512_BF16 1
#if defined(__AVX512BF16__)
#define HP_NATIVE_BF16 1
#endif
#define SIMD_MAX_GROUP 8
#define SIMD_MAX_DIM 128

/* The odd (high) and even (low) bfloat16 of each 32-bit lane, as float32. */
static inline __m512 bf16_hi(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline __m512 bf16_lo(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}

/* 16 floats to bfloat16, nearest even; NaN stays a quiet NaN (f2bf's function). */
static inline __m256i to_bf16x16(__m512 v) {
#ifdef HP_NATIVE_BF16
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
#endif
}

/*
 * The AVX-512 BF16 task, for block sizes that are a multiple of 16, head dims 64 and 128
 * and up to 8 query heads per KV head (every model the engine runs). Keys go 16 at a time: vdpbf16ps multiplies
 * bfloat16 pairs exactly and sums in float32, leaving 16 partial sums per key; a tree of
 * blends and shuffles (15 steps for 16 keys, not 16 horizontal sums) turns the 16 vectors
 * into one vector of 16 scores. Softmax is online (running max and sum per query head), so
 * each block's keys and values are read once, together, and no score buffer is needed.
 * The scalar task computes the same function in another summation order.
 */

/* One step of the tree: lanes whose bit `w` is clear get a's pair sum, the others b's. */
#define HP_COMBINE(name, mask, swap)                                              \
    static inline __m512 name(__m512 a, __m512 b) {                               \
        __m512 x = _mm512_mask_blend_ps((__mmask16)(mask), a, b);                 \
        __m512 y = _mm512_mask_blend_ps((__mmask16)(mask), b, a);                 \
        return _mm512_add_ps(x, swap);                                            \
    }
HP_COMBINE(combine8, 0xFF00, _mm512_shuffle_f32x4(y, y, 0x4E))
HP_COMBINE(combine4, 0xF0F0, _mm512_shuffle_f32x4(y, y, 0xB1))
HP_COMBINE(combine2, 0xCCCC, _mm512_permute_ps(y, 0x4E))
HP_COMBINE(combine1, 0xAAAA, _mm512_permute_ps(y, 0xB1))

/* Lane i of the result is the sum of the lanes of p[i]. */
static inline __m512 lane_sums16(const __m512 *p) {
    __m512 r[8], t[4];
    for (int j = 0; j < 8; ++j) r[j] = combine8(p[j], p[j + 8]);
    for (int j = 0; j < 4; ++j) t[j] = combine4(r[j], r[j + 4]);
    return combine1(combine2(t[0], t[2]), combine2(t[1], t[3]));
}

/* exp_f32 on 16 lanes, the same polynomial. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __m512 widen16(const bf16 *x) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Widen value rows [lead, n) ([n][dim] bf16) and add each, weighted by its probability, into
 * every head of the group: acc[g][d] += probs[g][i] * v[i][d]. Each row is widened once.
 * Rows outside the window are skipped, not weighted by 0: they may hold NaN. */
static inline __attribute__((always_inline)) void pv_accumulate(
    __m512 *acc, const float (*probs)[16], const bf16 *vb, int64_t lead, int64_t n,
    const int64_t group, const int64_t dim) {
    const int64_t vecs = dim / 16;
    /* Dims and heads unroll (the accumulators must be registers); keys need not. */
#pragma GCC unroll 1
    for (int64_t i = lead; i < n; ++i)
#pragma GCC unroll 16
        for (int64_t d = 0; d < vecs; ++d) {
            __m512 v = widen16(vb + i * dim + 16 * d);
#pragma GCC unroll 16
            for (int64_t g = 0; g < group; ++g)
                acc[g * vecs + d] =
                    _mm512_fmadd_ps(_mm512_set1_ps(probs[g][i]), v, acc[g * vecs + d]);
        }
}

/*
 * One (sequence, KV head) task. Inlined into one function per common (group, head dim), so
 * that every loop over heads and dims unrolls and the accumulators (group x dim / 16
 * vectors) live in registers. With run-time sizes they lived on the stack, and each key's
 * load-add-store chains cost more than its memory traffic: B=32, 192 keys, group 3, dim 64,
 * cache-resident, one thread: 0.48 -> 0.29 ms a layer.
 */
static inline __attribute__((always_inline)) void decode_core(
    const decode_args *a, int64_t b, int64_t h, const int64_t group, const int64_t dim) {
    const int64_t bs = a->block_size, chunks = dim / 32, vecs = dim / 16, len = a->seq_lens[b];
#ifdef HP_NATIVE_BF16
    __m512bh qv[SIMD_MAX_GROUP * SIMD_MAX_DIM / 32];
#else
    __m512 q_hi[SIMD_MAX_GROUP * SIMD_MAX_DIM / 32], q_lo[SIMD_MAX_GROUP * SIMD_MAX_DIM / 32];
#endif
    __m512 acc[SIMD_MAX_GROUP * SIMD_MAX_DIM / 16];
    float run_max[SIMD_MAX_GROUP], run_sum[SIMD_MAX_GROUP];
    float probs[SIMD_MAX_GROUP][16] __attribute__((aligned(64)));
#pragma GCC unroll 16
    for (int64_t g = 0; g < group; ++g) {
        const bf16 *qh = a->q + b * a->q_stride + (h * group + g) * dim;
#pragma GCC unroll 8
        for (int64_t c = 0; c < chunks; ++c) {
#ifdef HP_NATIVE_BF16
            qv[g * chunks + c] = (__m512bh)_mm512_loadu_si512(qh + c * 32);
#else
            __m512i raw = _mm512_loadu_si512(qh + c * 32);
            q_hi[g * chunks + c] = bf16_hi(raw);
            q_lo[g * chunks + c] = bf16_lo(raw);
#endif
        }
#pragma GCC unroll 16
        for (int64_t d = 0; d < vecs; ++d) acc[g * vecs + d] = _mm512_setzero_ps();
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
    }
    const int64_t *table = a->tables + b * a->table_width;
    const bf16 *kh = a->k_cache + h * a->num_blocks * bs * dim;
    const bf16 *vh = a->v_cache + h * a->num_blocks * bs * dim;
    const __m512 scale = _mm512_set1_ps(a->scale), neg_inf = _mm512_set1_ps(-INFINITY);
    /* Chunks of 16 keys start on multiples of 16, so each lies inside one block (block
     * sizes are in 16s): the first chunk's keys before the window are in the window's
     * first block, read and masked like those past the end. */
    const int64_t first = window_first(a, b);
    for (int64_t s0 = first - first % 16; s0 < len; s0 += 16) {
        int64_t block = table[s0 / bs], row = s0 % bs;
        const bf16 *kb = kh + (block * bs + row) * dim;
        const bf16 *vb = vh + (block * bs + row) * dim;
        int64_t n = len - s0 < 16 ? len - s0 : 16;
        if (s0 + 16 < len) {
            /* The next chunk's block can be anywhere in the cache (the free list scatters
             * blocks), out of the hardware prefetcher's sight: request its keys and values
             * into L2 now. B=32, 192 keys, 30 layers: blocks at random over 1 GB 13.5 ->
             * 10.5 ms; L1 (T0) prefetches did worse, as did two or three chunks ahead. */
            int64_t next = table[(s0 + 16) / bs], next_row = (s0 + 16) % bs;
            const char *nk = (const char *)(kh + (next * bs + next_row) * dim);
            const char *nv = (const char *)(vh + (next * bs + next_row) * dim);
            for (int64_t off = 0; off < 16 * dim * (int64_t)sizeof(bf16); off += 64) {
                _mm_prefetch(nk + off, _MM_HINT_T1);
                _mm_prefetch(nv + off, _MM_HINT_T1);
            }
        }
        /* Keys past the sequence or before the window may hold stale data (maybe NaN): their
         * lanes are masked. */
        int64_t lead = s0 < first ? first - s0 : 0;
        __mmask16 live = (__mmask16)(((1u << n) - 1u) & ~((1u << lead) - 1u));
#pragma GCC unroll 16
        for (int64_t g = 0; g < group; ++g) {
            __m512 part[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) {
                __m512 dot = _mm512_setzero_ps();
#pragma GCC unroll 8
                for (int64_t c = 0; c < chunks; ++c) {
#ifdef HP_NATIVE_BF16
                    dot = _mm512_dpbf16_ps(
                        dot, qv[g * chunks + c],
                        (__m512bh)_mm512_loadu_si512(kb + i * dim + c * 32));
#else
                    __m512i key = _mm512_loadu_si512(kb + i * dim + c * 32);
                    dot = _mm512_fmadd_ps(q_hi[g * chunks + c], bf16_hi(key), dot);
                    dot = _mm512_fmadd_ps(q_lo[g * chunks + c], bf16_lo(key), dot);
#endif
                }
                part[i] = dot;
            }
            __m512 s = _mm512_mask_blend_ps(live, neg_inf, _mm512_mul_ps(lane_sums16(part), scale));
            float m = _mm512_reduce_max_ps(s);
            float next_max = m > run_max[g] ? m : run_max[g];
            /* exp(-inf) is 0: the first block rescales an empty accumulator. */
            float alpha = run_max[g] == -INFINITY ? 0.0f : exp_f32(run_max[g] - next_max);
            __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(next_max))));
            run_sum[g] = run_sum[g] * alpha + _mm512_reduce_add_ps(e);
            run_max[g] = next_max;
            _mm512_store_ps(probs[g], e);
            if (alpha != 1.0f) {
                __m512 av = _mm512_set1_ps(alpha);
#pragma GCC unroll 16
                for (int64_t d = 0; d < vecs; ++d)
                    acc[g * vecs + d] = _mm512_mul_ps(acc[g * vecs + d], av);
            }
        }
        pv_accumulate(acc, probs, vb, lead, n, group, dim);
    }
#pragma GCC unroll 16
    for (int64_t g = 0; g < group; ++g) {
        bf16 *o = a->out + (b * a->q_heads + h * group + g) * dim;
        __m512 inv = _mm512_set1_ps(1.0f / run_sum[g]);
#pragma GCC unroll 16
        for (int64_t d = 0; d < vecs; ++d)
            _mm256_storeu_si256((__m256i *)(o + 16 * d), to_bf16x16(_mm512_mul_ps(acc[g * vecs + d], inv)));
    }
}

typedef void (*decode_fn)(const decode_args *, int64_t, int64_t);
#define DECODE_FIXED(G, D)                                                        \
    static void decode_##G##_##D(const decode_args *a, int64_t b, int64_t h) {    \
        decode_core(a, b, h, G, D);                                               \
    }
#define DECODE_GROUPS(D)                                                          \
    DECODE_FIXED(1, D) DECODE_FIXED(2, D) DECODE_FIXED(3, D) DECODE_FIXED(4, D)   \
    DECODE_FIXED(5, D) DECODE_FIXED(6, D) DECODE_FIXED(7, D) DECODE_FIXED(8, D)
DECODE_GROUPS(64)
DECODE_GROUPS(128)

/* The vector kernel for a (group, head dim), or NULL: every Llama-family model this engine
 * runs has head dim 64 or 128 and at most 8 query heads per KV head. Other shapes take the
 * portable task (a run-time-sized vector kernel cost ~8 s of compile time for shapes no
 * supported model has). Gemma 3's head dim 256 takes it too, for now: at groups 2 and 4
 * its 32-64 accumulators and 16-32 query vectors exceed the 32 registers, so a fixed
 * kernel for it wants measuring before it replaces the portable one. */
static decode_fn decode_simd_for(int64_t group, int64_t dim) {
    static const decode_fn d64[8] = {decode_1_64, decode_2_64, decode_3_64, decode_4_64,
                                     decode_5_64, decode_6_64, decode_7_64, decode_8_64};
    static const decode_fn d128[8] = {decode_1_128, decode_2_128, decode_3_128, decode_4_128,
                                      decode_5_128, decode_6_128, decode_7_128, decode_8_128};
    if (group < 1 || group > 8) return NULL;
    if (dim == 64) return d64[group - 1];
    if (dim == 128) return d128[group - 1];
    return NULL;
}
#endif

void hp_paged_decode(const bf16 *q, int64_t q_stride, const bf16 *k_cache, const bf16 *v_cache,
                     int64_t num_blocks, int64_t block_size, const int64_t *tables,
                     int64_t table_width, const int64_t *seq_lens, int64_t window, bf16 *out,
                     int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t dim,
                     float scale) {
    decode_args a = {q,        q_stride, k_cache,  v_cache,  num_blocks, block_size,
                     tables,   table_width, seq_lens, window, out,     q_heads,
                     kv_heads, dim,      scale};
#ifdef HP_AVX512_BF16
    decode_fn simd = block_size % 16 == 0 ? decode_simd_for(q_heads / kv_heads, dim) : NULL;
#endif
#pragma omp parallel for schedule(dynamic, 1) if (batch * kv_heads > 1)
    for (int64_t task = 0; task < batch * kv_heads; ++task) {
#ifdef HP_AVX512_BF16
        if (simd) {
            simd(&a, task / kv_heads, task % kv_heads);
            continue;
        }
#endif
        decode_task_scalar(&a, task / kv_heads, task % kv_heads);
    }
}

/* Whether this build has the AVX-512 paths: hp_paged_decode's and hp_linear's. */
int hp_avx512(void) {
#ifdef HP_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

/* Whether their bfloat16 dot products are vdpbf16ps (else float32 FMAs, the same sums). */
int hp_native_bf16(void) {
#ifdef HP_NATIVE_BF16
    return 1;
#else
    return 0;
#endif
}

/*
 * Linear layers: y[m, n] = bf16(x[m, :] . w[n, :] (+ bias[n])), float32 accumulation.
 *
 * The weight is packed once, at load, in tiles of LIN_TILE output features: tile t holds
 * features [48 t, 48 t + width) as [k / 2][width][2], so that one 64-byte load is a
 * vdpbf16ps operand (16 features x one pair of k) and each tile is one sequential stream.
 * The last tile is 16 or 32 wide when n is not a multiple of 48 (n must be one of 16, k
 * even; cpu_ops.py keeps oneDNN for other shapes). A micro-kernel keeps R <= 8 rows x 3
 * vectors of 16 features in 24 accumulators and broadcasts each row's k pair from memory:
 * 24 vdpbf16ps per 3 weight loads. Tiles go to threads; rows are walked in blocks of 256
 * so the block's activations stay in L2 while each tile's weights are reused.
 *
 * benchmarks/bench_linear.py (2 Zen 4 cores, SmolLM2's four layer shapes, 30 layers of
 * weights streamed from memory) against oneDNN's prepacked linear: 1.2-2.1x at 1 row,
 * 1.4-1.8x at 8, 1.2x at 32, 1.1-1.3x at 64, level from 256 rows (~410-425 GFLOP/s).
 */
#define LIN_TILE 48
/* While a tile's first block of rows runs, the next tile's weights are requested into L2
 * (pf, one line per line used): later rows reuse this tile from L2 at full speed, and the
 * next tile then starts from L2 instead of memory. 30 layers at 32 rows (bench_linear.py
 * shapes, A/B in one process): gate/up 268 -> 340 GFLOP/s, lm_head 276 -> 334, the
 * others +10-15%; level at 1, 8 and 256 rows. An L1 (T0) hint did worse, T1 the same. */
#define LIN_PREFETCH _MM_HINT_T2

/* One tile: features rows[0..width) of w (row indices), as [k / 2][width][2]. */
static void pack_tile(const bf16 *w, int64_t k, const int64_t *rows, int64_t width, bf16 *tile) {
    for (int64_t kp = 0; kp < k / 2; ++kp)
        for (int64_t j = 0; j < width; ++j) {
            const bf16 *src = w + rows[j] * k + 2 * kp;
            bf16 *dst = tile + (kp * width + j) * 2;
            dst[0] = src[0];
            dst[1] = src[1];
        }
}

void hp_pack_linear(const bf16 *w, int64_t n, int64_t k, bf16 *out) {
    int64_t rows[LIN_TILE];
    for (int64_t f0 = 0; f0 < n; f0 += LIN_TILE) {
        int64_t width = n - f0 < LIN_TILE ? n - f0 : LIN_TILE;
        for (int64_t j = 0; j < width; ++j) rows[j] = f0 + j;
        pack_tile(w, k, rows, width, out + f0 * k);
    }
}

/*
 * The MLP's fused gate/up projection, w = [gate | up] ([2 inter, k]), packed so that each
 * 32-feature tile holds 16 gate features and the same 16 up features: hp_gate_up can then
 * finish with silu(gate) * up in registers (HF's LlamaMLP, rounded where HF rounds) and
 * write [m, inter], instead of writing [m, 2 inter] for hp_silu_mul to read back.
 */
void hp_pack_gate_up(const bf16 *w, int64_t inter, int64_t k, bf16 *out) {
    int64_t rows[32];
    for (int64_t f0 = 0; f0 < inter; f0 += 16) {
        for (int64_t j = 0; j < 16; ++j) {
            rows[j] = f0 + j;
            rows[16 + j] = inter + f0 + j;
        }
        pack_tile(w, k, rows, 32, out + 2 * f0 * k);
    }
}

#ifdef HP_AVX512_BF16
/* What the register kernels read of x, and how: vdpbf16ps takes each row's k pair as one
 * broadcast 32-bit lane (x stays bf16); the FMA path reads x widened to float32 once per
 * call (lin_widen), broadcasting the pair's two values, and widens each weight vector into
 * its odd and even words once for all the rows. */
#ifdef HP_NATIVE_BF16
typedef bf16 lin_x;
#define LIN_W_DECL(J) __m512bh w[J]
#define LIN_W_LOAD(j, p) (w[j] = (__m512bh)_mm512_loadu_si512(p))
#define LIN_X_DECL __m512bh xb
#define LIN_X_LOAD(x, k, r, kp) \
    (xb = (__m512bh)_mm512_set1_epi32(((const int32_t *)(x))[(r) * ((k) / 2) + (kp)]))
#define LIN_DOT(acc, j) ((acc) = _mm512_dpbf16_ps((acc), xb, w[j]))
#else
typedef float lin_x;
#define LIN_W_DECL(J) __m512 w_hi[J], w_lo[J]
#define LIN_W_LOAD(j, p) \
    (w_hi[j] = bf16_hi(_mm512_loadu_si512(p)), w_lo[j] = bf16_lo(_mm512_loadu_si512(p)))
#define LIN_X_DECL __m512 x_hi, x_lo
#define LIN_X_LOAD(x, k, r, kp)                                        \
    (x_hi = _mm512_set1_ps((x)[(r) * (k) + 2 * (kp) + 1]),             \
     x_lo = _mm512_set1_ps((x)[(r) * (k) + 2 * (kp)]))
#define LIN_DOT(acc, j) \
    ((acc) = _mm512_fmadd_ps(x_lo, w_lo[j], _mm512_fmadd_ps(x_hi, w_hi[j], (acc))))
#endif

/* R rows x 16 J features of one tile, over all of k. */
#define LIN_KERNEL(R, J)                                                                    \
    static void lin_##R##_##J(const lin_x *x, int64_t k, const bf16 *tile, bf16 *y,       \
                              int64_t n, const float *bias, const bf16 *pf) {               \
        __m512 acc[R][J];                                                                   \
        for (int r = 0; r < R; ++r)                                                         \
            for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();                    \
        for (int64_t kp = 0; kp < k / 2; ++kp) {                                            \
            const bf16 *wk = tile + kp * 32 * J;                                            \
            if (pf)                                                                         \
                for (int j = 0; j < J; ++j)                                                 \
                    _mm_prefetch((const char *)(pf + kp * 32 * J + 32 * j), LIN_PREFETCH);   \
            LIN_W_DECL(J);                                                                  \
            for (int j = 0; j < J; ++j) LIN_W_LOAD(j, wk + 32 * j);                         \
            for (int r = 0; r < R; ++r) {                                                   \
                LIN_X_DECL;                                                                 \
                LIN_X_LOAD(x, k, r, kp);                                                    \
                for (int j = 0; j < J; ++j) LIN_DOT(acc[r][j], j);                          \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < R; ++r)                                                         \
            for (int j = 0; j < J; ++j) {                                                   \
                __m512 v = acc[r][j];                                                       \
                if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));             \
                _mm256_storeu_si256((__m256i *)(y + r * n + 16 * j), to_bf16x16(v));        \
            }                                                                               \
    }
#define LIN_KERNELS(R) LIN_KERNEL(R, 1) LIN_KERNEL(R, 2) LIN_KERNEL(R, 3)
LIN_KERNELS(1) LIN_KERNELS(2) LIN_KERNELS(3) LIN_KERNELS(4)
LIN_KERNELS(5) LIN_KERNELS(6) LIN_KERNELS(7) LIN_KERNELS(8)

typedef void (*lin_fn)(const lin_x *, int64_t, const bf16 *, bf16 *, int64_t, const float *,
                       const bf16 *);
#define LIN_ROW(R) {lin_##R##_1, lin_##R##_2, lin_##R##_3}
static const lin_fn LIN[8][3] = {LIN_ROW(1), LIN_ROW(2), LIN_ROW(3), LIN_ROW(4),
                                 LIN_ROW(5), LIN_ROW(6), LIN_ROW(7), LIN_ROW(8)};

/* Rows [m0, m1) of x as the register kernels read them: x itself (vdpbf16ps), or widened to
 * float32 into *buf (grown as needed; the caller frees it). NULL when out of memory. */
static const lin_x *lin_rows(const bf16 *x, int64_t m0, int64_t m1, int64_t k, float **buf) {
#ifdef HP_NATIVE_BF16
    (void)m1;
    (void)buf;
    return x + m0 * k;
#else
    float *f = realloc(*buf, (size_t)((m1 - m0) * k) * sizeof(float));
    if (!f) return NULL;
    *buf = f;
#pragma omp parallel for schedule(static) if ((m1 - m0) * k >= 65536)
    for (int64_t i = 0; i < (m1 - m0) * k; ++i) f[i] = bf2f(x[m0 * k + i]);
    return f;
#endif
}

static inline __m512 round_bf16(__m512 v) { /* to bf16 and back, nearest even */
    __m256i h = to_bf16x16(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One row's 16 gate and 16 up sums (features f0 ..): + bias, then act: silu(gate) * up
 * rounded where HF's bf16 LlamaMLP rounds, into yrow[f0 ..]; else both, into yrow[f0 ..]
 * and yrow[inter + f0 ..]. The register and the AMX paths share it, bit for bit. */
static inline void gu_finish(__m512 g, __m512 u, bf16 *yrow, int64_t inter, int64_t f0,
                             const float *bias, int act) {
    if (bias) {
        g = _mm512_add_ps(g, _mm512_loadu_ps(bias + f0));
        u = _mm512_add_ps(u, _mm512_loadu_ps(bias + inter + f0));
    }
    if (act) {
        __m512 gb = round_bf16(g), one = _mm512_set1_ps(1.0f);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gb));
        __m512 s = round_bf16(_mm512_div_ps(gb, _mm512_add_ps(one, e)));
        __m512 out = _mm512_mul_ps(s, round_bf16(u));
        _mm256_storeu_si256((__m256i *)(yrow + f0), to_bf16x16(out));
    } else {
        _mm256_storeu_si256((__m256i *)(yrow + f0), to_bf16x16(g));
        _mm256_storeu_si256((__m256i *)(yrow + inter + f0), to_bf16x16(u));
    }
}

/* R rows x one gate/up tile; act: y [m, inter] = silu(gate) * up, else y [m, 2 inter]. */
#define GU_KERNEL(R)                                                                        \
    static void gu_##R(const lin_x *x, int64_t k, const bf16 *tile, bf16 *y, int64_t inter,\
                       int64_t f0, const float *bias, int act, const bf16 *pf) {           \
        __m512 acc[R][2]; /* [row][gate, up] */                                             \
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();            \
        for (int64_t kp = 0; kp < k / 2; ++kp) {                                            \
            if (pf) {                                                                       \
                _mm_prefetch((const char *)(pf + kp * 64), LIN_PREFETCH);                    \
                _mm_prefetch((const char *)(pf + kp * 64 + 32), LIN_PREFETCH);               \
            }                                                                               \
            LIN_W_DECL(2);                                                                  \
            LIN_W_LOAD(0, tile + kp * 64);                                                  \
            LIN_W_LOAD(1, tile + kp * 64 + 32);                                             \
            for (int r = 0; r < R; ++r) {                                                   \
                LIN_X_DECL;                                                                 \
                LIN_X_LOAD(x, k, r, kp);                                                    \
                LIN_DOT(acc[r][0], 0);                                                      \
                LIN_DOT(acc[r][1], 1);                                                      \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < R; ++r)                                                         \
            gu_finish(acc[r][0], acc[r][1], y + r * (act ? inter : 2 * inter), inter, f0,   \
                      bias, act);                                                           \
    }
GU_KERNEL(1) GU_KERNEL(2) GU_KERNEL(3) GU_KERNEL(4)
GU_KERNEL(5) GU_KERNEL(6) GU_KERNEL(7) GU_KERNEL(8)
typedef void (*gu_fn)(const lin_x *, int64_t, const bf16 *, bf16 *, int64_t, int64_t,
                      const float *, int, const bf16 *);
static const gu_fn GU[8] = {gu_1, gu_2, gu_3, gu_4, gu_5, gu_6, gu_7, gu_8};
#endif

#if defined(HP_NATIVE_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HP_AMX 1
#include "amx_tiles.h"
/*
 * AMX for 16 rows at a time. The packed tiles ([k / 2][width][2]) are already in the
 * weight tiles' VNNI order: 16 column pairs x 16 features x 2 is 16 rows of 64 bytes,
 * width * 4 bytes apart. On Sapphire Rapids vdpbf16ps retires one a ~2 cycles, so the
 * register kernels above reach ~80 GFLOP/s at 32+ rows where a tile instruction does a
 * 16 x 16 x 32 product (bench_linear.py, 2 cores: 86 -> ~35 ms a pass of SmolLM2 at 32
 * rows). Tiles: 0-2 results (16 rows x 16 features each), 3 x, 4-6 weights.
 */
static inline int lin_amx_usable(int64_t rows, int64_t k) {
    return rows >= 16 && k % 32 == 0 && amx_ready();
}

/* out[j] = float32 [16 rows][16 features] of feature group j < J of the tile at col. */
static void amx_rows16(const bf16 *x, int64_t k, const bf16 *tile, int64_t width, int64_t col,
                       int J, float out[3][256]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    const int64_t stride = width * 2 * (int64_t)sizeof(bf16);
    for (int64_t c = 0; c < k / 32; ++c) {
        const bf16 *w = tile + 16 * c * width * 2 + 2 * col;
        _tile_loadd(3, x + 32 * c, k * (int64_t)sizeof(bf16));
        _tile_loadd(4, w, stride);
        _tile_dpbf16ps(0, 3, 4);
        if (J > 1) {
            _tile_loadd(5, w + 32, stride);
            _tile_dpbf16ps(1, 3, 5);
        }
        if (J > 2) {
            _tile_loadd(6, w + 64, stride);
            _tile_dpbf16ps(2, 3, 6);
        }
    }
    _tile_stored(0, out[0], 64);
    if (J > 1) _tile_stored(1, out[1], 64);
    if (J > 2) _tile_stored(2, out[2], 64);
}
#endif

/* x [m, k] and y [m, n] contiguous; packed from hp_pack_linear; bias float32 or NULL.
 * Returns 0, or -2 when its buffer cannot be allocated (quant_ops' code). */
int64_t hp_linear(const bf16 *x, int64_t m, int64_t k, const bf16 *packed, int64_t n,
                  const float *bias, bf16 *y) {
    int64_t tiles = (n + LIN_TILE - 1) / LIN_TILE;
#ifdef HP_AVX512_BF16
    float *buf = NULL;
#endif
    for (int64_t m0 = 0; m0 < m; m0 += 256) {
        int64_t m1 = m0 + 256 < m ? m0 + 256 : m;
#ifdef HP_AVX512_BF16
        const lin_x *xs = lin_rows(x, m0, m1, k, &buf);
        if (!xs) return -2;
#endif
#ifdef HP_AMX
        const int amx = lin_amx_usable(m1 - m0, k);
#endif
#pragma omp parallel if (tiles > 1)
        {
#ifdef HP_AMX
        if (amx) amx_configure();
#endif
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            int64_t f0 = t * LIN_TILE, width = n - f0 < LIN_TILE ? n - f0 : LIN_TILE;
            const bf16 *tile = packed + f0 * k;
            const float *b = bias ? bias + f0 : NULL;
#ifdef HP_AVX512_BF16
            int64_t r_amx = m0;
#ifdef HP_AMX
            for (; amx && r_amx + 16 <= m1; r_amx += 16) {
                float out[3][256];
                const int J = (int)(width / 16);
                amx_rows16(x + r_amx * k, k, tile, width, 0, J, out);
                for (int64_t r = 0; r < 16; ++r)
                    for (int j = 0; j < J; ++j) {
                        __m512 v = _mm512_loadu_ps(out[j] + 16 * r);
                        if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + 16 * j));
                        _mm256_storeu_si256((__m256i *)(y + (r_amx + r) * n + f0 + 16 * j),
                                            to_bf16x16(v));
                    }
            }
#endif
            for (int64_t r0 = r_amx; r0 < m1; r0 += 8) {
                int64_t rows = m1 - r0 < 8 ? m1 - r0 : 8;
                const bf16 *pf =
                    r0 == m0 && t + 1 < tiles ? packed + (f0 + LIN_TILE) * k : NULL;
                LIN[rows - 1][width / 16 - 1](xs + (r0 - m0) * k, k, tile, y + r0 * n + f0, n,
                                              b, pf);
            }
#else
            /* Portable and slow (cpu_ops.py uses oneDNN instead where this would run). */
            for (int64_t r = m0; r < m1; ++r)
                for (int64_t j = 0; j < width; ++j) {
                    float acc = 0.0f;
                    for (int64_t kp = 0; kp < k / 2; ++kp) {
                        const bf16 *wp = tile + (kp * width + j) * 2;
                        acc += bf2f(x[r * k + 2 * kp]) * bf2f(wp[0]);
                        acc += bf2f(x[r * k + 2 * kp + 1]) * bf2f(wp[1]);
                    }
                    y[r * n + f0 + j] = f2bf(b ? acc + b[j] : acc);
                }
#endif
        }
#ifdef HP_AMX
        if (amx) _tile_release();
#endif
        }
    }
#ifdef HP_AVX512_BF16
    free(buf);
#endif
    return 0;
}

/* x [m, k] contiguous; packed from hp_pack_gate_up; bias float32 [2 inter] or NULL; y
 * [m, inter] (act) or [m, 2 inter]. */
int64_t hp_gate_up(const bf16 *x, int64_t m, int64_t k, const bf16 *packed, int64_t inter,
                   const float *bias, int act, bf16 *y) {
    int64_t tiles = inter / 16, width = act ? inter : 2 * inter;
#ifdef HP_AVX512_BF16
    float *buf = NULL;
#endif
    for (int64_t m0 = 0; m0 < m; m0 += 256) {
        int64_t m1 = m0 + 256 < m ? m0 + 256 : m;
#ifdef HP_AVX512_BF16
        const lin_x *xs = lin_rows(x, m0, m1, k, &buf);
        if (!xs) return -2;
#endif
#ifdef HP_AMX
        const int amx = lin_amx_usable(m1 - m0, k);
#endif
#pragma omp parallel if (tiles > 1)
        {
#ifdef HP_AMX
        if (amx) amx_configure();
#endif
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            int64_t f0 = 16 * t;
            const bf16 *tile = packed + 2 * f0 * k;
#ifdef HP_AVX512_BF16
            int64_t r_amx = m0;
#ifdef HP_AMX
            for (; amx && r_amx + 16 <= m1; r_amx += 16) {
                float out[3][256]; /* [gate, up][16 rows][16 features] */
                amx_rows16(x + r_amx * k, k, tile, 32, 0, 2, out);
                for (int64_t r = 0; r < 16; ++r)
                    gu_finish(_mm512_loadu_ps(out[0] + 16 * r), _mm512_loadu_ps(out[1] + 16 * r),
                              y + (r_amx + r) * width, inter, f0, bias, act);
            }
#endif
            for (int64_t r0 = r_amx; r0 < m1; r0 += 8) {
                int64_t rows = m1 - r0 < 8 ? m1 - r0 : 8;
                const bf16 *pf = r0 == m0 && t + 1 < tiles ? tile + 32 * k : NULL;
                GU[rows - 1](xs + (r0 - m0) * k, k, tile, y + r0 * width, inter, f0, bias, act,
                             pf);
            }
#else
            for (int64_t r = m0; r < m1; ++r)
                for (int64_t j = 0; j < 16; ++j) {
                    float gate = 0.0f, up = 0.0f;
                    for (int64_t kp = 0; kp < k / 2; ++kp) {
                        const bf16 *wg = tile + (kp * 32 + j) * 2, *wu = wg + 32;
                        float x0 = bf2f(x[r * k + 2 * kp]), x1 = bf2f(x[r * k + 2 * kp + 1]);
                        /* hp_linear's order of operations, so the two agree bit for bit */
                        gate += x0 * bf2f(wg[0]);
                        gate += x1 * bf2f(wg[1]);
                        up += x0 * bf2f(wu[0]);
                        up += x1 * bf2f(wu[1]);
                    }
                    if (bias) {
                        gate += bias[f0 + j];
                        up += bias[inter + f0 + j];
                    }
                    if (act) {
                        float gf = round_bf(gate);
                        float sv = round_bf(gf / (1.0f + exp_f32(-gf)));
                        y[r * inter + f0 + j] = f2bf(sv * round_bf(up));
                    } else {
                        y[r * 2 * inter + f0 + j] = f2bf(gate);
                        y[r * 2 * inter + inter + f0 + j] = f2bf(up);
                    }
                }
#endif
        }
#ifdef HP_AMX
        if (amx) _tile_release();
#endif
        }
    }
#ifdef HP_AVX512_BF16
    free(buf);
#endif
    return 0;
}

/*
 * Sampling helpers over float32 rows [rows, v], contiguous (the CPU sampler's full-row
 * path, kernels/sampling_torch.py): one vectorised pass each where torch makes two or
 * three.
 */

/* w = softmax(x / t) per row, as exp((x - max) * (1 / t)) / sum. exp flushes arguments
 * below -87.3 to 0, so masked (-inf) logits weigh exactly 0; a row holding NaN or +inf
 * comes out NaN throughout, as torch's softmax does. */
#define SUM_BLOCK 1024 /* terms of one float partial sum in the row sums below */
#define TOPK_BLOCK 64  /* weights per block maximum in hp_sample's top_k and argmax */

/* The row's largest value (NaNs left out), and in *nan whether it holds one. */
static float row_max(const float *xr, int64_t v, int *nan) {
    float m = -INFINITY;
    int n = 0;
#pragma omp simd reduction(max : m) reduction(| : n)
    for (int64_t j = 0; j < v; ++j) {
        m = xr[j] > m ? xr[j] : m;
        n |= xr[j] != xr[j];
    }
    *nan = n;
    return m;
}

/*
 * Greedy picks straight from the model's logits: out[i] = the first index of the largest
 * value of row rows[i] of x ([*, ld] float32, or bfloat16 when x_bf16), as torch.argmax
 * picks, or -1 where the row has no distribution: a NaN or +inf in it, or every value -inf
 * (the torch sampler's rule). Returns how many rows got -1. No float copy of the logits,
 * no gather: a greedy CPU step's sampling is two passes over its rows.
 */
int64_t hp_greedy(const void *x, int x_bf16, int64_t ld, const int64_t *rows, int64_t n,
                  int64_t v, int64_t *out) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        float m = -INFINITY;
        int nan = 0;
        int64_t best = -1;
        if (x_bf16) {
            const bf16 *xr = (const bf16 *)x + rows[i] * ld;
#pragma omp simd reduction(max : m) reduction(| : nan)
            for (int64_t j = 0; j < v; ++j) {
                const float f = bf2f(xr[j]);
                m = f > m ? f : m;
                nan |= f != f;
            }
            if (!nan && m != INFINITY && m != -INFINITY)
                for (best = 0; bf2f(xr[best]) != m; ++best) {}
        } else {
            const float *xr = (const float *)x + rows[i] * ld;
            m = row_max(xr, v, &nan);
            if (!nan && m != INFINITY && m != -INFINITY)
                for (best = 0; xr[best] != m; ++best) {}
        }
        out[i] = best;
        bad += best < 0;
    }
    return bad;
}

/* w = exp((x - m) * inv_t), 0 where that is below min_p (or its argument below -87.3: -inf
 * logits weigh exactly 0); returns the sum, taken as float sums of SUM_BLOCK terms
 * (vectorised) added up in double, each block's kept in bsum when it is not NULL. One float
 * sum over a vocabulary's 10^5 terms drifts by ~1e-5 (relative) with the summation order,
 * which the vector width decides. */
static double exp_weights(const float *xr, int64_t v, float m, float inv_t, float min_p,
                          float *w, double *bsum) {
    double total = 0.0;
    for (int64_t b = 0, j0 = 0; j0 < v; ++b, j0 += SUM_BLOCK) {
        int64_t j1 = j0 + SUM_BLOCK < v ? j0 + SUM_BLOCK : v;
        float part = 0.0f;
#pragma omp simd reduction(+ : part)
        for (int64_t j = j0; j < j1; ++j) {
            float z = (xr[j] - m) * inv_t;
            float e = z < -87.3f ? 0.0f : exp_f32(z);
            e = e < min_p ? 0.0f : e;
            w[j] = e;
            part += e;
        }
        if (bsum != NULL) bsum[b] = part;
        total += part;
    }
    return total;
}

void hp_softmax_t(const float *x, int64_t rows, int64_t v, const float *temperature, float *w) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * v;
        float *wr = w + r * v;
        int nan;
        float m = row_max(xr, v, &nan);
        double sum = exp_weights(xr, v, m, 1.0f / temperature[r], 0.0f, wr, NULL);
        float inv = nan ? NAN : (float)(1.0 / sum);
#pragma omp simd
        for (int64_t j = 0; j < v; ++j) wr[j] *= inv;
    }
}

/* The sum of the weights strictly above `pivot` (0 for a NaN pivot), as hp_softmax_t's
 * normaliser: float sums of SUM_BLOCK terms added up in double, each kept in bs when it is
 * not NULL. */
static double sums_above(const float *w, int64_t v, float pivot, double *bs) {
    double total = 0.0;
    for (int64_t b = 0, j0 = 0; j0 < v; ++b, j0 += SUM_BLOCK) {
        int64_t j1 = j0 + SUM_BLOCK < v ? j0 + SUM_BLOCK : v;
        float part = 0.0f;
#pragma omp simd reduction(+ : part)
        for (int64_t j = j0; j < j1; ++j) part += w[j] > pivot ? w[j] : 0.0f;
        if (bs != NULL) bs[b] = part;
        total += part;
    }
    return total;
}

/* out[r] = the sum of row r's weights strictly above pivot[r] (0 for a NaN pivot). */
void hp_sum_above(const float *w, int64_t rows, int64_t v, const float *pivot, float *out) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) out[r] = (float)sums_above(w + r * v, v, pivot[r], NULL);
}

/*
 * The whole CPU sampler for float32 rows [rows, v] in one call (kernels/sampling_torch.py's
 * native path), each row by one thread from its logits, in the order of
 * kernels/sampling.py: temperature (0: greedy, the first largest), min_p, top_k, top_p,
 * then a draw with the row's uniforms u[r * nu ...]. Weights w = exp((x - max) / t) go to a
 * per-thread buffer that stays in the core's cache, so the logits are read twice (max,
 * weights) and every later pass reads the buffer:
 *
 *   - min_p drops w < min_p (the largest weighs 1);
 *   - top_k keeps w >= the k-th largest weight (ties at the cut stay), found with a
 *     min-heap fed from the blocks of 64 whose maxima reach the k-th largest block maximum;
 *     the kept weights are packed, and what follows reads them instead of the row;
 *   - the draw walks block sums, then one block; top_p is settled by rejection: a drawn
 *     token is kept when the weights heavier than it sum below top_p of the total, else the
 *     row draws again among those heavier ones (each draw that lands in the nucleus follows
 *     the nucleus's distribution, so the result is exact). A row whose nu uniforms all end
 *     rejected gets status 1 and is finished by the caller.
 *
 * Penalties first, where a row has them (kernels/sampling.py's formulas): the row is copied
 * into the buffer and the tokens of ids[off[3r] .. off[3r+1]) (the prompt's) and of
 * ids[off[3r+1] .. off[3r+2]) (the output's) are penalized there, each value computed from
 * the logit itself, so a repeated id is penalized once, except by frequency, which counts
 * every occurrence. The ids are in [0, v) (the caller checks). rep == NULL: no penalties.
 *
 * Then the grammar's bitmask, where mask is not NULL: row r's words at mask + r * mask_stride,
 * bit j of word w allowing token 32 w + j. A row that allows every token reads its logits
 * as it would without one. Any other is copied into the buffer (after its penalties, in
 * place) with -inf at the tokens it disallows, in the pass that finds its largest allowed
 * logit; every later pass (max, weights, argmax) reads that copy, and reads nothing of the
 * mask: disallowed tokens weigh exactly 0, as -inf logits do, so top_k's blocks, the draw
 * and top_p's rejection never count them. A masked row whose allowed logits are all -inf
 * gets token -1 (no distribution).
 *
 * A row without a finite largest logit (NaN, +inf, all -inf) gets some in-range token: the
 * caller reports those rows, never their tokens.
 */
typedef struct {
    float *w, *heap, *bmax; /* heap: then top_k's candidates, packed */
    int64_t *at;            /* each candidate's place in the row */
    double *bsum, *bheavy;
    int64_t cap;
} sample_buf;

static __thread sample_buf tl_sample; /* libgomp's threads persist: grown once, reused */

static int sample_buf_fit(sample_buf *b, int64_t v) {
    if (b->cap >= v) return 1;
    free(b->w), free(b->heap), free(b->bmax), free(b->at), free(b->bsum), free(b->bheavy);
    int64_t nb = v / SUM_BLOCK + 1, nm = v / TOPK_BLOCK + 1;
    b->w = malloc(sizeof(float) * v);
    b->heap = malloc(sizeof(float) * v);
    b->bmax = malloc(sizeof(float) * nm);
    b->at = malloc(sizeof(int64_t) * v);
    b->bsum = malloc(sizeof(double) * nb);
    b->bheavy = malloc(sizeof(double) * nb);
    b->cap = (b->w && b->heap && b->bmax && b->at && b->bsum && b->bheavy) ? v : 0;
    return b->cap != 0;
}

/* The first index of the row's largest value (0 when nothing compares: all NaN). */
static int64_t first_largest(const float *xr, int64_t v) {
    int nan;
    float m = row_max(xr, v, &nan);
    for (int64_t j0 = 0; j0 < v; j0 += TOPK_BLOCK) { /* a vector test per block, then a scan */
        int64_t j1 = j0 + TOPK_BLOCK < v ? j0 + TOPK_BLOCK : v;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t j = j0; j < j1; ++j) hit |= xr[j] == m;
        if (hit)
            for (int64_t j = j0; j < j1; ++j)
                if (xr[j] == m) return j;
    }
    return 0;
}

static void heap_down(float *h, int64_t n, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, s = i;
        if (l < n && h[l] < h[s]) s = l;
        if (l + 1 < n && h[l + 1] < h[s]) s = l + 1;
        if (s == i) return;
        float t = h[i];
        h[i] = h[s], h[s] = t, i = s;
    }
}

/* Offer x to a min-heap of the k largest values seen (n of them so far). */
static void heap_offer(float *heap, int64_t *n, int64_t k, float x) {
    if (*n < k) { /* sift up */
        int64_t i = (*n)++;
        heap[i] = x;
        while (i > 0 && heap[(i - 1) / 2] > heap[i]) {
            float t = heap[i];
            heap[i] = heap[(i - 1) / 2], heap[(i - 1) / 2] = t, i = (i - 1) / 2;
        }
    } else if (x > heap[0]) {
        heap[0] = x;
        heap_down(heap, k, 0);
    }
}

/* The k-th largest positive weight of w, or 0 when fewer than k are positive. The k-th
 * largest block maximum is a floor for it (those maxima are k weights), so only blocks
 * whose maximum reaches that floor are read weight by weight: about k of them. */
static float kth_largest(const float *w, int64_t v, int64_t k, float *heap, float *bmax) {
    int64_t nm = (v + TOPK_BLOCK - 1) / TOPK_BLOCK, n = 0;
    for (int64_t b = 0; b < nm; ++b) {
        int64_t j1 = (b + 1) * TOPK_BLOCK < v ? (b + 1) * TOPK_BLOCK : v;
        float m = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t j = b * TOPK_BLOCK; j < j1; ++j) m = w[j] > m ? w[j] : m;
        bmax[b] = m;
        if (m > 0.0f) heap_offer(heap, &n, k, m);
    }
    float floor = n == k ? heap[0] : 0.0f;
    n = 0;
    for (int64_t b = 0; b < nm; ++b) {
        if (!(bmax[b] > 0.0f) || bmax[b] < floor || (n == k && bmax[b] <= heap[0])) continue;
        int64_t j1 = (b + 1) * TOPK_BLOCK < v ? (b + 1) * TOPK_BLOCK : v;
        for (int64_t j = b * TOPK_BLOCK; j < j1; ++j)
            if (w[j] > 0.0f && w[j] >= floor) heap_offer(heap, &n, k, w[j]);
    }
    return n == k ? heap[0] : 0.0f;
}

/* The weights >= cut, packed into cw in row order, their places in at; returns how many.
 * Only blocks whose maximum (bmax, from kth_largest) reaches the cut are read. */
static int64_t gather_top(const float *w, int64_t v, float cut, const float *bmax, float *cw,
                          int64_t *at) {
    int64_t n = 0;
    for (int64_t b = 0, j0 = 0; j0 < v; ++b, j0 += TOPK_BLOCK) {
        if (!(bmax[b] >= cut)) continue;
        int64_t j1 = j0 + TOPK_BLOCK < v ? j0 + TOPK_BLOCK : v;
        for (int64_t j = j0; j < j1; ++j)
            if (w[j] >= cut) cw[n] = w[j], at[n++] = j;
    }
    return n;
}

/* A token drawn with probability proportional to its weight, among weights above `pivot`
 * (block sums `bs`, total `mass`), at u * mass along the row. */
static int64_t draw_above(const float *w, int64_t v, float pivot, const double *bs, double mass,
                          float u) {
    double target = (double)u * mass, acc = 0.0;
    int64_t last = -1;
    for (int64_t b = 0, j0 = 0; j0 < v; ++b, j0 += SUM_BLOCK) {
        int64_t j1 = j0 + SUM_BLOCK < v ? j0 + SUM_BLOCK : v;
        if (acc + bs[b] <= target) {
            acc += bs[b];
            if (bs[b] > 0.0) last = b; /* a block with weight, if rounding runs off the end */
            continue;
        }
        double in = acc;
        for (int64_t j = j0; j < j1; ++j) {
            if (w[j] > pivot) {
                in += w[j];
                if (in > target) return j;
            }
        }
        acc += bs[b]; /* the block's float sum rounded above the scan's: on to the next */
        last = b;
    }
    if (last < 0) return -1;
    int64_t j0 = last * SUM_BLOCK, j1 = j0 + SUM_BLOCK < v ? j0 + SUM_BLOCK : v;
    for (int64_t j = j1 - 1; j >= j0; --j)
        if (w[j] > pivot) return j;
    return -1;
}

static inline float repetition(float x, float penalty) {
    return x > 0.0f ? x / penalty : x * penalty;
}

/* The row's penalized logits, in w (a copy of xr with the ids' logits changed). */
static void penalize(const float *xr, int64_t v, const int64_t *ids, const int64_t *off,
                     float rep, float presence, float frequency, float *w) {
    memcpy(w, xr, sizeof(float) * v);
    if (rep != 1.0f)
        for (int64_t i = off[0]; i < off[2]; ++i) w[ids[i]] = repetition(xr[ids[i]], rep);
    if (presence != 0.0f || frequency != 0.0f) {
        for (int64_t i = off[1]; i < off[2]; ++i) {
            float x = rep != 1.0f ? repetition(xr[ids[i]], rep) : xr[ids[i]];
            w[ids[i]] = x - presence;
        }
        for (int64_t i = off[1]; i < off[2]; ++i) w[ids[i]] -= frequency;
    }
}

static int64_t sample_row(const float *xr, int64_t v, float t, int64_t k, float top_p,
                          float min_p, const float *u, int64_t nu, sample_buf *buf, int *status) {
    *status = 0;
    if (t < 1e-5f || k == 1) return first_largest(xr, v);
    int nan;
    float m = row_max(xr, v, &nan);
    if (nan || !isfinite(m)) return first_largest(xr, v);
    float *w = buf->w;
    double total = exp_weights(xr, v, m, 1.0f / t, min_p, w, buf->bsum);
    const int64_t *at = NULL; /* with top_k: the draw reads the packed candidates */
    int64_t n = v;
    if (k > 1 && k < v) {
        float cut = kth_largest(w, v, k, buf->heap, buf->bmax);
        if (cut > 0.0f) {
            n = gather_top(w, v, cut, buf->bmax, buf->heap, buf->at);
            w = buf->heap, at = buf->at;
            total = sums_above(w, n, -1.0f, buf->bsum);
        }
    }
    if (!(total > 0.0)) return first_largest(xr, v);
    double *bs = buf->bsum, *heavy = buf->bheavy;
    int64_t tok = draw_above(w, n, -1.0f, bs, total, u[0]);
    if (tok < 0) return first_largest(xr, v);
    if (top_p < 1.0f) {
        double nucleus = (double)top_p * total;
        for (int64_t i = 1;; ++i) {
            double above = sums_above(w, n, w[tok], heavy);
            if (above < nucleus) break; /* the tokens heavier than it weigh under top_p */
            int64_t next = i < nu ? draw_above(w, n, w[tok], heavy, above, u[i]) : -1;
            if (next < 0) {
                *status = 1;
                break;
            }
            double *swap = bs;
            bs = heavy, heavy = swap;
            tok = next;
        }
    }
    return at != NULL ? at[tok] : tok;
}

/* Whether the bitmask row mk allows every one of the v tokens (bits past v ignored). */
static int allows_all(const int32_t *mk, int64_t v) {
    int64_t full = v / 32;
    for (int64_t w = 0; w < full; ++w)
        if (mk[w] != -1) return 0;
    if (v % 32 == 0) return 1;
    uint32_t tail = (1u << (v % 32)) - 1u;
    return ((uint32_t)mk[full] & tail) == tail;
}

/* w = xr with -inf at the tokens mk disallows (w may be xr); returns the largest allowed
 * logit, NaNs left out (-inf when none is finite). A word at a time: the 32 bits of one word
 * test 32 lanes, and the running maxima stay per lane until the end. */
static float mask_row(const float *xr, int64_t v, const int32_t *mk, float *w) {
    float acc[32];
    for (int i = 0; i < 32; ++i) acc[i] = -INFINITY;
    int64_t full = v / 32;
    for (int64_t k = 0; k < full; ++k) {
        uint32_t bits = (uint32_t)mk[k];
        const float *xk = xr + 32 * k;
        float *wk = w + 32 * k;
#pragma omp simd
        for (int i = 0; i < 32; ++i) {
            float y = (bits >> i) & 1u ? xk[i] : -INFINITY;
            wk[i] = y;
            acc[i] = y > acc[i] ? y : acc[i];
        }
    }
    for (int64_t j = 32 * full; j < v; ++j) {
        float y = ((uint32_t)mk[full] >> (j - 32 * full)) & 1u ? xr[j] : -INFINITY;
        w[j] = y;
        acc[0] = y > acc[0] ? y : acc[0];
    }
    float m = -INFINITY;
    for (int i = 0; i < 32; ++i) m = acc[i] > m ? acc[i] : m;
    return m;
}

/* Returns how many rows got a nonzero status (the caller's to sample). */
int64_t hp_sample(const float *x, int64_t rows, int64_t v, const float *temperature,
                  const int64_t *top_k, const float *top_p, const float *min_p, const float *u,
                  int64_t nu, const int64_t *ids, const int64_t *off, const float *rep,
                  const float *presence, const float *frequency, const int32_t *mask,
                  int64_t mask_stride, int64_t *tokens, int32_t *status) {
    int64_t left = 0;
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1) reduction(+ : left)
    for (int64_t r = 0; r < rows; ++r) {
        int st = 0;
        sample_buf *buf = &tl_sample;
        if (!sample_buf_fit(buf, v)) {
            tokens[r] = first_largest(x + r * v, v);
            status[r] = 2; /* no memory for this row's buffer: the caller samples it */
            ++left;
            continue;
        }
        const float *xr = x + r * v;
        if (rep != NULL && (rep[r] != 1.0f || presence[r] != 0.0f || frequency[r] != 0.0f)) {
            /* The penalized copy is the row from here on: max and weights read it, and the
               weights overwrite it in place. */
            penalize(xr, v, ids, off + 3 * r, rep[r], presence[r], frequency[r], buf->w);
            xr = buf->w;
        }
        const int32_t *mk = mask != NULL ? mask + r * mask_stride : NULL;
        if (mk != NULL && !allows_all(mk, v)) {
            /* The masked copy is the row from here on, as the penalized one is. */
            if (!(mask_row(xr, v, mk, buf->w) > -INFINITY)) {
                tokens[r] = -1; /* nothing allowed is finite: no distribution */
                status[r] = 0;
                continue;
            }
            xr = buf->w;
        }
        tokens[r] = sample_row(xr, v, temperature[r], top_k[r], top_p[r], min_p[r],
                               u + r * nu, nu, buf, &st);
        status[r] = st;
        left += st != 0;
    }
    return left;
}

#include "cpu_program.c"
