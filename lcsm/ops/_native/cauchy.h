/* S4's Cauchy sums over conjugate pairs and their adjoint (lcsm/layers/s4.py, cauchy_conj):
 *
 *   S[h, m, k] = sum_n W[h, n, k] q[h, n, m],   q = 1 / ((g_m - lam_n)(g_m - conj(lam_n)))
 *
 * in real arithmetic, with a = Re lam, s = |lam|^2 and x = Re g - a: the denominator is
 * D = x^2 + (s - a^2 - (Im g)^2) + 2i x Im g and q = conj(D) / |D|^2. One work item is one h; the
 * roots g run a vector of VL at a time, one per lane, and q is formed in registers (never stored),
 * forward and backward. The adjoint is s4.py's _CauchyConj.backward's, whose comment derives it.
 * Written with GCC's vector extension (GCC and Clang). Included by scan.c once per type, as scan.h
 * is. */

#ifndef CAUCHY_BLOCK
#define CAUCHY_BLOCK
/* the most columns K (S4 has 8), and a vector's bytes: both read by native_scan.py, which checks K
 * and sizes the backward's scratch from them */
enum { KB = 8, VEC_BYTES = 64 };
const int64_t lcsm_cauchy_columns = KB, lcsm_cauchy_vector_bytes = VEC_BYTES;
#endif

/* a vector of roots, one per lane: 64 bytes, AVX-512's width (narrower machines split it) */
#define VEC FN(cauchy_vec_)
#define VL ((int64_t)(VEC_BYTES / sizeof(REAL)))
typedef REAL VEC __attribute__((vector_size(VEC_BYTES)));

/* gr, gi [H, M]; a, s [H, N2]; W [H, N2, K]; S [H, M, K, 2] (real and imaginary parts). VL roots at
 * a time, one per lane of a vector, each keeping its 2 KB sums in registers over the whole loop over
 * the poles n (a, s and W's row are the same for every lane): no pass over memory per pole. */
static void FN(cauchy_forward_)(const REAL *gr, const REAL *gi, const REAL *a, const REAL *s, const REAL *W,
                                REAL *S, int64_t M, int64_t N2, int64_t K, int64_t h) {
    const REAL *ah = a + h * N2, *sh = s + h * N2, *Wh = W + h * N2 * K;
    for (int64_t m0 = 0; m0 < M; m0 += VL) {
        const int64_t w = M - m0 < VL ? M - m0 : VL;
        REAL lanes_r[VL], lanes_i[VL];
        for (int64_t l = 0; l < VL; l++) { /* the tail's idle lanes repeat its last root */
            lanes_r[l] = gr[h * M + m0 + (l < w ? l : w - 1)];
            lanes_i[l] = gi[h * M + m0 + (l < w ? l : w - 1)];
        }
        VEC xr, xi, acc[2 * KB] = {0};
        __builtin_memcpy(&xr, lanes_r, sizeof xr);
        __builtin_memcpy(&xi, lanes_i, sizeof xi);
        const VEC xi2 = xi * xi, xi_2 = -2 * xi;
        for (int64_t n = 0; n < N2; n++) {
            const VEC x = xr - ah[n], dr = x * x + ((sh[n] - ah[n] * ah[n]) - xi2), di = x * xi_2;
            const VEC r = 1 / (dr * dr + di * di), qr = dr * r, qi = di * r;
            const REAL *Wn = Wh + n * K;
            for (int64_t k = 0; k < K; k++) {
                acc[2 * k] += Wn[k] * qr;
                acc[2 * k + 1] += Wn[k] * qi;
            }
        }
        REAL out[2 * KB][VL];
        __builtin_memcpy(out, acc, sizeof out);
        for (int64_t l = 0; l < w; l++)
            for (int64_t k = 0; k < 2 * K; k++) S[(h * M + m0 + l) * K * 2 + k] = out[k][l];
    }
}

/* gS [H, M, K, 2]: S's cotangent. Gradients: dg [H, M, 2], da, ds [H, N2], dW [H, N2, K]. VL roots at
 * a time, as the forward: per lane, q, the cotangent of q (gq = sum_k W G_k) and T's two parts (T0 =
 * -Re t, T1 = Im t / 2 with t = -gq conj(q)^2, s4.py's _CauchyConj.backward) stay in registers;
 * the sums over the roots (dW, da, ds) are kept per lane in `acc` [N2][K + 2] vectors and summed
 * across lanes once per row. */
