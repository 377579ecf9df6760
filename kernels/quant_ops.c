/*
 * Weight-only quantized linear layers for the CPU: y = x @ W.T (+ bias), with W kept in its
 * quantized bytes (see quant_ops.py, which builds and loads this file, and quant_weight.py,
 * which defines the formats).
 *
 * Formats (fmt): 0 int8 per output channel (q [n, k] int8 and scale [n]: W = q * scale),
 * and GGUF's blocks as the file stores them, one row of blocks per output feature:
 * 1 Q8_0 (fp16 d, 32 int8), 2 Q4_0 (fp16 d, 16 bytes of nibbles: (q - 8) * d), 3 Q4_1
 * (fp16 d, fp16 m, nibbles: q * d + m), 4 Q4_K (super-blocks of 256: fp16 d, fp16 dmin,
 * 12 bytes of 6-bit scales and mins of 8 sub-blocks of 32, 128 bytes of nibbles).
 *
 * Numerics: activations stay float32 (bfloat16 ones are widened exactly); each weight is
 * dequantized to float32 in registers, as GGUF's reference dequantizer computes it (up to
 * one fused rounding), and products accumulate in float32. Nothing is quantized on the
 * activation side, so the result is x @ deq(W).T up to float32 summation order.
 *
 * Why two paths: with one or two rows (decode) the layer is bound by the bandwidth of the
 * weight bytes, so each weight row is streamed once and its 32-value units are dotted with
 * the rows straight from registers. With more rows the work is bound by multiply-adds: a
 * panel of PANEL weight rows is dequantized once into a small per-thread buffer (PANEL x k
 * floats, a tile and never the whole matrix) and a register-blocked kernel multiplies it
 * with every activation row, so the dequantization is paid once per panel, not per row.
 * Both parallelise over output features with OpenMP.
 *
 * The AVX2 + FMA + F16C build is what -march=native makes on x86-64 today; elsewhere
 * (-march=x86-64, other CPUs) a portable C path computes the same function.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HQ_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
#define HQ_AVX512 1
#endif
#endif

enum { HQ_INT8 = 0, HQ_Q8_0 = 1, HQ_Q4_0 = 2, HQ_Q4_1 = 3, HQ_Q4_K = 4 };
/* The interleaved forms of Q8_0, Q4_0 and Q4_1 (AVX-512 builds; see ilinear). */
enum { HQ_IQ8_0 = 5, HQ_IQ4_0 = 6, HQ_IQ4_1 = 7 };

