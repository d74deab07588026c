/* The EOS recurrence on a CPU with vector e and s and a K x D decay given as a product,
 * o_t = exp(a_t * b) (Mamba's Delta_t A, a of one row; a full log decay as a of K rows times ones),
 * fused into one pass per step. See native_scan.py.
 *
 *   h_t = exp(a_t[k|., d] b[k, d]) h_{t-1}[k, d] + e_t[k] x_t[d],   y_t[d] = sum_k s_t[k] h_t[k, d]
 *
 * One work item is one (batch, head, block of DB columns d); its memory h [K, DB] stays in cache
 * for the whole sequence. The forward keeps h at each chunk start (every C steps); the backward
 * recomputes a chunk from there and runs the adjoint recurrence over it in reverse.
 *
 * The kernel body is written once for float and double: scan.c includes this file once per type,
 * with REAL, SUFFIX, EXP_POLY and the type's constants defined. */

#include <stdint.h>
#include <string.h>
#ifndef THREAD_NUM
#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM omp_get_thread_num()
#define THREAD_COUNT omp_get_num_threads()
#else
#define THREAD_NUM 0
#define THREAD_COUNT 1
#endif
#endif

#ifndef REAL
#error "compile scan.c, which defines REAL and includes this file"
#endif

/* The bytes of one of the machine's vector registers, the width the kernels' explicit vectors take
 * (cauchy.h, chunk.h): a wider vector is split into several registers, and a kernel that keeps
 * many of them live spills (4-8x slower on an AVX2 machine with AVX-512's 64 bytes). */
#ifndef LCSM_VEC_BYTES
#if defined(__AVX512F__)
#define LCSM_VEC_BYTES 64
#elif defined(__AVX__)
#define LCSM_VEC_BYTES 32
#else
#define LCSM_VEC_BYTES 16
#endif
#endif

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUFFIX)

/* exp(x) without libm, so that the compiler can vectorise the step loops: x = n ln 2 + r with
 * |r| <= ln 2 / 2, exp(r) by its Taylor polynomial (truncation below the type's rounding: r^8/8!
 * < 6e-9 for float, r^14/14! < 5e-18 for double), times 2^n built in the exponent bits. Below
 * the smallest normal number's log the result is 0 (a subnormal decay would be flushed anyway). */
static inline REAL FN(exp_)(REAL x) {
    const REAL log2e = (REAL)1.4426950408889634074;
    const REAL ln2_hi = (REAL)LN2_HI, ln2_lo = (REAL)LN2_LO;
    REAL z = x < (REAL)EXP_MAX ? x : (REAL)EXP_MAX;
    REAL zz = z > (REAL)EXP_MIN ? z : (REAL)EXP_MIN;
    REAL n = (zz * log2e + (REAL)ROUND_MAGIC) - (REAL)ROUND_MAGIC;
    REAL r = (zz - n * ln2_hi) - n * ln2_lo;
    REAL p = EXP_POLY(r, r * r);
    union { UINT bits; REAL value; } scale = {((UINT)((INT)n + EXP_BIAS)) << MANT_BITS};
    REAL out = p * scale.value;
    return x < (REAL)EXP_MIN ? (REAL)0 : out;
}

/* the logistic function, for the SiLU gates of the layers' kernels (readout.h, conv.h, rmsnorm.h):
 * silu(x) = x sigmoid(x), silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x))) */
static inline REAL FN(sigmoid_)(REAL x) { return 1 / (1 + FN(exp_)(-x)); }

#ifndef SCAN_LAYOUT
#define SCAN_LAYOUT
/* Strides (in elements) of the inputs, in this order: i, e, s each (batch, head, time); a (batch,
 * head, time, row k: 0 for Mamba's [.., T, 1, D]); b (head, row k). Every last dimension has stride 1. */
enum { I_B, I_H, I_T, E_B, E_H, E_T, S_B, S_H, S_T, A_B, A_H, A_T, A_K, B_H, B_K, N_STRIDES };
/* Sizes: batch, heads, steps, K, D, chunk length, columns per item, documents per batch row, rows
 * of a (1 or K; da has as many). */
