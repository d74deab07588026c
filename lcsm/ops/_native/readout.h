/* mLSTM's readout after its EOS call (lcsm/layers/mlstm.py), one pass forward and one backward.
 * Per token r and head h, with y [R, H, d + 1] (C_t^T q_t, then n_t^T q_t), floor [R, H]
 * (e^{-m_t}), c and z [R, H d], scale (1 + the norm's weight) and skip [H d]:
 *
 *   den = max(|n|, floor) + eps,   h_j = y_j / den,   hn = (h - mean h) / sqrt(var h + neps)
 *   out_j = (hn_j scale_j + skip_j c_j) silu(z_j)
 *
 * (var the biased variance over the head's d channels, as layer_norm's). As PyTorch operations
 * this is about ten passes over [R, H d] forward and twenty backward, each a fresh tensor. The
 * backward recomputes den, the mean and the inverse deviation from y; it writes dy, dfloor, dc
 * and dz, and each work item's share of dscale and dskip to parts [items, 2, H d], which the
 * caller sums. torch.maximum's derivative is followed: where |n| = floor each side takes half.
 * A work item is a tile of RT rows. Included by scan.c once per type, as scan.h is. */

#include <math.h>

#ifndef READOUT_ROWS
#define READOUT_ROWS
enum { RT = 256 };
/* read by native_scan.py, which counts work items from it */
const int64_t lcsm_readout_rows = RT;
#endif

static inline REAL FN(readout_rsqrt_)(REAL x) {
    return sizeof(REAL) == sizeof(float) ? 1.0f / sqrtf((float)x) : (REAL)(1.0 / sqrt((double)x));
}

/* 1 / den, the mean of h and 1 / sqrt(var + neps) of one head's row yr [d + 1] */
static inline void FN(readout_stats_)(const REAL *yr, REAL fl, int64_t d, REAL eps, REAL neps, REAL *rinv, REAL *mean,
                                      REAL *rstd) {
    const REAL an = yr[d] < 0 ? -yr[d] : yr[d];
    const REAL r = 1 / ((an > fl ? an : fl) + eps);
    REAL sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < d; j++) sum += yr[j] * r;
    const REAL mu = sum / (REAL)d;
    REAL var = 0;
#pragma omp simd reduction(+ : var)
    for (int64_t j = 0; j < d; j++) {
        const REAL t = yr[j] * r - mu;
        var += t * t;
    }
    *rinv = r;
    *mean = mu;
    *rstd = FN(readout_rsqrt_)(var / (REAL)d + neps);
}

static void FN(readout_forward_)(const REAL *y, const REAL *floor_, const REAL *c, const REAL *z, const REAL *scale,
                                 const REAL *skip, REAL *out, int64_t R, int64_t H, int64_t d, REAL eps, REAL neps,
                                 int64_t item) {
    const int64_t r0 = item * RT, r1 = R < r0 + RT ? R : r0 + RT;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t h = 0; h < H; h++) {
            const REAL *yr = y + (r * H + h) * (d + 1);
            REAL rinv, mean, rstd;
            FN(readout_stats_)(yr, floor_[r * H + h], d, eps, neps, &rinv, &mean, &rstd);
            const int64_t o = (r * H + h) * d;
            const REAL *sc = scale + h * d, *sk = skip + h * d;
#pragma omp simd
            for (int64_t j = 0; j < d; j++) {
                const REAL hn = (yr[j] * rinv - mean) * rstd, zz = z[o + j];
                const REAL sig = FN(sigmoid_)(zz);
                out[o + j] = (hn * sc[j] + sk[j] * c[o + j]) * (zz * sig);
            }
        }
}

