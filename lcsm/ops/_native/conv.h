/* The depthwise causal convolution of channels-last rows (lcsm/layers/packing.py's short_conv:
 * the short convolutions of Mamba, Mamba-2, mLSTM, MetaLA, RG-LRU and the fla-style layers),
 * optionally followed by SiLU, and its adjoint:
 *
 *   u_t[c] = bias[c] + sum_j w[j, c] full_{t + j}[c],    y_t = u_t, or silu(u_t)
 *
 * with full = [history (W - 1 steps), x (T steps)] of one batch row, x [B, T, C], history
 * [B, W - 1, C] (none: zeros), w [W, C] (the taps, the oldest input's first). As PyTorch
 * operations this is W shifted multiply-adds forward and, backward, a zero-filled gradient of the
 * whole row per tap. A work item is (batch row, tile of TT steps), every loop vectorised along
 * the C contiguous channels. The backward recomputes u where SiLU needs it, for its tile and the
 * W - 1 steps after it (the steps its inputs reach), in per-thread scratch; it writes dx, the
 * first tile's dhistory, and each item's share of dw and dbias to parts [items, W + 1, C], which
 * the caller sums. Included by scan.c once per type, as scan.h is. */

#ifndef CONV_ROWS
#define CONV_ROWS
enum { TT = 128 };
/* read by native_scan.py, which counts work items and sizes scratch from it */
const int64_t lcsm_conv_rows = TT;
#endif

/* the row of full at position p (0 .. W - 2: history, else x), or NULL for a zero history */
static inline const REAL *FN(conv_row_)(const REAL *x, const REAL *hist, int64_t b, int64_t p, int64_t T, int64_t W,
                                        int64_t C) {
    if (p >= W - 1) return x + (b * T + p - (W - 1)) * C;
    return hist ? hist + (b * (W - 1) + p) * C : 0;
}

/* u_t into out (C values) */
static inline void FN(conv_pre_)(const REAL *x, const REAL *hist, const REAL *w, const REAL *bias, REAL *out,
                                 int64_t b, int64_t t, int64_t T, int64_t W, int64_t C) {
#pragma omp simd
    for (int64_t c = 0; c < C; c++) out[c] = bias ? bias[c] : 0;
    for (int64_t j = 0; j < W; j++) {
        const REAL *row = FN(conv_row_)(x, hist, b, t + j, T, W, C), *wj = w + j * C;
        if (!row) continue;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) out[c] += wj[c] * row[c];
    }
}

static void FN(conv_forward_)(const REAL *x, const REAL *hist, const REAL *w, const REAL *bias, REAL *y, int64_t B,
                              int64_t T, int64_t W, int64_t C, int64_t silu, int64_t item) {
    const int64_t tiles = (T + TT - 1) / TT, b = item / tiles, t0 = (item % tiles) * TT;
    const int64_t t1 = T < t0 + TT ? T : t0 + TT;
    (void)B;
    for (int64_t t = t0; t < t1; t++) {
        REAL *out = y + (b * T + t) * C;
        FN(conv_pre_)(x, hist, w, bias, out, b, t, T, W, C);
        if (silu) {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) out[c] *= FN(sigmoid_)(out[c]);
        }
    }
}

/* scratch: (TT + W - 1) C values (du over the tile and the W - 1 steps after it) */
static void FN(conv_backward_)(const REAL *x, const REAL *hist, const REAL *w, const REAL *bias, const REAL *dy,
                               REAL *dx, REAL *dhist, REAL *parts, int64_t B, int64_t T, int64_t W, int64_t C,
                               int64_t silu, int64_t item, REAL *du) {
    const int64_t tiles = (T + TT - 1) / TT, b = item / tiles, t0 = (item % tiles) * TT;
    const int64_t t1 = T < t0 + TT ? T : t0 + TT, t2 = T < t1 + W - 1 ? T : t1 + W - 1;
    REAL *dw = parts + item * (W + 1) * C, *db = dw + W * C;
    (void)B;
    for (int64_t t = t0; t < t2; t++) {
        REAL *d = du + (t - t0) * C;
        const REAL *g = dy + (b * T + t) * C;
        if (silu) {
            FN(conv_pre_)(x, hist, w, bias, d, b, t, T, W, C);
#pragma omp simd
            for (int64_t c = 0; c < C; c++) {
                const REAL sig = FN(sigmoid_)(d[c]);
                d[c] = g[c] * sig * (1 + d[c] * (1 - sig));
            }
        } else {
#pragma omp simd
            for (int64_t c = 0; c < C; c++) d[c] = g[c];
        }
    }
    memset(dw, 0, (W + 1) * C * sizeof(REAL));
    /* dw_j and dbias over the tile's own steps */
    for (int64_t t = t0; t < t1; t++) {
        const REAL *d = du + (t - t0) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) db[c] += d[c];
        for (int64_t j = 0; j < W; j++) {
            const REAL *row = FN(conv_row_)(x, hist, b, t + j, T, W, C);
            if (!row) continue;
            REAL *dwj = dw + j * C;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) dwj[c] += d[c] * row[c];
        }
    }
    /* dx_s = sum_j w_j du_{s + W - 1 - j} over the steps t = s + W - 1 - j in [0, T) */
    for (int64_t s = t0; s < t1; s++) {
        REAL *out = dx + (b * T + s) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) out[c] = 0;
        for (int64_t j = 0; j < W; j++) {
            const int64_t t = s + W - 1 - j;
            if (t >= T) continue;
            const REAL *d = du + (t - t0) * C, *wj = w + j * C;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) out[c] += wj[c] * d[c];
        }
    }
    /* dhistory_p = sum_{j <= p} w_j du_{p - j}, from the row's first tile (its du starts at t = 0) */
    if (dhist && t0 == 0)
        for (int64_t p = 0; p < W - 1; p++) {
            REAL *out = dhist + (b * (W - 1) + p) * C;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) out[c] = 0;
            for (int64_t j = 0; j <= p; j++) {
                if (p - j >= t2) continue;
                const REAL *d = du + (p - j) * C, *wj = w + j * C;
#pragma omp simd
                for (int64_t c = 0; c < C; c++) out[c] += wj[c] * d[c];
            }
        }
}

void FN(conv_forward_all_)(const REAL *x, const REAL *hist, const REAL *w, const REAL *bias, REAL *y, int64_t B,
                           int64_t T, int64_t W, int64_t C, int64_t silu, int64_t items, int64_t threads, REAL *scratch,
                           int64_t per_thread) {
    (void)scratch;
    (void)per_thread;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++) FN(conv_forward_)(x, hist, w, bias, y, B, T, W, C, silu, item);
}

void FN(conv_backward_all_)(const REAL *x, const REAL *hist, const REAL *w, const REAL *bias, const REAL *dy, REAL *dx,
                            REAL *dhist, REAL *parts, int64_t B, int64_t T, int64_t W, int64_t C, int64_t silu,
                            int64_t items, int64_t threads, REAL *scratch, int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++)
        FN(conv_backward_)(x, hist, w, bias, dy, dx, dhist, parts, B, T, W, C, silu, item,
                           scratch + THREAD_NUM * per_thread);
}
