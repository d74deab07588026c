/* The chunk form of EOS without a decay or with a scalar, row or column one (lcsm/ops/chunk_matmul.py's
 * matmul kernel, kinds "none", "scalar", "row" and "col"; lcsm.ops.native_chunk), forward and
 * backward, with its products on register tiles. Without a decay or with a scalar one (a row or
 * column decay: below, "The same chunk form"):
 *
 *   m_t = o_t m_{t-1} + e_t x_t^T,   y_t = m_t^T s_t,   o_t = exp(g_t) (1 without a decay)
 *
 * per work item (batch row b, head h), the chunks of C steps in order. With s, e [C, K], x [C, D] a
 * chunk's rows, S the memory at its start, Gam_t = g_0 + .. + g_t (from the chunk start, summed in
 * double), W_tj = exp(Gam_t - Gam_j) for j <= t (<= 1: no factor ever overflows, whatever the
 * decay), a_t = exp(Gam_t) and b_j = exp(Gam_last - Gam_j):
 *
 *   y = (tril(s e^T) * W) x + diag(a) s S,   S <- exp(Gam_last) S + (diag(b) e)^T x
 *
 * and backward, the chunks in reverse with R the cotangent of the memory after the chunk (dM, the
 * final state's, after the last), A = tril(s e^T) * W and G = tril(dy x^T, -1) * W (strict):
 *
 *   ds = G e + diag(a) dy S^T,   de = G^T s + diag(b) x R^T,   dx = A^T dy + diag(b) e R,
 *   R <- exp(Gam_last) R + (diag(a) s)^T dy
 *
 * then each step's own terms (x_t . dy_t) e_t and (x_t . dy_t) s_t added to ds and de. The decay's
 * gradient is the reverse cumulative sum of s . ds - e . de taken before those own terms, which
 * cancel in it exactly (chunk_matmul.py's ChunkMatmulFunction says why), the sequence's last e . de
 * left out, from the carry <dM, o_T m_{T-1}> that the caller forms from the kept m_strict
 * (o_T m_{T-1}, computed directly; chunk_matmul.py's _final_memory_strict). The chunk-start
 * memories S are kept by the forward for the backward ([B, H, N, K, D]).
 *
 * A chunk's operands are copied into per-thread scratch, zero-padded to whole vectors in C, K and
 * D, so that every product is a `gemm_` of whole tiles: 4 rows by up to 4 vectors of accumulators
 * in registers over the inner dimension, the left operand read a scalar at a time in either
 * orientation (s or s^T without a copy), the right one a row of vectors. The tensors are read and
 * written through their strides ([B, H, T, X] views whose last stride is 1: the caller's
 * [B, T, H, X] layout or a contiguous one; native_scan.py copies any other). Included by scan.c
 * once per type. */

#ifndef CHUNK_ONCE
#define CHUNK_ONCE
/* The register tile is 4 rows by CHUNK_NV vectors: its accumulators, a row of vectors and the
 * broadcast value must fit the vector registers, or the tile spills to memory every step (4 x 4
 * vectors of 64 bytes on a machine with sixteen 32-byte registers ran the products 4-8x slower
 * than torch's matmuls on an AVX2 AMD EPYC). With 32 registers (AVX-512, AArch64) 4 x 4 (21 of
 * them); with 16 (AVX2, SSE) 4 x 2 (11). */
#if LCSM_VEC_BYTES == 64 || defined(__aarch64__)
#define CHUNK_NV 4
#else
#define CHUNK_NV 2
#endif
/* sizes are padded to whole vectors and to whole blocks of the register transpose (32 bytes) */
#define CHUNK_PAD_BYTES (LCSM_VEC_BYTES > 32 ? LCSM_VEC_BYTES : 32)
/* The triangles the chunk form's C x C maps leave zero, which the products skip: FULL none; A_LOWER
 * a's row r zero past column r (a map tril(.) times an operand); A_UPPER a's row r zero before
 * column r (a map's transpose times an operand); OUT_LOWER only out's lower triangle wanted (a map
 * formed: the tiles wholly above the diagonal are written as zeros, the rest computed, to be
 * masked by the caller). About a quarter of the products' work on whole chunks. */
enum { FULL, A_LOWER, A_UPPER, OUT_LOWER };
/* LOG_ZERO of lcsm/ops/_inputs.py per type (a test compares them): a log decay below it (-inf,
 * a decay of exactly 0) is read as it, whose exp is 0, and its gradient is 0, as finite_log's */
const int64_t lcsm_chunk_log_zero_f32 = -128, lcsm_chunk_log_zero_f64 = -1024;
/* The work split: thread j of a team of n takes the items [lo, hi) (contiguous, as schedule(static)
 * would) and goes through them in groups of up to CHUNK_GROUP items, chunk by chunk over the
 * group, each item's memory (cotangent) kept in a slot of its thread's scratch. The caller's
 * [B, T, H, X] layout puts a step's heads side by side: item after item, a thread would read one
 * head's rows strided over the others', for each of its heads in turn; a group reads them as one
 * run of memory. */
#define CHUNK_GROUP 8
static inline void chunk_share(int64_t items, int64_t n, int64_t j, int64_t *lo, int64_t *hi) {
    const int64_t q = items / n, r = items % n;
    *lo = j * q + (j < r ? j : r);
    *hi = *lo + q + (j < r);
}
/* the end of the group that starts at item g0 of [g0, hi) */
static inline int64_t chunk_group_end(int64_t g0, int64_t hi) { return g0 + CHUNK_GROUP < hi ? g0 + CHUNK_GROUP : hi; }
#endif

#define CVEC FN(chunk_vec_)
#define CVL ((int64_t)(LCSM_VEC_BYTES / sizeof(REAL)))
/* a vector of CVL values (the machine's width, scan.h), loaded and stored at any element's alignment */
typedef REAL CVEC __attribute__((vector_size(LCSM_VEC_BYTES), aligned(sizeof(REAL))));

/* a padded size: n rounded up to whole vectors and transpose blocks */
static inline int64_t FN(chunk_pad_)(int64_t n) {
    const int64_t p = CHUNK_PAD_BYTES / sizeof(REAL);
    return (n + p - 1) / p * p;
}

