/* S4's Cauchy sums over conjugate pairs and their adjoint (lcsm/layers/s4.py, cauchy_conj):
 *
 *   S[h, m, k] = sum_n W[h, n, k] q[h, n, m],   q = 1 / ((g_m - lam_n)(g_m - conj(lam_n)))
 *
 * in real arithmetic, with a = Re lam, s = |lam|^2 and x = Re g - a: the denominator is
 * D = x^2 + (s - a^2 - (Im g)^2) + 2i x Im g and q = conj(D) / |D|^2. One work item is one h; the
 * roots g run in blocks of MB, along which every loop vectorises, and q is formed block by block
 * (never stored), forward and backward. The adjoint is s4.py's _CauchyConj.backward's, whose
 * comment derives it. Included by scan.c once per type, as scan.h is. */

#ifndef CAUCHY_BLOCK
#define CAUCHY_BLOCK
enum { MB = 64 };
/* read by native_scan.py, which sizes the scratch from it */
const int64_t lcsm_cauchy_block = MB;
#endif

/* q's real and imaginary parts for roots m0 .. m0 + w of row h and pole (a, c = s - a^2). */
static inline void FN(pair_inverse_)(const REAL *gr, const REAL *gi, REAL a, REAL c, int64_t w, REAL *qr,
                                     REAL *qi) {
#pragma omp simd
    for (int64_t m = 0; m < w; m++) {
        REAL x = gr[m] - a, dr = x * x + c - gi[m] * gi[m], di = -2 * x * gi[m];
        REAL r = 1 / (dr * dr + di * di);
        qr[m] = dr * r;
        qi[m] = di * r;
    }
}

/* gr, gi [H, M]; a, s [H, N2]; W [H, N2, K]; S [H, M, K, 2] (real and imaginary parts). */
static void FN(cauchy_forward_)(const REAL *gr, const REAL *gi, const REAL *a, const REAL *s, const REAL *W,
                                REAL *S, int64_t M, int64_t N2, int64_t K, int64_t h, REAL *scratch) {
    REAL *qr = scratch, *qi = qr + MB, *acc = qi + MB; /* acc: [K][2][MB] */
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t w = M - m0 < MB ? M - m0 : MB;
        for (int64_t j = 0; j < 2 * K * MB; j++) acc[j] = 0;
        for (int64_t n = 0; n < N2; n++) {
            const REAL an = a[h * N2 + n], *Wn = W + (h * N2 + n) * K;
            FN(pair_inverse_)(gr + h * M + m0, gi + h * M + m0, an, s[h * N2 + n] - an * an, w, qr, qi);
            for (int64_t k = 0; k < K; k++) {
                REAL *re = acc + 2 * k * MB, *im = re + MB, wk = Wn[k];
#pragma omp simd
                for (int64_t m = 0; m < w; m++) {
                    re[m] += wk * qr[m];
                    im[m] += wk * qi[m];
                }
            }
        }
        for (int64_t m = 0; m < w; m++)
            for (int64_t k = 0; k < K; k++) {
                REAL *out = S + ((h * M + m0 + m) * K + k) * 2;
                out[0] = acc[2 * k * MB + m];
                out[1] = acc[(2 * k + 1) * MB + m];
            }
    }
}

