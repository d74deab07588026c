/* The chunk form of EOS without a decay or with a scalar one (lcsm/ops/chunk_matmul.py's matmul
 * kernel, kinds "none" and "scalar"; lcsm.ops.native_chunk), forward and backward, with its
 * products on register tiles:
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

/* A chunk's decay spans at most exp(-CHUNK_SPAN) from its start: W_tj = exp(Gam_t) exp(-Gam_j), every
 * factor within exp(+-CHUNK_SPAN) (chunk_matmul.py's SAFE_SPAN: e^30 keeps float32 far from
 * overflow); beyond it each W_tj is its own exp. */
#define CHUNK_SPAN ((double)(sizeof(REAL) == 4 ? 30 : 200))

/* a padded size: n rounded up to whole vectors */
static inline int64_t FN(chunk_pad_)(int64_t n) { return (n + CVL - 1) / CVL * CVL; }

/* the scratch one thread needs (REALs), forward and backward: the padded blocks below */
int64_t FN(chunk_scratch_)(int64_t C, int64_t K, int64_t D) {
    const int64_t c = FN(chunk_pad_)(C), k = FN(chunk_pad_)(K), d = FN(chunk_pad_)(D);
    /* blocks, then the decay's W [c, c], a, b and 1 / a [c] and Gam [c] in double (2 REALs or 1 each) */
    return 5 * c * k + 5 * c * d + 3 * c * c + 4 * k * d + 5 * c;
}

/* a chunk's decay factors from its logs g (L steps, stride st): W [Cp, Cp] (W_tj for j <= t, 0
 * above), a, b and inv = 1 / a [Cp] (1, 0 and 1 past L), returning exp(Gam_last). Without g: W all
 * ones on and below the diagonal, a = b = inv = 1. */
