/* S4's kernel spectrum (lcsm/layers/s4.py, S4._kernel): four Cauchy sums over conjugate pairs and
 * the Woodbury identity that combines them, with their adjoint:
 *
 *   S[h, m, k] = sum_n W[h, n, k] q[h, n, m],   q = 1 / ((g_m - lam_n)(g_m - conj(lam_n))),  k < 8
 *   k_j = g S_j - S_(4+j)  (j < 4),   K[h, m] = c_m (k_0 - k_1 k_2 / (1 + k_3))
 *
 * in real arithmetic, with a = Re lam, s = |lam|^2 and x = Re g - a: the denominator is
 * D = x^2 + (s - a^2 - (Im g)^2) + 2i x Im g and q = conj(D) / |D|^2. One work item is one h; the
 * roots g run a vector of VL at a time, one per lane, each lane keeping its 8 complex sums in
 * registers over the whole loop over the poles n (a, s and W's row are the same for every lane),
 * forward and backward; q is never stored. The forward also returns S, which the backward reads to
 * differentiate the Woodbury combination. The Cauchy sums' adjoint is s4.py's
 * _CauchyConj.backward's, whose comment derives it; the combination is holomorphic in g and S, so
 * its adjoint takes PyTorch's convention, grad_in = conj(d out / d in) grad_out. Written with GCC's
 * vector extension (GCC and Clang). Included by scan.c once per type, as scan.h is. */

#ifndef CAUCHY_BLOCK
#define CAUCHY_BLOCK
/* W's columns (the four sums' numerators over conjugate pairs), and a vector's bytes: read by
 * native_scan.py, which checks W and sizes the backward's scratch from them */
enum { SUMS = 8, VEC_BYTES = 64 };
const int64_t lcsm_cauchy_columns = SUMS, lcsm_cauchy_vector_bytes = VEC_BYTES;
#endif

/* a vector of roots, one per lane: 64 bytes, AVX-512's width (narrower machines split it) */
#define VEC FN(cauchy_vec_)
#define VL ((int64_t)(VEC_BYTES / sizeof(REAL)))
typedef REAL VEC __attribute__((vector_size(VEC_BYTES)));

/* VL values from src[(m0 + l) * stride] for the lanes l < w; the idle lanes (a row's tail) get the
 * last one (roots: a valid denominator) or `idle` where given (cotangents: zero). */
static inline VEC FN(cauchy_lanes_)(const REAL *src, int64_t m0, int64_t w, int64_t stride, const REAL *idle) {
    VEC v;
    if (stride == 1 && w == VL) {
        __builtin_memcpy(&v, src + m0, sizeof v);
        return v;
    }
    REAL lanes[VL];
    for (int64_t l = 0; l < VL; l++)
        lanes[l] = l < w ? src[(m0 + l) * stride] : idle ? *idle : src[(m0 + w - 1) * stride];
    __builtin_memcpy(&v, lanes, sizeof v);
    return v;
}

/* the lanes l < w of v to dst[(m0 + l) * stride] */
static inline void FN(cauchy_store_)(REAL *dst, VEC v, int64_t m0, int64_t w, int64_t stride) {
    if (stride == 1 && w == VL) {
        __builtin_memcpy(dst + m0, &v, sizeof v);
        return;
    }
    REAL lanes[VL];
    __builtin_memcpy(lanes, &v, sizeof v);
    for (int64_t l = 0; l < w; l++) dst[(m0 + l) * stride] = lanes[l];
}

/* The Woodbury combination's parts at one vector of roots g = xr + i xi from the sums S (Sr, Si):
 * k_j (kr, ki), 1 / |1 + k_3|^2 (inv) and w = k_1 k_2 / (1 + k_3) (wr, wi). */
static inline void FN(woodbury_)(VEC xr, VEC xi, const VEC *Sr, const VEC *Si, VEC *kr, VEC *ki, VEC *inv, VEC *wr,
                                 VEC *wi) {
    for (int j = 0; j < 4; j++) {
        kr[j] = xr * Sr[j] - xi * Si[j] - Sr[4 + j];
        ki[j] = xr * Si[j] + xi * Sr[j] - Si[4 + j];
    }
    const VEC dr = 1 + kr[3], di = ki[3], nr = kr[1] * kr[2] - ki[1] * ki[2], ni = kr[1] * ki[2] + ki[1] * kr[2];
    *inv = 1 / (dr * dr + di * di);
    *wr = (nr * dr + ni * di) * *inv;
    *wi = (ni * dr - nr * di) * *inv;
}

/* gr, gi [H, M]: g; cr, ci [M]: c; a, s [H, N2]; W [H, N2, 8]. Out: K [H, M, 2] (real and
 * imaginary parts) and S [H, 16, M] (each sum's real part, then its imaginary part: a lane's
 * values M apart, so that a vector of them is contiguous). */