/* gS [H, M, K, 2]: S's cotangent. Gradients: dg [H, M, 2], da, ds [H, N2], dW [H, N2, K]. */
static void FN(cauchy_backward_)(const REAL *gr, const REAL *gi, const REAL *a, const REAL *s, const REAL *W,
                                 const REAL *gS, REAL *dg, REAL *da, REAL *ds, REAL *dW, int64_t M, int64_t N2,
                                 int64_t K, int64_t h, REAL *scratch) {
    /* q, the cotangent of q (gq), T's two parts, the four sums over n, and gS's block as [K][2][MB] */
    REAL *qr = scratch, *qi = qr + MB, *gqr = qi + MB, *gqi = gqr + MB, *sums = gqi + MB, *G = sums + 4 * MB;
    for (int64_t n = 0; n < N2; n++) {
        da[h * N2 + n] = 0;
        ds[h * N2 + n] = 0;
        for (int64_t k = 0; k < K; k++) dW[(h * N2 + n) * K + k] = 0;
    }
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t w = M - m0 < MB ? M - m0 : MB;
        const REAL *grb = gr + h * M + m0, *gib = gi + h * M + m0;
        for (int64_t m = 0; m < w; m++)
            for (int64_t k = 0; k < K; k++) {
                const REAL *in = gS + ((h * M + m0 + m) * K + k) * 2;
                G[2 * k * MB + m] = in[0];
                G[(2 * k + 1) * MB + m] = in[1];
            }
        for (int64_t j = 0; j < 4 * MB; j++) sums[j] = 0;
        for (int64_t n = 0; n < N2; n++) {
            const REAL an = a[h * N2 + n], *Wn = W + (h * N2 + n) * K;
            REAL *dWn = dW + (h * N2 + n) * K;
            FN(pair_inverse_)(grb, gib, an, s[h * N2 + n] - an * an, w, qr, qi);
            for (int64_t m = 0; m < w; m++) gqr[m] = gqi[m] = 0;
            for (int64_t k = 0; k < K; k++) {
                const REAL *Gr = G + 2 * k * MB, *Gi = Gr + MB, wk = Wn[k];
                REAL gw = 0;
#pragma omp simd reduction(+ : gw)
                for (int64_t m = 0; m < w; m++) {
                    gqr[m] += wk * Gr[m];
                    gqi[m] += wk * Gi[m];
                    gw += Gr[m] * qr[m] + Gi[m] * qi[m];
                }
                dWn[k] += gw;
            }
            /* T0 = -Re t, T1 = Im t / 2 with t = -gq conj(q)^2 (s4.py's backward) */
            REAL sum_gr_t0 = 0, sum_t0 = 0, sum_gi_t1 = 0;
            REAL *s0 = sums, *s1 = sums + MB, *s2 = sums + 2 * MB, *s3 = sums + 3 * MB;
#pragma omp simd reduction(+ : sum_gr_t0, sum_t0, sum_gi_t1)
            for (int64_t m = 0; m < w; m++) {
                REAL u = qr[m] * qr[m] - qi[m] * qi[m], v = qr[m] * qi[m];
                REAL t0 = gqr[m] * u + 2 * gqi[m] * v, t1 = gqr[m] * v - gqi[m] * u / 2;
                s0[m] += t0;
                s1[m] += an * t0;
                s2[m] += t1;
                s3[m] += an * t1;
                sum_gr_t0 += grb[m] * t0;
                sum_t0 += t0;
                sum_gi_t1 += gib[m] * t1;
            }
            da[h * N2 + n] += 2 * sum_gr_t0 - 4 * sum_gi_t1;
            ds[h * N2 + n] -= sum_t0;
        }
        for (int64_t m = 0; m < w; m++) {
            const REAL t0_r = -sums[m], t1_r = -sums[MB + m], t0_i = 2 * sums[2 * MB + m], t1_i = 2 * sums[3 * MB + m];
            REAL *out = dg + (h * M + m0 + m) * 2;
            out[0] = 2 * (grb[m] * t0_r + gib[m] * t0_i - t1_r);
            out[1] = 2 * (grb[m] * t0_i - gib[m] * t0_r - t1_i);
        }
    }
}

/* Every row h < H (the work items) on `threads` OpenMP threads, each with its own scratch of
 * `per_thread` values (at least (2 K + 2) MB forward, (2 K + 8) MB backward). */
void FN(cauchy_forward_all_)(const REAL *gr, const REAL *gi, const REAL *a, const REAL *s, const REAL *W, REAL *S,
                             int64_t M, int64_t N2, int64_t K, int64_t H, int64_t threads, REAL *scratch,
                             int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++)
        FN(cauchy_forward_)(gr, gi, a, s, W, S, M, N2, K, h, scratch + THREAD_NUM * per_thread);
}

void FN(cauchy_backward_all_)(const REAL *gr, const REAL *gi, const REAL *a, const REAL *s, const REAL *W,
                              const REAL *gS, REAL *dg, REAL *da, REAL *ds, REAL *dW, int64_t M, int64_t N2,
                              int64_t K, int64_t H, int64_t threads, REAL *scratch, int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++)
        FN(cauchy_backward_)(gr, gi, a, s, W, gS, dg, da, ds, dW, M, N2, K, h, scratch + THREAD_NUM * per_thread);
}