static REAL FN(chunk_decay_)(const REAL *g, int64_t st, int64_t t0, int64_t L, int64_t Cp, double *gam, REAL *W,
                             REAL *a, REAL *b, REAL *inv) {
    double total = 0;
    for (int64_t t = 0; t < L; t++) gam[t] = total += g ? (double)g[(t0 + t) * st] : 0;
    for (int64_t t = 0; t < Cp; t++) {
        REAL *w = W + t * Cp;
        for (int64_t j = 0; j < Cp; j++) w[j] = 0;
        if (t >= L) {
            a[t] = 1, b[t] = 0, inv[t] = 1;
            continue;
        }
        a[t] = g ? FN(exp_)((REAL)gam[t]) : 1;
        b[t] = g ? FN(exp_)((REAL)(total - gam[t])) : 1;
        inv[t] = g ? FN(exp_)((REAL)-gam[t]) : 1;
        if (g && -total > CHUNK_SPAN)
            for (int64_t j = 0; j <= t; j++) w[j] = FN(exp_)((REAL)(gam[t] - gam[j]));
        else /* every factor within exp(CHUNK_SPAN): exp(Gam_t) exp(-Gam_j), a product, not an exp */
            for (int64_t j = 0; j <= t; j++) w[j] = a[t] * inv[j];
    }
    return g ? FN(exp_)((REAL)total) : 1;
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

/* Strides (batch, head, time) of s, e, x, g and y in that order; g NULL: no decay. m_strict
 * (o_T m_{T-1}) is written only with g. */
void FN(chunk_forward_all_)(const REAL *s, const REAL *e, const REAL *x, const REAL *g, const REAL *m0, REAL *y,
                            REAL *mT, REAL *m_strict, REAL *starts, const int64_t *strides, int64_t H, int64_t T,
                            int64_t K, int64_t D, int64_t C, int64_t items, int64_t threads, REAL *scratch,
                            int64_t per_thread) {
    const int64_t Cp = FN(chunk_pad_)(C), Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D), N = (T + C - 1) / C;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t b = item / H, h = item % H;
        REAL *sc = scratch + THREAD_NUM * per_thread, *ec = sc + Cp * Kp, *eT = ec + Cp * Kp, *xc = eT + Kp * Cp;
        REAL *A = xc + Cp * Dp, *S = A + Cp * Cp, *yc = S + Kp * Dp, *W = yc + Cp * Dp, *fa = W + Cp * Cp;
        REAL *fb = fa + Cp, *finv = fb + Cp;
        double *gam = (double *)(finv + Cp);
        const REAL *sb = s + b * strides[0] + h * strides[1], *eb = e + b * strides[3] + h * strides[4];
        const REAL *xb = x + b * strides[6] + h * strides[7], *gb = g ? g + b * strides[9] + h * strides[10] : 0;
        REAL *yb = y + b * strides[12] + h * strides[13], *kept = starts + item * N * K * D;
        for (int64_t k = 0; k < Kp * Dp; k++) S[k] = 0;
        if (m0) FN(chunk_dense_)(m0 + item * K * D, D, S, Dp, K, D);
        for (int64_t n = 0; n < N; n++) {
            const int64_t t0 = n * C, L = T - t0 < C ? T - t0 : C;
            FN(chunk_load_)(sb, strides[2], t0, L, K, sc, Cp, Kp);
            FN(chunk_load_)(eb, strides[5], t0, L, K, ec, Cp, Kp);
            FN(chunk_load_)(xb, strides[8], t0, L, D, xc, Cp, Dp);
            const REAL last = FN(chunk_decay_)(gb, strides[11], t0, L, Cp, gam, W, fa, fb, finv);
            FN(chunk_transpose_)(ec, Kp, Cp, Kp, eT, Cp);
            FN(chunk_gemm_)(Cp, Cp, Kp, sc, Kp, 0, eT, Cp, A, Cp, 0);
            FN(chunk_mask_)(A, W, Cp, Cp, 0);
            FN(chunk_gemm_)(Cp, Dp, Kp, sc, Kp, 0, S, Dp, yc, Dp, 0);
            FN(chunk_scale_rows_)(yc, Dp, Cp, Dp, fa);
            FN(chunk_gemm_)(Cp, Dp, Cp, A, Cp, 0, xc, Dp, yc, Dp, 1);
            FN(chunk_dense_)(S, Dp, kept + n * K * D, D, K, D);
            for (int64_t k = 0; k < Kp * Dp; k++) S[k] *= last;
            FN(chunk_scale_rows_)(ec, Kp, Cp, Kp, fb);
            if (g && n == N - 1) { /* o_T m_{T-1}: every input but the last step's */
                FN(chunk_gemm_)(Kp, Dp, L - 1, ec, Kp, 1, xc, Dp, S, Dp, 1);
                FN(chunk_dense_)(S, Dp, m_strict + item * K * D, D, K, D);
                FN(chunk_gemm_)(Kp, Dp, 1, ec + (L - 1) * Kp, Kp, 1, xc + (L - 1) * Dp, Dp, S, Dp, 1);
            } else {
                FN(chunk_gemm_)(Kp, Dp, Cp, ec, Kp, 1, xc, Dp, S, Dp, 1);
            }
            FN(chunk_store_)(yc, Dp, yb, strides[14], t0, L, D);
        }
        FN(chunk_dense_)(S, Dp, mT + item * K * D, D, K, D);
    }
}

/* Strides of s, e, x, g and dy in that order; ds, de, dx (and dg) are laid out as s, e, x (g);
 * carry [items]: <dM, o_T m_{T-1}> of each item (with g). */