/* out[4 rows, nv vectors] (+)= a[4 rows, k] b[k, nv vectors]; a's element (r, q) at a[r * ar + q * ac] */
static inline __attribute__((always_inline)) void FN(chunk_tile_)(const REAL *a, int64_t ar, int64_t ac,
                                                                 const REAL *b, int64_t ldb, REAL *out, int64_t ldo,
                                                                 int64_t k, const int nv, int accumulate) {
    CVEC acc[4][CHUNK_NV];
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = accumulate ? *(const CVEC *)(out + r * ldo + v * CVL) : (CVEC){0};
    for (int64_t q = 0; q < k; q++) {
        CVEC row[CHUNK_NV];
        for (int v = 0; v < nv; v++) row[v] = *(const CVEC *)(b + q * ldb + v * CVL);
        for (int r = 0; r < 4; r++) {
            const REAL x = a[r * ar + q * ac];
            for (int v = 0; v < nv; v++) acc[r][v] += x * row[v];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++) *(CVEC *)(out + r * ldo + v * CVL) = acc[r][v];
}

#define CHUNK_LOG_ZERO ((REAL)(sizeof(REAL) == 4 ? lcsm_chunk_log_zero_f32 : lcsm_chunk_log_zero_f64))

/* a log decay raised to CHUNK_LOG_ZERO (NaN kept) */
static inline REAL FN(chunk_log_)(REAL g) { return g < CHUNK_LOG_ZERO ? CHUNK_LOG_ZERO : g; }

/* out[m, n] (+)= a[m, k] b[k, n] with m a multiple of 4 and n of CVL; a transposed (its element
 * (r, q) at a[q * lda + r]) when `at`; `tri` the triangle of zeros skipped (above) */
static void FN(chunk_gemm_)(int64_t m, int64_t n, int64_t k, const REAL *a, int64_t lda, int at, const REAL *b,
                            int64_t ldb, REAL *out, int64_t ldo, int accumulate, int tri) {
    const int64_t ar = at ? 1 : lda, ac = at ? lda : 1;
    for (int64_t i = 0; i < m; i += 4) {
        const int64_t q0 = tri == A_UPPER ? (i < k ? i : k) : 0, q1 = tri == A_LOWER && i + 4 < k ? i + 4 : k;
        const int64_t nn = tri == OUT_LOWER && FN(chunk_pad_)(i + 4) < n ? FN(chunk_pad_)(i + 4) : n;
        const REAL *ai = a + i * ar + q0 * ac, *bq = b + q0 * ldb;
        REAL *oi = out + i * ldo;
        int64_t j = 0;
        for (; j + CHUNK_NV * CVL <= nn; j += CHUNK_NV * CVL)
            FN(chunk_tile_)(ai, ar, ac, bq + j, ldb, oi + j, ldo, q1 - q0, CHUNK_NV, accumulate);
        if (CHUNK_NV > 2 && j + 2 * CVL <= nn) {
            FN(chunk_tile_)(ai, ar, ac, bq + j, ldb, oi + j, ldo, q1 - q0, 2, accumulate);
            j += 2 * CVL;
        }
        if (j < nn) FN(chunk_tile_)(ai, ar, ac, bq + j, ldb, oi + j, ldo, q1 - q0, 1, accumulate);
        if (nn < n && !accumulate)
            for (int r = 0; r < 4; r++)
                for (int64_t c = nn; c < n; c++) oi[r * ldo + c] = 0;
    }
}

/* rows [t0, t0 + L) of x (row stride st, width X) into dst [rows, ld], zeros in the padding */
static void FN(chunk_load_)(const REAL *x, int64_t st, int64_t t0, int64_t L, int64_t X, REAL *dst, int64_t rows,
                            int64_t ld) {
    for (int64_t t = 0; t < rows; t++) {
        REAL *d = dst + t * ld;
        if (t < L) {
            memcpy(d, x + (t0 + t) * st, X * sizeof(REAL));
            for (int64_t c = X; c < ld; c++) d[c] = 0;
        } else {
            for (int64_t c = 0; c < ld; c++) d[c] = 0;
        }
    }
}

/* the first L rows and X columns of src [., ld] to rows [t0, t0 + L) of x (row stride st) */
static void FN(chunk_store_)(const REAL *src, int64_t ld, REAL *x, int64_t st, int64_t t0, int64_t L, int64_t X) {
    for (int64_t t = 0; t < L; t++) memcpy(x + (t0 + t) * st, src + t * ld, X * sizeof(REAL));
}

/* A square block transposed in registers, 8 x 8 floats or 4 x 4 doubles (32-byte vectors), by the
 * usual unpack / interleave stages: a scalar transpose stores one value at a time, strided. */
#if EXP_BIAS == 127
#define CHUNK_TB 8
typedef REAL FN(chunk_tvec_) __attribute__((vector_size(32), aligned(sizeof(REAL))));
typedef int32_t FN(chunk_tidx_) __attribute__((vector_size(32)));
static inline void FN(chunk_block_transpose_)(const REAL *src, int64_t lds, REAL *dst, int64_t ldd) {
    typedef FN(chunk_tvec_) V;
    typedef FN(chunk_tidx_) I;
    V r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = *(const V *)(src + i * lds);
    for (int i = 0; i < 8; i += 2) { /* pairs of rows interleaved by element */
        t[i] = __builtin_shuffle(r[i], r[i + 1], (I){0, 8, 1, 9, 4, 12, 5, 13});
        t[i + 1] = __builtin_shuffle(r[i], r[i + 1], (I){2, 10, 3, 11, 6, 14, 7, 15});
    }
    for (int i = 0; i < 8; i += 4) /* then by pairs of elements */
        for (int j = 0; j < 2; j++) {
            u[i + 2 * j] = __builtin_shuffle(t[i + j], t[i + j + 2], (I){0, 1, 8, 9, 4, 5, 12, 13});
            u[i + 2 * j + 1] = __builtin_shuffle(t[i + j], t[i + j + 2], (I){2, 3, 10, 11, 6, 7, 14, 15});
        }
    for (int i = 0; i < 4; i++) { /* then by halves */
        *(V *)(dst + i * ldd) = __builtin_shuffle(u[i], u[i + 4], (I){0, 1, 2, 3, 8, 9, 10, 11});
        *(V *)(dst + (i + 4) * ldd) = __builtin_shuffle(u[i], u[i + 4], (I){4, 5, 6, 7, 12, 13, 14, 15});
    }
}
#else
#define CHUNK_TB 4
typedef REAL FN(chunk_tvec_) __attribute__((vector_size(32), aligned(sizeof(REAL))));
typedef int64_t FN(chunk_tidx_) __attribute__((vector_size(32)));
static inline void FN(chunk_block_transpose_)(const REAL *src, int64_t lds, REAL *dst, int64_t ldd) {
    typedef FN(chunk_tvec_) V;
    typedef FN(chunk_tidx_) I;
    V r[4], t[4];
    for (int i = 0; i < 4; i++) r[i] = *(const V *)(src + i * lds);
    for (int i = 0; i < 4; i += 2) {
        t[i] = __builtin_shuffle(r[i], r[i + 1], (I){0, 4, 2, 6});
        t[i + 1] = __builtin_shuffle(r[i], r[i + 1], (I){1, 5, 3, 7});
    }
    for (int i = 0; i < 2; i++) {
        *(V *)(dst + i * ldd) = __builtin_shuffle(t[i], t[i + 2], (I){0, 1, 4, 5});
        *(V *)(dst + (i + 2) * ldd) = __builtin_shuffle(t[i], t[i + 2], (I){2, 3, 6, 7});
    }
}
#endif

/* dst [cols, ldd] = src [rows, lds]^T over the rows x cols block, both multiples of CVL (every
 * block the kernel transposes is padded to whole vectors), so whole CHUNK_TB blocks */
static void FN(chunk_transpose_)(const REAL *src, int64_t lds, int64_t rows, int64_t cols, REAL *dst, int64_t ldd) {
    for (int64_t r = 0; r < rows; r += CHUNK_TB)
        for (int64_t c = 0; c < cols; c += CHUNK_TB)
            FN(chunk_block_transpose_)(src + r * lds + c, lds, dst + c * ldd + r, ldd);
}
#undef CHUNK_TB

/* A chunk's decay spans at most exp(-CHUNK_SPAN) from its start: W_tj = exp(Gam_t) exp(-Gam_j), every
 * factor within exp(+-CHUNK_SPAN) (chunk_matmul.py's SAFE_SPAN: e^30 keeps float32 far from
 * overflow); beyond it each W_tj is its own exp. */
#define CHUNK_SPAN ((double)(sizeof(REAL) == 4 ? 30 : 200))


/* the scratch one thread needs (REALs), forward and backward: the padded blocks below */
int64_t FN(chunk_scratch_)(int64_t C, int64_t K, int64_t D) {
    const int64_t c = FN(chunk_pad_)(C), k = FN(chunk_pad_)(K), d = FN(chunk_pad_)(D);
    /* blocks, then the decay's W [c, c], a, b and 1 / a [c] and Gam [c] in double (2 REALs or 1 each),
     * then a group's memories (cotangents) and decay-gradient sums in double */
    return 5 * c * k + 5 * c * d + 3 * c * c + 3 * k * d + 5 * c + CHUNK_GROUP * (k * d + 2);
}

/* a chunk's decay factors from its logs g (L steps, stride st): W [Cp, Cp] (W_tj for j <= t, 0
 * above), a, b and inv = 1 / a [Cp] (1, 0 and 1 past L), returning exp(Gam_last). Without g: W all
 * ones on and below the diagonal, a = b = inv = 1. A step whose log is at most CHUNK_LOG_ZERO (a
 * reset: a decay of exactly 0, a packed document's first token) restarts the sums, its own log
 * taken as 0: every factor spanning it is exactly 0 and is set so, and the others are differences
 * within one run between resets. Summed through it, the differences would carry the rounding of
 * |Gam| >= |LOG_ZERO| (about 2e-13 in double) into every pair after it. */
static REAL FN(chunk_decay_)(const REAL *g, int64_t st, int64_t t0, int64_t L, int64_t Cp, double *gam, REAL *W,
                             REAL *a, REAL *b, REAL *inv) {
    double total = 0, span = 0;
    int64_t first = L, last = -1; /* the chunk's first and last reset (none: L and -1) */
    for (int64_t t = 0; t < L; t++) {
        const REAL log = g ? g[(t0 + t) * st] : 0;
        if (log <= CHUNK_LOG_ZERO) {
            total = 0, last = t;
            first = first < L ? first : t;
        } else {
            total += (double)log;
        }
        gam[t] = total;
        span = -total > span ? -total : span;
    }
    int64_t run = 0; /* the step that starts t's run: its last reset, or the chunk start */
    for (int64_t t = 0; t < Cp; t++) {
        REAL *w = W + t * Cp;
        for (int64_t j = 0; j < Cp; j++) w[j] = 0;
        if (t >= L) {
            a[t] = 1, b[t] = 0, inv[t] = 1;
            continue;
        }
        run = g && g[(t0 + t) * st] <= CHUNK_LOG_ZERO ? t : run;
        const REAL from_run = g ? FN(exp_)((REAL)gam[t]) : 1;
        a[t] = t < first ? from_run : 0;
        b[t] = t >= last ? (g ? FN(exp_)((REAL)(total - gam[t])) : 1) : 0;
        inv[t] = g ? FN(exp_)((REAL)-gam[t]) : 1;
        if (g && span > CHUNK_SPAN)
            for (int64_t j = run; j <= t; j++) w[j] = FN(exp_)((REAL)(gam[t] - gam[j]));
        else /* every factor within exp(CHUNK_SPAN): exp(Gam_t) exp(-Gam_j), a product, not an exp */
            for (int64_t j = run; j <= t; j++) w[j] = from_run * inv[j];
    }
    return g && last < 0 ? FN(exp_)((REAL)total) : (g ? 0 : 1);
}

/* a [n, n] (ld) block times W elementwise; strict: the diagonal zeroed too */
static void FN(chunk_mask_)(REAL *A, const REAL *W, int64_t n, int64_t ld, int strict) {
    for (int64_t t = 0; t < n; t++) {
        REAL *row = A + t * ld;
        const REAL *w = W + t * n;
        for (int64_t j = 0; j < n; j++) row[j] *= w[j];
        if (strict) row[t] = 0;
    }
}

/* each row t < rows of x [., ld] (its first `cols` entries) times f[t] */
static void FN(chunk_scale_rows_)(REAL *x, int64_t ld, int64_t rows, int64_t cols, const REAL *f) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t c = 0; c < cols; c++) x[t * ld + c] *= f[t];
}

