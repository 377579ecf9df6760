/* quant_interleaved.c: interleaved weights (quant_interleave.py): the
 * streaming and AMX paths.
 * Included by quant_ops.c inside #ifdef HQ_AVX512 (one translation unit, one build). */


/*
 * Interleaved weights (quant_interleave.py): group g of 16 output features, block b at
 * w + (g * nb + b) * 16 * BS: the 16 fp16 scales d (Q4_1: then the 16 m), then a column
 * pair p at a time the 16 features' integers (Q4: one byte a feature, column 2 p in the
 * low nibble; Q8_0: two int8 a feature).
 */
#define IQ_BS(FMT) ((FMT) == HQ_IQ8_0 ? 34 : (FMT) == HQ_IQ4_0 ? 18 : 20)
/* AMX: up to SPLIT_ROWS rows, each block's integer products scaled (iamx); more, the split
 * weights accumulated in tiles (iamx_split), which pay their splitting once for all rows;
 * AMX_ROWS rows a call at most, so that x stays in cache while every group reads it. */
#define SPLIT_ROWS 96
#define AMX_ROWS 256
#define AMX_MIN_ROWS 8 /* more rows: AMX where the CPU has it (streaming is faster up to here) */
#define IDIRECT 8 /* rows a pass of the streaming path on interleaved weights */
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
        _mm256_mask_storeu_epi16((bf16 *)y + i * n + j0, keep, bf16x16(v));
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
    case (FMT) * 16 + (MM): {                                                                \
        _Pragma("omp parallel for schedule(static) if (par)")                               \
        for (int64_t g = 0; g < groups; g++)                                                 \
            igroup(FMT, MM, nb, xq, sx, xsum, w + g * gb, 16 * g, n, bias, y, y_bf16);       \
        break;                                                                               \
    }
#define IDIRECT_FMT(FMT)                                                                     \
    IDIRECT_CASE(FMT, 1) IDIRECT_CASE(FMT, 2) IDIRECT_CASE(FMT, 3) IDIRECT_CASE(FMT, 4)      \
    IDIRECT_CASE(FMT, 5) IDIRECT_CASE(FMT, 6) IDIRECT_CASE(FMT, 7) IDIRECT_CASE(FMT, 8)
    switch (fmt * 16 + (int)m) { IDIRECT_FMT(HQ_IQ8_0) IDIRECT_FMT(HQ_IQ4_0) IDIRECT_FMT(HQ_IQ4_1) }
#undef IDIRECT_FMT
#undef IDIRECT_CASE
}

#ifdef HQ_AMX
/*
 * The AMX path on interleaved weights. The weights' integers are exact in bfloat16, and so
 * are bfloat16 activations, so the tiles multiply them as they are: per group of 16
 * features, each block's integers become a B tile (VNNI order is the interleaved order: a
 * column pair per feature), x's rows of the block an A tile (float32 x: its hi, then lo
 * rows, into the same result), and one instruction gives the block's 16 x 16 integer dot
 * products exactly in float32. Those are scaled by the block's D per feature in registers
 * (and its offset added through x's block sums): one tile product a block, no dequantized
 * weights, x @ W.T to float32 rounding. Tiles: 0-1 results (blocks alternate, so one
 * block's product runs while the last one's is scaled), 2-3 x, 4-5 weights.
 */

/* Group-block blk's integers as a B tile t ([16 pairs][16 features][2] bf16), its scales
 * d[16] and offsets mb[16] (Q4_0: -8 d; Q8_0: 0). */
static inline __attribute__((always_inline)) void iq_tile(const int FMT, const uint8_t *blk,
                                                          __m512i table, bf16 *t, float *d,
                                                          float *mb) {
    __m512 vd, vm;
    iq_head(FMT, blk, &vd, &vm);
    _mm512_storeu_ps(d, vd);
    _mm512_storeu_ps(mb, vm);
    const uint8_t *qs = blk + IQ_HEAD(FMT);
    for (int p = 0; p < 16; p++) {
        const __m512i q = iq_pair(FMT, qs, p); /* int16 pairs (even column, odd column) */
        __m512i b;
        if (FMT == HQ_IQ8_0) {
            /* int16 -> float32 -> its top half: exact for |q| <= 256 */
            const __m512 e = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(q, 16), 16));
            const __m512 o = _mm512_cvtepi32_ps(_mm512_srai_epi32(q, 16));
            b = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(e), 16),
                                _mm512_and_si512(_mm512_castps_si512(o),
                                                 _mm512_set1_epi32((int)0xFFFF0000u)));
        } else {
            b = nib_words_bf16(q, table);
        }
        _mm512_storeu_si512(t + 32 * p, b);
    }
}

