/* A block-diagonal linear map (mLSTM's q/k/v projections, lcsm/layers/mlstm.py) and its adjoint:
 *
 *   y[r, n, u] = sum_o w[n, u, o] x[r, n, o]      x [R, NB, BI], w [NB, BO, BI], y [R, NB, BO]
 *   dx[r, n, o] = sum_u w[n, u, o] dy[r, n, u],   dw[n, u, o] = sum_r dy[r, n, u] x[r, n, o]
 *
 * with r over the tokens. Blocks of a few channels (mLSTM's are 4 x 4) make a batched product of
 * tiny matrices, which torch's CPU bmm runs far below its speed and after transposing copies. Here
 * a work item is a tile of RB rows, taken a row at a time: each block's outputs are a few
 * multiply-adds of its column of w (the blocks transposed once per item, in scratch) by one of
 * its inputs, the row's memory read and written once, in order. (Copying each block's columns
 * contiguous along the rows to vectorise over them ran 5x slower forward: the copies were scalar.)
 * dx is the map itself with w's blocks transposed (the caller passes them); the weight gradient
 * sums each block over the tile's rows and writes each item's share of dw to dw_part [items, NB,
 * BO, BI], which the caller sums. Included by scan.c once per type, as scan.h is. */

#ifndef BLOCKDIAG_ROWS
#define BLOCKDIAG_ROWS
enum { RB = 256 };
/* read by native_scan.py, which counts work items and sizes scratch from it */
const int64_t lcsm_blockdiag_rows = RB;
#endif

/* one row's blocks: y_n = w_n x_n for every block n, with wt [NB][BI][BO] (each block transposed,
 * so that a column o of w_n is contiguous). Written out for 4 x 4 blocks (mLSTM's), where the
 * compiler keeps a block's four outputs in one vector register: four broadcast multiply-adds. */
static inline void FN(blockdiag_row_)(const REAL *xr, const REAL *wt, REAL *yr, int64_t NB, int64_t BO, int64_t BI) {
    if (BO == 4 && BI == 4) {
        for (int64_t n = 0; n < NB; n++) {
            const REAL *xn = xr + 4 * n, *wn = wt + 16 * n;
            REAL acc[4];
            for (int u = 0; u < 4; u++) acc[u] = wn[u] * xn[0];
            for (int o = 1; o < 4; o++)
                for (int u = 0; u < 4; u++) acc[u] += wn[4 * o + u] * xn[o];
            for (int u = 0; u < 4; u++) yr[4 * n + u] = acc[u];
        }
        return;
    }
    for (int64_t n = 0; n < NB; n++) {
        const REAL *xn = xr + BI * n, *wn = wt + BI * BO * n;
        REAL *yn = yr + BO * n;
        for (int64_t u = 0; u < BO; u++) yn[u] = wn[u] * xn[0];
        for (int64_t o = 1; o < BI; o++)
            for (int64_t u = 0; u < BO; u++) yn[u] += wn[BO * o + u] * xn[o];
    }
}

/* scratch: NB BO BI values (the blocks transposed) */
static void FN(blockdiag_apply_)(const REAL *x, const REAL *w, REAL *y, int64_t R, int64_t NB, int64_t BO, int64_t BI,
                                 int64_t item, REAL *scratch) {
    const int64_t r0 = item * RB, r1 = R < r0 + RB ? R : r0 + RB;
    for (int64_t n = 0; n < NB; n++)
        for (int64_t u = 0; u < BO; u++)
            for (int64_t o = 0; o < BI; o++) scratch[(n * BI + o) * BO + u] = w[(n * BO + u) * BI + o];
    for (int64_t r = r0; r < r1; r++) FN(blockdiag_row_)(x + r * NB * BI, scratch, y + r * NB * BO, NB, BO, BI);
}

static void FN(blockdiag_weight_grad_)(const REAL *x, const REAL *dy, REAL *dw_part, int64_t R, int64_t NB, int64_t BO,
                                       int64_t BI, int64_t item, REAL *scratch) {
    const int64_t r0 = item * RB, r1 = R < r0 + RB ? R : r0 + RB;
    REAL *dw = dw_part + item * NB * BO * BI;
    (void)scratch;
    if (BO == 4 && BI == 4) {
        /* a block's 16 sums in registers over the tile's rows, as four 4-lane vectors (one per
         * output u) written with GCC's vector extension: left to the loop vectorizer, GCC 12 -O3
         * paired each row's group of 4 inputs with the next row's and read one row past the
         * tile's end (a fault where the tensor ends at a page; tests/ops/test_native_block_diag.py) */
        typedef REAL V4 __attribute__((vector_size(4 * sizeof(REAL)), aligned(sizeof(REAL))));
        for (int64_t n = 0; n < NB; n++) {
            V4 acc[4] = {{0}};
            for (int64_t r = r0; r < r1; r++) {
                const V4 xv = *(const V4 *)(x + r * NB * 4 + 4 * n);
                const REAL *gn = dy + r * NB * 4 + 4 * n;
                for (int u = 0; u < 4; u++) acc[u] += gn[u] * xv;
            }
            for (int u = 0; u < 4; u++) memcpy(dw + 16 * n + 4 * u, &acc[u], sizeof acc[u]);
        }
        return;
    }
    memset(dw, 0, NB * BO * BI * sizeof(REAL));
    for (int64_t r = r0; r < r1; r++) {
        const REAL *xr = x + r * NB * BI, *dyr = dy + r * NB * BO;
        for (int64_t n = 0; n < NB; n++)
            for (int64_t u = 0; u < BO; u++) {
                const REAL g = dyr[n * BO + u];
                REAL *row = dw + (n * BO + u) * BI;
                for (int64_t o = 0; o < BI; o++) row[o] += g * xr[n * BI + o];
            }
    }
}

/* Every work item (tile of RB rows) on `threads` OpenMP threads, each with its own scratch of
 * `per_thread` values (NB BO BI for the map). */
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
