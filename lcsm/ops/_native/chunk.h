/* The chunk form of EOS without a decay (lcsm/ops/chunk_matmul.py's matmul kernel, kind "none";
 * lcsm.ops.native_chunk), forward and backward, with its products on register tiles:
 *
 *   m_t = m_{t-1} + e_t i_t^T,   y_t = m_t^T s_t
 *
 * per work item (batch row b, head h), the chunks of C steps in order. With s, e [C, K], i [C, D]
 * a chunk's rows and S the memory at its start,
 *
 *   y = tril(s e^T) i + s S,   S <- S + e^T i
 *
 * and backward, the chunks in reverse with dA the cotangent of the memory after the chunk (dM, the
 * final state's, after the last):
 *
 *   A = tril(s e^T), G = tril(dy i^T)
 *   ds = G e + dy S^T,   de = G^T s + i dA^T,   di = A^T dy + e dA,   dA <- dA + s^T dy
 *
 * (chunk_matmul.py's _no_decay_backward). The chunk-start memories S are kept by the forward for
 * the backward ([B, H, N, K, D]). A chunk's operands are copied into per-thread scratch, zero-padded
 * to whole vectors in C, K and D, so that every product is a `gemm_` of whole tiles: 4 rows by up
 * to 4 vectors of accumulators in registers over the inner dimension, the left operand read a
 * scalar at a time in either orientation (s or s^T without a copy), the right one a row of vectors.
 * The tensors are read and written through their strides ([B, H, T, X] views whose last stride is
 * 1: the caller's [B, T, H, X] layout, or a broadcast one). Included by scan.c once per type. */

#define CVEC FN(chunk_vec_)
#define CVL ((int64_t)(64 / sizeof(REAL)))
/* a vector of CVL values, loaded and stored at any element's alignment */
typedef REAL CVEC __attribute__((vector_size(64), aligned(sizeof(REAL))));

/* out[4 rows, nv vectors] (+)= a[4 rows, k] b[k, nv vectors]; a's element (r, q) at a[r * ar + q * ac] */
static inline __attribute__((always_inline)) void FN(chunk_tile_)(const REAL *a, int64_t ar, int64_t ac,
                                                                 const REAL *b, int64_t ldb, REAL *out, int64_t ldo,
                                                                 int64_t k, const int nv, int accumulate) {
    CVEC acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = accumulate ? *(const CVEC *)(out + r * ldo + v * CVL) : (CVEC){0};
    for (int64_t q = 0; q < k; q++) {
        CVEC row[4];
        for (int v = 0; v < nv; v++) row[v] = *(const CVEC *)(b + q * ldb + v * CVL);
        for (int r = 0; r < 4; r++) {
            const REAL x = a[r * ar + q * ac];
            for (int v = 0; v < nv; v++) acc[r][v] += x * row[v];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++) *(CVEC *)(out + r * ldo + v * CVL) = acc[r][v];
}

/* out[m, n] (+)= a[m, k] b[k, n] with m a multiple of 4 and n of CVL; a transposed (its element
 * (r, q) at a[q * lda + r]) when `at` */
static void FN(chunk_gemm_)(int64_t m, int64_t n, int64_t k, const REAL *a, int64_t lda, int at, const REAL *b,
                            int64_t ldb, REAL *out, int64_t ldo, int accumulate) {
    const int64_t ar = at ? 1 : lda, ac = at ? lda : 1;
    for (int64_t i = 0; i < m; i += 4) {
        const REAL *ai = a + i * ar;
        REAL *oi = out + i * ldo;
        int64_t j = 0;
        for (; j + 4 * CVL <= n; j += 4 * CVL) FN(chunk_tile_)(ai, ar, ac, b + j, ldb, oi + j, ldo, k, 4, accumulate);
        if (j + 2 * CVL <= n) {
            FN(chunk_tile_)(ai, ar, ac, b + j, ldb, oi + j, ldo, k, 2, accumulate);
            j += 2 * CVL;
        }
        if (j < n) FN(chunk_tile_)(ai, ar, ac, b + j, ldb, oi + j, ldo, k, 1, accumulate);
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

/* dst [cols, ldd] = src [rows, lds]^T over the rows x cols block */
static void FN(chunk_transpose_)(const REAL *src, int64_t lds, int64_t rows, int64_t cols, REAL *dst, int64_t ldd) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) dst[c * ldd + r] = src[r * lds + c];
}

/* zero the entries above the diagonal of a [n, n] (ld) block: the causal mask j <= t */
static void FN(chunk_tril_)(REAL *a, int64_t n, int64_t ld) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = t + 1; j < n; j++) a[t * ld + j] = 0;
}

