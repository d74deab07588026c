/* SwiGLU's gate, y = silu(a) b elementwise (lcsm/models/blocks.py's GLU: a the gate projection,
 * b the up projection), one pass forward and one backward:
 *
 *   y = a sigmoid(a) b,   db = dy silu(a),   da = dy b sigmoid(a) (1 + a (1 - sigmoid(a)))
 *
 * As PyTorch operations this is two passes over [R, C] forward (SiLU, then the product) and four
 * backward, with SiLU's output kept; here a and b are kept and the sigmoid recomputed. A work item
 * is a tile of GE elements of the flattened operands. Included by scan.c once per type, as scan.h is. */

#ifndef GLU_ELEMENTS
#define GLU_ELEMENTS
enum { GE = 16384 };
/* read by native_scan.py, which counts work items from it */
const int64_t lcsm_glu_elements = GE;
#endif

/* forward (dy NULL): out = y; backward: out = da, and db */
void FN(glu_all_)(const REAL *a, const REAL *b, const REAL *dy, REAL *out, REAL *db, int64_t n, int64_t items,
                  int64_t threads, REAL *scratch, int64_t per_thread) {
    (void)scratch;
    (void)per_thread;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t i0 = item * GE, i1 = n < i0 + GE ? n : i0 + GE;
        if (!dy) {
#pragma omp simd
            for (int64_t i = i0; i < i1; i++) out[i] = a[i] * FN(sigmoid_)(a[i]) * b[i];
        } else {
#pragma omp simd
            for (int64_t i = i0; i < i1; i++) {
                const REAL sig = FN(sigmoid_)(a[i]), g = dy[i];
                db[i] = g * a[i] * sig;
                out[i] = g * b[i] * sig * (1 + a[i] * (1 - sig));
            }
        }
    }
}
