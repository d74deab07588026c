/* The kernels of scan.h (the selective scan), cauchy.h (S4's kernel spectrum), diag.h (CES's
 * diagonal recurrence) and blockdiag.h (mLSTM's block-diagonal projections)
 * readout.h (mLSTM's readout after its EOS call), conv.h (the short depthwise causal
 * convolutions), rmsnorm.h (gated RMSNorms), glu.h (SwiGLU's gate) and chunk.h (the chunk form) for float
 * (suffix f32) and double (f64). */
#include <stdint.h>

#define REAL float
#define UINT uint32_t
#define INT int32_t
#define SUFFIX f32
#define EXP_BIAS 127
#define MANT_BITS 23
#define EXP_MAX 88.0f
#define EXP_MIN -87.0f
#define ROUND_MAGIC 12582912.0f /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
#define LN2_HI 0.693145751953125f
#define LN2_LO 1.428606765330187e-06f
/* Taylor's polynomial as pairs of terms (c_2i + c_2i+1 r) by Horner's rule in r2 = r^2: half the
 * chain of dependent multiply-adds of Horner's rule in r (the forward ran 8% faster). */
#define EXP_POLY(r, r2)                                                                        \
    ((1 + (r)) + (r2) * ((1.0f / 2 + (r) * (1.0f / 6)) + (r2) * ((1.0f / 24 + (r) * (1.0f / 120)) + \
                                                                 (r2) * (1.0f / 720 + (r) * (1.0f / 5040)))))
#include "scan.h"
#include "cauchy.h"
#include "diag.h"
#include "blockdiag.h"
#include "readout.h"
#include "conv.h"
#include "rmsnorm.h"
#include "glu.h"
#include "chunk.h"
#undef REAL
#undef UINT
#undef INT
#undef SUFFIX
#undef EXP_BIAS
#undef MANT_BITS
#undef EXP_MAX
#undef EXP_MIN
#undef ROUND_MAGIC
#undef LN2_HI
#undef LN2_LO
#undef EXP_POLY

#define REAL double
#define UINT uint64_t
#define INT int64_t
#define SUFFIX f64
#define EXP_BIAS 1023
#define MANT_BITS 52
#define EXP_MAX 709.0
#define EXP_MIN -708.0
#define ROUND_MAGIC 6755399441055744.0 /* 1.5 * 2^52 */
#define LN2_HI 0.6931471803691238
#define LN2_LO 1.9082149292705877e-10
#define EXP_POLY(r, r2)                                                                                  \
    ((1 + (r)) + (r2) * ((1.0 / 2 + (r) * (1.0 / 6)) + (r2) * ((1.0 / 24 + (r) * (1.0 / 120)) +                 \
     (r2) * ((1.0 / 720 + (r) * (1.0 / 5040)) + (r2) * ((1.0 / 40320 + (r) * (1.0 / 362880)) +                \
     (r2) * ((1.0 / 3628800 + (r) * (1.0 / 39916800)) + (r2) * (1.0 / 479001600 + (r) * (1.0 / 6227020800.0))))))))
#include "scan.h"
#include "cauchy.h"
#include "diag.h"
#include "blockdiag.h"
#include "readout.h"
#include "conv.h"
#include "rmsnorm.h"
#include "glu.h"
#include "chunk.h"