/* scratch: 2 d values (a head's dhn and hn) */
static void FN(readout_backward_)(const REAL *y, const REAL *floor_, const REAL *c, const REAL *z, const REAL *scale,
                                  const REAL *skip, const REAL *dout, REAL *dy, REAL *dfloor, REAL *dc, REAL *dz,
                                  REAL *parts, int64_t R, int64_t H, int64_t d, REAL eps, REAL neps, int64_t item,
                                  REAL *scratch) {
    const int64_t r0 = item * RT, r1 = R < r0 + RT ? R : r0 + RT, width = H * d;
    REAL *dscale = parts + item * 2 * width, *dskip = dscale + width, *dhn = scratch, *hns = scratch + d;
    memset(dscale, 0, 2 * width * sizeof(REAL));
    for (int64_t r = r0; r < r1; r++)
        for (int64_t h = 0; h < H; h++) {
            const REAL *yr = y + (r * H + h) * (d + 1);
            const REAL fl = floor_[r * H + h];
            REAL rinv, mean, rstd;
            FN(readout_stats_)(yr, fl, d, eps, neps, &rinv, &mean, &rstd);
            const int64_t o = (r * H + h) * d;
            const REAL *sc = scale + h * d, *sk = skip + h * d;
            REAL *dsc = dscale + h * d, *dsk = dskip + h * d;
            REAL s1 = 0, s2 = 0;
#pragma omp simd reduction(+ : s1, s2)
            for (int64_t j = 0; j < d; j++) {
                const REAL hn = (yr[j] * rinv - mean) * rstd, zz = z[o + j], cj = c[o + j];
                const REAL sig = FN(sigmoid_)(zz);
                const REAL a = hn * sc[j] + sk[j] * cj, g = dout[o + j];
                const REAL da = g * (zz * sig);
                dz[o + j] = g * a * (sig * (1 + zz * (1 - sig)));
                dc[o + j] = da * sk[j];
                dsk[j] += da * cj;
                dsc[j] += da * hn;
                const REAL dh = da * sc[j];
                dhn[j] = dh;
                hns[j] = hn;
                s1 += dh;
                s2 += dh * hn;
            }
            const REAL m1 = s1 / (REAL)d, m2 = s2 / (REAL)d;
            REAL dr = 0;
            REAL *dyr = dy + (r * H + h) * (d + 1);
#pragma omp simd reduction(+ : dr)
            for (int64_t j = 0; j < d; j++) {
                const REAL dh = rstd * (dhn[j] - m1 - hns[j] * m2);
                dyr[j] = dh * rinv;
                dr += dh * yr[j];
            }
            const REAL dden = -dr * rinv * rinv, n = yr[d], an = n < 0 ? -n : n;
            const REAL dan = an > fl ? dden : an < fl ? 0 : dden / 2;
            dfloor[r * H + h] = an < fl ? dden : an > fl ? 0 : dden / 2;
            dyr[d] = n > 0 ? dan : n < 0 ? -dan : 0;
        }
}

void FN(readout_forward_all_)(const REAL *y, const REAL *floor_, const REAL *c, const REAL *z, const REAL *scale,
                              const REAL *skip, REAL *out, int64_t R, int64_t H, int64_t d, double eps, double neps,
                              int64_t items, int64_t threads, REAL *scratch, int64_t per_thread) {
    (void)scratch;
    (void)per_thread;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++)
        FN(readout_forward_)(y, floor_, c, z, scale, skip, out, R, H, d, (REAL)eps, (REAL)neps, item);
}

void FN(readout_backward_all_)(const REAL *y, const REAL *floor_, const REAL *c, const REAL *z, const REAL *scale,
                               const REAL *skip, const REAL *dout, REAL *dy, REAL *dfloor, REAL *dc, REAL *dz,
                               REAL *parts, int64_t R, int64_t H, int64_t d, double eps, double neps, int64_t items,
                               int64_t threads, REAL *scratch, int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++)
        FN(readout_backward_)(y, floor_, c, z, scale, skip, dout, dy, dfloor, dc, dz, parts, R, H, d, (REAL)eps,
                              (REAL)neps, item, scratch + THREAD_NUM * per_thread);
}