/* a padded size: n rounded up to whole vectors */
static inline int64_t FN(chunk_pad_)(int64_t n) { return (n + CVL - 1) / CVL * CVL; }

/* the scratch one thread needs (REALs), forward and backward: the padded blocks below */
int64_t FN(chunk_scratch_)(int64_t C, int64_t K, int64_t D) {
    const int64_t c = FN(chunk_pad_)(C), k = FN(chunk_pad_)(K), d = FN(chunk_pad_)(D);
    return 5 * c * k + 5 * c * d + 2 * c * c + 4 * k * d;
}

/* Strides of a [B, H, T, X] view: batch, head, time (the last dim's is 1). */
typedef struct {
    int64_t b, h, t;
} FN(chunk_strides_);

void FN(chunk_forward_all_)(const REAL *s, const REAL *e, const REAL *x, const REAL *m0, REAL *y, REAL *mT,
                            REAL *starts, const int64_t *strides, int64_t H, int64_t T, int64_t K,
                            int64_t D, int64_t C, int64_t items, int64_t threads, REAL *scratch, int64_t per_thread) {
    /* strides: s's, e's, x's, y's (b, h, t) */
    const int64_t Cp = FN(chunk_pad_)(C), Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D), N = (T + C - 1) / C;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t b = item / H, h = item % H;
        REAL *sc = scratch + THREAD_NUM * per_thread, *ec = sc + Cp * Kp, *eT = ec + Cp * Kp, *xc = eT + Kp * Cp;
        REAL *A = xc + Cp * Dp, *S = A + Cp * Cp, *yc = S + Kp * Dp;
        const REAL *sb = s + b * strides[0] + h * strides[1], *eb = e + b * strides[3] + h * strides[4];
        const REAL *xb = x + b * strides[6] + h * strides[7];
        REAL *yb = y + b * strides[9] + h * strides[10], *kept = starts + item * N * K * D;
        for (int64_t k = 0; k < Kp; k++)
            for (int64_t d = 0; d < Dp; d++) S[k * Dp + d] = m0 && k < K && d < D ? m0[(item * K + k) * D + d] : 0;
        for (int64_t n = 0; n < N; n++) {
            const int64_t t0 = n * C, L = T - t0 < C ? T - t0 : C;
            FN(chunk_load_)(sb, strides[2], t0, L, K, sc, Cp, Kp);
            FN(chunk_load_)(eb, strides[5], t0, L, K, ec, Cp, Kp);
            FN(chunk_load_)(xb, strides[8], t0, L, D, xc, Cp, Dp);
            FN(chunk_transpose_)(ec, Kp, Cp, Kp, eT, Cp);
            FN(chunk_gemm_)(Cp, Cp, Kp, sc, Kp, 0, eT, Cp, A, Cp, 0);
            FN(chunk_tril_)(A, Cp, Cp);
            FN(chunk_gemm_)(Cp, Dp, Kp, sc, Kp, 0, S, Dp, yc, Dp, 0);
            FN(chunk_gemm_)(Cp, Dp, Cp, A, Cp, 0, xc, Dp, yc, Dp, 1);
            for (int64_t k = 0; k < K; k++) memcpy(kept + (n * K + k) * D, S + k * Dp, D * sizeof(REAL));
            FN(chunk_gemm_)(Kp, Dp, Cp, ec, Kp, 1, xc, Dp, S, Dp, 1);
            FN(chunk_store_)(yc, Dp, yb, strides[11], t0, L, D);
        }
        for (int64_t k = 0; k < K; k++) memcpy(mT + (item * K + k) * D, S + k * Dp, D * sizeof(REAL));
    }
}