static void FN(cauchy_forward_)(const REAL *gr, const REAL *gi, const REAL *cr, const REAL *ci, const REAL *a,
                                const REAL *s, const REAL *W, REAL *K, REAL *S, int64_t M, int64_t N2, int64_t h) {
    const REAL *ah = a + h * N2, *sh = s + h * N2, *Wh = W + h * N2 * SUMS;
    for (int64_t m0 = 0; m0 < M; m0 += VL) {
        const int64_t w = M - m0 < VL ? M - m0 : VL;
        const VEC xr = FN(cauchy_lanes_)(gr + h * M, m0, w, 1, 0), xi = FN(cauchy_lanes_)(gi + h * M, m0, w, 1, 0);
        const VEC xi2 = xi * xi, xi_2 = -2 * xi;
        VEC Sr[SUMS] = {0}, Si[SUMS] = {0};
        for (int64_t n = 0; n < N2; n++) {
            const VEC x = xr - ah[n], dr = x * x + ((sh[n] - ah[n] * ah[n]) - xi2), di = x * xi_2;
            const VEC r = 1 / (dr * dr + di * di), qr = dr * r, qi = di * r;
            const REAL *Wn = Wh + n * SUMS;
            for (int k = 0; k < SUMS; k++) {
                Sr[k] += Wn[k] * qr;
                Si[k] += Wn[k] * qi;
            }
        }
        for (int k = 0; k < SUMS; k++) {
            FN(cauchy_store_)(S + (h * 2 * SUMS + k) * M, Sr[k], m0, w, 1);
            FN(cauchy_store_)(S + (h * 2 * SUMS + SUMS + k) * M, Si[k], m0, w, 1);
        }
        VEC kr[4], ki[4], inv, wr, wi;
        FN(woodbury_)(xr, xi, Sr, Si, kr, ki, &inv, &wr, &wi);
        const VEC pr = kr[0] - wr, pi = ki[0] - wi;
        const VEC c_r = FN(cauchy_lanes_)(cr, m0, w, 1, 0), c_i = FN(cauchy_lanes_)(ci, m0, w, 1, 0);
        FN(cauchy_store_)(K + h * M * 2, c_r * pr - c_i * pi, m0, w, 2);
        FN(cauchy_store_)(K + h * M * 2 + 1, c_r * pi + c_i * pr, m0, w, 2);
    }
}

/* gK [H, M, 2]: K's cotangent; S the forward's. Gradients: dg [H, M, 2], da, ds [H, N2], dW [H, N2, 8].
 * Per lane: the cotangents G of S from the Woodbury combination's adjoint, then, as the forward,
 * over the poles: q, the cotangent of q (gq = sum_k W G_k) and T's two parts (T0 = -Re t, T1 =
 * Im t / 2 with t = -gq conj(q)^2) in registers; the sums over the roots (dW, da, ds) are kept
 * per lane in `acc` [N2][8 + 2] vectors and summed across lanes once per row. */