/* One block's product into tile T (its weights in tile WT): x's rows (hi, then lo for
 * float32 x) times the block's B tile. */
#define IAMX_PRODUCT(T, WT, C)                                                               \
    do {                                                                                     \
        _tile_zero(T);                                                                       \
        _tile_loadd(2, xa + r0 * kp + 32 * (C), as);                                         \
        _tile_loadd(WT, wt + (C) * 512, 64);                                                 \
        _tile_dpbf16ps(T, 2, WT);                                                            \
        if (x_lo) {                                                                          \
            _tile_loadd(3, xa + (rows + r0) * kp + 32 * (C), as);                            \
            _tile_dpbf16ps(T, 3, WT);                                                        \
        }                                                                                    \
    } while (0)

/* acc[r] += product(r) * D (+ MB * row r's block sum), from the stored tile cb. */
static inline __attribute__((always_inline)) void iamx_scale(const int OFFSETS, __m512 acc[16],
                                                             const float *cb, const float *d,
                                                             const float *mb, const float *xs,
                                                             int64_t nb) {
    const __m512 vd = _mm512_loadu_ps(d), vm = _mm512_loadu_ps(mb);
    for (int r = 0; r < 16; r++) {
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(cb + 16 * r), vd, acc[r]);
        if (OFFSETS) acc[r] = _mm512_fmadd_ps(vm, _mm512_set1_ps(xs[r * nb]), acc[r]);
    }
}

/* The groups of one format; returns -1 when a thread's buffer cannot be allocated. */
static inline __attribute__((always_inline)) int iamx_fmt(
    const int FMT, int64_t m, int64_t nb, const bf16 *xa, int x_lo, const float *xsum,
    const uint8_t *w, int64_t n, const float *bias, void *y, int y_bf16) {
    const int OFFSETS = FMT != HQ_IQ8_0;
    const int64_t kp = 32 * nb, rows = (m + 15) / 16 * 16, groups = (n + 15) / 16;
    const int64_t gb = nb * 16 * IQ_BS(FMT), as = kp * (int64_t)sizeof(bf16);
    int failed = 0;
#pragma omp parallel if (groups * gb * m >= PAR_WORK && groups > 1)
    {
        /* a group's B tiles, scales and offsets; two tiles' results */
        const size_t tiles = (size_t)nb * 512 * sizeof(bf16);
        const size_t heads = (size_t)nb * 16 * sizeof(float);
        char *mem = amx_thread_start(tiles + 2 * heads + 2 * 256 * sizeof(float), &failed);
        const __m512i table = _mm512_loadu_si512(NIB_BF16);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (!mem) continue;
            bf16 *wt = (bf16 *)mem;
            float *ds = (float *)(mem + tiles), *ms = ds + nb * 16, *cb = ms + nb * 16;
            for (int64_t b = 0; b < nb; b++)
                iq_tile(FMT, w + g * gb + b * 16 * IQ_BS(FMT), table, wt + b * 512, ds + 16 * b,
                        ms + 16 * b);
            for (int64_t r0 = 0; r0 < rows; r0 += 16) {
                __m512 acc[16];
                for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                const float *xs = xsum + r0 * nb; /* rows past m read their zero sums */
                IAMX_PRODUCT(0, 4, 0);
                for (int64_t c = 0; c < nb; c += 2) {
                    if (c + 1 < nb) IAMX_PRODUCT(1, 5, c + 1);
                    _tile_stored(0, cb, 64);
                    iamx_scale(OFFSETS, acc, cb, ds + 16 * c, ms + 16 * c, xs + c, nb);
                    if (c + 1 >= nb) break;
                    if (c + 2 < nb) IAMX_PRODUCT(0, 4, c + 2);
                    _tile_stored(1, cb + 256, 64);
                    iamx_scale(OFFSETS, acc, cb + 256, ds + 16 * (c + 1), ms + 16 * (c + 1),
                               xs + c + 1, nb);
                }
                for (int64_t r = 0; r < 16 && r0 + r < m; r++)
                    put16(acc[r], r0 + r, 16 * g, n, bias, y, y_bf16);
            }
        }
        if (mem) _tile_release();
        free(mem);
    }
    return failed ? -1 : 0;
}