/* the [K, D] block of a padded [., Dp] memory to a dense one, or back */
static void FN(chunk_dense_)(const REAL *src, int64_t lds, REAL *dst, int64_t ldd, int64_t K, int64_t D) {
    for (int64_t k = 0; k < K; k++) memcpy(dst + k * ldd, src + k * lds, D * sizeof(REAL));
}

/* a group's slots (items g0 .. g1, padded [Kp, Dp] each) set from their items' [K, D] blocks of
 * `from` (zeros without it), and written back to those of `to` */
static void FN(chunk_slots_in_)(REAL *slots, const REAL *from, int64_t g0, int64_t g1, int64_t K, int64_t D) {
    const int64_t Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D);
    for (int64_t item = g0; item < g1; item++) {
        REAL *S = slots + (item - g0) * Kp * Dp;
        for (int64_t k = 0; k < Kp * Dp; k++) S[k] = 0;
        if (from) FN(chunk_dense_)(from + item * K * D, D, S, Dp, K, D);
    }
}
static void FN(chunk_slots_out_)(const REAL *slots, REAL *to, int64_t g0, int64_t g1, int64_t K, int64_t D) {
    const int64_t Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D);
    for (int64_t item = g0; item < g1; item++)
        FN(chunk_dense_)(slots + (item - g0) * Kp * Dp, Dp, to + item * K * D, D, K, D);
}

/* Strides (batch, head, time) of s, e, x, g and y in that order; g NULL: no decay. m_strict
 * (o_T m_{T-1}) is written only with g. */
void FN(chunk_forward_all_)(const REAL *s, const REAL *e, const REAL *x, const REAL *g, const REAL *m0, REAL *y,
                            REAL *mT, REAL *m_strict, REAL *starts, const int64_t *strides, int64_t H, int64_t T,
                            int64_t K, int64_t D, int64_t C, int64_t items, int64_t threads, REAL *scratch,
                            int64_t per_thread) {
    const int64_t Cp = FN(chunk_pad_)(C), Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D), N = (T + C - 1) / C;