void FN(chunk_backward_all_)(const REAL *s, const REAL *e, const REAL *x, const REAL *starts, const REAL *dy,
                             const REAL *dmT, REAL *ds, REAL *de, REAL *dx, REAL *dm0, const int64_t *strides,
                             int64_t H, int64_t T, int64_t K, int64_t D, int64_t C, int64_t items,
                             int64_t threads, REAL *scratch, int64_t per_thread) {
    /* strides: s's, e's, x's, dy's (b, h, t); ds, de, dx are laid out as s, e, x are */
    const int64_t Cp = FN(chunk_pad_)(C), Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D), N = (T + C - 1) / C;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t b = item / H, h = item % H;
        REAL *sc = scratch + THREAD_NUM * per_thread, *ec = sc + Cp * Kp, *eT = ec + Cp * Kp, *dsc = eT + Kp * Cp;
        REAL *dec = dsc + Cp * Kp, *xc = dec + Cp * Kp, *dyc = xc + Cp * Dp, *xT = dyc + Cp * Dp, *dxc = xT + Dp * Cp;
        REAL *A = dxc + Cp * Dp, *G = A + Cp * Cp, *S = G + Cp * Cp, *dA = S + Kp * Dp, *ST = dA + Kp * Dp;
        REAL *dAT = ST + Dp * Kp;
        const int64_t sb = b * strides[0] + h * strides[1], eb = b * strides[3] + h * strides[4];
        const int64_t xb = b * strides[6] + h * strides[7];
        const REAL *dyb = dy + b * strides[9] + h * strides[10], *kept = starts + item * N * K * D;
        for (int64_t k = 0; k < Kp; k++)
            for (int64_t d = 0; d < Dp; d++) dA[k * Dp + d] = dmT && k < K && d < D ? dmT[(item * K + k) * D + d] : 0;
        for (int64_t n = N - 1; n >= 0; n--) {
            const int64_t t0 = n * C, L = T - t0 < C ? T - t0 : C;
            FN(chunk_load_)(s + sb, strides[2], t0, L, K, sc, Cp, Kp);
            FN(chunk_load_)(e + eb, strides[5], t0, L, K, ec, Cp, Kp);
            FN(chunk_load_)(x + xb, strides[8], t0, L, D, xc, Cp, Dp);
            FN(chunk_load_)(dyb, strides[11], t0, L, D, dyc, Cp, Dp);
            FN(chunk_load_)(kept + n * K * D, D, 0, K, D, S, Kp, Dp);
            FN(chunk_transpose_)(ec, Kp, Cp, Kp, eT, Cp);
            FN(chunk_transpose_)(xc, Dp, Cp, Dp, xT, Cp);
            FN(chunk_transpose_)(S, Dp, Kp, Dp, ST, Kp);
            FN(chunk_transpose_)(dA, Dp, Kp, Dp, dAT, Kp);
            FN(chunk_gemm_)(Cp, Cp, Kp, sc, Kp, 0, eT, Cp, A, Cp, 0);
            FN(chunk_tril_)(A, Cp, Cp);
            FN(chunk_gemm_)(Cp, Cp, Dp, dyc, Dp, 0, xT, Cp, G, Cp, 0);
            FN(chunk_tril_)(G, Cp, Cp);
            FN(chunk_gemm_)(Cp, Kp, Cp, G, Cp, 0, ec, Kp, dsc, Kp, 0);
            FN(chunk_gemm_)(Cp, Kp, Dp, dyc, Dp, 0, ST, Kp, dsc, Kp, 1);
            FN(chunk_gemm_)(Cp, Kp, Cp, G, Cp, 1, sc, Kp, dec, Kp, 0);
            FN(chunk_gemm_)(Cp, Kp, Dp, xc, Dp, 0, dAT, Kp, dec, Kp, 1);
            FN(chunk_gemm_)(Cp, Dp, Cp, A, Cp, 1, dyc, Dp, dxc, Dp, 0);
            FN(chunk_gemm_)(Cp, Dp, Kp, ec, Kp, 0, dA, Dp, dxc, Dp, 1);
            FN(chunk_gemm_)(Kp, Dp, Cp, sc, Kp, 1, dyc, Dp, dA, Dp, 1);
            FN(chunk_store_)(dsc, Kp, ds + sb, strides[2], t0, L, K);
            FN(chunk_store_)(dec, Kp, de + eb, strides[5], t0, L, K);
            FN(chunk_store_)(dxc, Dp, dx + xb, strides[8], t0, L, D);
        }
        for (int64_t k = 0; k < K; k++) memcpy(dm0 + (item * K + k) * D, dA + k * Dp, D * sizeof(REAL));
    }
}
#undef CVEC
#undef CVL
