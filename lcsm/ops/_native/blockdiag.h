/* A block-diagonal linear map (mLSTM's q/k/v projections, lcsm/layers/mlstm.py) and its adjoint:
 *
 *   y[r, n, u] = sum_o w[n, u, o] x[r, n, o]      x [R, NB, BI], w [NB, BO, BI], y [R, NB, BO]
 *   dx[r, n, o] = sum_u w[n, u, o] dy[r, n, u],   dw[n, u, o] = sum_r dy[r, n, u] x[r, n, o]
 *
 * with r over the tokens. Blocks of a few channels (mLSTM's are 4 x 4) make a batched product of
 * tiny matrices, which torch's CPU bmm runs far below its speed and after transposing copies. Here
 * a work item is a tile of RB rows; per block n, its columns of x (and dy) are copied contiguous
 * along the rows into scratch, where every product and sum runs vectorised over the rows. dx is
 * the map itself with w's blocks transposed (the caller passes them); the weight gradient writes
 * each item's share of dw to dw_part [items, NB, BO, BI], which the caller sums. Included by
 * scan.c once per type, as scan.h is. */

#ifndef BLOCKDIAG_ROWS
#define BLOCKDIAG_ROWS
enum { RB = 256 };
/* read by native_scan.py, which counts work items and sizes scratch from it */
const int64_t lcsm_blockdiag_rows = RB;
#endif

/* the columns n * width .. n * width + width of src's rows r0 .. r0 + rows (row length `stride`)
 * into dst [width][RB] */
static inline void FN(blockdiag_gather_)(const REAL *src, REAL *dst, int64_t r0, int64_t rows, int64_t stride,
                                         int64_t n, int64_t width) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < width; c++) dst[c * RB + r] = src[(r0 + r) * stride + n * width + c];
}

/* scratch: (BI + BO) RB values */
static void FN(blockdiag_apply_)(const REAL *x, const REAL *w, REAL *y, int64_t R, int64_t NB, int64_t BO, int64_t BI,
                                 int64_t item, REAL *scratch) {
    const int64_t r0 = item * RB, rows = R - r0 < RB ? R - r0 : RB;
    REAL *xt = scratch, *yt = scratch + BI * RB;
    for (int64_t n = 0; n < NB; n++) {
        FN(blockdiag_gather_)(x, xt, r0, rows, NB * BI, n, BI);
        const REAL *wn = w + n * BO * BI;
        for (int64_t u = 0; u < BO; u++) {
            REAL *out = yt + u * RB;
#pragma omp simd
            for (int64_t r = 0; r < rows; r++) out[r] = wn[u * BI] * xt[r];
            for (int64_t o = 1; o < BI; o++) {
                const REAL wk = wn[u * BI + o], *in = xt + o * RB;
#pragma omp simd
                for (int64_t r = 0; r < rows; r++) out[r] += wk * in[r];
            }
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t u = 0; u < BO; u++) y[((r0 + r) * NB + n) * BO + u] = yt[u * RB + r];
    }
}

/* scratch: (BI + BO) RB values */
static void FN(blockdiag_weight_grad_)(const REAL *x, const REAL *dy, REAL *dw_part, int64_t R, int64_t NB, int64_t BO,
                                       int64_t BI, int64_t item, REAL *scratch) {
    const int64_t r0 = item * RB, rows = R - r0 < RB ? R - r0 : RB;
    REAL *dw = dw_part + item * NB * BO * BI, *xt = scratch, *dyt = scratch + BI * RB;
    for (int64_t n = 0; n < NB; n++) {
        FN(blockdiag_gather_)(x, xt, r0, rows, NB * BI, n, BI);
        FN(blockdiag_gather_)(dy, dyt, r0, rows, NB * BO, n, BO);
        for (int64_t u = 0; u < BO; u++)
            for (int64_t o = 0; o < BI; o++) {
                const REAL *a = dyt + u * RB, *b = xt + o * RB;
                REAL acc = 0;
#pragma omp simd reduction(+ : acc)
                for (int64_t r = 0; r < rows; r++) acc += a[r] * b[r];
                dw[(n * BO + u) * BI + o] = acc;
            }
    }
}

/* Every work item (tile of RB rows) on `threads` OpenMP threads, each with its own scratch of
 * `per_thread` values, at least (BI + BO) RB. */
void FN(blockdiag_apply_all_)(const REAL *x, const REAL *w, REAL *y, int64_t R, int64_t NB, int64_t BO, int64_t BI,
                              int64_t items, int64_t threads, REAL *scratch, int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++)
        FN(blockdiag_apply_)(x, w, y, R, NB, BO, BI, item, scratch + THREAD_NUM * per_thread);
}

void FN(blockdiag_weight_grad_all_)(const REAL *x, const REAL *dy, REAL *dw_part, int64_t R, int64_t NB, int64_t BO,
                                    int64_t BI, int64_t items, int64_t threads, REAL *scratch, int64_t per_thread) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++)
        FN(blockdiag_weight_grad_)(x, dy, dw_part, R, NB, BO, BI, item, scratch + THREAD_NUM * per_thread);
}