void FN(chunk_backward_all_)(const REAL *s, const REAL *e, const REAL *x, const REAL *g, const REAL *starts,
                             const REAL *dy, const REAL *dmT, const REAL *carry, REAL *ds, REAL *de, REAL *dx,
                             REAL *dg, REAL *dm0, const int64_t *strides, int64_t H, int64_t T, int64_t K, int64_t D,
                             int64_t C, int64_t items, int64_t threads, REAL *scratch, int64_t per_thread) {
    const int64_t Cp = FN(chunk_pad_)(C), Kp = FN(chunk_pad_)(K), Dp = FN(chunk_pad_)(D), N = (T + C - 1) / C;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t b = item / H, h = item % H;
        REAL *sc = scratch + THREAD_NUM * per_thread, *ec = sc + Cp * Kp, *eT = ec + Cp * Kp, *dsc = eT + Kp * Cp;
        REAL *dec = dsc + Cp * Kp, *xc = dec + Cp * Kp, *dyc = xc + Cp * Dp, *xT = dyc + Cp * Dp, *dxc = xT + Dp * Cp;
        REAL *A = dxc + Cp * Dp, *G = A + Cp * Cp, *S = G + Cp * Cp, *R = S + Kp * Dp, *ST = R + Kp * Dp;
        REAL *RT = ST + Dp * Kp, *W = RT + Dp * Kp, *fa = W + Cp * Cp, *fb = fa + Cp, *finv = fb + Cp;
        double *gam = (double *)(finv + Cp);
        const int64_t sb = b * strides[0] + h * strides[1], eb = b * strides[3] + h * strides[4];
        const int64_t xb = b * strides[6] + h * strides[7], gb = b * strides[9] + h * strides[10];
        const REAL *dyb = dy + b * strides[12] + h * strides[13], *kept = starts + item * N * K * D;
        double running = g && carry ? carry[item] : 0; /* the decay gradient's reverse cumulative sum */
        for (int64_t k = 0; k < Kp * Dp; k++) R[k] = 0;
        if (dmT) FN(chunk_dense_)(dmT + item * K * D, D, R, Dp, K, D);
        for (int64_t n = N - 1; n >= 0; n--) {
            const int64_t t0 = n * C, L = T - t0 < C ? T - t0 : C;
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
            FN(chunk_gemm_)(Cp, Cp, Kp, sc, Kp, 0, eT, Cp, A, Cp, 0);
            FN(chunk_mask_)(A, W, Cp, Cp, 0);
            FN(chunk_gemm_)(Cp, Cp, Dp, dyc, Dp, 0, xT, Cp, G, Cp, 0);
            FN(chunk_mask_)(G, W, Cp, Cp, 1);
            FN(chunk_gemm_)(Cp, Kp, Dp, dyc, Dp, 0, ST, Kp, dsc, Kp, 0);
            FN(chunk_scale_rows_)(dsc, Kp, Cp, Kp, fa);
            FN(chunk_gemm_)(Cp, Kp, Cp, G, Cp, 0, ec, Kp, dsc, Kp, 1);
            FN(chunk_gemm_)(Cp, Kp, Dp, xc, Dp, 0, RT, Kp, dec, Kp, 0);
            FN(chunk_scale_rows_)(dec, Kp, Cp, Kp, fb);
            FN(chunk_gemm_)(Cp, Kp, Cp, G, Cp, 1, sc, Kp, dec, Kp, 1);
            FN(chunk_gemm_)(Cp, Dp, Kp, ec, Kp, 0, R, Dp, dxc, Dp, 0);
            FN(chunk_scale_rows_)(dxc, Dp, Cp, Dp, fb);
            FN(chunk_gemm_)(Cp, Dp, Cp, A, Cp, 1, dyc, Dp, dxc, Dp, 1);
            for (int64_t t = L - 1; t >= 0; t--) {
                const REAL *st_ = sc + t * Kp, *et = ec + t * Kp, *xt = xc + t * Dp, *dyt = dyc + t * Dp;
                REAL *dst = dsc + t * Kp, *det = dec + t * Kp, x_dy = 0, s_ds = 0, e_de = 0;
                for (int64_t d = 0; d < D; d++) x_dy += xt[d] * dyt[d];
                for (int64_t k = 0; k < K; k++) {
                    s_ds += st_[k] * dst[k];
                    e_de += et[k] * det[k];
                    dst[k] += x_dy * et[k];
                    det[k] += x_dy * st_[k];
                }
                if (g) {
                    running += s_ds - (t0 + t == T - 1 ? 0 : e_de);
                    dg[b * strides[15] + h * strides[16] + (t0 + t) * strides[17]] = (REAL)running;
                }
            }
            FN(chunk_scale_rows_)(sc, Kp, Cp, Kp, fa);
            for (int64_t k = 0; k < Kp * Dp; k++) R[k] *= last;
            FN(chunk_gemm_)(Kp, Dp, Cp, sc, Kp, 1, dyc, Dp, R, Dp, 1);
            FN(chunk_store_)(dsc, Kp, ds + sb, strides[2], t0, L, K);
            FN(chunk_store_)(dec, Kp, de + eb, strides[5], t0, L, K);
            FN(chunk_store_)(dxc, Dp, dx + xb, strides[8], t0, L, D);
        }
        FN(chunk_dense_)(R, Dp, dm0 + item * K * D, D, K, D);
    }
}
#undef CVEC
#undef CVL
#undef CHUNK_SPAN