#pragma omp parallel num_threads(threads)
    {
        REAL *sc = scratch + THREAD_NUM * per_thread, *ec = sc + Cp * Kp, *eT = ec + Cp * Kp, *xc = eT + Kp * Cp;
        REAL *A = xc + Cp * Dp, *yc = A + Cp * Cp, *W = yc + Cp * Dp, *fa = W + Cp * Cp, *fb = fa + Cp;
        REAL *finv = fb + Cp;
        double *gam = (double *)(finv + Cp);
        REAL *slots = (REAL *)(gam + Cp);
        int64_t lo, hi;
        chunk_share(items, THREAD_COUNT, THREAD_NUM, &lo, &hi);
        for (int64_t g0 = lo, g1; g0 < hi; g0 = g1) {
            g1 = chunk_group_end(g0, hi);
            FN(chunk_slots_in_)(slots, m0, g0, g1, K, D);
            for (int64_t w = 0; w < N * (g1 - g0); w++) { /* the chunks in order, the group's items in each */
                const int64_t n = w / (g1 - g0), item = g0 + w % (g1 - g0), b = item / H, h = item % H;
                const int64_t t0 = n * C, L = T - t0 < C ? T - t0 : C;
                const REAL *sb = s + b * strides[0] + h * strides[1], *eb = e + b * strides[3] + h * strides[4];
                const REAL *xb = x + b * strides[6] + h * strides[7];
                const REAL *gb = g ? g + b * strides[9] + h * strides[10] : 0;
                REAL *yb = y + b * strides[12] + h * strides[13], *S = slots + (item - g0) * Kp * Dp;
                FN(chunk_load_)(sb, strides[2], t0, L, K, sc, Cp, Kp);
                FN(chunk_load_)(eb, strides[5], t0, L, K, ec, Cp, Kp);
                FN(chunk_load_)(xb, strides[8], t0, L, D, xc, Cp, Dp);
                const REAL last = FN(chunk_decay_)(gb, strides[11], t0, L, Cp, gam, W, fa, fb, finv);
                FN(chunk_transpose_)(ec, Kp, Cp, Kp, eT, Cp);
                FN(chunk_gemm_)(Cp, Cp, Kp, sc, Kp, 0, eT, Cp, A, Cp, 0, OUT_LOWER);
                FN(chunk_mask_)(A, W, Cp, Cp, 0);
                FN(chunk_gemm_)(Cp, Dp, Kp, sc, Kp, 0, S, Dp, yc, Dp, 0, FULL);
                FN(chunk_scale_rows_)(yc, Dp, Cp, Dp, fa);
                FN(chunk_gemm_)(Cp, Dp, Cp, A, Cp, 0, xc, Dp, yc, Dp, 1, A_LOWER);
                FN(chunk_dense_)(S, Dp, starts + (item * N + n) * K * D, D, K, D);
                for (int64_t k = 0; k < Kp * Dp; k++) S[k] *= last;
                FN(chunk_scale_rows_)(ec, Kp, Cp, Kp, fb);
                if (g && n == N - 1) { /* o_T m_{T-1}: every input but the last step's */
                    FN(chunk_gemm_)(Kp, Dp, L - 1, ec, Kp, 1, xc, Dp, S, Dp, 1, FULL);
                    FN(chunk_dense_)(S, Dp, m_strict + item * K * D, D, K, D);
                    FN(chunk_gemm_)(Kp, Dp, 1, ec + (L - 1) * Kp, Kp, 1, xc + (L - 1) * Dp, Dp, S, Dp, 1, FULL);
                } else {
                    FN(chunk_gemm_)(Kp, Dp, Cp, ec, Kp, 1, xc, Dp, S, Dp, 1, FULL);
                }
                FN(chunk_store_)(yc, Dp, yb, strides[14], t0, L, D);
            }
            FN(chunk_slots_out_)(slots, mT, g0, g1, K, D);
        }
    }
}

/* Strides of s, e, x, g and dy in that order; ds, de, dx (and dg) are laid out as s, e, x (g);
 * carry [items]: <dM, o_T m_{T-1}> of each item (with g). */
void FN(chunk_backward_all_)(const REAL *s, const REAL *e, const REAL *x, const REAL *g, const REAL *starts,
                             const REAL *dy, const REAL *dmT, const REAL *carry, REAL *ds, REAL *de, REAL *dx,
                             REAL *dg, REAL *dm0, const int64_t *strides, int64_t H, int64_t T, int64_t K, int64_t D,
                             int64_t C, int64_t items, int64_t threads, REAL *scratch, int64_t per_thread) {
    const int64_t Cp = FN(chunk_pad_)(C), Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D), N = (T + C - 1) / C;
#pragma omp parallel num_threads(threads)
    {
        REAL *sc = scratch + THREAD_NUM * per_thread, *ec = sc + Cp * Kp, *eT = ec + Cp * Kp, *dsc = eT + Kp * Cp;
        REAL *dec = dsc + Cp * Kp, *xc = dec + Cp * Kp, *dyc = xc + Cp * Dp, *xT = dyc + Cp * Dp, *dxc = xT + Dp * Cp;
        REAL *A = dxc + Cp * Dp, *G = A + Cp * Cp, *S = G + Cp * Cp, *ST = S + Kp * Dp, *RT = ST + Dp * Kp;
        REAL *W = RT + Dp * Kp, *fa = W + Cp * Cp, *fb = fa + Cp, *finv = fb + Cp;
        double *gam = (double *)(finv + Cp);
        REAL *slots = (REAL *)(gam + Cp);
        double *runs = (double *)(slots + CHUNK_GROUP * Kp * Dp); /* the decay gradient's reverse cumulative sums */
        int64_t lo, hi;
        chunk_share(items, THREAD_COUNT, THREAD_NUM, &lo, &hi);
        for (int64_t g0 = lo, g1; g0 < hi; g0 = g1) {
            g1 = chunk_group_end(g0, hi);
            FN(chunk_slots_in_)(slots, dmT, g0, g1, K, D);
            for (int64_t item = g0; item < g1; item++) runs[item - g0] = g && carry ? carry[item] : 0;
            for (int64_t w = 0; w < N * (g1 - g0); w++) { /* the chunks in reverse, the group's items in each */
                const int64_t n = N - 1 - w / (g1 - g0), item = g0 + w % (g1 - g0), b = item / H, h = item % H;
                const int64_t t0 = n * C, L = T - t0 < C ? T - t0 : C;
                const int64_t sb = b * strides[0] + h * strides[1], eb = b * strides[3] + h * strides[4];
                const int64_t xb = b * strides[6] + h * strides[7], gb = b * strides[9] + h * strides[10];
                const REAL *dyb = dy + b * strides[12] + h * strides[13], *kept = starts + item * N * K * D;
                REAL *R = slots + (item - g0) * Kp * Dp;
                double running = runs[item - g0];
                FN(chunk_load_)(s + sb, strides[2], t0, L, K, sc, Cp, Kp);
                FN(chunk_load_)(e + eb, strides[5], t0, L, K, ec, Cp, Kp);
                FN(chunk_load_)(x + xb, strides[8], t0, L, D, xc, Cp, Dp);
                FN(chunk_load_)(dyb, strides[14], t0, L, D, dyc, Cp, Dp);
                FN(chunk_load_)(kept + n * K * D, D, 0, K, D, S, Kp, Dp);
                const REAL last = FN(chunk_decay_)(g ? g + gb : 0, strides[11], t0, L, Cp, gam, W, fa, fb, finv);
                FN(chunk_transpose_)(ec, Kp, Cp, Kp, eT, Cp);
                FN(chunk_transpose_)(xc, Dp, Cp, Dp, xT, Cp);
                FN(chunk_transpose_)(S, Dp, Kp, Dp, ST, Kp);
                FN(chunk_transpose_)(R, Dp, Kp, Dp, RT, Kp);
                FN(chunk_gemm_)(Cp, Cp, Kp, sc, Kp, 0, eT, Cp, A, Cp, 0, OUT_LOWER);
                FN(chunk_mask_)(A, W, Cp, Cp, 0);
                FN(chunk_gemm_)(Cp, Cp, Dp, dyc, Dp, 0, xT, Cp, G, Cp, 0, OUT_LOWER);
                FN(chunk_mask_)(G, W, Cp, Cp, 1);
                FN(chunk_gemm_)(Cp, Kp, Dp, dyc, Dp, 0, ST, Kp, dsc, Kp, 0, FULL);
                FN(chunk_scale_rows_)(dsc, Kp, Cp, Kp, fa);
                FN(chunk_gemm_)(Cp, Kp, Cp, G, Cp, 0, ec, Kp, dsc, Kp, 1, A_LOWER);
                FN(chunk_gemm_)(Cp, Kp, Dp, xc, Dp, 0, RT, Kp, dec, Kp, 0, FULL);
                FN(chunk_scale_rows_)(dec, Kp, Cp, Kp, fb);
                FN(chunk_gemm_)(Cp, Kp, Cp, G, Cp, 1, sc, Kp, dec, Kp, 1, A_UPPER);
                FN(chunk_gemm_)(Cp, Dp, Kp, ec, Kp, 0, R, Dp, dxc, Dp, 0, FULL);
                FN(chunk_scale_rows_)(dxc, Dp, Cp, Dp, fb);
                FN(chunk_gemm_)(Cp, Dp, Cp, A, Cp, 1, dyc, Dp, dxc, Dp, 1, A_UPPER);
                for (int64_t t = L - 1; t >= 0; t--) {
                    /* restrict and simd reductions: the step's rows vectorise (as in the vector-decay kernel) */
                    const REAL *restrict st_ = sc + t * Kp, *restrict et = ec + t * Kp;
                    const REAL *restrict xt = xc + t * Dp, *restrict dyt = dyc + t * Dp;
                    REAL *restrict dst = dsc + t * Kp, *restrict det = dec + t * Kp, x_dy = 0, s_ds = 0, e_de = 0;
#pragma omp simd reduction(+ : x_dy)
                    for (int64_t d = 0; d < D; d++) x_dy += xt[d] * dyt[d];
#pragma omp simd reduction(+ : s_ds, e_de)
                    for (int64_t k = 0; k < K; k++) {
                        s_ds += st_[k] * dst[k];
                        e_de += et[k] * det[k];
                        dst[k] += x_dy * et[k];
                        det[k] += x_dy * st_[k];
                    }
                    if (g) {
                        running += s_ds - (t0 + t == T - 1 ? 0 : e_de);
                        const int raised = g[gb + (t0 + t) * strides[11]] < CHUNK_LOG_ZERO;
                        dg[b * strides[15] + h * strides[16] + (t0 + t) * strides[17]] = raised ? 0 : (REAL)running;
                    }
                }
                FN(chunk_scale_rows_)(sc, Kp, Cp, Kp, fa);
                for (int64_t k = 0; k < Kp * Dp; k++) R[k] *= last;
                FN(chunk_gemm_)(Kp, Dp, Cp, sc, Kp, 1, dyc, Dp, R, Dp, 1, FULL);
                FN(chunk_store_)(dsc, Kp, ds + sb, strides[2], t0, L, K);
                FN(chunk_store_)(dec, Kp, de + eb, strides[5], t0, L, K);
                FN(chunk_store_)(dxc, Dp, dx + xb, strides[8], t0, L, D);
                runs[item - g0] = running;
            }
            FN(chunk_slots_out_)(slots, dm0, g0, g1, K, D);
        }
    }
}