static void FN(cauchy_backward_)(const REAL *gr, const REAL *gi, const REAL *cr, const REAL *ci, const REAL *a,
                                 const REAL *s, const REAL *W, const REAL *S, const REAL *gK, REAL *dg, REAL *da,
                                 REAL *ds, REAL *dW, int64_t M, int64_t N2, int64_t h, VEC *acc) {
    const REAL *ah = a + h * N2, *sh = s + h * N2, *Wh = W + h * N2 * SUMS, zero = 0;
    const int64_t stride = SUMS + 2; /* acc[n]: dW's 8 lanes, then da's and ds's */
    for (int64_t j = 0; j < N2 * stride; j++) acc[j] = (VEC){0};
    for (int64_t m0 = 0; m0 < M; m0 += VL) {
        const int64_t w = M - m0 < VL ? M - m0 : VL;
        const VEC xr = FN(cauchy_lanes_)(gr + h * M, m0, w, 1, 0), xi = FN(cauchy_lanes_)(gi + h * M, m0, w, 1, 0);
        VEC Sr[SUMS], Si[SUMS];
        for (int k = 0; k < SUMS; k++) {
            Sr[k] = FN(cauchy_lanes_)(S + (h * 2 * SUMS + k) * M, m0, w, 1, 0);
            Si[k] = FN(cauchy_lanes_)(S + (h * 2 * SUMS + SUMS + k) * M, m0, w, 1, 0);
        }
        VEC kr[4], ki[4], inv, wr, wi;
        FN(woodbury_)(xr, xi, Sr, Si, kr, ki, &inv, &wr, &wi);
        /* gP = conj(c) gK (P = k_0 - w), zero in the idle lanes */
        const VEC c_r = FN(cauchy_lanes_)(cr, m0, w, 1, 0), c_i = FN(cauchy_lanes_)(ci, m0, w, 1, 0);
        const VEC gKr = FN(cauchy_lanes_)(gK + h * M * 2, m0, w, 2, &zero);
        const VEC gKi = FN(cauchy_lanes_)(gK + h * M * 2 + 1, m0, w, 2, &zero);
        const VEC gPr = c_r * gKr + c_i * gKi, gPi = c_r * gKi - c_i * gKr;
        /* the cotangents of k_j: gP, -conj(k_2 / D) gP, -conj(k_1 / D) gP, conj(w / D) gP with D = 1 + k_3 */
        const VEC Dr = 1 + kr[3], Di = ki[3];
        /* f_j: -1, k_2 / D, k_1 / D, w / D; gk_j = -conj(f_j) gP for j < 3, conj(f_3) gP */
        const VEC fr[4] = {(VEC){0} - 1, (kr[2] * Dr + ki[2] * Di) * inv, (kr[1] * Dr + ki[1] * Di) * inv,
                           (wr * Dr + wi * Di) * inv};
        const VEC fi[4] = {(VEC){0}, (ki[2] * Dr - kr[2] * Di) * inv, (ki[1] * Dr - kr[1] * Di) * inv,
                           (wi * Dr - wr * Di) * inv};
        VEC G[2 * SUMS], dgr = {0}, dgi = {0};
        for (int j = 0; j < 4; j++) {
            const REAL sign = j < 3 ? -1 : 1;
            const VEC gkr = sign * (fr[j] * gPr + fi[j] * gPi), gki = sign * (fr[j] * gPi - fi[j] * gPr);
            /* k_j = g S_j - S_(4+j): S_j's cotangent conj(g) gk_j, S_(4+j)'s -gk_j, g's conj(S_j) gk_j */
            G[2 * j] = xr * gkr + xi * gki;
            G[2 * j + 1] = xr * gki - xi * gkr;
            G[2 * (4 + j)] = -gkr;
            G[2 * (4 + j) + 1] = -gki;
            dgr += Sr[j] * gkr + Si[j] * gki;
            dgi += Sr[j] * gki - Si[j] * gkr;
        }
        const VEC xi2 = xi * xi, xi_2 = -2 * xi;
        VEC s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}; /* sums over n of T0, a T0, T1, a T1 */
        for (int64_t n = 0; n < N2; n++) {
            const REAL an = ah[n];
            const VEC x = xr - an, dr = x * x + ((sh[n] - an * an) - xi2), di = x * xi_2;
            const VEC r = 1 / (dr * dr + di * di), qr = dr * r, qi = di * r;
            const REAL *Wn = Wh + n * SUMS;
            VEC *acc_n = acc + n * stride, gqr = {0}, gqi = {0};
            for (int k = 0; k < SUMS; k++) {
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
            acc_n[SUMS] += 2 * xr * t0 - 4 * xi * t1;
            acc_n[SUMS + 1] -= t0;
        }
        const VEC t0_r = -s0, t1_r = -s1, t0_i = 2 * s2, t1_i = 2 * s3;
        FN(cauchy_store_)(dg + h * M * 2, dgr + 2 * (xr * t0_r + xi * t0_i - t1_r), m0, w, 2);
        FN(cauchy_store_)(dg + h * M * 2 + 1, dgi + 2 * (xr * t0_i - xi * t0_r - t1_i), m0, w, 2);
    }
    for (int64_t n = 0; n < N2; n++) {
        REAL sums[SUMS + 2];
        for (int64_t k = 0; k < stride; k++) {
            REAL lanes[VL], total = 0;
            __builtin_memcpy(lanes, acc + n * stride + k, sizeof lanes);
            for (int64_t l = 0; l < VL; l++) total += lanes[l];
            sums[k] = total;
        }
        for (int k = 0; k < SUMS; k++) dW[(h * N2 + n) * SUMS + k] = sums[k];
        da[h * N2 + n] = sums[SUMS];
        ds[h * N2 + n] = sums[SUMS + 1];
    }
}

/* Every row h < H (the work items) on `threads` OpenMP threads. The backward's threads each have
 * their own scratch of `per_thread` values, at least (N2 (8 + 2) + 1) VL. */
void FN(cauchy_forward_all_)(const REAL *gr, const REAL *gi, const REAL *cr, const REAL *ci, const REAL *a,
                             const REAL *s, const REAL *W, REAL *K, REAL *S, int64_t M, int64_t N2, int64_t H,
                             int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++)
        FN(cauchy_forward_)(gr, gi, cr, ci, a, s, W, K, S, M, N2, h);
}

void FN(cauchy_backward_all_)(const REAL *gr, const REAL *gi, const REAL *cr, const REAL *ci, const REAL *a,
                              const REAL *s, const REAL *W, const REAL *S, const REAL *gK, REAL *dg, REAL *da,
                              REAL *ds, REAL *dW, int64_t M, int64_t N2, int64_t H, int64_t threads, REAL *scratch,
                              int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++) {
        /* this thread's accumulators, on a vector boundary (per_thread leaves a vector's slack) */
        const uintptr_t at = (uintptr_t)(scratch + THREAD_NUM * per_thread), align = sizeof(VEC);
        FN(cauchy_backward_)(gr, gi, cr, ci, a, s, W, S, gK, dg, da, ds, dW, M, N2, h,
                             (VEC *)((at + align - 1) / align * align));
    }
}
#undef VEC
#undef VL