/*
 * The AMX path on interleaved weights past SPLIT_ROWS rows: here the weights are the B
 * tiles (VNNI order is the interleaved order: a column pair per feature) and x the A tiles
 * (rows of 32 columns). Per group and block, the 16 features' w = q * d + m (float32) are
 * split into bf16 hi + lo pairs, [16 pairs][16 features][2] each, and multiplied with x's
 * hi (and lo) rows: C [16 rows][16 features]. Tiles: 0-3 results (row group 2 a + feature
 * group b'), 4-5 x, 6-7 weights.
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

static int iamx_split(int fmt, int64_t m, int64_t k, int64_t nb, const float *xf, int x_lo,
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

static int iamx(int fmt, const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
                int64_t nb, const uint8_t *w, int64_t n, const float *bias, void *y, int y_bf16) {
    const int64_t kp = 32 * nb, rows = (m + 15) / 16 * 16, parts = x_bf16 ? 1 : 2;
    /* x's rows (hi, then lo rows from `rows` on), zero up to a multiple of 16; block sums */
    bf16 *xa = aligned_alloc(64, (size_t)(parts * rows * kp) * sizeof(bf16) + 64);
    float *xsum = calloc((size_t)(rows * nb), sizeof(float));
    int rc = -1;
    if (xa && xsum) {
        memset(xa, 0, (size_t)(parts * rows * kp) * sizeof(bf16));
        prepare_x(x, ldx, x_bf16, m, k, nb, rows, xa, xsum);
        const int lo = !x_bf16;
        switch (fmt) {
        case HQ_IQ8_0: rc = iamx_fmt(HQ_IQ8_0, m, nb, xa, lo, xsum, w, n, bias, y, y_bf16); break;
        case HQ_IQ4_0: rc = iamx_fmt(HQ_IQ4_0, m, nb, xa, lo, xsum, w, n, bias, y, y_bf16); break;
        default: rc = iamx_fmt(HQ_IQ4_1, m, nb, xa, lo, xsum, w, n, bias, y, y_bf16); break;
        }
    }
    free(xa);
    free(xsum);
    return rc;
}
#endif

/* hq_linear for interleaved weights (AVX-512 builds only). */
static int ilinear(int fmt, const void *x, int64_t ldx, int x_bf16, int64_t m, int64_t k,
                   const uint8_t *w, int64_t n, const float *bias, void *y, int y_bf16) {
    const int64_t nb = k / 32, kp = 32 * nb;
#ifdef HQ_AMX
    if (m > AMX_MIN_ROWS && amx_ready()) {
        /* AMX_ROWS rows at a time: a chunk's x stays in cache across the weights' groups */
        const size_t out = y_bf16 ? sizeof(bf16) : sizeof(float);
        const size_t in = x_bf16 ? sizeof(bf16) : sizeof(float);
        float *xf = NULL;
        for (int64_t i0 = 0; i0 < m; i0 += AMX_ROWS) {
            const int64_t rows = m - i0 < AMX_ROWS ? m - i0 : AMX_ROWS;
            const void *xi = (const char *)x + (size_t)(i0 * ldx) * in;
            void *yi = (char *)y + (size_t)(i0 * n) * out;
            int rc;
            if (rows > SPLIT_ROWS) { /* (the last chunk may be short: then it scales) */
                if (!xf) xf = aligned_alloc(64, (size_t)(AMX_ROWS * kp) * sizeof(float) + 64);
                if (!xf) return -1;
                widen_x(xi, ldx, x_bf16, rows, k, nb, xf, NULL);
                rc = iamx_split(fmt, rows, k, nb, xf, !x_bf16, w, n, bias, yi, y_bf16);
            } else {
                rc = iamx(fmt, xi, ldx, x_bf16, rows, k, nb, w, n, bias, yi, y_bf16);
            }
            if (rc) {
                free(xf);
                return rc;
            }
        }
        free(xf);
        return 0;
    }
#endif
    /* the streaming path, IDIRECT rows a pass */
    const int64_t mc = m < IDIRECT ? m : IDIRECT;
    int16_t *xq = aligned_alloc(64, (size_t)(mc * kp) * sizeof(int16_t) + 64);
    float *sx = malloc((size_t)(2 * mc * nb) * sizeof(float) + 4);
    int rc = -1;
    if (xq && sx) {
        const size_t out = y_bf16 ? sizeof(bf16) : sizeof(float);
        for (int64_t i0 = 0; i0 < m; i0 += IDIRECT) {
            const int64_t rows = m - i0 < IDIRECT ? m - i0 : IDIRECT;
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
