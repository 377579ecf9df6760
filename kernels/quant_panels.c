/* quant_panels.c: the vdpbf16ps panel path (AVX-512 without AMX)
 * and linear512, the row layout's entry.
 * Included by quant_ops.c inside #ifdef HQ_AVX512BF16 (one translation unit, one build). */

/* The vdpbf16ps panel path (no AMX) */
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
    if (m <= DIRECT512) return stream512(fmt, x, ldx, x_bf16, m, k, w, n, rb, scale, bias, y, y_bf16);
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
        prepare_x(x, ldx, x_bf16, m, k, nb, m, xb, xsum);
        rc = tiled512(fmt, m, mm, k, nb, xb, xsum, w, n, rb, scale, bias, y, y_bf16);
    }
    free(xb);
    free(xsum);
    return rc;
}
