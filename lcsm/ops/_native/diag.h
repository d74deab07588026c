/* A time-invariant complex diagonal recurrence with one state per channel and a real readout
 * (CES, lcsm/layers/ces.py), and its adjoint:
 *
 *   m_t[c] = lam[c] m_{t-1}[c] + e[c] x_t[c],   y_t[c] = Re(s[c] m_t[c])
 *
 * x, y [B, T, C] real; lam, e, s [C] complex (real and imaginary parts apart); m0, m_T [B, C, 2].
 * One work item is one (batch row, block of CB channels): the channels run along the vectorised
 * loops, time in order. The forward keeps the memory every CH steps; the backward recomputes a
 * block of CH steps from there and runs the adjoint over it in reverse. With PyTorch's convention
 * for complex gradients (the cotangent of w = a b is conj(b) times w's):
 *
 *   G_t = conj(s) gy_t + conj(lam) G_{t+1}    (t = 0 .. T - 1; G_T = gm_T)
 *   dlam = sum_t conj(m_{t-1}) G_t,  de = sum_t x_t G_t,  ds = sum_t conj(m_t) gy_t,
 *   dx_t = Re(conj(e) G_t),  dm0 = conj(lam) G_0      (m_{-1} = m0).
 *
 * Included by scan.c once per type, as scan.h is. */

#ifndef DIAG_BLOCK
#define DIAG_BLOCK
enum { CB = 64, CH = 64 };
/* read by native_scan.py, which counts work items and sizes kept memories and scratch from them */
const int64_t lcsm_diag_block = CB, lcsm_diag_chunk = CH;
#endif

static void FN(diag_forward_)(const REAL *x, const REAL *lam, const REAL *e, const REAL *s, const REAL *m0,
                              REAL *y, REAL *m_T, REAL *starts, int64_t T, int64_t C, int64_t item, REAL *scratch) {
    const int64_t blocks = (C + CB - 1) / CB, b = item / blocks, c0 = (item % blocks) * CB;
    const int64_t w = C - c0 < CB ? C - c0 : CB, chunks = (T + CH - 1) / CH;
    const REAL *lr = lam + c0, *li = lam + C + c0, *er = e + c0, *ei = e + C + c0, *sr = s + c0, *si = s + C + c0;
    REAL *mr = scratch, *mi = mr + CB;
    for (int64_t c = 0; c < w; c++) {
        mr[c] = m0 ? m0[(b * C + c0 + c) * 2] : (REAL)0;
        mi[c] = m0 ? m0[(b * C + c0 + c) * 2 + 1] : (REAL)0;
    }
    for (int64_t t = 0; t < T; t++) {
        if (t % CH == 0) {
            REAL *keep = starts + ((b * chunks + t / CH) * 2) * C + c0;
            memcpy(keep, mr, w * sizeof(REAL));
            memcpy(keep + C, mi, w * sizeof(REAL));
        }
        const REAL *xt = x + (b * T + t) * C + c0;
        REAL *yt = y + (b * T + t) * C + c0;
#pragma omp simd
        for (int64_t c = 0; c < w; c++) {
            REAL nr = lr[c] * mr[c] - li[c] * mi[c] + er[c] * xt[c];
            REAL ni = lr[c] * mi[c] + li[c] * mr[c] + ei[c] * xt[c];
            mr[c] = nr;
            mi[c] = ni;
            yt[c] = sr[c] * nr - si[c] * ni;
        }
    }
    if (m_T)
        for (int64_t c = 0; c < w; c++) {
            m_T[(b * C + c0 + c) * 2] = mr[c];
            m_T[(b * C + c0 + c) * 2 + 1] = mi[c];
        }
}

/* Gradients: dx [B, T, C]; dlam, de, ds [B, 2, C] (each batch row's share, real then imaginary
 * parts); dm0 [B, C, 2]. gy [B, T, C], gm_T [B, C, 2] or NULL. */
