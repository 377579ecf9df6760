/* quant_amx.c: AMX tiles: the process's permission, tile
 * configuration, the row layout's panel path.
 * Included by quant_ops.c inside #ifdef HQ_AVX512 (one translation unit, one build). */

#if defined(HQ_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HQ_AMX 1
#include "amx_tiles.h"
#define AMX_F 32 /* features per AMX panel: two A tiles of 16 */

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