/* ----------------------------------------------------------------------------------------------
 * The same chunk form with a decay that varies over the memory's rows ("row", GLA's: o_t a
 * K-vector, m_t = diag(o_t) m_{t-1} + e_t x_t^T) or over its columns ("col": o_t a D-vector,
 * m_t = m_{t-1} diag(o_t) + e_t x_t^T). A pair's decay exp(Gam_t - Gam_j) now differs per row (or
 * column) and cannot be a C x C map: it is factorised, exp(c_t) on the one side and exp(-c_j) on
 * the other. So that no factor leaves exp(+-CHUNK_SPAN), a chunk is cut into pieces: a piece
 * starts at some step p and runs while every c_t = g_{p+1} + .. + g_t (summed in double, from the
 * step after its first) stays within CHUNK_SPAN. Moderate decays give one piece per chunk; a decay
 * of exactly 0 (a reset, log at LOG_ZERO) ends the piece before it, its own log taken by the next
 * piece's u below, where it is exact; a strong decay gives short pieces, down to single steps.
 * Per piece, with u = exp(g_p), v = exp(c_last) and, for a row decay, q = s exp(c), k = e exp(-c):
 *
 *   S' = diag(u) S,   y = q S' + tril(q k^T) x,   S <- diag(v) (S' + k^T x)
 *
 *   backward, R the cotangent after the piece, R' = diag(v) R, G = tril(dy x^T, -1):
 *   ds = exp(c) (dy S'^T + G k),   de = exp(-c) (G^T q + x R'^T),   dx = tril(q k^T)^T dy + k R',
 *   R <- diag(u) (R' + q^T dy)
 *
 * and for a column decay, with x~ = x exp(-c), dy~ = dy exp(c) and P = tril(s e^T, -1) (strict):
 *
 *   S' = S diag(u),   y_strict = exp(c) (s S' + P x~),   y = y_strict + (s . e) x,
 *   S <- (S' + e^T x~) diag(v)
 *
 *   backward, R' = R diag(v), G = tril(dy~ x~^T, -1):
 *   ds = dy~ S'^T + G e,   de = G^T s + x~ R'^T,   dx_strict = exp(-c) (P^T dy~ + e R'),
 *   R <- (R' + s^T dy~) diag(u)
 *
 * then the own terms as before ((s . e) dy to dx too). The decay's gradient (chunk_matmul.py's
 * docstring) is the reverse cumulative sum per row of s ds - e de, or per column of dy y - x dx,
 * the strict ones (before the own terms, which cancel in it: from the full ones, the difference
 * of two O(1) terms would bury it where the decay is strong), the sequence's last e de (x dx) left
 * out, from the carry, that row's (column's) <dM, o_T m_{T-1}>; y_strict is written by the
 * forward beside y. The backward recomputes a chunk's piece-start memories from its kept start
 * when it has more than one piece. */

/* the next piece of a chunk from step t0 (at most Lmax steps): its length, and its factors fpos =
 * exp(c), fneg = exp(-c) [rows, Xp] (1 in the padding), u and v [Xp] */
static int64_t FN(chunk_piece_)(const REAL *g, int64_t st, int64_t t0, int64_t Lmax, int64_t X, int64_t Xp,
                                double *c, double *next, REAL *fpos, REAL *fneg, REAL *u, REAL *v) {
    int64_t L = 1;
    for (int64_t k = 0; k < Xp; k++) {
        u[k] = k < X ? FN(exp_)(FN(chunk_log_)(g[t0 * st + k])) : 1;
        c[k] = 0;
    }
    for (; L < Lmax; L++) { /* c_t into fpos while every entry stays within the span */
        const REAL *gt = g + (t0 + L) * st;
        int within = 1;
        for (int64_t k = 0; k < X; k++) {
            next[k] = c[k] + (double)FN(chunk_log_)(gt[k]);
            within &= next[k] <= CHUNK_SPAN && next[k] >= -CHUNK_SPAN;
        }
        if (!within) break;
        double *swap = c;
        c = next, next = swap;
        for (int64_t k = 0; k < X; k++) fpos[L * Xp + k] = (REAL)c[k];
    }
    for (int64_t t = 0; t < FN(chunk_pad_)(L); t++) { /* then the factors, one pass over whole rows */
        REAL *pos = fpos + t * Xp, *neg = fneg + t * Xp;
        const int64_t width = t == 0 || t >= L ? 0 : X; /* c_p = 0 and the padding: factors 1 */
        for (int64_t k = 0; k < Xp; k++) {
            const REAL log = k < width ? pos[k] : 0;
            pos[k] = FN(exp_)(log);
            neg[k] = 1 / pos[k]; /* within e^CHUNK_SPAN; a division costs less than another exp */
        }
    }
    for (int64_t k = 0; k < Xp; k++) v[k] = fpos[(L - 1) * Xp + k];
    return L;
}

/* x [rows, ld] times f [rows, ldf] elementwise over the first `cols` columns */
static void FN(chunk_mul_)(REAL *x, int64_t ld, const REAL *f, int64_t ldf, int64_t rows, int64_t cols) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t c = 0; c < cols; c++) x[t * ld + c] *= f[t * ldf + c];
}