#define PANEL 16       /* weight rows dequantized together (the tiled path) */
#define TM 2           /* activation rows per register tile */
#define TN 4           /* weight rows per register tile */
#define DIRECT_ROWS 2  /* up to this many rows take the streaming path */
#define PAR_WORK 65536 /* below this many weight bytes x rows, one thread is faster */

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

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h); /* GGUF fields are little-endian and unaligned */
#ifdef HQ_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise the mantissa */
            exp = 113;
            while (!(mant & 0x400u)) {
                mant <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Q4_K's 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4). */
static inline void q4k_scale_min(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static int64_t row_bytes(int fmt, int64_t k) {
    switch (fmt) {
    case HQ_INT8: return k;
    case HQ_Q8_0: return k / 32 * 34;
    case HQ_Q4_0: return k / 32 * 18;
    case HQ_Q4_1: return k / 32 * 20;
    case HQ_Q4_K: return k / 256 * 144;
    case HQ_IQ8_0: return k / 32 * 34; /* a feature's share of its group */
    case HQ_IQ4_0: return k / 32 * 18;
    case HQ_IQ4_1: return k / 32 * 20;
    default: return -1;
    }
}

#ifndef HQ_AVX2
/* One weight row as k floats (int8: unscaled; the scale is applied to the dot product). */
static void dequant_row(int fmt, const uint8_t *row, int64_t k, float *out) {
    switch (fmt) {
    case HQ_INT8:
        for (int64_t i = 0; i < k; i++) out[i] = (float)(int8_t)row[i];
        break;
    case HQ_Q8_0:
        for (int64_t b = 0; b < k / 32; b++, row += 34) {
            float d = h2f(row);
            for (int i = 0; i < 32; i++) out[32 * b + i] = (float)(int8_t)row[2 + i] * d;
        }
        break;
    case HQ_Q4_0:
    case HQ_Q4_1: {
        const int asym = fmt == HQ_Q4_1, size = asym ? 20 : 18;
        for (int64_t b = 0; b < k / 32; b++, row += size) {
            float d = h2f(row), m = asym ? h2f(row + 2) : -8.0f * d;
            const uint8_t *q = row + (asym ? 4 : 2);
            for (int i = 0; i < 16; i++) {
                out[32 * b + i] = (float)(q[i] & 0xF) * d + m;
                out[32 * b + 16 + i] = (float)(q[i] >> 4) * d + m;
            }
        }
        break;
    }
    case HQ_Q4_K:
        for (int64_t b = 0; b < k / 256; b++, row += 144) {
            float d = h2f(row), dmin = h2f(row + 2);
            const uint8_t *q = row + 16;
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                q4k_scale_min(j, row + 4, &sc, &mn);
                float ds = d * (float)sc, ms = dmin * (float)mn;
                const uint8_t *c = q + 32 * (j / 2);
                const int shift = 4 * (j & 1);
                for (int i = 0; i < 32; i++)
                    out[256 * b + 32 * j + i] = (float)((c[i] >> shift) & 0xF) * ds - ms;
            }
        }
        break;
    }
}
#endif

static inline void put(void *y, int y_bf16, int64_t at, float v) {
    if (y_bf16)
        ((bf16 *)y)[at] = f2bf(v);
    else
        ((float *)y)[at] = v;
}

/* The scale (int8) and bias of output feature j applied to its dot product. */
static inline float finish(float dot, const float *scale, const float *bias, int64_t j) {
    if (scale) dot *= scale[j];
    if (bias) dot += bias[j];
    return dot;
}

#ifdef HQ_AVX2

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 i8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 u8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* 16 nibble bytes (value j low, j + 16 high, GGUF's order) -> 32 floats 0..15. */
static inline void nib16(const uint8_t *q, __m256 w[4]) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    w[0] = u8x8(lo);
    w[1] = u8x8(_mm_srli_si128(lo, 8));
    w[2] = u8x8(hi);
    w[3] = u8x8(_mm_srli_si128(hi, 8));
}

/* 32 unpacked nibbles (one a byte) -> 32 floats. */
static inline void nib32(__m256i q, __m256 w[4]) {
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w[0] = u8x8(lo);
    w[1] = u8x8(_mm_srli_si128(lo, 8));
    w[2] = u8x8(hi);
    w[3] = u8x8(_mm_srli_si128(hi, 8));
}

/*
 * Runs the statement(s) after the first eight arguments once for each block of 32 weights
 * of a row, in order: the block's weights are Q * D + MB, with the integers Q as float32 in
 * Q[0..3], the block's scale D and its offset MB (Q4_0: -8 D, Q4_1: m, Q4_K: -dmin * min,
 * Q8_0 and int8: 0) as floats, and its first column in K0. SCALED and OFFSET are
 * compile-time constants of each format: whether D is not 1 (int8's scale is the
 * caller's) and whether MB is not 0. An int8 row's last k % 32 columns are the caller's.
 */
#define HQ_WALK(FMT, ROW, K, Q, D, MB, K0, SCALED, OFFSET, ...)                                   \
    do {                                                                                         \
        const uint8_t *r_ = (ROW);                                                               \
        switch (FMT) {                                                                           \
        case HQ_INT8:                                                                            \
            for (int64_t K0 = 0; K0 + 32 <= (K); K0 += 32) {                                     \
                enum { SCALED = 0, OFFSET = 0 };                                                 \
                const float D = 1.0f, MB = 0.0f;                                                 \
                __m256 Q[4] = {i8x8(r_ + K0), i8x8(r_ + K0 + 8), i8x8(r_ + K0 + 16),             \
                               i8x8(r_ + K0 + 24)};                                              \
                (void)D, (void)MB;                                                               \
                __VA_ARGS__;                                                                     \
            }                                                                                    \
            break;                                                                               \
        case HQ_Q8_0:                                                                            \
            for (int64_t K0 = 0; K0 < (K); K0 += 32, r_ += 34) {                                 \
                enum { SCALED = 1, OFFSET = 0 };                                                 \
                const float D = h2f(r_), MB = 0.0f;                                              \
                __m256 Q[4] = {i8x8(r_ + 2), i8x8(r_ + 10), i8x8(r_ + 18), i8x8(r_ + 26)};       \
                (void)MB;                                                                        \
                __VA_ARGS__;                                                                     \
            }                                                                                    \
            break;                                                                               \
        case HQ_Q4_0:                                                                            \
            for (int64_t K0 = 0; K0 < (K); K0 += 32, r_ += 18) {                                 \
                enum { SCALED = 1, OFFSET = 1 };                                                 \
                const float D = h2f(r_), MB = -8.0f * D;                                         \
                __m256 Q[4];                                                                     \
                nib16(r_ + 2, Q);                                                                \
                __VA_ARGS__;                                                                     \
            }                                                                                    \
            break;                                                                               \
        case HQ_Q4_1:                                                                            \
            for (int64_t K0 = 0; K0 < (K); K0 += 32, r_ += 20) {                                 \
                enum { SCALED = 1, OFFSET = 1 };                                                 \
                const float D = h2f(r_), MB = h2f(r_ + 2);                                       \
                __m256 Q[4];                                                                     \
                nib16(r_ + 4, Q);                                                                \
                __VA_ARGS__;                                                                     \
            }                                                                                    \
            break;                                                                               \
        case HQ_Q4_K:                                                                            \
            for (int64_t s_ = 0; s_ < (K); s_ += 256, r_ += 144) {                               \
                const float d_ = h2f(r_), dmin_ = h2f(r_ + 2);                                   \
                float ds_[8], ms_[8];                                                            \
                for (int j_ = 0; j_ < 8; j_++) {                                                 \
                    int sc_, mn_;                                                                \
                    q4k_scale_min(j_, r_ + 4, &sc_, &mn_);                                       \
                    ds_[j_] = d_ * (float)sc_;                                                   \
                    ms_[j_] = -(dmin_ * (float)mn_);                                             \
                }                                                                                \
                for (int c_ = 0; c_ < 4; c_++) {                                                 \
                    const __m256i v_ = _mm256_loadu_si256((const __m256i *)(r_ + 16 + 32 * c_)); \
                    const __m256i m4_ = _mm256_set1_epi8(0x0F);                                  \
                    const __m256i lo_ = _mm256_and_si256(v_, m4_);                               \
                    const __m256i hi_ = _mm256_and_si256(_mm256_srli_epi16(v_, 4), m4_);         \
                    for (int h_ = 0; h_ < 2; h_++) {                                             \
                        enum { SCALED = 1, OFFSET = 1 };                                         \
                        const int64_t K0 = s_ + 64 * c_ + 32 * h_;                               \
                        const float D = ds_[2 * c_ + h_], MB = ms_[2 * c_ + h_];                 \
                        __m256 Q[4];                                                             \
                        nib32(h_ ? hi_ : lo_, Q);                                                \
                        __VA_ARGS__;                                                             \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
            break;                                                                               \
        }                                                                                        \
    } while (0)

/* ACC += D * (Q . X[K0 .. K0 + 32)), and C += MB * (the block's sum of X) where OFFSET:
 * the block's dot product is formed unscaled, so a block costs one scaling, not four. */
#define HQ_DOT(ACC, C, X, XSUM, Q, D, MB, K0, SCALED, OFFSET)                                   \
    do {                                                                                         \
        __m256 p_ = _mm256_mul_ps(Q[0], _mm256_loadu_ps((X) + (K0)));                            \
        p_ = _mm256_fmadd_ps(Q[1], _mm256_loadu_ps((X) + (K0) + 8), p_);                         \
        p_ = _mm256_fmadd_ps(Q[2], _mm256_loadu_ps((X) + (K0) + 16), p_);                        \
        p_ = _mm256_fmadd_ps(Q[3], _mm256_loadu_ps((X) + (K0) + 24), p_);                        \
        ACC = SCALED ? _mm256_fmadd_ps(_mm256_set1_ps(D), p_, ACC) : _mm256_add_ps(p_, ACC);     \
        if (OFFSET) C += (MB) * (XSUM)[(K0) / 32];                                               \
    } while (0)

/* Each 32-column block's sum of each of the first m rows of x: xsum[i * (k / 32) + b]. */
static void block_sums(const float *x, int64_t ldx, int64_t m, int64_t k, float *xsum) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < k / 32; b++) {
            const float *p = x + i * ldx + 32 * b;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
            xsum[i * (k / 32) + b] = hsum8(s);
        }
}

/* The streaming path: m <= DIRECT_ROWS; returns -1 when memory runs out. Two accumulators
 * a row (even and odd blocks) keep the chains of block scalings short. */
static int linear_direct(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k,
                         const uint8_t *w, int64_t n, int64_t rb, const float *scale,
                         const float *bias, void *y, int y_bf16) {
    const int64_t k32 = fmt == HQ_INT8 ? k & ~(int64_t)31 : k, nb = k / 32;
    float *xsum = malloc((size_t)(m * nb + 1) * sizeof(float));
    if (!xsum) return -1;
    block_sums(x, ldx, m, k32, xsum);
    const float *x0 = x, *x1 = x + ldx, *s0 = xsum, *s1 = xsum + nb;
#pragma omp parallel for schedule(dynamic, 32) if (n * rb * m >= PAR_WORK)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = w + j * rb;
        __m256 a = _mm256_setzero_ps(), b = a;
        float c0 = 0.0f, c1 = 0.0f;
        if (m == 2)
            HQ_WALK(fmt, row, k, Q, D, MB, k0, SCALED, OFFSET,
                    HQ_DOT(a, c0, x0, s0, Q, D, MB, k0, SCALED, OFFSET);
                    HQ_DOT(b, c1, x1, s1, Q, D, MB, k0, SCALED, OFFSET));
        else
            HQ_WALK(fmt, row, k, Q, D, MB, k0, SCALED, OFFSET,
                    if ((k0 / 32) & 1) HQ_DOT(b, c0, x0, s0, Q, D, MB, k0, SCALED, OFFSET);
                    else HQ_DOT(a, c0, x0, s0, Q, D, MB, k0, SCALED, OFFSET));
        float r0 = c0 + hsum8(m == 2 ? a : _mm256_add_ps(a, b)), r1 = c1 + hsum8(b);
        for (int64_t kk = k32; kk < k; kk++) { /* int8 only */
            const float q = (float)(int8_t)row[kk];
            r0 += x0[kk] * q;
            if (m == 2) r1 += x1[kk] * q;
        }
        put(y, y_bf16, j, finish(r0, scale, bias, j));
        if (m == 2) put(y, y_bf16, n + j, finish(r1, scale, bias, j));
    }
    free(xsum);
    return 0;
}

static void dequant_row(int fmt, const uint8_t *row, int64_t k, float *out) {
    HQ_WALK(fmt, row, k, Q, D, MB, k0, SCALED, OFFSET, {
        const __m256 d = _mm256_set1_ps(D), mb = _mm256_set1_ps(MB);
        for (int t = 0; t < 4; t++)
            _mm256_storeu_ps(out + k0 + 8 * t, SCALED ? _mm256_fmadd_ps(Q[t], d, mb) : Q[t]);
    });
    if (fmt == HQ_INT8)
        for (int64_t i = k & ~(int64_t)31; i < k; i++) out[i] = (float)(int8_t)row[i];
}

/*
 * out[r][c] = x row r . buffered weight row c, for r < mr (1 or 2) and c < TN = 4; weight
 * rows are kp floats apart, 32-byte aligned, zero past k. Written out by hand: with loops
 * over arrays of accumulators gcc spilled two of them to the stack every iteration.
 */
static void tile(const int mr, const float *x, int64_t ldx, const float *wb, int64_t kp,
                 int64_t k, float out[TM][TN]) {
    const float *x0 = x, *x1 = mr > 1 ? x + ldx : x;
    const float *w0 = wb, *w1 = wb + kp, *w2 = wb + 2 * kp, *w3 = wb + 3 * kp;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    const int64_t k8 = k & ~(int64_t)7;
    if (mr > 1) {
        for (int64_t kk = 0; kk < k8; kk += 8) {
            const __m256 u = _mm256_loadu_ps(x0 + kk), v = _mm256_loadu_ps(x1 + kk);
            __m256 w = _mm256_load_ps(w0 + kk);
            a0 = _mm256_fmadd_ps(u, w, a0);
            b0 = _mm256_fmadd_ps(v, w, b0);
            w = _mm256_load_ps(w1 + kk);
            a1 = _mm256_fmadd_ps(u, w, a1);
            b1 = _mm256_fmadd_ps(v, w, b1);
            w = _mm256_load_ps(w2 + kk);
            a2 = _mm256_fmadd_ps(u, w, a2);
            b2 = _mm256_fmadd_ps(v, w, b2);
            w = _mm256_load_ps(w3 + kk);
            a3 = _mm256_fmadd_ps(u, w, a3);
            b3 = _mm256_fmadd_ps(v, w, b3);
        }
    } else {
        for (int64_t kk = 0; kk < k8; kk += 8) {
            const __m256 u = _mm256_loadu_ps(x0 + kk);
            a0 = _mm256_fmadd_ps(u, _mm256_load_ps(w0 + kk), a0);
            a1 = _mm256_fmadd_ps(u, _mm256_load_ps(w1 + kk), a1);
            a2 = _mm256_fmadd_ps(u, _mm256_load_ps(w2 + kk), a2);
            a3 = _mm256_fmadd_ps(u, _mm256_load_ps(w3 + kk), a3);
        }
    }
    const __m256 acc[2][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}};
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < TN; c++) {
            float s = hsum8(acc[r][c]);
            for (int64_t kk = k8; kk < k; kk++) s += x[r * ldx + kk] * wb[c * kp + kk];
            out[r][c] = s;
        }
}

