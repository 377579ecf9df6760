/* quant_avx2.c: the AVX2 streaming path (up to DIRECT_AVX2 rows) with int16 activations.
 * Included by quant_ops.c inside #if defined(HQ_AVX2) && !defined(HQ_AVX512).
 *
 * Decode reads every weight once per step, so the layer should run at the memory bus's
 * speed; on AVX2 CPUs (Zen 2/3, Intel before Ice Lake) widening each weight to float32 and
 * multiplying in float costs more instructions than the bus allows (Q4: ~8 GB/s of 37 on
 * a 2-core Zen 3). Here, as in quant_avx512.c's streaming path, x is carried as int16
 * blocks of 32 with power-of-two scales (|error| <= 2^-15 of the block's largest |x|;
 * one-hot rows stay exact; inf/NaN give NaN), so a block of weights needs only widening to
 * int16: vpmaddwd forms 16 products a instruction, exactly, and one float conversion and
 * one FMA scale the block's sum by D times x's block scale. MB's share (Q4_0, Q4_1, Q4_K)
 * is added through the block's exact float sum of x.
 */

#define DIRECT_AVX2 4

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 values of row i at column c as float32 (bfloat16 widened exactly), zero past k. */
static inline __m256 load8(const void *x, int64_t ldx, int x_bf16, int64_t i, int64_t c,
                           int64_t k) {
    if (c + 8 <= k) {
        if (x_bf16) {
            const __m128i h = _mm_loadu_si128((const __m128i *)((const bf16 *)x + i * ldx + c));
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        return _mm256_loadu_ps((const float *)x + i * ldx + c);
    }
    float buf[8];
    for (int64_t t = 0; t < 8; t++)
        buf[t] = c + t >= k ? 0.0f
                 : x_bf16   ? bf2f(((const bf16 *)x)[i * ldx + c + t])
                            : ((const float *)x)[i * ldx + c + t];
    return _mm256_loadu_ps(buf);
}

/* x as int16 blocks xq [m][32 nb] with scales sx [m][nb] and exact block sums xsum [m][nb]
 * (the same function as quant_avx512.c's quantize_x16). */
static void quantize_x16_avx2(const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
                              int64_t nb, int16_t *xq, float *sx, float *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            __m256 v[4];
            for (int t = 0; t < 4; t++) v[t] = load8(x, ldx, x_bf16, i, 32 * b + 8 * t, k);
            const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]),
                                                          _mm256_andnot_ps(sign, v[1])),
                                            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]),
                                                          _mm256_andnot_ps(sign, v[3])));
            /* NaN compares false in max: find it in a sum, which propagates it */
            const float sum = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]),
                                                  _mm256_add_ps(v[2], v[3])));
            if (xsum) xsum[i * nb + b] = sum;
            float inv;
            const float s = x16_scale(hmax8(mx), &inv);
            sx[i * nb + b] = sum == sum ? s : sum; /* max_ps drops a NaN; the sum keeps it */
            const __m256 sc = _mm256_set1_ps(inv);
            __m256i q[4];
            for (int t = 0; t < 4; t++) q[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], sc));
            /* packs works within 128-bit lanes: restore column order after it */
            const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
            const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
            _mm256_storeu_si256((__m256i *)(xq + i * 32 * nb + 32 * b), lo);
            _mm256_storeu_si256((__m256i *)(xq + i * 32 * nb + 32 * b + 16), hi);
        }
}

/* Block b's 32 integers as int16 (columns 0-15 in q[0], 16-31 in q[1]), its scale D and
 * offset MB. FMT is a constant where this is inlined; int8 columns past k read 0. */
static inline __attribute__((always_inline)) void qblock16_avx2(const int FMT, const uint8_t *row,
                                                                int64_t b, int64_t k,
                                                                __m256i q[2], float *D,
                                                                float *MB) {
    switch (FMT) {
    case HQ_INT8:
    case HQ_Q8_0: {
        uint8_t tail[32];
        const uint8_t *p = q8_block(FMT, row, b, k, tail, D);
        *MB = 0.0f;
        q[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
        q[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
        return;
    }
    case HQ_Q4_0:
    case HQ_Q4_1: {
        const __m128i m4 = _mm_set1_epi8(0x0F);
        const __m128i v = _mm_loadu_si128((const __m128i *)q4_block(FMT, row, b, D, MB));
        q[0] = _mm256_cvtepu8_epi16(_mm_and_si128(v, m4));
        q[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), m4));
        return;
    }
    default: { /* HQ_Q4_K: super-block b / 8, sub-block j = b % 8; D and MB are the
                  caller's (q4k_scales_avx2, once a super-block) */
        const uint8_t *r = row + 144 * (b / 8);
        const int j = (int)(b % 8);
        /* 32 bytes of nibbles hold sub-blocks 2c (low nibbles) and 2c + 1 (high) */
        const uint8_t *nib = r + 16 + 32 * (j / 2);
        const __m128i m4 = _mm_set1_epi8(0x0F);
        __m128i a = _mm_loadu_si128((const __m128i *)nib);
        __m128i c = _mm_loadu_si128((const __m128i *)(nib + 16));
        if (j & 1) {
            a = _mm_srli_epi16(a, 4);
            c = _mm_srli_epi16(c, 4);
        }
        q[0] = _mm256_cvtepu8_epi16(_mm_and_si128(a, m4));
        q[1] = _mm256_cvtepu8_epi16(_mm_and_si128(c, m4));
        return;
    }
    }
}

