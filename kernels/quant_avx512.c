/* quant_avx512.c: the AVX-512 paths' common parts and the
 * streaming path of the row layout.
 * Included by quant_ops.c inside #ifdef HQ_AVX512 (one translation unit, one build). */

/*
 * The AVX-512 paths (Intel from Cascade Lake, AMD from Zen 4; the panels and AMX tiles need
 * AVX-512 BF16: Sapphire Rapids on, Zen 4; without it, rows past the streaming path take the
 * tiled path of quant_ops.c). Every format is blocks
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
 *   tests' 1e-4, at AMX's rate (a 16 x 16 x 32 product an instruction). Interleaved
 *   weights up to SPLIT_ROWS rows skip the split: the tiles multiply the integers
 *   themselves, and each block's products are scaled in registers (quant_interleaved.c);
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
        uint8_t tail[32];
        const uint8_t *p = q8_block(FMT, row, b, k, tail, D);
        *MB = 0.0f;
        q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        return;
    }
    case HQ_Q4_0:
    case HQ_Q4_1: {
        /* byte i holds value i (low nibble) and value i + 16 (high) */
        const __m128i v = _mm_loadu_si128((const __m128i *)q4_block(FMT, row, b, D, MB));
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

/* The bfloat16 of 0..15, indexed by a nibble held in a 16-bit lane (vpermw's table). */
static const uint16_t NIB_BF16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120,
    0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};

#ifdef HQ_AVX512BF16
static inline __m512i i8x32_bf16(const uint8_t *p) { /* 32 int8 -> 32 bf16, in order */
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
#endif

/* 32 nibble values in 16-bit lanes (0..15 each) -> 32 bf16. */
static inline __m512i nib_words_bf16(__m512i words, __m512i table) {
    return _mm512_permutexvar_epi16(words, table);
}

/*
 * The activations as vdpbf16ps and AMX's tiles read them: xb rows of kp = nb * 32 bf16
 * (zero past k): m rows of bf16 x as they are, or for float32 x its hi parts (the top 16
 * bits: x - hi is exact in float32) and, from row lo_row on, its lo parts (x - hi rounded);
 * rows the caller allocated past these are its own to clear. xsum [m][nb] (or NULL), each
 * block's sum of x (exact x, float32), for the formats with offsets.
 */
static void prepare_x(const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
                      int64_t nb, int64_t lo_row, bf16 *xb, float *xsum) {
    const int64_t kp = nb * 32;
    for (int64_t i = 0; i < m; i++) {
        bf16 *hi = xb + i * kp, *lo = xb + (lo_row + i) * kp;
        if (x_bf16) {
            memcpy(hi, (const bf16 *)x + i * ldx, (size_t)k * sizeof(bf16));
        } else {
            for (int64_t c = 0; c < k; c++) {
                const float v = ((const float *)x)[i * ldx + c];
                uint32_t u;
                memcpy(&u, &v, sizeof u);
                hi[c] = (bf16)(u >> 16); /* truncated: v - hi is exact in float32 */
                /* inf and NaN are carried by hi alone */
                lo[c] = (u & 0x7F800000u) == 0x7F800000u ? 0 : f2bf(v - bf2f(hi[c]));
            }
            memset(lo + k, 0, (size_t)(kp - k) * sizeof(bf16));
        }
        memset(hi + k, 0, (size_t)(kp - k) * sizeof(bf16));
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

/* Block b's integers as 32 int16 in column order, its scale and offset (as qblock_ps). */
static inline __attribute__((always_inline)) __m512i qblock_epi16(const int FMT,
                                                                  const uint8_t *row, int64_t b,
                                                                  int64_t k, float *D, float *MB) {
    switch (FMT) {
    case HQ_INT8:
    case HQ_Q8_0: {
        uint8_t tail[32];
        const uint8_t *p = q8_block(FMT, row, b, k, tail, D);
        *MB = 0.0f;
        return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    }
    case HQ_Q4_0:
    case HQ_Q4_1: {
        const __m128i m4 = _mm_set1_epi8(0x0F);
        const __m128i v = _mm_loadu_si128((const __m128i *)q4_block(FMT, row, b, D, MB));
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
            const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a, z));
            if (xsum) xsum[i * nb + b] = sum;
            float inv;
            const float s16 = x16_scale(amax, &inv);
            sx[i * nb + b] = sum == sum ? s16 : sum; /* max_ps drops a NaN; the sum keeps it */
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

/* The streaming path of the row layout (m <= DIRECT512); -1 when memory runs out. */
static int stream512(int fmt, const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
                     const uint8_t *w, int64_t n, int64_t rb, const float *scale,
                     const float *bias, void *y, int y_bf16) {
    const int64_t nb = (k + 31) / 32, kp = nb * 32;
    const int offsets = fmt == HQ_Q4_0 || fmt == HQ_Q4_1 || fmt == HQ_Q4_K;
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

/* 16 float32 as bfloat16, rounded to nearest even (NaN stays a quiet NaN): vcvtneps2bf16's
 * result where the CPU has it; integer operations (f2bf's) where not. */
static inline __m256i bf16x16(__m512 v) {
#ifdef HQ_AVX512BF16
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u,
                             _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
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

#ifdef HQ_AVX512BF16
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
#endif