enum { N_B, N_H, N_T, N_K, N_D, N_C, N_DB, N_DOCS, N_KA, N_SIZES };
/* Work item `item`'s place, as locals: batch bb and head hh (bh = bb H + hh), column block blk
 * (columns d0 .. d0 + w), and the inputs' rows there (xb, eb, sb, ab; bk0 b's row 0). */
#define ITEM_PLACE(item)                                                                               \
    const int64_t bh = (item) / blocks, bb = bh / H, hh = bh % H, blk = (item) % blocks, d0 = blk * DB; \
    const int64_t w = D - d0 < DB ? D - d0 : DB;                                                       \
    const REAL *xb = x + bb * stride[I_B] + hh * stride[I_H] + d0;                                     \
    const REAL *eb = e + bb * stride[E_B] + hh * stride[E_H];                                          \
    const REAL *sb = s + bb * stride[S_B] + hh * stride[S_H];                                          \
    const REAL *ab = a + bb * stride[A_B] + hh * stride[A_H] + d0;                                     \
    const REAL *bk0 = b + hh * stride[B_H] + d0
#endif

/* Documents: every batch row holds ``docs`` of them, steps bounds[n] <= t < bounds[n + 1] (one,
 * [0, T], unless sequences are packed); each starts from its own initial state m0[(b docs + n) H + h]
 * (or zeros) and ends in its own final state, at the same index. */

static void FN(scan_forward_)(const REAL *x, const REAL *e, const REAL *s, const REAL *a, const REAL *b,
                              const REAL *m0, REAL *y, REAL *m_T, REAL *starts, const int64_t *bounds,
                              const int64_t *stride, const int64_t *size, int64_t item0, int64_t item1, REAL *h) {
    const int64_t H = size[N_H], T = size[N_T], K = size[N_K], D = size[N_D], docs = size[N_DOCS];
    const int64_t C = size[N_C], DB = size[N_DB], blocks = (D + DB - 1) / DB, chunks = (T + C - 1) / C;
    for (int64_t item = item0; item < item1; item++) {
        ITEM_PLACE(item);
        REAL *yb = y + bh * T * D + d0;
        for (int64_t n = 0; n < docs; n++) {
            const int64_t state = (bb * docs + n) * H + hh;
            for (int64_t k = 0; k < K; k++)
                for (int64_t d = 0; d < w; d++) h[k * DB + d] = m0 ? m0[(state * K + k) * D + d0 + d] : (REAL)0;
            for (int64_t t = bounds[n]; t < bounds[n + 1]; t++) {
                if (t % C == 0)
                    for (int64_t k = 0; k < K; k++)
                        memcpy(starts + ((bh * chunks + t / C) * K + k) * D + d0, h + k * DB, w * sizeof(REAL));
                const REAL *xt = xb + t * stride[I_T], *at = ab + t * stride[A_T];
                const REAL *et = eb + t * stride[E_T], *st = sb + t * stride[S_T];
                REAL *yt = yb + t * D;
                for (int64_t d = 0; d < w; d++) yt[d] = 0;
                for (int64_t k = 0; k < K; k++) {
                    const REAL ek = et[k], sk = st[k], *bk = bk0 + k * stride[B_K], *atk = at + k * stride[A_K];
                    REAL *hk = h + k * DB;
#pragma omp simd
                    for (int64_t d = 0; d < w; d++) {
                        REAL v = FN(exp_)(atk[d] * bk[d]) * hk[d] + ek * xt[d];
                        hk[d] = v;
                        yt[d] += sk * v;
                    }
                }
            }
            if (m_T)
                for (int64_t k = 0; k < K; k++) memcpy(m_T + (state * K + k) * D + d0, h + k * DB, w * sizeof(REAL));
        }
    }
}

