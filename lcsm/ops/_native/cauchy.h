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
/* W's columns (the four sums' numerators over conjugate pairs), and a vector's bytes, the
 * machine's (the sixteen sums a lane keeps in registers): read by native_scan.py, which checks W
 * and sizes the backward's scratch from them */
enum { SUMS = 8, VEC_BYTES = LCSM_VEC_BYTES };
const int64_t lcsm_cauchy_columns = SUMS, lcsm_cauchy_vector_bytes = VEC_BYTES;
#endif

/* a vector of roots, one per lane */
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

/* S4's kernel spectrum from its parameters (lcsm.ops.native_s4_kernel, for lcsm/layers/s4.py):
 * the operands above formed per row from log_a, b [H, N2] (lam = -exp(log_a) + i b), P, B, C
 * [H, N2, 2] (real and imaginary parts; C is C~), log_dt [H] and the roots' r = (1 - z) / (1 + z)
 * (rr, ri [M]), with the gradients of those parameters, so that none of the small [H, N2]
 * operations runs in PyTorch. */

/* v = [C B, C P, conj(P) B, |P|^2] at one pole: real parts vr, imaginary vi */
static inline void FN(s4_numerators_)(const REAL *p, const REAL *b, const REAL *c, REAL *vr, REAL *vi) {
    vr[0] = c[0] * b[0] - c[1] * b[1], vi[0] = c[0] * b[1] + c[1] * b[0];
    vr[1] = c[0] * p[0] - c[1] * p[1], vi[1] = c[0] * p[1] + c[1] * p[0];
    vr[2] = p[0] * b[0] + p[1] * b[1], vi[2] = p[0] * b[1] - p[1] * b[0];
    vr[3] = p[0] * p[0] + p[1] * p[1], vi[3] = 0;
}

/* Row h's roots g = (2 / dt) r (gr, gi [H, M]), poles a = Re lam, s = |lam|^2 and numerators over
 * conjugate pairs W = 2 [Re v, Re v a + Im v b] ([H, N2, 8]); returns dt. */
static REAL FN(s4_operands_)(const REAL *log_a, const REAL *b, const REAL *P, const REAL *B, const REAL *C,
                             const REAL *log_dt, const REAL *rr, const REAL *ri, REAL *gr, REAL *gi, REAL *a, REAL *s,
                             REAL *W, int64_t M, int64_t N2, int64_t h) {
    const REAL dt = FN(exp_)(log_dt[h]), scale = 2 / dt;
    for (int64_t m = 0; m < M; m++) {
        gr[h * M + m] = scale * rr[m];
        gi[h * M + m] = scale * ri[m];
    }
    for (int64_t n = 0, i = h * N2; n < N2; n++, i++) {
        const REAL an = -FN(exp_)(log_a[i]), bn = b[i];
        REAL vr[4], vi[4];
        FN(s4_numerators_)(P + 2 * i, B + 2 * i, C + 2 * i, vr, vi);
        a[i] = an;
        s[i] = an * an + bn * bn;
        for (int j = 0; j < 4; j++) {
            W[i * SUMS + j] = 2 * vr[j];
            W[i * SUMS + 4 + j] = 2 * (vr[j] * an + vi[j] * bn);
        }
    }
    return dt;
}

/* K [H, M + even, 2]: the spectrum at the M roots, and with `even` its value at z = -1,
 * dt Re(sum_n C_n B_n); the operands gr, gi, a, s, W and the sums S are kept for the backward. */
void FN(s4_kernel_forward_all_)(const REAL *log_a, const REAL *b, const REAL *P, const REAL *B, const REAL *C,
                                const REAL *log_dt, const REAL *rr, const REAL *ri, const REAL *cr, const REAL *ci,
                                REAL *gr, REAL *gi, REAL *a, REAL *s, REAL *W, REAL *K, REAL *S, int64_t M, int64_t N2,
                                int64_t even, int64_t H, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++) {
        const REAL dt = FN(s4_operands_)(log_a, b, P, B, C, log_dt, rr, ri, gr, gi, a, s, W, M, N2, h);
        REAL *Kh = K + h * (M + even) * 2;
        /* row h's operands as row 0 of their own: K's rows are M + even long */
        FN(cauchy_forward_)(gr + h * M, gi + h * M, cr, ci, a + h * N2, s + h * N2, W + h * N2 * SUMS, Kh,
                            S + h * 2 * SUMS * M, M, N2, 0);
        if (even) {
            REAL total = 0;
            for (int64_t n = 0; n < N2; n++) total += W[(h * N2 + n) * SUMS] / 2;
            Kh[2 * M] = dt * total;
            Kh[2 * M + 1] = 0;
        }
    }
}

