/* quant_interleaved_avx2.c: interleaved weights (quant_interleave.py) on AVX2 CPUs.
 * Included by quant_ops.c after quant_avx2.c (AVX2 builds without AVX-512).
 *
 * Group g of 16 output features, block b at w + (g * nb + b) * 16 * BS: the 16 fp16 scales
 * d (Q4_1: then the 16 m), then a column pair p at a time the 16 features' integers (Q4: one
 * byte a feature, column 2 p in the low nibble; Q8_0: two int8 a feature). Row by row, a
 * block of 32 weights costs its own scale conversion and bookkeeping, about half of the
 * streaming loop's instructions on AVX2; here one conversion serves 16 features' blocks and
 * every vpmaddwd 8 outputs, so a decode step keeps up with the memory bus.
 *
 * x is carried as int16 blocks (quantize_x16_avx2); a column pair of 8 features widens
 * into one int16 vector, multiplied with the pair of x broadcast.
 */

#define IQ2_BS(FMT) ((FMT) == HQ_IQ8_0 ? 34 : (FMT) == HQ_IQ4_0 ? 18 : 20)
#define IQ2_HEAD(FMT) ((FMT) == HQ_IQ4_1 ? 64 : 32)
#ifndef IQ2_PREFETCH
#define IQ2_PREFETCH 2048 /* bytes ahead in the weight stream */
#endif

/* Column pair p of a block for features 0-7 (w[0]) and 8-15 (w[1]): dword lane f holds
 * the int16 pair (q[f][2 p], q[f][2 p + 1]). */
static inline __attribute__((always_inline)) void iq2_pair(const int FMT, const uint8_t *qs,
                                                           int p, __m256i w[2]) {
    if (FMT == HQ_IQ8_0) {
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * p)));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * p + 16)));
        return;
    }
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128((const __m128i *)(qs + 16 * p));
    const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    w[0] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(lo, hi));
    w[1] = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(lo, hi));
}

/* The block's scales d and offsets mb of features 0-7 ([0]) and 8-15 ([1]). */
static inline __attribute__((always_inline)) void iq2_head(const int FMT, const uint8_t *blk,
                                                           __m256 d[2], __m256 mb[2]) {
    for (int h = 0; h < 2; h++) {
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
        mb[h] = FMT == HQ_IQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)))
              : FMT == HQ_IQ4_0 ? _mm256_mul_ps(d[h], _mm256_set1_ps(-8.0f))
                                : _mm256_setzero_ps();
    }
}

/* Outputs j0 .. j0 + 16 (those below n) of row i from v[0], v[1]. */
static inline void iq2_put(const __m256 v[2], int64_t i, int64_t j0, int64_t n,
                           const float *bias, void *y, int y_bf16) {
    float out[16];
    _mm256_storeu_ps(out, v[0]);
    _mm256_storeu_ps(out + 8, v[1]);
    for (int f = 0; f < 16 && j0 + f < n; f++)
        put(y, y_bf16, i * n + j0 + f, finish(out[f], NULL, bias, j0 + f));
}