/* The document of step t: the largest n with bounds[n] <= t. */
static inline int64_t FN(doc_of_)(const int64_t *bounds, int64_t docs, int64_t t) {
    int64_t lo = 0, hi = docs - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (bounds[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* The adjoint. Gradients: dx [B, H, T, D], da [B, H, T, KA, D] (before any reduction to a's shape),
 * de and ds [blocks, B, H, T, K] (each block's partial sum over its columns), db [B, H, K, D]
 * (summed over time), dm0 like m0. gy [B, H, T, D], gm_T and m0 (each like the final states, or
 * NULL) contiguous. Scratch per thread: (2C + 3) K DB + DB values. */
static void FN(scan_backward_)(const REAL *x, const REAL *e, const REAL *s, const REAL *a, const REAL *b,
                               const REAL *starts, const REAL *gy, const REAL *gm_T, const REAL *m0, REAL *dx,
                               REAL *de, REAL *ds, REAL *da, REAL *db, REAL *dm0, const int64_t *bounds,
                               const int64_t *stride, const int64_t *size, int64_t item0, int64_t item1,
                               REAL *scratch) {
    const int64_t B = size[N_B], H = size[N_H], T = size[N_T], K = size[N_K], D = size[N_D], docs = size[N_DOCS];
    const int64_t KA = size[N_KA];
    const int64_t C = size[N_C], DB = size[N_DB], blocks = (D + DB - 1) / DB, chunks = (T + C - 1) / C;
    const int64_t KDB = K * DB;
    REAL *hs = scratch;             /* h before each step of the chunk and after its last: (C + 1) K DB */
    REAL *os = hs + (C + 1) * KDB;  /* each step's decay: C K DB */
    REAL *g = os + C * KDB;         /* dL/dh, carried backwards: K DB */
    REAL *gb = g + KDB;             /* db summed over time: K DB */
    REAL *zero = gb + KDB;          /* the memory before a document's first step without m0: DB */
    for (int64_t d = 0; d < DB; d++) zero[d] = 0;
/* The memory before step t (slot j of the chunk), row k: hs's slot, or at a document's first step
 * its initial state (zeros without m0), which hs's slot, the previous document's last memory, is not. */
#define MEMORY_BEFORE(t, j, k)                                                                       \
    ((t) != bounds[doc] ? hs + (j) * KDB + (k) * DB                                                   \
     : m0               ? m0 + (((bb * docs + doc) * H + hh) * K + (k)) * D + d0                      \
                        : zero)
    for (int64_t item = item0; item < item1; item++) {
        ITEM_PLACE(item);
        const REAL *gyb = gy + bh * T * D + d0;
        REAL *dxb = dx + bh * T * D + d0, *dab = da + bh * T * KA * D + d0;
        REAL *deb = de + (blk * B * H + bh) * T * K, *dsb = ds + (blk * B * H + bh) * T * K;
        for (int64_t k = 0; k < K; k++)
            for (int64_t d = 0; d < w; d++) gb[k * DB + d] = 0;
        for (int64_t c = chunks - 1; c >= 0; c--) {
            const int64_t t0 = c * C, n = T - t0 < C ? T - t0 : C;
            for (int64_t k = 0; k < K; k++)
                memcpy(hs + k * DB, starts + ((bh * chunks + c) * K + k) * D + d0, w * sizeof(REAL));
            int64_t doc = FN(doc_of_)(bounds, docs, t0);
            for (int64_t j = 0; j < n; j++) {
                const int64_t t = t0 + j;
                if (doc + 1 < docs && t == bounds[doc + 1]) doc++;
                const REAL *xt = xb + t * stride[I_T], *at = ab + t * stride[A_T], *et = eb + t * stride[E_T];
                for (int64_t k = 0; k < K; k++) {
                    const REAL ek = et[k], *bk = bk0 + k * stride[B_K], *atk = at + k * stride[A_K];
                    const REAL *hp = MEMORY_BEFORE(t, j, k);
                    REAL *hn = hs + (j + 1) * KDB + k * DB, *o = os + j * KDB + k * DB;
#pragma omp simd
                    for (int64_t d = 0; d < w; d++) {
                        o[d] = FN(exp_)(atk[d] * bk[d]);
                        hn[d] = o[d] * hp[d] + ek * xt[d];
                    }
                }
            }
            for (int64_t j = n - 1; j >= 0; j--) {
                const int64_t t = t0 + j;
                if (t < bounds[doc]) doc--;
                const int64_t state = (bb * docs + doc) * H + hh;
                if (t == bounds[doc + 1] - 1) /* a document's last step: dL/dh is its final state's cotangent */
                    for (int64_t k = 0; k < K; k++)
                        for (int64_t d = 0; d < w; d++)
                            g[k * DB + d] = gm_T ? gm_T[(state * K + k) * D + d0 + d] : (REAL)0;
                const REAL *xt = xb + t * stride[I_T], *at = ab + t * stride[A_T];
                const REAL *et = eb + t * stride[E_T], *st = sb + t * stride[S_T], *gyt = gyb + t * D;
                REAL *dxt = dxb + t * D, *dat = dab + t * KA * D;
                for (int64_t d = 0; d < w; d++) dxt[d] = 0;
                for (int64_t k = 0; k < KA; k++)
                    for (int64_t d = 0; d < w; d++) dat[k * D + d] = 0;
                for (int64_t k = 0; k < K; k++) {
                    const REAL ek = et[k], sk = st[k], *bk = bk0 + k * stride[B_K], *atk = at + k * stride[A_K];
                    REAL *datk = dat + (KA > 1 ? k * D : 0);
                    const REAL *hp = MEMORY_BEFORE(t, j, k), *hn = hs + (j + 1) * KDB + k * DB;
                    const REAL *o = os + j * KDB + k * DB;
                    REAL *gk = g + k * DB, *gbk = gb + k * DB;
                    REAL sum_s = 0, sum_e = 0;
#pragma omp simd reduction(+ : sum_s, sum_e)
                    for (int64_t d = 0; d < w; d++) {
                        sum_s += gyt[d] * hn[d];
                        REAL gh = gk[d] + sk * gyt[d]; /* dL/dh_t */
                        sum_e += gh * xt[d];
                        dxt[d] += gh * ek;
                        REAL glog = gh * o[d] * hp[d]; /* dL/d(a_t b) */
                        datk[d] += glog * bk[d];
                        gbk[d] += glog * atk[d];
                        gk[d] = gh * o[d];
                    }
                    dsb[t * K + k] = sum_s;
                    deb[t * K + k] = sum_e;
                }
                if (t == bounds[doc]) /* dL/dh before the document's first step: its initial state's */
                    for (int64_t k = 0; k < K; k++) memcpy(dm0 + (state * K + k) * D + d0, g + k * DB, w * sizeof(REAL));
            }
        }
        for (int64_t k = 0; k < K; k++) memcpy(db + (bh * K + k) * D + d0, gb + k * DB, w * sizeof(REAL));
    }
}
#undef MEMORY_BEFORE

/* Every work item 0 .. items, split among `threads` OpenMP threads (scratch: `per_thread` values
 * for each). Linked to the process's OpenMP runtime, torch's when torch was loaded first: its idle
 * workers, still spinning after torch's last parallel operation, take the items, where threads of
 * our own would have shared the cores with them. Items are independent, so the split does not
 * change the results. Built without OpenMP: one thread. */
void FN(scan_forward_all_)(const REAL *x, const REAL *e, const REAL *s, const REAL *a, const REAL *b,
                           const REAL *m0, REAL *y, REAL *m_T, REAL *starts, const int64_t *bounds,
                           const int64_t *stride, const int64_t *size, int64_t items, int64_t threads,
                           REAL *scratch, int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++)
        FN(scan_forward_)(x, e, s, a, b, m0, y, m_T, starts, bounds, stride, size, item, item + 1,
                          scratch + THREAD_NUM * per_thread);
}

void FN(scan_backward_all_)(const REAL *x, const REAL *e, const REAL *s, const REAL *a, const REAL *b,
                            const REAL *starts, const REAL *gy, const REAL *gm_T, const REAL *m0, REAL *dx,
                            REAL *de, REAL *ds, REAL *da, REAL *db, REAL *dm0, const int64_t *bounds,
                            const int64_t *stride, const int64_t *size, int64_t items, int64_t threads,
                            REAL *scratch, int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++)
        FN(scan_backward_)(x, e, s, a, b, starts, gy, gm_T, m0, dx, de, ds, da, db, dm0, bounds, stride, size, item,
                           item + 1, scratch + THREAD_NUM * per_thread);
}