#else /* portable C */

static inline void tile(const int mr, const float *x, int64_t ldx, const float *wb, int64_t kp,
                        int64_t k, float out[TM][TN]) {
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < TN; c++) {
            const float *xr = x + r * ldx, *wc = wb + c * kp;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t kk = 0; kk < k; kk++) s += xr[kk] * wc[kk];
            out[r][c] = s;
        }
}

#endif

/* The tiled path; returns -1 when a thread's panel buffer cannot be allocated. */
static int linear_tiled(int fmt, const float *x, int64_t ldx, int64_t m, int64_t k,
                        const uint8_t *w, int64_t n, int64_t rb, const float *scale,
                        const float *bias, void *y, int y_bf16) {
    const int64_t kp = (k + 7) & ~(int64_t)7, panels = (n + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel if (n * rb * m >= PAR_WORK && panels > 1)
    {
        float *buf = aligned_alloc(32, (size_t)(PANEL * kp) * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < panels; p++) {
            if (!buf) continue;
            const int64_t j0 = p * PANEL, rows = n - j0 < PANEL ? n - j0 : PANEL;
            for (int64_t r = 0; r < rows; r++) {
                float *dst = buf + r * kp;
                dequant_row(fmt, w + (j0 + r) * rb, k, dst);
                for (int64_t kk = k; kk < kp; kk++) dst[kk] = 0.0f;
            }
            const int64_t groups = (rows + TN - 1) / TN;
            memset(buf + rows * kp, 0, (size_t)((groups * TN - rows) * kp) * sizeof(float));
            for (int64_t i0 = 0; i0 < m; i0 += TM) {
                const int mr = m - i0 < TM ? (int)(m - i0) : TM;
                const float *xi = x + i0 * ldx;
                for (int64_t g = 0; g < groups; g++) {
                    float out[TM][TN];
                    const float *wb = buf + g * TN * kp;
                    tile(mr, xi, ldx, wb, kp, k, out);
                    for (int r = 0; r < mr; r++)
                        for (int c = 0; c < TN; c++) {
                            const int64_t j = j0 + g * TN + c;
                            if (j < n)
                                put(y, y_bf16, (i0 + r) * n + j,
                                    finish(out[r][c], scale, bias, j));
                        }
                }
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

#ifdef HQ_AVX512
/*
 * The AVX-512 paths (Intel from Sapphire Rapids, AMD from Zen 4). Every format is blocks
 * of 32 weights q * D + MB with integer q (int8 and Q8_0: -128..127, Q4_*: 0..15); the
 * block's scale D and offset MB come from its header (int8: D = 1, its scale is applied to
 * the finished dot product).
 *
 * Up to DIRECT512 rows (decode, speculative verification) stream each weight row once:
 * the block's integers become 32 float32 in two registers and are dotted with the float32
 * rows (bfloat16 ones widened exactly), scaled by D once per block; MB's share is added
 * through the block's sum of x. Format and row count are compile-time constants of each
 * loop (DIRECT_CASE), so a block is a handful of instructions and the loop keeps up with
 * the memory bus.
 *
 * More rows take panels of output features, dequantized once per call into a small
 * per-thread buffer (never the whole matrix), where the work is bound by multiply-adds:
 * - with AMX (Sapphire Rapids on), each weight w = q * D + MB, formed in float32, is split
 *   into two bfloat16, w = hi + lo (hi its top 16 bits, lo the rest rounded: |error| <
 *   2^-16 |w|), and the tiles multiply both with x; float32 x is split the same way and
 *   x_lo * hi is added, so the result is x @ W.T to about 2^-15 of |x| |w|, inside the
 *   tests' 1e-4, at AMX's rate (a 16 x 16 x 32 product an instruction);
 * - without AMX (Zen 4), vdpbf16ps over the integers themselves: integers and bfloat16
 *   activations are exact in bfloat16, products of two bfloat16 exact in float32, so
 *   each block's dot product is scaled by D and its offset added once; float32 x is split
 *   into hi + lo rows.
 * Measured on this project's Sapphire Rapids machines, vdpbf16ps retires one a ~3 cycles
 * where a float32 FMA retires two a cycle: the streaming path uses FMAs for that reason.
 */
#include <sys/syscall.h>
#include <unistd.h>

#define DIRECT512 4
#define PREFETCH512 2048 /* bytes ahead in the weight stream */
#define PANEL512 48 /* features per panel of the vdpbf16ps path: three vectors of 16 */

/* Block b's integers as 32 float32 (q[0]: columns 32 b .. 32 b + 15, q[1]: the rest), its
 * scale and offset. FMT is a constant where this is inlined. int8 columns past k read 0. */
static inline __attribute__((always_inline)) void qblock_ps(const int FMT, const uint8_t *row,
                                                            int64_t b, int64_t k, __m512 q[2],
                                                            float *D, float *MB) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const uint8_t *nib;
    int shift = 0;
    switch (FMT) {
    case HQ_INT8:
    case HQ_Q8_0: {
        const uint8_t *p;
        uint8_t tail[32];
        if (FMT == HQ_Q8_0) {
            p = row + 34 * b + 2;
            *D = h2f(row + 34 * b);
        } else {
            p = row + 32 * b;
            *D = 1.0f;
            if (32 * b + 32 > k) {
                memset(tail, 0, sizeof tail);
                memcpy(tail, p, (size_t)(k - 32 * b));
                p = tail;
            }
        }
        *MB = 0.0f;
        q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        return;
    }
    case HQ_Q4_0:
    case HQ_Q4_1: {
        const int asym = FMT == HQ_Q4_1;
        const uint8_t *r = row + (asym ? 20 : 18) * b;
        *D = h2f(r);
        *MB = asym ? h2f(r + 2) : -8.0f * *D;
        /* byte i holds value i (low nibble) and value i + 16 (high) */
        const __m128i v = _mm_loadu_si128((const __m128i *)(r + (asym ? 4 : 2)));
        q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, m4)));
        q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), m4)));
        return;
    }
    default: { /* HQ_Q4_K: super-block b / 8, sub-block j = b % 8 */
        const uint8_t *r = row + 144 * (b / 8);
        const int j = (int)(b % 8);
        int sc, mn;
        q4k_scale_min(j, r + 4, &sc, &mn);
        *D = h2f(r) * (float)sc;
        *MB = -(h2f(r + 2) * (float)mn);
        /* 32 bytes of nibbles hold sub-blocks 2c (low nibbles) and 2c + 1 (high) */
        nib = r + 16 + 32 * (j / 2);
        shift = 4 * (j & 1);
        const __m128i a = _mm_loadu_si128((const __m128i *)nib);
        const __m128i c = _mm_loadu_si128((const __m128i *)(nib + 16));
        q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(a, shift), m4)));
        q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(c, shift), m4)));
        return;
    }
    }
}

/* x as float32 rows xf [m][kp] (kp = 32 nb, zero past k) and, for the formats with
 * offsets, each block's sum xsum [m][nb]. */
static void widen_x(const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k, int64_t nb,
                    float *xf, float *xsum) {
    const int64_t kp = 32 * nb;
    for (int64_t i = 0; i < m; i++) {
        float *dst = xf + i * kp;
        if (x_bf16)
            for (int64_t c = 0; c < k; c++) dst[c] = bf2f(((const bf16 *)x)[i * ldx + c]);
        else
            memcpy(dst, (const float *)x + i * ldx, (size_t)k * sizeof(float));
        memset(dst + k, 0, (size_t)(kp - k) * sizeof(float));
        if (xsum)
            for (int64_t b = 0; b < nb; b++)
                xsum[i * nb + b] = _mm512_reduce_add_ps(
                    _mm512_add_ps(_mm512_loadu_ps(dst + 32 * b), _mm512_loadu_ps(dst + 32 * b + 16)));
    }
}