/* A Q4_K super-block's 8 sub-block scales D and offsets MB. */
static inline void q4k_scales_avx2(const uint8_t *r, float ds[8], float ms[8]) {
    const float d = h2f(r), dmin = h2f(r + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        q4k_scale_min(j, r + 4, &sc, &mn);
        ds[j] = d * (float)sc;
        ms[j] = -(dmin * (float)mn);
    }
}

/* One weight row against the MM rows of xq: per block, vpmaddwd dots the 32 integer
 * weights with each row's 32 int16; the sum is scaled by D times the row's block scale. */
static inline __attribute__((always_inline)) void direct_row_avx2(
    const int FMT, const int MM, int64_t k, int64_t nb, const int16_t *xq, const float *sx,
    const float *xsum, const uint8_t *row, int64_t i0, int64_t j, const float *scale,
    const float *bias, void *y, int y_bf16, int64_t n) {
    const int64_t kp = 32 * nb;
    const int offset = FMT == HQ_Q4_0 || FMT == HQ_Q4_1 || FMT == HQ_Q4_K;
    __m256 acc[MM];
    float off[MM];
    for (int r = 0; r < MM; r++) {
        acc[r] = _mm256_setzero_ps();
        off[r] = 0.0f;
    }
    float ds[8], ms[8]; /* Q4_K: the current super-block's sub-block scales and offsets */
    for (int64_t b = 0; b < nb; b++) {
        __m256i q[2];
        float D = 0.0f, MB = 0.0f;
        if (FMT == HQ_Q4_K && b % 8 == 0) q4k_scales_avx2(row + 144 * (b / 8), ds, ms);
        qblock16_avx2(FMT, row, b, k, q, &D, &MB);
        if (FMT == HQ_Q4_K) {
            D = ds[b % 8];
            MB = ms[b % 8];
        }
        for (int r = 0; r < MM; r++) {
            const int16_t *xr = xq + r * kp + 32 * b;
            const __m256i dot = _mm256_add_epi32(
                _mm256_madd_epi16(q[0], _mm256_loadu_si256((const __m256i *)xr)),
                _mm256_madd_epi16(q[1], _mm256_loadu_si256((const __m256i *)(xr + 16))));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(D * sx[r * nb + b]),
                                     acc[r]);
            if (offset) off[r] += MB * xsum[r * nb + b];
        }
    }
    for (int r = 0; r < MM; r++)
        put(y, y_bf16, (i0 + r) * n + j, finish(hsum8(acc[r]) + off[r], scale, bias, j));
}

/* The streaming path for m <= DIRECT_AVX2 rows; returns -1 when memory runs out. (More rows
 * take linear_tiled: its float32 panels beat re-streaming runs of 4 rows for the row
 * layouts, measured on SmolLM2's shapes; interleaved weights stream at every m.) */
static int direct_avx2(int fmt, const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
                       const uint8_t *w, int64_t n, int64_t rb, const float *scale,
                       const float *bias, void *y, int y_bf16) {
    const int64_t nb = (k + 31) / 32;
    int16_t *xq = malloc((size_t)(m * 32 * nb) * sizeof(int16_t));
    float *sx = malloc((size_t)(2 * m * nb + 1) * sizeof(float));
    if (!xq || !sx) {
        free(xq);
        free(sx);
        return -1;
    }
    float *xsum = sx + m * nb;
    quantize_x16_avx2(x, ldx, x_bf16, m, k, nb, xq, sx, xsum);
    const int par = n * rb * m >= PAR_WORK;
#define DIRECT_AVX2_CASE(FMT, MM)                                                            \
    case (FMT) * 8 + (MM): {                                                                 \
        _Pragma("omp parallel for schedule(static) if (par)")                               \
        for (int64_t j = 0; j < n; j++)                                                      \
            direct_row_avx2(FMT, MM, k, nb, xq, sx, xsum, w + j * rb, 0, j, scale, bias, y,  \
                            y_bf16, n);                                                      \
        break;                                                                               \
    }
#define DIRECT_AVX2_FMT(FMT)                                                                 \
    DIRECT_AVX2_CASE(FMT, 1) DIRECT_AVX2_CASE(FMT, 2) DIRECT_AVX2_CASE(FMT, 3)               \
    DIRECT_AVX2_CASE(FMT, 4)
    switch (fmt * 8 + (int)m) {
        DIRECT_AVX2_FMT(HQ_INT8) DIRECT_AVX2_FMT(HQ_Q8_0) DIRECT_AVX2_FMT(HQ_Q4_0)
        DIRECT_AVX2_FMT(HQ_Q4_1) DIRECT_AVX2_FMT(HQ_Q4_K)
    }
#undef DIRECT_AVX2_FMT
#undef DIRECT_AVX2_CASE
    free(xq);
    free(sx);
    return 0;
}
