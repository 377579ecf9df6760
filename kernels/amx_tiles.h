/*
 * AMX tiles, shared by cpu_ops.c (bf16 linears) and quant_ops.c (quantized linears): Linux
 * lends a process the tile state only on request, and each thread loads its own tile
 * configuration before its first tile instruction (else it dies of SIGILL).
 * Include inside #if defined(__AMX_TILE__) && defined(__AMX_BF16__).
 */
#ifndef HOTPOOL_AMX_TILES_H
#define HOTPOOL_AMX_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out AMX's tile state only on request (once per process). */
static inline int amx_ready(void) {
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

/* All eight tiles 16 rows x 64 bytes: a float32 result of 16 x 16, or 16 rows of 32 bf16
 * (a VNNI weight tile: 16 column pairs x 16 features x 2); each path assigns their roles. */
static inline void amx_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

#endif