/* Block b's integers as 32 int16 in column order, its scale and offset (as qblock_ps). */
static inline __attribute__((always_inline)) __m512i qblock_epi16(const int FMT,
                                                                  const uint8_t *row, int64_t b,
                                                                  int64_t k, float *D, float *MB) {
    switch (FMT) {
    case HQ_INT8:
    case HQ_Q8_0: {
        const uint8_t *p;
        uint8_t tail[32];
        if (FMT == HQ_Q8_0) {
            p = row + 34 * b + 2;
            *D = h2f(row + 34 * b);
        } else {
            p = row + 32 * b;
            *D = 1.0f;
            if (32 * b + 32 > k) {
                memset(tail, 0, sizeof tail);
                memcpy(tail, p, (size_t)(k - 32 * b));
                p = tail;
            }
        }
        *MB = 0.0f;
        return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    }
    case HQ_Q4_0:
    case HQ_Q4_1: {
        const int asym = FMT == HQ_Q4_1;
        const uint8_t *r = row + (asym ? 20 : 18) * b;
        *D = h2f(r);
        *MB = asym ? h2f(r + 2) : -8.0f * *D;
        const __m128i m4 = _mm_set1_epi8(0x0F);
        const __m128i v = _mm_loadu_si128((const __m128i *)(r + (asym ? 4 : 2)));
        const __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4),
                                              _mm_and_si128(v, m4));
        return _mm512_cvtepu8_epi16(both);
    }
    default: { /* HQ_Q4_K */
        const uint8_t *r = row + 144 * (b / 8);
        const int j = (int)(b % 8);
        int sc, mn;
        q4k_scale_min(j, r + 4, &sc, &mn);
        *D = h2f(r) * (float)sc;
        *MB = -(h2f(r + 2) * (float)mn);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(r + 16 + 32 * (j / 2)));
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        return _mm512_cvtepu8_epi16(
            _mm256_and_si256((j & 1) ? _mm256_srli_epi16(v, 4) : v, m4));
    }
    }
}

static inline float pow2(int e) { /* 2^e, -126 <= e <= 127 */
    const uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/*
 * x for the streaming path: each row's blocks of 32 as int16 with a scale of their own,
 * xq [m][kp] and sx [m][nb] (x ~ xq * sx, sx a power of two: |error| <= 2^-15 of the
 * block's largest |x|, about the precision the AMX path's hi + lo split keeps), and each
 * block's exact sum xsum [m][nb] for the formats with offsets. An all-zero block has
 * scale 0. A value that rounds to 32768 saturates to 32767 (one unit: the same bound).
 */
static void quantize_x16(const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
                         int64_t nb, int16_t *xq, float *sx, float *xsum) {
    const int64_t kp = 32 * nb;
    float buf[32];
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t c0 = 32 * b, len = k - c0 < 32 ? k - c0 : 32;
            for (int64_t c = 0; c < 32; c++)
                buf[c] = c >= len ? 0.0f
                         : x_bf16 ? bf2f(((const bf16 *)x)[i * ldx + c0 + c])
                                  : ((const float *)x)[i * ldx + c0 + c];
            const __m512 a = _mm512_loadu_ps(buf), z = _mm512_loadu_ps(buf + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(z)));
            if (xsum) xsum[i * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(a, z));
            /* a power of two: scaling is exact, and x's of few bits (one-hot rows) stay exact */
            uint32_t u;
            memcpy(&u, &amax, sizeof u);
            int e = (int)(u >> 23) - 126; /* amax < 2^e */
            if (e < -111) e = -111;       /* both powers below stay normal floats */
            const float inv = amax > 0.0f ? pow2(15 - e) : 0.0f;
            sx[i * nb + b] = amax > 0.0f ? pow2(e - 15) : 0.0f;
            if (!(amax <= 3.4028235e38f)) sx[i * nb + b] = amax - amax; /* inf, NaN: NaN out */
            const __m512 s = _mm512_set1_ps(inv);
            const __m256i qa = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, s)));
            const __m256i qz = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(z, s)));
            _mm256_storeu_si256((__m256i *)(xq + i * kp + c0), qa);
            _mm256_storeu_si256((__m256i *)(xq + i * kp + c0 + 16), qz);
        }
}

/* One weight row of the streaming path against the MM rows of xq: per block, vpdpwssd
 * dots the 32 integer weights with each row's 32 int16, scaled by D times the row's
 * block scale. */
static inline __attribute__((always_inline)) void direct_row(
    const int FMT, const int MM, int64_t k, int64_t nb, const int16_t *xq, const float *sx,
    const float *xsum, const uint8_t *row, int64_t j, const float *scale, const float *bias,
    void *y, int y_bf16, int64_t n) {
    const int64_t kp = 32 * nb;
    const int offset = FMT == HQ_Q4_0 || FMT == HQ_Q4_1 || FMT == HQ_Q4_K;
    __m512 acc[MM];
    float off[MM];
    for (int r = 0; r < MM; r++) {
        acc[r] = _mm512_setzero_ps();
        off[r] = 0.0f;
    }
    /* bytes a block: the rows follow each other, so this runs ahead through the matrix */
    const int64_t bs = FMT == HQ_INT8 ? 32 : FMT == HQ_Q8_0 ? 34 : FMT == HQ_Q4_0 ? 18
                     : FMT == HQ_Q4_1 ? 20 : 18;
    for (int64_t b = 0; b < nb; b++) {
        float D, MB;
        _mm_prefetch((const char *)row + bs * b + PREFETCH512, _MM_HINT_T0);
        const __m512i q = qblock_epi16(FMT, row, b, k, &D, &MB);
        for (int r = 0; r < MM; r++) {
            const __m512i xv = _mm512_loadu_si512(xq + r * kp + 32 * b);
            const __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), q, xv);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(D * sx[r * nb + b]),
                                     acc[r]);
            if (offset) off[r] += MB * xsum[r * nb + b];
        }
    }
    for (int r = 0; r < MM; r++)
        put(y, y_bf16, r * n + j, finish(_mm512_reduce_add_ps(acc[r]) + off[r], scale, bias, j));
}

static void direct512(int fmt, int64_t m, int64_t k, int64_t nb, const int16_t *xq,
                      const float *sx, const float *xsum, const uint8_t *w, int64_t n,
                      int64_t rb, const float *scale, const float *bias, void *y, int y_bf16) {
    const int par = n * rb * m >= PAR_WORK;
#define DIRECT_CASE(FMT, MM)                                                                 \
    case (FMT) * 8 + (MM): {                                                                 \
        _Pragma("omp parallel for schedule(static) if (par)")                          \
        for (int64_t j = 0; j < n; j++)                                                      \
            direct_row(FMT, MM, k, nb, xq, sx, xsum, w + j * rb, j, scale, bias, y, y_bf16, n); \
        break;                                                                               \
    }
#define DIRECT_FMT(FMT) DIRECT_CASE(FMT, 1) DIRECT_CASE(FMT, 2) DIRECT_CASE(FMT, 3) DIRECT_CASE(FMT, 4)
    switch (fmt * 8 + (int)m) {
        DIRECT_FMT(HQ_INT8) DIRECT_FMT(HQ_Q8_0) DIRECT_FMT(HQ_Q4_0) DIRECT_FMT(HQ_Q4_1)
        DIRECT_FMT(HQ_Q4_K)
    }
#undef DIRECT_FMT
#undef DIRECT_CASE
}

/* Feature j's weights dequantized into float32 columns 0 .. kp (zero past k): w[kp]. */
static inline __attribute__((always_inline)) void dequant_ps(const int FMT, const uint8_t *row,
                                                             int64_t k, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++) {
        __m512 q[2];
        float D, MB;
        qblock_ps(FMT, row, b, k, q, &D, &MB);
        const __m512 d = _mm512_set1_ps(D), mb = _mm512_set1_ps(MB);
        _mm512_storeu_ps(w + 32 * b, FMT == HQ_INT8 ? q[0] : _mm512_fmadd_ps(q[0], d, mb));
        _mm512_storeu_ps(w + 32 * b + 16, FMT == HQ_INT8 ? q[1] : _mm512_fmadd_ps(q[1], d, mb));
    }
}

/* hi = the top 16 bits of v (exact in bfloat16), lo = v - hi rounded to bfloat16. */
static inline void split_bf16(const float *v, int64_t count, bf16 *hi, bf16 *lo) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t c = 0; c < count; c += 32) {
        const __m512 a = _mm512_loadu_ps(v + c), b = _mm512_loadu_ps(v + c + 16);
        const __m512 ah = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), top));
        const __m512 bh = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), top));
        _mm512_storeu_si512(hi + c, (__m512i)_mm512_cvtne2ps_pbh(bh, ah));
        if (lo)
            _mm512_storeu_si512(lo + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bh),
                                                                      _mm512_sub_ps(a, ah)));
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HQ_AMX 1
#define AMX_F 32 /* features per AMX panel: two A tiles of 16 */

/* Linux hands out AMX's tile state only on request (once per process). */
static int amx_ready(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles: 0-3 results (feature group f x row group g: 2 f + g), 4-5 weights (16 features
 * x 32 columns), 6-7 activations (16 column pairs x 16 rows x 2, VNNI). All 16 x 64 B. */
static void amx_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* A thread's buffer of the AMX paths, tiles configured; NULL (and *failed set) when the
 * memory is not there. The thread gives both back with _tile_release() and free(). */
static char *amx_thread_start(size_t bytes, int *failed) {
    char *mem = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!mem) {
#pragma omp atomic write
        *failed = 1;
        return NULL;
    }
    amx_configure();
    return mem;
}

/*
 * x in the layout the tiles read: for row group g (16 rows, zero past m) and column chunk
 * c (32 columns): 16 pairs x 16 rows x 2 bf16, at xv[(g * nb + c) * 512]; hi parts, and lo
 * parts at xv + groups * nb * 512 for float32 x.
 */
