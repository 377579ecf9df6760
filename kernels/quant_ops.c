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
 * Numerics: each weight is its integer times the block's scale plus its offset, as GGUF's
 * reference dequantizer computes it. The panel paths dequantize to float32 (up to one fused
 * rounding) and multiply float32 activations (bfloat16 ones widened exactly). The SIMD
 * streaming paths carry x as int16 blocks of 32 with power-of-two scales (|error| <= 2^-15
 * of the block's largest |x|) and form each block's dot product exactly in integers. Either
 * way the result is x @ deq(W).T to ~2^-15 of |x| |w|, and products accumulate in float32.
 *
 * Why two paths: with up to 4 rows (decode, speculative verification) the layer is bound by
 * the bandwidth of the weight bytes, so each weight row is streamed once and its blocks are
 * dotted with the rows in integers straight from registers (vpmaddwd on AVX2, vpdpwssd on
 * AVX-512). With more rows the work is bound by multiply-adds: a panel of PANEL weight rows
 * is dequantized once into a small per-thread buffer (PANEL x k floats, a tile and never
 * the whole matrix) and a register-blocked kernel multiplies it with every activation row,
 * so the dequantization is paid once per panel, not per row. Interleaved weights (16
 * features' blocks side by side, quant_interleave.py) stream at every row count on AVX2.
 * All parallelise over output features with OpenMP.
 *
 * Builds: -march=native on a CPU with AVX-512 (BW, BF16, VNNI) takes the paths of
 * quant_avx512.c and the files after it (AMX tiles where the CPU has them, interleaved
 * weights); on other x86-64 CPUs the AVX2 + FMA + F16C paths (here, quant_avx2.c and
 * quant_interleaved_avx2.c); elsewhere
 * (-march=x86-64, other CPUs) a portable C path computes the same function.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HQ_AVX2 1
#include <immintrin.h>
/* AVX-512 F/BW/VL with VNNI (Cascade Lake, Ice Lake on): the streaming paths; with AVX-512
 * BF16 too (Sapphire Rapids, Zen 4), the vdpbf16ps panels and AMX tiles for more rows. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define HQ_AVX512 1
#ifdef __AVX512BF16__
#define HQ_AVX512BF16 1
#endif
#endif
#endif

enum { HQ_INT8 = 0, HQ_Q8_0 = 1, HQ_Q4_0 = 2, HQ_Q4_1 = 3, HQ_Q4_K = 4 };
/* The interleaved forms of Q8_0, Q4_0 and Q4_1 (AVX-512 builds; see ilinear). */
enum { HQ_IQ8_0 = 5, HQ_IQ4_0 = 6, HQ_IQ4_1 = 7 };

#define PANEL 16       /* weight rows dequantized together (the tiled path) */
#define TM 2           /* activation rows per register tile */
#define TN 4           /* weight rows per register tile */
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

/* Block b's 32 int8 of an int8 or Q8_0 row (int8 columns past k read as 0, copied into
 * tail) and its scale *D (int8: 1, the caller's scale is applied later). */
static inline __attribute__((always_inline)) const uint8_t *q8_block(const int FMT,
                                                                     const uint8_t *row,
                                                                     int64_t b, int64_t k,
                                                                     uint8_t tail[32], float *D) {
    if (FMT == HQ_Q8_0) {
        *D = h2f(row + 34 * b);
        return row + 34 * b + 2;
    }
    *D = 1.0f;
    if (32 * b + 32 <= k) return row + 32 * b;
    memset(tail, 0, 32);
    memcpy(tail, row + 32 * b, (size_t)(k - 32 * b));
    return tail;
}

/* Block b of a Q4_0 or Q4_1 row: its scale *D and offset *MB (Q4_0: -8 D), and its 16 bytes
 * of nibbles (byte i: value i low, value i + 16 high). */
static inline __attribute__((always_inline)) const uint8_t *q4_block(const int FMT,
                                                                     const uint8_t *row,
                                                                     int64_t b, float *D,
                                                                     float *MB) {
    const int asym = FMT == HQ_Q4_1;
    const uint8_t *r = row + (asym ? 20 : 18) * b;
    *D = h2f(r);
    *MB = asym ? h2f(r + 2) : -8.0f * *D;
    return r + (asym ? 4 : 2);
}

static inline float pow2(int e) { /* 2^e, -126 <= e <= 127 */
    const uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The int16 scale of a block of x whose largest |x| is amax: returns sx (x ~ q * sx), and
 * 1 / sx in *inv. A power of two, so scaling is exact and x's of few bits (one-hot rows)
 * stay exact; an all-zero block has scale 0; inf or NaN give NaN (a NaN out, not a value
 * made up). */
static inline float x16_scale(float amax, float *inv) {
    uint32_t u;
    memcpy(&u, &amax, sizeof u);
    int e = (int)(u >> 23) - 126; /* amax < 2^e */
    if (e < -111) e = -111;       /* both powers below stay normal floats */
    *inv = amax > 0.0f ? pow2(15 - e) : 0.0f;
    if (!(amax <= 3.4028235e38f)) return amax - amax;
    return amax > 0.0f ? pow2(e - 15) : 0.0f;
}

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

#if defined(HQ_AVX2) && !defined(HQ_AVX512)
#include "quant_avx2.c"
#include "quant_interleaved_avx2.c"
#endif

#ifdef HQ_AVX512
#include "quant_avx512.c"
#include "quant_amx.c"
#include "quant_interleaved.c"
#ifdef HQ_AVX512BF16
#include "quant_panels.c"
#endif
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
#ifdef HQ_AVX512BF16
    return linear512(fmt, x, ldx, x_bf16, m, k, w, n, rb, scale, bias, y, y_bf16) ? -2 : 0;
#else /* no vdpbf16ps: the streaming path, and the tiled one past it */
    if (m <= DIRECT512)
        return stream512(fmt, x, ldx, x_bf16, m, k, w, n, rb, scale, bias, y, y_bf16) ? -2 : 0;
#endif
#elif defined(HQ_AVX2)
    if (fmt >= HQ_IQ8_0) return ilinear_avx2(fmt, x, ldx, x_bf16, m, k, w, n, bias, y, y_bf16) ? -2 : 0;
    if (m <= DIRECT_AVX2)
        return direct_avx2(fmt, x, ldx, x_bf16, m, k, w, n, rb, scale, bias, y, y_bf16) ? -2 : 0;
#else
    if (fmt >= HQ_IQ8_0) return -1; /* interleaved weights are made for SIMD builds only */
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
    const int rc = linear_tiled(fmt, xf, ldx, m, k, w, n, rb, scale, bias, y, y_bf16) ? -2 : 0;
    free(widened);
    return rc;
}

/* Whether more than DIRECT512 rows run on AMX tiles here (split weights, where they run,
 * compute x @ W.T to about 2^-15 of |x| |w| instead of float32 rounding). */
int hq_amx(void) {
#ifdef HQ_AMX
    return amx_ready();
#else
    return 0;
#endif
}

/* row_bytes for Python's checks: one definition of each format's size. */
int64_t hq_row_bytes(int fmt, int64_t k) { return row_bytes(fmt, k); }

/* Which path this build runs: 3 AVX-512 with BF16, 2 AVX-512 (VNNI, no BF16), 1 AVX2 + FMA +
 * F16C, 0 portable C. */
int hq_simd(void) {
#if defined(HQ_AVX512BF16)
    return 3;
#elif defined(HQ_AVX512)
    return 2;
#elif defined(HQ_AVX2)
    return 1;
#else
    return 0;
#endif
}