/* out [rows, ld] = x [rows, ld] times f [rows, ldf] elementwise */
static void FN(chunk_mul_to_)(const REAL *x, int64_t ld, const REAL *f, int64_t ldf, int64_t rows, int64_t cols,
                              REAL *out) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t c = 0; c < ld; c++) out[t * ld + c] = c < cols ? x[t * ld + c] * f[t * ldf + c] : 0;
}

/* each column c of x [rows, ld] times f[c] */
static void FN(chunk_scale_cols_)(REAL *x, int64_t ld, int64_t rows, const REAL *f) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t c = 0; c < ld; c++) x[t * ld + c] *= f[c];
}

/* the lower triangle of an [n, n] (ld) block kept, the diagonal too unless strict */
static void FN(chunk_tril_)(REAL *A, int64_t n, int64_t ld, int strict) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = t + !strict; j < n; j++) A[t * ld + j] = 0;
}

/* the next block of n values of a thread's scratch (base + *at; NULL without a base), its size kept
 * to whole 64-byte lines */
static inline REAL *FN(chunk_take_)(REAL *base, int64_t *at, int64_t n) {
    REAL *block = base ? base + *at : 0;
    *at += (n * (int64_t)sizeof(REAL) + 63) / 64 * 64 / (int64_t)sizeof(REAL);
    return block;
}

/* The blocks of one thread's scratch, forward and backward alike (`size` only counts them). */
typedef struct {
    REAL *sc, *ec, *qt, *kt, *ds, *de, *tT, *xc, *dy, *xt, *yt, *dx, *yc, *xT, *A, *G, *S, *R, *ST, *RT;
    REAL *fpos, *fneg, *u, *v, *starts, *slots; /* slots: a group's memories (forward) or cotangents */
    double *c, *next, *run, *runs;              /* runs: a group's decay-gradient sums (backward) */
    int64_t *bounds;
} FN(chunk_vec_blocks_);

static int64_t FN(chunk_vec_layout_)(REAL *base, int64_t C, int64_t K, int64_t D, int64_t X,
                                     FN(chunk_vec_blocks_) *b) {
    const int64_t Cp = FN(chunk_pad_)(C), Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D), Xp = FN(chunk_pad_)(X);
    const int64_t per_double = (int64_t)(sizeof(double) / sizeof(REAL));
    int64_t at = 0;
#define TAKE(n) FN(chunk_take_)(base, &at, (n))
    REAL **ck[] = {&b->sc, &b->ec, &b->qt, &b->kt, &b->ds, &b->de};
    for (int i = 0; i < 6; i++) *ck[i] = TAKE(Cp * Kp);
    b->tT = TAKE((Kp > Dp ? Kp : Dp) * Cp);
    REAL **cd[] = {&b->xc, &b->dy, &b->xt, &b->yt, &b->dx, &b->yc};
    for (int i = 0; i < 6; i++) *cd[i] = TAKE(Cp * Dp);
    b->xT = TAKE(Dp * Cp);
    b->A = TAKE(Cp * Cp), b->G = TAKE(Cp * Cp);
    REAL **kd[] = {&b->S, &b->ST, &b->RT};
    for (int i = 0; i < 3; i++) *kd[i] = TAKE(Kp * Dp);
    b->slots = TAKE(CHUNK_GROUP * Kp * Dp);
    b->fpos = TAKE(Cp * Xp), b->fneg = TAKE(Cp * Xp);
    b->u = TAKE(Xp), b->v = TAKE(Xp);
    b->c = (double *)TAKE(Xp * per_double), b->next = (double *)TAKE(Xp * per_double);
    b->runs = (double *)TAKE(CHUNK_GROUP * Xp * per_double);
    b->bounds = (int64_t *)TAKE((C + 1) * (int64_t)(sizeof(int64_t) / sizeof(REAL)));
    b->starts = TAKE(C * Kp * Dp); /* a piece-start memory for each of up to C pieces */
#undef TAKE
    return at;
}

/* the scratch one thread needs (REALs) for a decay of width X over C-step chunks */
int64_t FN(chunk_vec_scratch_)(int64_t C, int64_t K, int64_t D, int64_t X) {
    FN(chunk_vec_blocks_) b;
    return FN(chunk_vec_layout_)(0, C, K, D, X, &b);
}

/* One piece forward (rows t0 .. t0 + L of the item's s, e, x at strides st_*): y's rows written, S
 * carried over the piece; with m_strict, o_T m_{T-1} (every input but the piece's last) written. */
static void FN(chunk_vec_piece_forward_)(FN(chunk_vec_blocks_) *b, const REAL *s, int64_t sts, const REAL *e,
                                         int64_t ste, const REAL *x, int64_t stx, REAL *y, REAL *y_strict, int64_t sty,
                                         int64_t t0, int64_t L, int64_t K, int64_t D, int col, int64_t Xp,
                                         REAL *m_strict) {
    const int64_t Lp = FN(chunk_pad_)(L), Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D);
    FN(chunk_load_)(e, ste, t0, L, K, b->ec, Lp, Kp);
    FN(chunk_load_)(x, stx, t0, L, D, b->xc, Lp, Dp);
    REAL *left = b->ec, *right = b->xc; /* the operands of the memory's update: k and x, or e and x~ */
    if (!col) {
        FN(chunk_scale_rows_)(b->S, Dp, Kp, Dp, b->u);
        FN(chunk_mul_)(b->ec, Kp, b->fneg, Xp, Lp, Kp); /* k */
    } else {
        FN(chunk_scale_cols_)(b->S, Dp, Kp, b->u);
        FN(chunk_mul_to_)(b->xc, Dp, b->fneg, Xp, Lp, Dp, b->xt); /* x~ */
        right = b->xt;
    }
    if (y) {
        FN(chunk_load_)(s, sts, t0, L, K, b->sc, Lp, Kp);
        FN(chunk_transpose_)(b->ec, Kp, Lp, Kp, b->tT, Lp);
        if (!col) FN(chunk_mul_)(b->sc, Kp, b->fpos, Xp, Lp, Kp); /* q */
        FN(chunk_gemm_)(Lp, Lp, Kp, b->sc, Kp, 0, b->tT, Lp, b->A, Lp, 0, OUT_LOWER);
        /* a column decay's y without each step's own term (y_strict, which its decay gradient reads:
         * y less that term would cancel where the decay is strong), then the term added */
        FN(chunk_tril_)(b->A, Lp, Lp, col);
        FN(chunk_gemm_)(Lp, Dp, Kp, b->sc, Kp, 0, b->S, Dp, b->yc, Dp, 0, FULL);
        FN(chunk_gemm_)(Lp, Dp, Lp, b->A, Lp, 0, right, Dp, b->yc, Dp, 1, A_LOWER);
        if (col) /* y_strict and y written in one pass over the rows */
            for (int64_t t = 0; t < L; t++) {
                const REAL *restrict st_ = b->sc + t * Kp, *restrict et = b->ec + t * Kp, *restrict xt = b->xc + t * Dp;
                const REAL *restrict yt = b->yc + t * Dp, *restrict ft = b->fpos + t * Xp;
                REAL *restrict ys = y_strict + (t0 + t) * sty, *restrict yo = y + (t0 + t) * sty, s_e = 0;
#pragma omp simd reduction(+ : s_e)
                for (int64_t k = 0; k < K; k++) s_e += st_[k] * et[k];
                for (int64_t d = 0; d < D; d++) {
                    const REAL v = yt[d] * ft[d];
                    ys[d] = v;
                    yo[d] = v + s_e * xt[d];
                }
            }
        else
            FN(chunk_store_)(b->yc, Dp, y, sty, t0, L, D);
    }
    if (m_strict) { /* o_T m_{T-1}: every input but the piece's (the sequence's) last */
        FN(chunk_gemm_)(Kp, Dp, L - 1, left, Kp, 1, right, Dp, b->S, Dp, 1, FULL);
        for (int64_t k = 0; k < Kp * Dp; k++) b->ST[k] = b->S[k];
        if (!col) FN(chunk_scale_rows_)(b->ST, Dp, Kp, Dp, b->v);
        else FN(chunk_scale_cols_)(b->ST, Dp, Kp, b->v);
        FN(chunk_dense_)(b->ST, Dp, m_strict, D, K, D);
        FN(chunk_gemm_)(Kp, Dp, 1, left + (L - 1) * Kp, Kp, 1, right + (L - 1) * Dp, Dp, b->S, Dp, 1, FULL);
    } else {
        FN(chunk_gemm_)(Kp, Dp, Lp, left, Kp, 1, right, Dp, b->S, Dp, 1, FULL);
    }
    if (!col) FN(chunk_scale_rows_)(b->S, Dp, Kp, Dp, b->v);
    else FN(chunk_scale_cols_)(b->S, Dp, Kp, b->v);
}