static void amx_x(const float *xf, int64_t m, int64_t nb, int64_t groups, int lo, bf16 *xv) {
    const int64_t kp = 32 * nb, half = groups * nb * 512;
    memset(xv, 0, (size_t)((lo ? 2 : 1) * half) * sizeof(bf16));
    bf16 *hi_row = malloc((size_t)kp * sizeof(bf16)), *lo_row = malloc((size_t)kp * sizeof(bf16));
    for (int64_t i = 0; i < m; i++) {
        split_bf16(xf + i * kp, kp, hi_row, lo ? lo_row : NULL);
        const int64_t g = i / 16, r = i % 16;
        for (int64_t c = 0; c < kp; c++) {
            const int64_t at = (g * nb + c / 32) * 512 + ((c % 32) / 2) * 32 + r * 2 + (c & 1);
            xv[at] = hi_row[c];
            if (lo) xv[half + at] = lo_row[c];
        }
    }
    free(hi_row);
    free(lo_row);
}

#define AMX_PRODUCTS(A0, A1, AS, B0, B1, TWO)                                                \
    do {                                                                                     \
        _tile_loadd(4, (A0), (AS));                                                          \
        _tile_loadd(5, (A1), (AS));                                                          \
        _tile_loadd(6, (B0), 64);                                                            \
        if (TWO) _tile_loadd(7, (B1), 64);                                                   \
        _tile_dpbf16ps(0, 4, 6);                                                             \
        _tile_dpbf16ps(2, 5, 6);                                                             \
        if (TWO) {                                                                           \
            _tile_dpbf16ps(1, 4, 7);                                                         \
            _tile_dpbf16ps(3, 5, 7);                                                         \
        }                                                                                    \
    } while (0)

/* The AMX panel path; returns -1 when a thread's buffers cannot be allocated. */
static int amx512(int fmt, int64_t m, int64_t k, int64_t nb, const float *xf, int x_lo,
                  const uint8_t *w, int64_t n, int64_t rb, const float *scale, const float *bias,
                  void *y, int y_bf16) {
    const int64_t kp = 32 * nb, groups = (m + 15) / 16, panels = (n + AMX_F - 1) / AMX_F;
    const int64_t half = groups * nb * 512;
    /* int8's weights are its integers: exact in bfloat16, no lo part */
    const int w_lo = fmt != HQ_INT8;
    bf16 *xv = aligned_alloc(64, (size_t)((x_lo ? 2 : 1) * half) * sizeof(bf16));
    if (!xv) return -1;
    amx_x(xf, m, nb, groups, x_lo, xv);
    int failed = 0;
#pragma omp parallel if (n * rb * m >= PAR_WORK && panels > 1)
    {
        const size_t wbytes = (size_t)(AMX_F * kp) * sizeof(bf16);
        char *mem = amx_thread_start(2 * wbytes + (size_t)(AMX_F * kp + 4 * 256) * sizeof(float),
                                     &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < panels; p++) {
            if (!mem) continue;
            bf16 *whi = (bf16 *)mem, *wlo = (bf16 *)(mem + wbytes);
            float *wf = (float *)(mem + 2 * wbytes), *cbuf = wf + AMX_F * kp;
            const int64_t j0 = p * AMX_F, width = n - j0 < AMX_F ? n - j0 : AMX_F;
            for (int64_t f = 0; f < AMX_F; f++) {
                float *dst = wf + f * kp;
                if (f >= width) {
                    memset(dst, 0, (size_t)kp * sizeof(float));
                    continue;
                }
                const uint8_t *row = w + (j0 + f) * rb;
                switch (fmt) {
                case HQ_INT8: dequant_ps(HQ_INT8, row, k, nb, dst); break;
                case HQ_Q8_0: dequant_ps(HQ_Q8_0, row, k, nb, dst); break;
                case HQ_Q4_0: dequant_ps(HQ_Q4_0, row, k, nb, dst); break;
                case HQ_Q4_1: dequant_ps(HQ_Q4_1, row, k, nb, dst); break;
                default: dequant_ps(HQ_Q4_K, row, k, nb, dst); break;
                }
            }
            split_bf16(wf, AMX_F * kp, whi, w_lo ? wlo : NULL);
            const int64_t as = kp * (int64_t)sizeof(bf16);
            for (int64_t g = 0; g < groups; g += 2) {
                const int two = g + 1 < groups;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t c = 0; c < nb; c++) {
                    const bf16 *b0 = xv + (g * nb + c) * 512, *b1 = b0 + nb * 512;
                    const bf16 *h0 = whi + 32 * c, *h1 = h0 + 16 * kp;
                    AMX_PRODUCTS(h0, h1, as, b0, b1, two);
                    if (w_lo) AMX_PRODUCTS(wlo + 32 * c, wlo + 32 * c + 16 * kp, as, b0, b1, two);
                    if (x_lo) AMX_PRODUCTS(h0, h1, as, b0 + half, b1 + half, two);
                }
                _tile_stored(0, cbuf, 64);
                _tile_stored(2, cbuf + 512, 64);
                if (two) {
                    _tile_stored(1, cbuf + 256, 64);
                    _tile_stored(3, cbuf + 768, 64);
                }
                /* cbuf[(2 fg + gg) * 256 + feature * 16 + row] */
                for (int64_t gg = 0; gg < 1 + two; gg++)
                    for (int64_t r = 0; r < 16; r++) {
                        const int64_t i = (g + gg) * 16 + r;
                        if (i >= m) break;
                        for (int64_t f = 0; f < width; f++) {
                            const float v = cbuf[(2 * (f / 16) + gg) * 256 + (f % 16) * 16 + r];
                            put(y, y_bf16, i * n + j0 + f, finish(v, scale, bias, j0 + f));
                        }
                    }
            }
        }
        if (mem) _tile_release();
        free(mem);
    }
    free(xv);
    return failed ? -1 : 0;
}
#endif /* AMX */

/*
 * Interleaved weights (quant_interleave.py): group g of 16 output features, block b at
 * w + (g * nb + b) * 16 * BS: the 16 fp16 scales d (Q4_1: then the 16 m), then a column
 * pair p at a time the 16 features' integers (Q4: one byte a feature, column 2 p in the
 * low nibble; Q8_0: two int8 a feature).
 */
#define IQ_BS(FMT) ((FMT) == HQ_IQ8_0 ? 34 : (FMT) == HQ_IQ4_0 ? 18 : 20)
#define IQ_HEAD(FMT) ((FMT) == HQ_IQ4_1 ? 64 : 32)

/* Column pair p of a block, 16 features: dword lane f holds the int16 pair
 * (q[f][2 p], q[f][2 p + 1]), the order vpdpwssd multiplies and AMX's weight tile reads. */
static inline __attribute__((always_inline)) __m512i iq_pair(const int FMT, const uint8_t *qs,
                                                             int p) {
    if (FMT == HQ_IQ8_0) return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * p)));
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * p)));
    /* (v | v << 12) & 0x000F000F: the low nibble in the low word, the high one in the high */
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x000F000F),
                                     0xA8);
}

/* The block's scales (and offsets) of its 16 features. */
static inline __attribute__((always_inline)) void iq_head(const int FMT, const uint8_t *blk,
                                                          __m512 *d, __m512 *mb) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    if (FMT == HQ_IQ4_1) *mb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
    else if (FMT == HQ_IQ4_0) *mb = _mm512_mul_ps(*d, _mm512_set1_ps(-8.0f));
    else *mb = _mm512_setzero_ps();
}

/* 16 outputs of row i from v (float32 lanes; features j0 .. j0 + 16, those below n). */
static inline void put16(__m512 v, int64_t i, int64_t j0, int64_t n, const float *bias,
                         void *y, int y_bf16) {
    const __mmask16 keep = n - j0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j0)) - 1);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + j0));
    if (y_bf16)
        _mm256_mask_storeu_epi16((bf16 *)y + i * n + j0, keep, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float *)y + i * n + j0, keep, v);
}

