/* A gated RMSNorm over groups of n channels, one pass forward and one backward. Per row r (token)
 * and group, with y and z [R, C] (C a multiple of n) and w [C]:
 *
 *   gate first (Mamba-2's norm(y * SiLU(z))):   a = y silu(z),  out = a / rms(a) * w
 *   norm first (fla's FusedRMSNormGated):       out = y / rms(y) * w * silu(z)
 *
 * with rms(a) = sqrt(mean over the group of a^2 + eps). As PyTorch operations this is about seven
 * passes over [R, C] forward and twelve backward. The backward recomputes the group's rms; it
 * writes dy and dz and each work item's share of dw to parts [items, C], which the caller sums.
 * A work item is a tile of RN rows. Included by scan.c once per type, as scan.h is. */

#ifndef RMSNORM_ROWS
#define RMSNORM_ROWS
enum { RN = 256 };
/* read by native_scan.py, which counts work items from it */
const int64_t lcsm_rmsnorm_rows = RN;
#endif

/* 1 / rms of the normalised vector (a = y silu(z) when gate first, else y) of one group */
static inline REAL FN(rmsnorm_inverse_)(const REAL *y, const REAL *z, int64_t n, int64_t gate_first, REAL eps) {
    REAL sq = 0;
    if (gate_first) {
#pragma omp simd reduction(+ : sq)
        for (int64_t c = 0; c < n; c++) {
            const REAL a = y[c] * z[c] * FN(sigmoid_)(z[c]);
            sq += a * a;
        }
    } else {
#pragma omp simd reduction(+ : sq)
        for (int64_t c = 0; c < n; c++) sq += y[c] * y[c];
    }
    return 1 / (REAL)sqrt((double)(sq / (REAL)n + eps));
}

static void FN(rmsnorm_forward_)(const REAL *y, const REAL *z, const REAL *w, REAL *out, int64_t R, int64_t C,
                                 int64_t n, int64_t gate_first, REAL eps, int64_t item) {
    const int64_t r0 = item * RN, r1 = R < r0 + RN ? R : r0 + RN;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t k = 0; k < C; k += n) {
            const int64_t o = r * C + k;
            const REAL rs = FN(rmsnorm_inverse_)(y + o, z + o, n, gate_first, eps);
#pragma omp simd
            for (int64_t c = 0; c < n; c++) {
                const REAL zs = z[o + c] * FN(sigmoid_)(z[o + c]);
                out[o + c] = gate_first ? y[o + c] * zs * rs * w[k + c] : y[o + c] * rs * w[k + c] * zs;
            }
        }
}

static void FN(rmsnorm_backward_)(const REAL *y, const REAL *z, const REAL *w, const REAL *dout, REAL *dy, REAL *dz,
                                  REAL *parts, int64_t R, int64_t C, int64_t n, int64_t gate_first, REAL eps,
                                  int64_t item) {
    const int64_t r0 = item * RN, r1 = R < r0 + RN ? R : r0 + RN;
    REAL *dw = parts + item * C;
    memset(dw, 0, C * sizeof(REAL));
    for (int64_t r = r0; r < r1; r++)
        for (int64_t k = 0; k < C; k += n) {
            const int64_t o = r * C + k;
            const REAL rs = FN(rmsnorm_inverse_)(y + o, z + o, n, gate_first, eps);
            /* u = the cotangent of the normalised vector a / rms(a), with a = y silu(z) or y */
            REAL dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int64_t c = 0; c < n; c++) {
                const REAL zz = z[o + c], sig = FN(sigmoid_)(zz), zs = zz * sig;
                const REAL a = gate_first ? y[o + c] * zs : y[o + c];
                const REAL u = gate_first ? dout[o + c] * w[k + c] : dout[o + c] * zs * w[k + c];
                dot += u * a;
            }
            const REAL m = dot * rs * rs * rs / (REAL)n;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) {
                const REAL zz = z[o + c], sig = FN(sigmoid_)(zz), zs = zz * sig;
                const REAL dsilu = sig * (1 + zz * (1 - sig));
                const REAL g = dout[o + c];
                if (gate_first) {
                    const REAL a = y[o + c] * zs, da = rs * g * w[k + c] - a * m;
                    dw[k + c] += g * a * rs;
                    dy[o + c] = da * zs;
                    dz[o + c] = da * y[o + c] * dsilu;
                } else {
                    const REAL h = y[o + c] * rs * w[k + c];
                    dw[k + c] += g * zs * y[o + c] * rs;
                    dy[o + c] = rs * g * zs * w[k + c] - y[o + c] * m;
                    dz[o + c] = g * h * dsilu;
                }
            }
        }
}

void FN(rmsnorm_forward_all_)(const REAL *y, const REAL *z, const REAL *w, REAL *out, int64_t R, int64_t C, int64_t n,
                              int64_t gate_first, double eps, int64_t items, int64_t threads, REAL *scratch,
                              int64_t per_thread) {
    (void)scratch;
    (void)per_thread;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++) FN(rmsnorm_forward_)(y, z, w, out, R, C, n, gate_first, (REAL)eps, item);
}

void FN(rmsnorm_backward_all_)(const REAL *y, const REAL *z, const REAL *w, const REAL *dout, REAL *dy, REAL *dz,
                               REAL *parts, int64_t R, int64_t C, int64_t n, int64_t gate_first, double eps,
                               int64_t items, int64_t threads, REAL *scratch, int64_t per_thread) {
    (void)scratch;
    (void)per_thread;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++)
        FN(rmsnorm_backward_)(y, z, w, dout, dy, dz, parts, R, C, n, gate_first, (REAL)eps, item);
}
