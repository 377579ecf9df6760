/* cpu_program.c: replays a recorded list of kernel calls (cpu_program.py), the CPU's
 * counterpart of a CUDA graph. Included at the end of cpu_ops.c (one library, one build).
 *
 * A decode step of a small model is ~300 kernel calls, each a few microseconds of work
 * behind tens of microseconds of Python (argument checks, ctypes, allocation). Recorded
 * once per batch size over static buffers, the same calls run here back to back with the
 * GIL released: the step costs its kernels and nothing else.
 *
 * Every recorded function takes only 64-bit integers or pointers, then at most two float
 * arguments, in that order (cpu_program.py refuses anything else), and is called through a
 * pointer of exactly that shape: a function of k integer arguments and f trailing floats.
 * Arguments the C side declares `int` are passed as 64-bit values, which the x86-64 System
 * V and AArch64 procedure-call standards (the only targets recording runs on) pass in the
 * same register or stack slot and read the low half of. A function's int result (its
 * error code) is read from the low 32 bits of the 64-bit return register likewise.
 */

#define HP_PROGRAM_INTS 20
#define HP_PROGRAM_FLOATS 2

typedef struct {
    void *fn;
    int64_t n_int;   /* integer and pointer arguments, first */
    int64_t n_float; /* float arguments, after them */
    int64_t check;   /* 1: the function returns an int that is an error when not 0 */
    int64_t a[HP_PROGRAM_INTS];
    float f[HP_PROGRAM_FLOATS];
} hp_op;

typedef int64_t I;
#define A(i) op->a[i]
#define ARGS1 A(0)
#define ARGS2 ARGS1, A(1)
#define ARGS3 ARGS2, A(2)
#define ARGS4 ARGS3, A(3)
#define ARGS5 ARGS4, A(4)
#define ARGS6 ARGS5, A(5)
#define ARGS7 ARGS6, A(6)
#define ARGS8 ARGS7, A(7)
#define ARGS9 ARGS8, A(8)
#define ARGS10 ARGS9, A(9)
#define ARGS11 ARGS10, A(10)
#define ARGS12 ARGS11, A(11)
#define ARGS13 ARGS12, A(12)
#define ARGS14 ARGS13, A(13)
#define ARGS15 ARGS14, A(14)
#define ARGS16 ARGS15, A(15)
#define ARGS17 ARGS16, A(16)
#define ARGS18 ARGS17, A(17)
#define ARGS19 ARGS18, A(18)
#define ARGS20 ARGS19, A(19)
#define T1 I
#define T2 T1, I
#define T3 T2, I
#define T4 T3, I
#define T5 T4, I
#define T6 T5, I
#define T7 T6, I
#define T8 T7, I
#define T9 T8, I
#define T10 T9, I
#define T11 T10, I
#define T12 T11, I
#define T13 T12, I
#define T14 T13, I
#define T15 T14, I
#define T16 T15, I
#define T17 T16, I
#define T18 T17, I
#define T19 T18, I
#define T20 T19, I
/* k >= 1 integers, then none, one or two floats */
#define HP_CALLS(K)                                                                          \
    case K * 4 + 0: return ((I(*)(T##K))op->fn)(ARGS##K);                                   \
    case K * 4 + 1: return ((I(*)(T##K, float))op->fn)(ARGS##K, op->f[0]);                  \
    case K * 4 + 2: return ((I(*)(T##K, float, float))op->fn)(ARGS##K, op->f[0], op->f[1]);

static int64_t hp_call(const hp_op *op) {
    switch (op->n_int * 4 + op->n_float) {
    case 0: return ((I(*)(void))op->fn)();
    case 1: return ((I(*)(float))op->fn)(op->f[0]);
    case 2: return ((I(*)(float, float))op->fn)(op->f[0], op->f[1]);
        HP_CALLS(1) HP_CALLS(2) HP_CALLS(3) HP_CALLS(4) HP_CALLS(5) HP_CALLS(6) HP_CALLS(7)
        HP_CALLS(8) HP_CALLS(9) HP_CALLS(10) HP_CALLS(11) HP_CALLS(12) HP_CALLS(13)
        HP_CALLS(14) HP_CALLS(15) HP_CALLS(16) HP_CALLS(17) HP_CALLS(18) HP_CALLS(19)
        HP_CALLS(20)
    }
    return 0; /* unreachable: the recorder checks the counts */
}

/* Runs ops[0 .. n) in order; returns -1, or the index of the first op whose error code was
 * not 0 (the ops after it are not run) with its code in *code. */
int64_t hp_run_program(const hp_op *ops, int64_t n, int64_t *code) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t rc = hp_call(&ops[i]);
        if (ops[i].check && (int32_t)rc != 0) {
            *code = (int32_t)rc;
            return i;
        }
    }
    return -1;
}

/* sizeof(hp_op), for cpu_program.py to check its ctypes layout against. */
int64_t hp_op_size(void) { return (int64_t)sizeof(hp_op); }