/* The streaming path on interleaved weights: one group of 16 features against MM rows. */
static inline __attribute__((always_inline)) void igroup(
    const int FMT, const int MM, int64_t nb, const int16_t *xq, const float *sx,
    const float *xsum, const uint8_t *grp, int64_t j0, int64_t n, const float *bias, void *y,
    int y_bf16) {
    const int64_t kp = 32 * nb;
    __m512 acc[MM];
    for (int r = 0; r < MM; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * 16 * IQ_BS(FMT);
        _mm_prefetch((const char *)blk + PREFETCH512, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + PREFETCH512 + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + PREFETCH512 + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + PREFETCH512 + 192, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + PREFETCH512 + 256, _MM_HINT_T0);
        if (FMT == HQ_IQ8_0)
            for (int c = 320; c < 16 * IQ_BS(FMT); c += 64)
                _mm_prefetch((const char *)blk + PREFETCH512 + c, _MM_HINT_T0);
        const uint8_t *qs = blk + IQ_HEAD(FMT);
        __m512i dot[MM];
        for (int r = 0; r < MM; r++) dot[r] = _mm512_setzero_si512();
        for (int p = 0; p < 16; p++) {
            const __m512i q = iq_pair(FMT, qs, p);
            for (int r = 0; r < MM; r++) {
                int32_t pair;
                memcpy(&pair, xq + r * kp + 32 * b + 2 * p, sizeof pair);
                dot[r] = _mm512_dpwssd_epi32(dot[r], q, _mm512_set1_epi32(pair));
            }
        }
        __m512 d, mb;
        iq_head(FMT, blk, &d, &mb);
        for (int r = 0; r < MM; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                     _mm512_mul_ps(d, _mm512_set1_ps(sx[r * nb + b])), acc[r]);
            if (FMT != HQ_IQ8_0)
                acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(xsum[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < MM; r++) put16(acc[r], r, j0, n, bias, y, y_bf16);
}

static void idirect(int fmt, int64_t m, int64_t nb, const int16_t *xq, const float *sx,
                    const float *xsum, const uint8_t *w, int64_t n, const float *bias, void *y,
                    int y_bf16) {
    const int64_t groups = (n + 15) / 16, gb = nb * 16 * IQ_BS(fmt);
    const int par = groups * gb * m >= PAR_WORK && groups > 1;
#define IDIRECT_CASE(FMT, MM)                                                                \
    case (FMT) * 8 + (MM): {                                                                 \
        _Pragma("omp parallel for schedule(static) if (par)")                               \
        for (int64_t g = 0; g < groups; g++)                                                 \
            igroup(FMT, MM, nb, xq, sx, xsum, w + g * gb, 16 * g, n, bias, y, y_bf16);       \
        break;                                                                               \
    }
#define IDIRECT_FMT(FMT) IDIRECT_CASE(FMT, 1) IDIRECT_CASE(FMT, 2) IDIRECT_CASE(FMT, 3) IDIRECT_CASE(FMT, 4)
    switch (fmt * 8 + (int)m) { IDIRECT_FMT(HQ_IQ8_0) IDIRECT_FMT(HQ_IQ4_0) IDIRECT_FMT(HQ_IQ4_1) }
#undef IDIRECT_FMT
#undef IDIRECT_CASE
}

#ifdef HQ_AMX
/*
 * The AMX path on interleaved weights: here the weights are the B tiles (VNNI order is
 * the interleaved order: a column pair per feature) and x the A tiles (rows of 32
 * columns). Per group and block, the 16 features' w = q * d + m (float32) are split into
 * bf16 hi + lo pairs, [16 pairs][16 features][2] each, and multiplied with x's hi (and lo)
 * rows: C [16 rows][16 features]. Tiles: 0-3 results (row group 2 a + feature group b'),
 * 4-5 x, 6-7 weights.
 */
static void iq_dequant_block(const int FMT, const uint8_t *blk, bf16 *hi, bf16 *lo) {
    __m512 d, mb;
    iq_head(FMT, blk, &d, &mb);
    const uint8_t *qs = blk + IQ_HEAD(FMT);
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    for (int p = 0; p < 16; p++) {
        const __m512i q = iq_pair(FMT, qs, p);
        const __m512i qe = FMT == HQ_IQ8_0 ? _mm512_srai_epi32(_mm512_slli_epi32(q, 16), 16)
                                           : _mm512_and_si512(q, _mm512_set1_epi32(0xFFFF));
        const __m512i qo = FMT == HQ_IQ8_0 ? _mm512_srai_epi32(q, 16) : _mm512_srli_epi32(q, 16);
        const __m512 we = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qe), d, mb);
        const __m512 wo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qo), d, mb);
        const __m512i he = _mm512_and_si512(_mm512_castps_si512(we), top);
        const __m512i ho = _mm512_and_si512(_mm512_castps_si512(wo), top);
        /* hi: (even's top half, odd's top half) a feature */
        _mm512_storeu_si512(hi + 32 * p, _mm512_or_si512(_mm512_srli_epi32(he, 16), ho));
        const __m512 le = _mm512_sub_ps(we, _mm512_castsi512_ps(he));
        const __m512 lo_ = _mm512_sub_ps(wo, _mm512_castsi512_ps(ho));
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(lo_, le); /* [even 16 | odd 16] */
        _mm512_storeu_si512(lo + 32 * p, _mm512_permutexvar_epi16(pairs, both));
    }
}