/* Strides (batch, head, time) of s, e, x, g and y in that order; g's width X is K (row, col 0) or D
 * (col 1). m_strict (o_T m_{T-1}) is always written; y_strict (y without each step's own term, laid
 * out as y) with a column decay. */
void FN(chunk_vec_forward_all_)(const REAL *s, const REAL *e, const REAL *x, const REAL *g, const REAL *m0, REAL *y,
                                REAL *y_strict, REAL *mT, REAL *m_strict, REAL *starts, const int64_t *strides,
                                int64_t H, int64_t T, int64_t K, int64_t D, int64_t C, int64_t col, int64_t items,
                                int64_t threads, REAL *scratch, int64_t per_thread) {
    const int64_t Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D), X = col ? D : K, Xp = FN(chunk_pad_)(X);
    const int64_t N = (T + C - 1) / C;
#pragma omp parallel num_threads(threads)
    {
        FN(chunk_vec_blocks_) b;
        FN(chunk_vec_layout_)(scratch + THREAD_NUM * per_thread, C, K, D, X, &b);
        int64_t lo, hi;
        chunk_share(items, THREAD_COUNT, THREAD_NUM, &lo, &hi);
        for (int64_t g0 = lo, g1; g0 < hi; g0 = g1) {
            g1 = chunk_group_end(g0, hi);
            FN(chunk_slots_in_)(b.slots, m0, g0, g1, K, D);
            for (int64_t w = 0; w < N * (g1 - g0); w++) { /* the chunks in order, the group's items in each */
                const int64_t n = w / (g1 - g0), item = g0 + w % (g1 - g0), b_ = item / H, h = item % H;
                const int64_t t0 = n * C, L = T - t0 < C ? T - t0 : C;
                const REAL *sb = s + b_ * strides[0] + h * strides[1], *eb = e + b_ * strides[3] + h * strides[4];
                const REAL *xb = x + b_ * strides[6] + h * strides[7], *gb = g + b_ * strides[9] + h * strides[10];
                REAL *yb = y + b_ * strides[12] + h * strides[13];
                b.S = b.slots + (item - g0) * Kp * Dp;
                FN(chunk_dense_)(b.S, Dp, starts + (item * N + n) * K * D, D, K, D);
                for (int64_t p = t0; p < t0 + L;) {
                    const int64_t Lq = FN(chunk_piece_)(gb, strides[11], p, t0 + L - p, X, Xp, b.c, b.next, b.fpos,
                                                        b.fneg, b.u, b.v);
                    REAL *strict = p + Lq == T ? m_strict + item * K * D : 0;
                    FN(chunk_vec_piece_forward_)(&b, sb, strides[2], eb, strides[5], xb, strides[8], yb,
                                                 col ? yb - y + y_strict : 0, strides[14], p, Lq, K, D, (int)col,
                                                 Xp, strict);
                    p += Lq;
                }
            }
            FN(chunk_slots_out_)(b.slots, mT, g0, g1, K, D);
        }
    }
}

/* Strides of s, e, x, g, dy and y_strict in that order (y_strict, the forward's, with a column
 * decay only); ds, de, dx and dg are laid out as s, e, x and g; carry [items, X]: <dM, o_T m_{T-1}>
 * of each row (column) of each item, or NULL (no dM). */
void FN(chunk_vec_backward_all_)(const REAL *s, const REAL *e, const REAL *x, const REAL *g, const REAL *y_strict,
                                 const REAL *starts, const REAL *dy, const REAL *dmT, const REAL *carry, REAL *ds,
                                 REAL *de, REAL *dx, REAL *dg, REAL *dm0, const int64_t *strides, int64_t H, int64_t T,
                                 int64_t K, int64_t D, int64_t C, int64_t col, int64_t items, int64_t threads,
                                 REAL *scratch, int64_t per_thread) {
    const int64_t Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D), X = col ? D : K, Xp = FN(chunk_pad_)(X);
    const int64_t N = (T + C - 1) / C;