/* The gradients of log_a, b, P, B, C and log_dt given K's cotangent gK [H, M + even, 2]: the sums'
 * adjoint (cauchy_backward_, into dg [H, M, 2], da, ds [H, N2], dW [H, N2, 8]), then by hand:
 * g = (2 / dt) r gives d log_dt = -sum_m Re(dg conj(g)); W's real and imaginary parts of v give
 * v's cotangent G, and v's factors take conj(partner) G (C B, C P, B of conj(P) B), conj(G) B
 * (P of conj(P) B) and 2 Re(G) P (|P|^2), in PyTorch's convention (grad = dL/d Re + i dL/d Im). */
void FN(s4_kernel_backward_all_)(const REAL *log_dt, const REAL *b, const REAL *P, const REAL *B, const REAL *C,
                                 const REAL *cr, const REAL *ci, const REAL *gr, const REAL *gi, const REAL *a,
                                 const REAL *s, const REAL *W, const REAL *S, const REAL *gK, REAL *dg, REAL *da,
                                 REAL *ds, REAL *dW, REAL *d_log_a, REAL *d_b, REAL *dP, REAL *dB, REAL *dC,
                                 REAL *d_log_dt, int64_t M, int64_t N2, int64_t even, int64_t H, int64_t threads,
                                 REAL *scratch, int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++) {
        const uintptr_t at = (uintptr_t)(scratch + THREAD_NUM * per_thread), align = sizeof(VEC);
        const REAL *gKh = gK + h * (M + even) * 2;
        FN(cauchy_backward_)(gr + h * M, gi + h * M, cr, ci, a + h * N2, s + h * N2, W + h * N2 * SUMS,
                             S + h * 2 * SUMS * M, gKh, dg + h * M * 2, da + h * N2, ds + h * N2, dW + h * N2 * SUMS,
                             M, N2, 0, (VEC *)((at + align - 1) / align * align));
        const REAL dt = FN(exp_)(log_dt[h]), last = even ? gKh[2 * M] : 0;
        REAL d_dt = 0, sum_v0 = 0;
        for (int64_t m = h * M; m < (h + 1) * M; m++) d_dt -= dg[2 * m] * gr[m] + dg[2 * m + 1] * gi[m];
        for (int64_t n = 0, i = h * N2; n < N2; n++, i++) {
            const REAL an = a[i], bn = b[i], *w1 = dW + i * SUMS, *w2 = w1 + 4, *p = P + 2 * i, *bb = B + 2 * i,
                       *c = C + 2 * i;
            REAL vr[4], vi[4], Gr[4], Gi[4], da_n = da[i] + 2 * an * ds[i], db_n = 2 * bn * ds[i];
            FN(s4_numerators_)(p, bb, c, vr, vi);
            sum_v0 += vr[0];
            for (int j = 0; j < 4; j++) {
                Gr[j] = 2 * (w1[j] + an * w2[j]);
                Gi[j] = 2 * bn * w2[j];
                da_n += 2 * vr[j] * w2[j];
                db_n += 2 * vi[j] * w2[j];
            }
            Gr[0] += dt * last;
            d_log_a[i] = da_n * an; /* a = -exp(log_a) */
            d_b[i] = db_n;
            dC[2 * i] = Gr[0] * bb[0] + Gi[0] * bb[1] + Gr[1] * p[0] + Gi[1] * p[1];
            dC[2 * i + 1] = Gi[0] * bb[0] - Gr[0] * bb[1] + Gi[1] * p[0] - Gr[1] * p[1];
            dB[2 * i] = Gr[0] * c[0] + Gi[0] * c[1] + Gr[2] * p[0] - Gi[2] * p[1];
            dB[2 * i + 1] = Gi[0] * c[0] - Gr[0] * c[1] + Gr[2] * p[1] + Gi[2] * p[0];
            dP[2 * i] = Gr[1] * c[0] + Gi[1] * c[1] + Gr[2] * bb[0] + Gi[2] * bb[1] + 2 * Gr[3] * p[0];
            dP[2 * i + 1] = Gi[1] * c[0] - Gr[1] * c[1] + Gr[2] * bb[1] - Gi[2] * bb[0] + 2 * Gr[3] * p[1];
        }
        d_log_dt[h] = d_dt + dt * last * sum_v0;
    }
}
#undef VEC
#undef VL