static int iamx(int fmt, int64_t m, int64_t k, int64_t nb, const float *xf, int x_lo,
                const uint8_t *w, int64_t n, const float *bias, void *y, int y_bf16) {
    const int64_t kp = 32 * nb, rows = (m + 15) / 16 * 16, groups = (n + 15) / 16;
    const int64_t panels = (groups + 1) / 2, gb = nb * 16 * IQ_BS(fmt);
    /* x as bf16 rows (hi, then lo for float32 x), zero rows up to a multiple of 16 */
    bf16 *xa = aligned_alloc(64, (size_t)((x_lo ? 2 : 1) * rows * kp) * sizeof(bf16));
    if (!xa) return -1;
    memset(xa, 0, (size_t)((x_lo ? 2 : 1) * rows * kp) * sizeof(bf16));
    for (int64_t i = 0; i < m; i++)
        split_bf16(xf + i * kp, kp, xa + i * kp, x_lo ? xa + (rows + i) * kp : NULL);
    int failed = 0;
    (void)k;
#pragma omp parallel if (groups * gb * m >= PAR_WORK && panels > 1)
    {
        /* hi and lo B tiles of two groups for every block, then the results */
        const size_t tiles = (size_t)(2 * 2 * nb * 512);
        char *mem = amx_thread_start(tiles * sizeof(bf16) + 4 * 256 * sizeof(float), &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t pn = 0; pn < panels; pn++) {
            if (!mem) continue;
            bf16 *wt = (bf16 *)mem; /* [group 0/1][hi, lo][block][512] */
            float *cbuf = (float *)(mem + tiles * sizeof(bf16));
            const int two_g = 2 * pn + 1 < groups;
            for (int gi = 0; gi < 1 + two_g; gi++)
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = w + (2 * pn + gi) * gb + b * 16 * IQ_BS(fmt);
                    bf16 *hi = wt + ((gi * 2 + 0) * nb + b) * 512, *lo = wt + ((gi * 2 + 1) * nb + b) * 512;
                    switch (fmt) {
                    case HQ_IQ8_0: iq_dequant_block(HQ_IQ8_0, blk, hi, lo); break;
                    case HQ_IQ4_0: iq_dequant_block(HQ_IQ4_0, blk, hi, lo); break;
                    default: iq_dequant_block(HQ_IQ4_1, blk, hi, lo); break;
                    }
                }
            const int64_t as = kp * (int64_t)sizeof(bf16);
            for (int64_t r0 = 0; r0 < rows; r0 += 32) {
                const int two_r = r0 + 16 < rows;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t c = 0; c < nb; c++) {
                    const bf16 *a0 = xa + r0 * kp + 32 * c, *a1 = a0 + 16 * kp;
                    for (int part = 0; part < 2 + x_lo; part++) {
                        /* part 0: x hi . w hi, 1: x hi . w lo, 2: x lo . w hi */
                        const bf16 *xa0 = part == 2 ? a0 + rows * kp : a0;
                        const bf16 *xa1 = part == 2 ? a1 + rows * kp : a1;
                        const int wl = part == 1;
                        _tile_loadd(4, xa0, as);
                        if (two_r) _tile_loadd(5, xa1, as);
                        _tile_loadd(6, wt + ((0 * 2 + wl) * nb + c) * 512, 64);
                        if (two_g) _tile_loadd(7, wt + ((1 * 2 + wl) * nb + c) * 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (two_g) _tile_dpbf16ps(1, 4, 7);
                        if (two_r) {
                            _tile_dpbf16ps(2, 5, 6);
                            if (two_g) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                }
                /* cbuf[(2 rg + fg) * 256 + row * 16 + feature] */
                _tile_stored(0, cbuf, 64);
                if (two_g) _tile_stored(1, cbuf + 256, 64);
                if (two_r) {
                    _tile_stored(2, cbuf + 512, 64);
                    if (two_g) _tile_stored(3, cbuf + 768, 64);
                }
                for (int rg = 0; rg < 1 + two_r; rg++)
                    for (int64_t r = 0; r < 16; r++) {
                        const int64_t i = r0 + 16 * rg + r;
                        if (i >= m) break;
                        for (int fg = 0; fg < 1 + two_g; fg++)
                            put16(_mm512_loadu_ps(cbuf + (2 * rg + fg) * 256 + r * 16), i,
                                  16 * (2 * pn + fg), n, bias, y, y_bf16);
                    }
            }
        }
        if (mem) _tile_release();
        free(mem);
    }
    free(xa);
    return failed ? -1 : 0;
}
#endif

/* hq_linear for interleaved weights (AVX-512 builds only). */
static int ilinear(int fmt, const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
                   const uint8_t *w, int64_t n, const float *bias, void *y, int y_bf16) {
    const int64_t nb = k / 32, kp = 32 * nb;
#ifdef HQ_AMX
    if (m > DIRECT512 && amx_ready()) {
        float *xf = aligned_alloc(64, (size_t)(m * kp) * sizeof(float) + 64);
        int rc = -1;
        if (xf) {
            widen_x(x, ldx, x_bf16, m, k, nb, xf, NULL);
            rc = iamx(fmt, m, k, nb, xf, !x_bf16, w, n, bias, y, y_bf16);
        }
        free(xf);
        return rc;
    }
#endif
    /* the streaming path, four rows at a time */
    const int64_t mc = m < DIRECT512 ? m : DIRECT512;
    int16_t *xq = aligned_alloc(64, (size_t)(mc * kp) * sizeof(int16_t) + 64);
    float *sx = malloc((size_t)(2 * mc * nb) * sizeof(float) + 4);
    int rc = -1;
    if (xq && sx) {
        const size_t out = y_bf16 ? sizeof(bf16) : sizeof(float);
        for (int64_t i0 = 0; i0 < m; i0 += DIRECT512) {
            const int64_t rows = m - i0 < DIRECT512 ? m - i0 : DIRECT512;
            const void *xi = x_bf16 ? (const void *)((const bf16 *)x + i0 * ldx)
                                    : (const void *)((const float *)x + i0 * ldx);
            quantize_x16(xi, ldx, x_bf16, rows, k, nb, xq, sx, sx + rows * nb);
            idirect(fmt, rows, nb, xq, sx, sx + rows * nb, w, n, bias,
                    (char *)y + (size_t)(i0 * n) * out, y_bf16);
        }
        rc = 0;
    }
    free(xq);
    free(sx);
    return rc;
}

/* The vdpbf16ps panel path (no AMX) */
/* The bfloat16 of 0..15, indexed by a nibble held in a 16-bit lane (vpermw's table). */
static const uint16_t NIB_BF16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120,
    0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

static inline __m512i i8x32_bf16(const uint8_t *p) { /* 32 int8 -> 32 bf16, in order */
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* 32 nibble values in 16-bit lanes (0..15 each) -> 32 bf16. */
static inline __m512i nib_words_bf16(__m512i words, __m512i table) {
    return _mm512_permutexvar_epi16(words, table);
}

/*
 * Block b (32 weights, from column 32 b) of a weight row in format fmt: its integers as 32
 * bf16 in column order, its scale *D and offset *MB (the weights are q * D + MB). int8's
 * scale is the caller's (D = 1); its columns past k are read as zeros.
 */
static inline __m512i qblock(int fmt, const uint8_t *row, int64_t b, int64_t k, __m512i table,
                             float *D, float *MB) {
    switch (fmt) {
    case HQ_INT8: {
        *D = 1.0f;
        *MB = 0.0f;
        if (32 * b + 32 <= k) return i8x32_bf16(row + 32 * b);
        uint8_t tail[32] = {0};
        memcpy(tail, row + 32 * b, (size_t)(k - 32 * b));
        return i8x32_bf16(tail);
    }
    case HQ_Q8_0: {
        const uint8_t *r = row + 34 * b;
        *D = h2f(r);
        *MB = 0.0f;
        return i8x32_bf16(r + 2);
    }
    case HQ_Q4_0:
    case HQ_Q4_1: {
        const int asym = fmt == HQ_Q4_1;
        const uint8_t *r = row + (asym ? 20 : 18) * b;
        *D = h2f(r);
        *MB = asym ? h2f(r + 2) : -8.0f * *D;
        /* byte i holds value i (low nibble) and value i + 16 (high) */
        __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(r + (asym ? 4 : 2))));
        const __m256i m4 = _mm256_set1_epi16(0x0F);
        __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(w, m4)),
                                           _mm256_srli_epi16(w, 4), 1);
        return nib_words_bf16(words, table);
    }
    default: { /* HQ_Q4_K: super-block b / 8, sub-block j = b % 8 */
        const uint8_t *r = row + 144 * (b / 8);
        const int j = (int)(b % 8);
        int sc, mn;
        q4k_scale_min(j, r + 4, &sc, &mn);
        *D = h2f(r) * (float)sc;
        *MB = -(h2f(r + 2) * (float)mn);
        /* 32 bytes of nibbles hold sub-blocks 2c (low) and 2c + 1 (high) */
        __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(r + 16 + 32 * (j / 2))));
        __m512i q = (j & 1) ? _mm512_srli_epi16(w, 4) : _mm512_and_si512(w, _mm512_set1_epi16(0x0F));
        return nib_words_bf16(q, table);
    }
    }
}

/*
 * The activations as vdpbf16ps reads them: xb [mm][kp] bf16 (kp = nb * 32, zero past k),
 * mm = m rows of bf16 x as they are, or 2 m for float32 x (rows hi, then rows lo); and
 * xsum [m][nb], each block's sum of x (exact x, float32), for the formats with offsets.
 */
static void prepare_x(const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
                      int64_t nb, bf16 *xb, float *xsum) {
    const int64_t kp = nb * 32, mm = x_bf16 ? m : 2 * m;
    memset(xb, 0, (size_t)(mm * kp) * sizeof(bf16));
    for (int64_t i = 0; i < m; i++) {
        for (int64_t c = 0; c < k; c++) {
            if (x_bf16) {
                xb[i * kp + c] = ((const bf16 *)x)[i * ldx + c];
            } else {
                const float v = ((const float *)x)[i * ldx + c];
                uint32_t u;
                memcpy(&u, &v, sizeof u);
                const bf16 hi = (bf16)(u >> 16); /* truncated: v - hi is exact in float32 */
                xb[i * kp + c] = hi;
                /* inf and NaN are carried by hi alone */
                xb[(m + i) * kp + c] = (u & 0x7F800000u) == 0x7F800000u ? 0 : f2bf(v - bf2f(hi));
            }
        }
        if (xsum)
            for (int64_t b = 0; b < nb; b++) {
                float s = 0.0f;
                for (int64_t c = 32 * b; c < 32 * b + 32 && c < k; c++)
                    s += x_bf16 ? bf2f(((const bf16 *)x)[i * ldx + c])
                                : ((const float *)x)[i * ldx + c];
                xsum[i * nb + b] = s;
            }
    }
}

/* A panel: wp [kp / 2][48][2] bf16 integers of features j0 .. j0 + 48 (zero past n), ds and
 * ms [nb][48] their blocks' scales and offsets. */
static void fill_panel(int fmt, const uint8_t *w, int64_t rb, int64_t n, int64_t j0, int64_t k,
                       int64_t nb, __m512i table, bf16 *wp, float *ds, float *ms) {
    const __m512i stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                               6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(PANEL512));
    for (int64_t c = 0; c < PANEL512; c++) {
        const int64_t j = j0 + c;
        for (int64_t b = 0; b < nb; b++) {
            float D = 0.0f, MB = 0.0f;
            __m512i q = _mm512_setzero_si512();
            if (j < n) q = qblock(fmt, w + j * rb, b, k, table, &D, &MB);
            ds[b * PANEL512 + c] = D;
            ms[b * PANEL512 + c] = MB;
            /* pair p of the block goes to wp[(16 b + p) * 48 + c] (as 32 bits) */
            _mm512_i32scatter_epi32((int *)wp + 16 * b * PANEL512 + c, stride, q, 4);
        }
    }
}

/* R rows x 48 features of a panel: out[r][0..48) = sum over blocks of D * (q . x). */
#define PANEL_KERNEL(R)                                                                      \
    static void pk_##R(const bf16 *xb, int64_t kp, int64_t nb, const bf16 *wp,              \
                       const float *ds, float *out) {                                        \
        __m512 acc[R][3];                                                                    \
        for (int r = 0; r < R; r++)                                                          \
            for (int v = 0; v < 3; v++) acc[r][v] = _mm512_setzero_ps();                     \
        const uint32_t *pairs = (const uint32_t *)xb; /* row r's pair p: [r * kp / 2 + p] */ \
        for (int64_t b = 0; b < nb; b++) {                                                   \
            __m512 blk[R][3];                                                                \
            for (int r = 0; r < R; r++)                                                      \
                for (int v = 0; v < 3; v++) blk[r][v] = _mm512_setzero_ps();                 \
            for (int64_t p = 16 * b; p < 16 * b + 16; p++) {                                 \
                const bf16 *wk = wp + p * 2 * PANEL512;                                      \
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);                        \
                const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + 32);                   \
                const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64);                   \
                for (int r = 0; r < R; r++) {                                                \
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pairs[r * (kp / 2) + p]); \
                    blk[r][0] = _mm512_dpbf16_ps(blk[r][0], xv, w0);                          \
                    blk[r][1] = _mm512_dpbf16_ps(blk[r][1], xv, w1);                          \
                    blk[r][2] = _mm512_dpbf16_ps(blk[r][2], xv, w2);                          \
                }                                                                            \
            }                                                                                \
            for (int v = 0; v < 3; v++) {                                                    \
                const __m512 d = _mm512_loadu_ps(ds + b * PANEL512 + 16 * v);                \
                for (int r = 0; r < R; r++) acc[r][v] = _mm512_fmadd_ps(blk[r][v], d, acc[r][v]); \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < R; r++)                                                          \
            for (int v = 0; v < 3; v++) _mm512_storeu_ps(out + r * PANEL512 + 16 * v, acc[r][v]); \
    }