static void FN(cauchy_backward_)(const REAL *gr, const REAL *gi, const REAL *a, const REAL *s, const REAL *W,
                                 const REAL *gS, REAL *dg, REAL *da, REAL *ds, REAL *dW, int64_t M, int64_t N2,
                                 int64_t K, int64_t h, VEC *acc) {
    const REAL *ah = a + h * N2, *sh = s + h * N2, *Wh = W + h * N2 * K;
    const int64_t stride = K + 2; /* acc[n]: dW's K lanes, then da's and ds's */
    for (int64_t j = 0; j < N2 * stride; j++) acc[j] = (VEC){0};
    for (int64_t m0 = 0; m0 < M; m0 += VL) {
        const int64_t w = M - m0 < VL ? M - m0 : VL;
        REAL lanes_r[VL], lanes_i[VL], lanes_g[2 * KB][VL];
        for (int64_t l = 0; l < VL; l++) { /* idle lanes: the last root, with a zero cotangent */
            lanes_r[l] = gr[h * M + m0 + (l < w ? l : w - 1)];
            lanes_i[l] = gi[h * M + m0 + (l < w ? l : w - 1)];
            for (int64_t k = 0; k < 2 * KB; k++)
                lanes_g[k][l] = l < w && k < 2 * K ? gS[(h * M + m0 + l) * K * 2 + k] : 0;
        }
        VEC xr, xi, G[2 * KB];
        __builtin_memcpy(&xr, lanes_r, sizeof xr);
        __builtin_memcpy(&xi, lanes_i, sizeof xi);
        __builtin_memcpy(G, lanes_g, sizeof G);
        const VEC xi2 = xi * xi, xi_2 = -2 * xi;
        VEC s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}; /* sums over n of T0, a T0, T1, a T1 */
        for (int64_t n = 0; n < N2; n++) {
            const REAL an = ah[n];
            const VEC x = xr - an, dr = x * x + ((sh[n] - an * an) - xi2), di = x * xi_2;
            const VEC r = 1 / (dr * dr + di * di), qr = dr * r, qi = di * r;
            const REAL *Wn = Wh + n * K;
            VEC *acc_n = acc + n * stride, gqr = {0}, gqi = {0};
            for (int64_t k = 0; k < K; k++) {
                gqr += Wn[k] * G[2 * k];
                gqi += Wn[k] * G[2 * k + 1];
                acc_n[k] += G[2 * k] * qr + G[2 * k + 1] * qi;
            }
            const VEC u = qr * qr - qi * qi, v = qr * qi;
            const VEC t0 = gqr * u + 2 * gqi * v, t1 = gqr * v - gqi * u / 2;
            s0 += t0;
            s1 += an * t0;
            s2 += t1;
            s3 += an * t1;
            acc_n[K] += 2 * xr * t0 - 4 * xi * t1;
            acc_n[K + 1] -= t0;
        }
        const VEC t0_r = -s0, t1_r = -s1, t0_i = 2 * s2, t1_i = 2 * s3;
        const VEC out_r = 2 * (xr * t0_r + xi * t0_i - t1_r), out_i = 2 * (xr * t0_i - xi * t0_r - t1_i);
        REAL parts[2][VL];
        __builtin_memcpy(parts[0], &out_r, sizeof out_r);
        __builtin_memcpy(parts[1], &out_i, sizeof out_i);
        for (int64_t l = 0; l < w; l++) {
            dg[(h * M + m0 + l) * 2] = parts[0][l];
            dg[(h * M + m0 + l) * 2 + 1] = parts[1][l];
        }
    }
    for (int64_t n = 0; n < N2; n++) {
        REAL sums[KB + 2];
        for (int64_t k = 0; k < K + 2; k++) {
            REAL lanes[VL], total = 0;
            __builtin_memcpy(lanes, acc + n * stride + k, sizeof lanes);
            for (int64_t l = 0; l < VL; l++) total += lanes[l];
            sums[k] = total;
        }
        for (int64_t k = 0; k < K; k++) dW[(h * N2 + n) * K + k] = sums[k];
        da[h * N2 + n] = sums[K];
        ds[h * N2 + n] = sums[K + 1];
    }
}

/* Every row h < H (the work items) on `threads` OpenMP threads; K <= KB. The backward's threads
 * each have their own scratch of `per_thread` values, at least (N2 (K + 2) + 1) VL. */
void FN(cauchy_forward_all_)(const REAL *gr, const REAL *gi, const REAL *a, const REAL *s, const REAL *W, REAL *S,
                             int64_t M, int64_t N2, int64_t K, int64_t H, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++)
        FN(cauchy_forward_)(gr, gi, a, s, W, S, M, N2, K, h);
}

void FN(cauchy_backward_all_)(const REAL *gr, const REAL *gi, const REAL *a, const REAL *s, const REAL *W,
                              const REAL *gS, REAL *dg, REAL *da, REAL *ds, REAL *dW, int64_t M, int64_t N2,
                              int64_t K, int64_t H, int64_t threads, REAL *scratch, int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++) {
        /* this thread's accumulators, on a vector boundary (per_thread leaves a vector's slack) */
        const uintptr_t at = (uintptr_t)(scratch + THREAD_NUM * per_thread), align = sizeof(VEC);
        FN(cauchy_backward_)(gr, gi, a, s, W, gS, dg, da, ds, dW, M, N2, K, h, (VEC *)((at + align - 1) / align * align));
    }
}
#undef VEC
#undef VL