static void FN(diag_backward_)(const REAL *x, const REAL *lam, const REAL *e, const REAL *s, const REAL *starts,
                               const REAL *gy, const REAL *gm_T, REAL *dx, REAL *dlam, REAL *de, REAL *ds, REAL *dm0,
                               int64_t T, int64_t C, int64_t item, REAL *scratch) {
    const int64_t blocks = (C + CB - 1) / CB, b = item / blocks, c0 = (item % blocks) * CB;
    const int64_t w = C - c0 < CB ? C - c0 : CB, chunks = (T + CH - 1) / CH;
    const REAL *lr = lam + c0, *li = lam + C + c0, *er = e + c0, *ei = e + C + c0, *sr = s + c0, *si = s + C + c0;
    /* the memories of a chunk, before its first step and after each: (CH + 1) x [re | im] x CB */
    REAL *hs = scratch, *Gr = hs + (CH + 1) * 2 * CB, *Gi = Gr + CB;
    REAL *acc = Gi + CB; /* dlam, de, ds: [6][CB], real and imaginary parts */
    for (int64_t j = 0; j < 6 * CB; j++) acc[j] = 0;
    for (int64_t c = 0; c < w; c++) {
        Gr[c] = gm_T ? gm_T[(b * C + c0 + c) * 2] : (REAL)0;
        Gi[c] = gm_T ? gm_T[(b * C + c0 + c) * 2 + 1] : (REAL)0;
    }
    for (int64_t k = chunks - 1; k >= 0; k--) {
        const int64_t t0 = k * CH, n = T - t0 < CH ? T - t0 : CH;
        const REAL *keep = starts + ((b * chunks + k) * 2) * C + c0;
        memcpy(hs, keep, w * sizeof(REAL));
        memcpy(hs + CB, keep + C, w * sizeof(REAL));
        for (int64_t j = 0; j < n; j++) {
            const REAL *pr = hs + j * 2 * CB, *pi = pr + CB, *xt = x + (b * T + t0 + j) * C + c0;
            REAL *nr = hs + (j + 1) * 2 * CB, *ni = nr + CB;
#pragma omp simd
            for (int64_t c = 0; c < w; c++) {
                nr[c] = lr[c] * pr[c] - li[c] * pi[c] + er[c] * xt[c];
                ni[c] = lr[c] * pi[c] + li[c] * pr[c] + ei[c] * xt[c];
            }
        }
        for (int64_t j = n - 1; j >= 0; j--) {
            const int64_t t = t0 + j;
            const REAL *pr = hs + j * 2 * CB, *pi = pr + CB, *mr = pr + 2 * CB, *mi = mr + CB;
            const REAL *xt = x + (b * T + t) * C + c0, *gyt = gy + (b * T + t) * C + c0;
            REAL *dxt = dx + (b * T + t) * C + c0;
            REAL *dlr = acc, *dli = acc + CB, *der = acc + 2 * CB, *dei = acc + 3 * CB, *dsr = acc + 4 * CB,
                 *dsi = acc + 5 * CB;
#pragma omp simd
            for (int64_t c = 0; c < w; c++) {
                REAL gr = Gr[c] + sr[c] * gyt[c], gi = Gi[c] - si[c] * gyt[c]; /* G_t */
                dsr[c] += mr[c] * gyt[c];
                dsi[c] -= mi[c] * gyt[c];
                dlr[c] += pr[c] * gr + pi[c] * gi;
                dli[c] += pr[c] * gi - pi[c] * gr;
                der[c] += xt[c] * gr;
                dei[c] += xt[c] * gi;
                dxt[c] = er[c] * gr + ei[c] * gi;
                Gr[c] = lr[c] * gr + li[c] * gi; /* conj(lam) G_t: the cotangent of m_{t-1} */
                Gi[c] = lr[c] * gi - li[c] * gr;
            }
        }
    }
    for (int64_t c = 0; c < w; c++) {
        dm0[(b * C + c0 + c) * 2] = Gr[c];
        dm0[(b * C + c0 + c) * 2 + 1] = Gi[c];
        for (int64_t part = 0; part < 2; part++) {
            dlam[(b * 2 + part) * C + c0 + c] = acc[part * CB + c];
            de[(b * 2 + part) * C + c0 + c] = acc[(2 + part) * CB + c];
            ds[(b * 2 + part) * C + c0 + c] = acc[(4 + part) * CB + c];
        }
    }
}

/* Every (batch row, channel block) on `threads` OpenMP threads, each with its own scratch of
 * `per_thread` values (at least 2 CB forward, (2 CH + 10) CB backward). */
void FN(diag_forward_all_)(const REAL *x, const REAL *lam, const REAL *e, const REAL *s, const REAL *m0, REAL *y,
                           REAL *m_T, REAL *starts, int64_t T, int64_t C, int64_t items, int64_t threads,
                           REAL *scratch, int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++)
        FN(diag_forward_)(x, lam, e, s, m0, y, m_T, starts, T, C, item, scratch + THREAD_NUM * per_thread);
}

void FN(diag_backward_all_)(const REAL *x, const REAL *lam, const REAL *e, const REAL *s, const REAL *starts,
                            const REAL *gy, const REAL *gm_T, REAL *dx, REAL *dlam, REAL *de, REAL *ds, REAL *dm0,
                            int64_t T, int64_t C, int64_t items, int64_t threads, REAL *scratch, int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++)
        FN(diag_backward_)(x, lam, e, s, starts, gy, gm_T, dx, dlam, de, ds, dm0, T, C, item,
                           scratch + THREAD_NUM * per_thread);
}