PANEL_KERNEL(1) PANEL_KERNEL(2) PANEL_KERNEL(3) PANEL_KERNEL(4)
typedef void (*panel_fn)(const bf16 *, int64_t, int64_t, const bf16 *, const float *, float *);
static const panel_fn PANEL_KERNELS[4] = {pk_1, pk_2, pk_3, pk_4};

/* The panel path; returns -1 when a thread's buffers cannot be allocated. */
static int tiled512(int fmt, int64_t m, int64_t mm, int64_t k, int64_t nb, const bf16 *xb,
                    const float *xsum, const uint8_t *w, int64_t n, int64_t rb,
                    const float *scale, const float *bias, void *y, int y_bf16) {
    const int64_t kp = nb * 32, panels = (n + PANEL512 - 1) / PANEL512;
    const int offsets = fmt == HQ_Q4_0 || fmt == HQ_Q4_1 || fmt == HQ_Q4_K;
    int failed = 0;
#pragma omp parallel if (n * rb * m >= PAR_WORK && panels > 1)
    {
        const size_t wp_bytes = (size_t)(kp * PANEL512) * sizeof(bf16);
        const size_t s_bytes = (size_t)(nb * PANEL512) * sizeof(float);
        const size_t o_bytes = (size_t)(mm * PANEL512) * sizeof(float);
        char *mem = aligned_alloc(64, wp_bytes + 2 * s_bytes + o_bytes + 64);
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        }
        const __m512i table = _mm512_loadu_si512(NIB_BF16);
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < panels; p++) {
            if (!mem) continue;
            bf16 *wp = (bf16 *)mem;
            float *ds = (float *)(mem + wp_bytes), *ms = ds + nb * PANEL512;
            float *out = ms + nb * PANEL512;
            const int64_t j0 = p * PANEL512, width = n - j0 < PANEL512 ? n - j0 : PANEL512;
            fill_panel(fmt, w, rb, n, j0, k, nb, table, wp, ds, ms);
            for (int64_t r0 = 0; r0 < mm; r0 += 4) {
                const int64_t rows = mm - r0 < 4 ? mm - r0 : 4;
                PANEL_KERNELS[rows - 1](xb + r0 * kp, kp, nb, wp, ds, out + r0 * PANEL512);
            }
            for (int64_t i = 0; i < m; i++) {
                float *o = out + i * PANEL512;
                for (int v = 0; v < 3; v++) {
                    __m512 s = _mm512_loadu_ps(o + 16 * v);
                    if (mm > m) s = _mm512_add_ps(s, _mm512_loadu_ps(out + (m + i) * PANEL512 + 16 * v));
                    if (offsets)
                        for (int64_t b = 0; b < nb; b++)
                            s = _mm512_fmadd_ps(_mm512_loadu_ps(ms + b * PANEL512 + 16 * v),
                                                _mm512_set1_ps(xsum[i * nb + b]), s);
                    _mm512_storeu_ps(o + 16 * v, s);
                }
                for (int64_t c = 0; c < width; c++)
                    put(y, y_bf16, i * n + j0 + c, finish(o[c], scale, bias, j0 + c));
            }
        }
        free(mem);
    }
    return failed ? -1 : 0;
}

/* hq_linear on this path: no widened copy of x in hq_linear's sense, both row regimes. */
static int linear512(int fmt, const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
                     const uint8_t *w, int64_t n, int64_t rb, const float *scale,
                     const float *bias, void *y, int y_bf16) {
    const int64_t nb = (k + 31) / 32, kp = nb * 32;
    const int offsets = fmt == HQ_Q4_0 || fmt == HQ_Q4_1 || fmt == HQ_Q4_K;
    int amx = 0;
#ifdef HQ_AMX
    amx = m > DIRECT512 && amx_ready();
#endif
    if (m <= DIRECT512) {
        int16_t *xq = aligned_alloc(64, (size_t)(m * kp) * sizeof(int16_t) + 64);
        float *sx = malloc((size_t)(2 * m * nb) * sizeof(float) + 4);
        int rc = -1;
        if (xq && sx) {
            quantize_x16(x, ldx, x_bf16, m, k, nb, xq, sx, offsets ? sx + m * nb : NULL);
            direct512(fmt, m, k, nb, xq, sx, sx + m * nb, w, n, rb, scale, bias, y, y_bf16);
            rc = 0;
        }
        free(xq);
        free(sx);
        return rc;
    }
#ifdef HQ_AMX
    if (amx) {
        float *xf = aligned_alloc(64, (size_t)(m * kp) * sizeof(float) + 64);
        int rc = -1;
        if (xf) {
            widen_x(x, ldx, x_bf16, m, k, nb, xf, NULL);
            rc = amx512(fmt, m, k, nb, xf, !x_bf16, w, n, rb, scale, bias, y, y_bf16);
        }
        free(xf);
        return rc;
    }
#endif
    const int64_t mm = x_bf16 ? m : 2 * m;
    bf16 *xb = aligned_alloc(64, (size_t)(mm * kp) * sizeof(bf16) + 64);
    float *xsum = offsets ? malloc((size_t)(m * nb) * sizeof(float) + 4) : NULL;
    int rc = -1;
    if (xb && (xsum || !offsets)) {
        prepare_x(x, ldx, x_bf16, m, k, nb, xb, xsum);
        rc = tiled512(fmt, m, mm, k, nb, xb, xsum, w, n, rb, scale, bias, y, y_bf16);
    }
    free(xb);
    free(xsum);
    return rc;
}
#endif /* HQ_AVX512 */

/*
 * y [m, n] (contiguous; float32, or bfloat16 when y_bf16) = x [m, k] (rows ldx elements
 * apart; float32, or bfloat16 when x_bf16) @ W.T (+ bias [n] float32), for the weight w of
 * format fmt ([n, row_bytes(fmt, k)] bytes; int8's scale [n] float32). k is a whole number
 * of blocks (the Python wrapper checks). Returns 0, -1 for an unknown format or shape, -2
 * when memory runs out.
 */
int hq_linear(int fmt, const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
              const uint8_t *w, int64_t n, const float *scale, const float *bias, void *y,
              int y_bf16) {
    const int64_t rb = row_bytes(fmt, k);
    if (rb < 0 || m < 0 || n < 0 || k < 0) return -1;
    if (m == 0 || n == 0) return 0;
    if (fmt != HQ_INT8) scale = NULL;
#ifdef HQ_AVX512
    if (fmt >= HQ_IQ8_0) return ilinear(fmt, x, ldx, x_bf16, m, k, w, n, bias, y, y_bf16) ? -2 : 0;
    return linear512(fmt, x, ldx, x_bf16, m, k, w, n, rb, scale, bias, y, y_bf16) ? -2 : 0;
#else
    if (fmt >= HQ_IQ8_0) return -1; /* interleaved weights are made for AVX-512 builds only */
#endif
    const float *xf = x;
    float *widened = NULL;
    if (x_bf16) { /* exact: bfloat16 is the top half of a float32 */
        widened = malloc((size_t)(m * k) * sizeof(float));
        if (!widened) return -2;
        for (int64_t i = 0; i < m; i++)
            for (int64_t kk = 0; kk < k; kk++)
                widened[i * k + kk] = bf2f(((const bf16 *)x)[i * ldx + kk]);
        xf = widened;
        ldx = k;
    }
    int rc = 0;
#ifdef HQ_AVX2
    if (m <= DIRECT_ROWS)
        rc = linear_direct(fmt, xf, ldx, m, k, w, n, rb, scale, bias, y, y_bf16) ? -2 : 0;
    else
#endif
        rc = linear_tiled(fmt, xf, ldx, m, k, w, n, rb, scale, bias, y, y_bf16) ? -2 : 0;
    free(widened);
    return rc;
}

/* Whether more than DIRECT512 rows run on AMX tiles here (its split weights compute x @ W.T
 * to about 2^-15 of |x| |w| instead of float32 rounding). */
int hq_amx(void) {
#ifdef HQ_AMX
    return amx_ready();
#else
    return 0;
#endif
}

/* row_bytes for Python's checks: one definition of each format's size. */
int64_t hq_row_bytes(int fmt, int64_t k) { return row_bytes(fmt, k); }

/* Which path this build runs: 2 AVX-512 BF16, 1 AVX2 + FMA + F16C, 0 portable C. */
int hq_simd(void) {
#if defined(HQ_AVX512)
    return 2;
#elif defined(HQ_AVX2)
    return 1;
#else
    return 0;
#endif
}