#pragma omp parallel num_threads(threads)
    {
        FN(chunk_vec_blocks_) b;
        FN(chunk_vec_layout_)(scratch + THREAD_NUM * per_thread, C, K, D, X, &b);
        int64_t lo, hi;
        chunk_share(items, THREAD_COUNT, THREAD_NUM, &lo, &hi);
        for (int64_t g0 = lo, g1; g0 < hi; g0 = g1) {
            g1 = chunk_group_end(g0, hi);
            FN(chunk_slots_in_)(b.slots, dmT, g0, g1, K, D);
            for (int64_t item = g0; item < g1; item++)
                for (int64_t k = 0; k < X; k++) b.runs[(item - g0) * Xp + k] = carry ? carry[item * X + k] : 0;
            for (int64_t w = 0; w < N * (g1 - g0); w++) { /* the chunks in reverse, the group's items in each */
                const int64_t n = N - 1 - w / (g1 - g0), item = g0 + w % (g1 - g0), b_ = item / H, h = item % H;
                const int64_t sb = b_ * strides[0] + h * strides[1], eb = b_ * strides[3] + h * strides[4];
                const int64_t xb = b_ * strides[6] + h * strides[7], gb = b_ * strides[9] + h * strides[10];
                const int64_t db = b_ * strides[12] + h * strides[13], yb = b_ * strides[15] + h * strides[16];
                const REAL *kept = starts + item * N * K * D;
                b.R = b.slots + (item - g0) * Kp * Dp, b.run = b.runs + (item - g0) * Xp;
                const int64_t t0 = n * C, L = T - t0 < C ? T - t0 : C;
                int64_t pieces = 0, single = 0;
                FN(chunk_load_)(kept + n * K * D, D, 0, K, D, b.S, Kp, Dp);
                for (int64_t p = t0; p < t0 + L; pieces++) { /* the pieces and the memory at each one's start */
                    const int64_t Lq = FN(chunk_piece_)(g + gb, strides[11], p, t0 + L - p, X, Xp, b.c, b.next, b.fpos,
                                                        b.fneg, b.u, b.v);
                    b.bounds[pieces] = p;
                    single = Lq == L; /* the usual case: its factors and its start, the kept memory, stay */
                    if (!single) {
                        for (int64_t k = 0; k < Kp * Dp; k++) b.starts[pieces * Kp * Dp + k] = b.S[k];
                        if (p + Lq < t0 + L)
                            FN(chunk_vec_piece_forward_)(&b, 0, 0, e + eb, strides[5], x + xb, strides[8], 0, 0, 0, p,
                                                         Lq, K, D, (int)col, Xp, 0);
                    }
                    p += Lq;
                }
                for (int64_t i = pieces - 1; i >= 0; i--) {
                    const int64_t p = b.bounds[i];
                    const int64_t Lq = single ? L
                                              : FN(chunk_piece_)(g + gb, strides[11], p, t0 + L - p, X, Xp, b.c, b.next,
                                                                 b.fpos, b.fneg, b.u, b.v);
                    if (!single)
                        for (int64_t k = 0; k < Kp * Dp; k++) b.S[k] = b.starts[i * Kp * Dp + k];
                    const int64_t Lp = FN(chunk_pad_)(Lq);
                    FN(chunk_load_)(s + sb, strides[2], p, Lq, K, b.sc, Lp, Kp);
                    FN(chunk_load_)(e + eb, strides[5], p, Lq, K, b.ec, Lp, Kp);
                    FN(chunk_load_)(x + xb, strides[8], p, Lq, D, b.xc, Lp, Dp);
                    FN(chunk_load_)(dy + db, strides[14], p, Lq, D, b.dy, Lp, Dp);
                    /* S' and R'; the scaled operands: q, k (row) or x~, dy~ (col) */
                    REAL *ls, *le, *lx, *ldy; /* the operands of the products: q or s, k or e, x or x~, dy or dy~ */
                    if (!col) {
                        FN(chunk_scale_rows_)(b.S, Dp, Kp, Dp, b.u);
                        FN(chunk_scale_rows_)(b.R, Dp, Kp, Dp, b.v);
                        FN(chunk_mul_to_)(b.sc, Kp, b.fpos, Xp, Lp, Kp, b.qt);
                        FN(chunk_mul_to_)(b.ec, Kp, b.fneg, Xp, Lp, Kp, b.kt);
                        ls = b.qt, le = b.kt, lx = b.xc, ldy = b.dy;
                    } else {
                        FN(chunk_scale_cols_)(b.S, Dp, Kp, b.u);
                        FN(chunk_scale_cols_)(b.R, Dp, Kp, b.v);
                        FN(chunk_mul_to_)(b.xc, Dp, b.fneg, Xp, Lp, Dp, b.xt);
                        FN(chunk_mul_to_)(b.dy, Dp, b.fpos, Xp, Lp, Dp, b.yt);
                        ls = b.sc, le = b.ec, lx = b.xt, ldy = b.yt;
                    }
                    FN(chunk_transpose_)(le, Kp, Lp, Kp, b.tT, Lp);
                    FN(chunk_gemm_)(Lp, Lp, Kp, ls, Kp, 0, b.tT, Lp, b.A, Lp, 0, OUT_LOWER);
                    FN(chunk_tril_)(b.A, Lp, Lp, col); /* a column decay's dx strict first, as its y */
                    FN(chunk_transpose_)(lx, Dp, Lp, Dp, b.xT, Lp);
                    FN(chunk_gemm_)(Lp, Lp, Dp, ldy, Dp, 0, b.xT, Lp, b.G, Lp, 0, OUT_LOWER);
                    FN(chunk_tril_)(b.G, Lp, Lp, 1);
                    FN(chunk_transpose_)(b.S, Dp, Kp, Dp, b.ST, Kp);
                    FN(chunk_transpose_)(b.R, Dp, Kp, Dp, b.RT, Kp);
                    FN(chunk_gemm_)(Lp, Kp, Dp, ldy, Dp, 0, b.ST, Kp, b.ds, Kp, 0, FULL);
                    FN(chunk_gemm_)(Lp, Kp, Lp, b.G, Lp, 0, le, Kp, b.ds, Kp, 1, A_LOWER);
                    FN(chunk_gemm_)(Lp, Kp, Dp, lx, Dp, 0, b.RT, Kp, b.de, Kp, 0, FULL);
                    FN(chunk_gemm_)(Lp, Kp, Lp, b.G, Lp, 1, ls, Kp, b.de, Kp, 1, A_UPPER);
                    FN(chunk_gemm_)(Lp, Dp, Kp, le, Kp, 0, b.R, Dp, b.dx, Dp, 0, FULL);
                    FN(chunk_gemm_)(Lp, Dp, Lp, b.A, Lp, 1, ldy, Dp, b.dx, Dp, 1, A_UPPER);
                    if (!col) {
                        FN(chunk_mul_)(b.ds, Kp, b.fpos, Xp, Lp, Kp);
                        FN(chunk_mul_)(b.de, Kp, b.fneg, Xp, Lp, Kp);
                    } else {
                        FN(chunk_mul_)(b.dx, Dp, b.fneg, Xp, Lp, Dp);
                        FN(chunk_load_)(y_strict + yb, strides[17], p, Lq, D, b.yc, Lp, Dp);
                    }
                    for (int64_t t = Lq - 1; t >= 0; t--) { /* restrict: the step's rows vectorise */
                        const REAL *restrict st_ = b.sc + t * Kp, *restrict et = b.ec + t * Kp;
                        const REAL *restrict xt = b.xc + t * Dp, *restrict dyt = b.dy + t * Dp;
                        const REAL *restrict gt = g + gb + (p + t) * strides[11];
                        REAL *restrict dst = b.ds + t * Kp, *restrict det = b.de + t * Kp;
                        REAL *restrict dgt = dg + gb + (p + t) * strides[11]; /* dg is laid out as g */
                        double *restrict run = b.run;
                        const REAL keep = p + t == T - 1 ? 0 : 1; /* the sequence's last e de (x dx) left out */
                        REAL x_dy = 0, s_e = 0;
#pragma omp simd reduction(+ : x_dy)
                        for (int64_t d = 0; d < D; d++) x_dy += xt[d] * dyt[d];
                        if (!col) {
                            for (int64_t k = 0; k < K; k++) run[k] += st_[k] * dst[k] - keep * et[k] * det[k];
                        } else { /* and dx's own term, (s . e) dy, after the strict dx it reads */
                            const REAL *restrict yt_ = b.yc + t * Dp;
                            REAL *restrict dxt = b.dx + t * Dp;
#pragma omp simd reduction(+ : s_e)
                            for (int64_t k = 0; k < K; k++) s_e += st_[k] * et[k];
                            for (int64_t d = 0; d < D; d++) run[d] += dyt[d] * yt_[d] - keep * xt[d] * dxt[d];
                            for (int64_t d = 0; d < D; d++) dxt[d] += s_e * dyt[d];
                        }
                        for (int64_t k = 0; k < X; k++) dgt[k] = gt[k] < CHUNK_LOG_ZERO ? 0 : (REAL)run[k];
                        for (int64_t k = 0; k < K; k++) {
                            dst[k] += x_dy * et[k];
                            det[k] += x_dy * st_[k];
                        }
                    }
                    FN(chunk_gemm_)(Kp, Dp, Lp, ls, Kp, 1, ldy, Dp, b.R, Dp, 1, FULL);
                    if (!col) FN(chunk_scale_rows_)(b.R, Dp, Kp, Dp, b.u);
                    else FN(chunk_scale_cols_)(b.R, Dp, Kp, b.u);
                    FN(chunk_store_)(b.ds, Kp, ds + sb, strides[2], p, Lq, K);
                    FN(chunk_store_)(b.de, Kp, de + eb, strides[5], p, Lq, K);
                    FN(chunk_store_)(b.dx, Dp, dx + xb, strides[8], p, Lq, D);
                }
            }
            FN(chunk_slots_out_)(b.slots, dm0, g0, g1, K, D);
        }
    }
}
#undef CVEC
#undef CVL
#undef CHUNK_SPAN