/* One group of 16 features against MM rows of xq (output rows i0 ..). */
static inline __attribute__((always_inline)) void igroup_avx2(
    const int FMT, const int MM, int64_t nb, const int16_t *xq, const float *sx,
    const float *xsum, const uint8_t *grp, int64_t i0, int64_t j0, int64_t n, const float *bias,
    void *y, int y_bf16) {
    const int64_t kp = 32 * nb;
    __m256 acc[MM][2];
    for (int r = 0; r < MM; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * 16 * IQ2_BS(FMT);
        const uint8_t *qs = blk + IQ2_HEAD(FMT);
        /* the groups follow each other: this runs ahead through the matrix */
        for (int c = 0; c < 16 * IQ2_BS(FMT); c += 64)
            _mm_prefetch((const char *)blk + IQ2_PREFETCH + c, _MM_HINT_T0);
        __m256i dot[MM][2];
        for (int r = 0; r < MM; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
        for (int p = 0; p < 16; p++) {
            __m256i w[2];
            iq2_pair(FMT, qs, p, w);
            for (int r = 0; r < MM; r++) {
                int32_t pair;
                memcpy(&pair, xq + r * kp + 32 * b + 2 * p, sizeof pair);
                const __m256i xp = _mm256_set1_epi32(pair);
                dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(w[0], xp));
                dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(w[1], xp));
            }
        }
        __m256 d[2], mb[2];
        iq2_head(FMT, blk, d, mb);
        for (int r = 0; r < MM; r++)
            for (int h = 0; h < 2; h++) {
                const __m256 s = _mm256_mul_ps(d[h], _mm256_set1_ps(sx[r * nb + b]));
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), s, acc[r][h]);
                if (FMT != HQ_IQ8_0)
                    acc[r][h] = _mm256_fmadd_ps(mb[h], _mm256_set1_ps(xsum[r * nb + b]), acc[r][h]);
            }
    }
    for (int r = 0; r < MM; r++) iq2_put(acc[r], i0 + r, j0, n, bias, y, y_bf16);
}

static void idirect_avx2(int fmt, int64_t m, int64_t nb, const int16_t *xq, const float *sx,
                         const float *xsum, const uint8_t *w, int64_t n, const float *bias,
                         void *y, int y_bf16) {
    const int64_t groups = (n + 15) / 16, gb = nb * 16 * IQ2_BS(fmt), kp = 32 * nb;
    const int par = groups * gb * m >= PAR_WORK && groups > 1;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t i0 = 0; i0 < m; i0 += DIRECT_AVX2) {
            const int mm = m - i0 < DIRECT_AVX2 ? (int)(m - i0) : DIRECT_AVX2;
            const int16_t *xr = xq + i0 * kp;
            const float *sr = sx + i0 * nb, *ssum = xsum + i0 * nb;
            const uint8_t *grp = w + g * gb;
#define IDIRECT2_CASE(FMT, MM)                                                               \
    case (FMT) * 8 + (MM):                                                                   \
        igroup_avx2(FMT, MM, nb, xr, sr, ssum, grp, i0, 16 * g, n, bias, y, y_bf16);         \
        break;
#define IDIRECT2_FMT(FMT)                                                                    \
    IDIRECT2_CASE(FMT, 1) IDIRECT2_CASE(FMT, 2) IDIRECT2_CASE(FMT, 3) IDIRECT2_CASE(FMT, 4)
            switch (fmt * 8 + mm) { IDIRECT2_FMT(HQ_IQ8_0) IDIRECT2_FMT(HQ_IQ4_0) IDIRECT2_FMT(HQ_IQ4_1) }
#undef IDIRECT2_FMT
#undef IDIRECT2_CASE
        }
}

/* Interleaved weights on AVX2: y [m, n] = x [m, k] @ W.T (+ bias); -1 when memory runs out.
 * Every row count streams: a group's blocks (10 KB at k = 576) stay in L1 while each run of
 * DIRECT_AVX2 rows passes over them, and vpmaddwd's 16 products an instruction outrun
 * float32 FMAs on a dequantized panel at any m measured here. */
static int ilinear_avx2(int fmt, const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
                        const uint8_t *w, int64_t n, const float *bias, void *y, int y_bf16) {
    const int64_t nb = k / 32;
    int16_t *xq = malloc((size_t)(m * k) * sizeof(int16_t));
    float *sx = malloc((size_t)(2 * m * nb + 1) * sizeof(float));
    if (!xq || !sx) {
        free(xq);
        free(sx);
        return -1;
    }
    quantize_x16_avx2(x, ldx, x_bf16, m, k, nb, xq, sx, sx + m * nb);
    idirect_avx2(fmt, m, nb, xq, sx, sx + m * nb, w, n, bias, y, y_bf16);
    free(xq);
    free(sx);
    return 0;
}
