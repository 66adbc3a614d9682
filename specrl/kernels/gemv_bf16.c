/* bf16 matrix-vector products for decoding: y[m, n] = sum_k x[m, k] * W[n, k], m < M <= 4.
 *
 * Built by specrl/kernels/gemv.py (gcc, AVX512-BF16) and called through ctypes.
 * Weights are pre-packed once as Wp[N/16][K/2][16][2] (16 output rows, each a pair of
 * consecutive k values), so one 64-byte load holds 16 rows x 2 ks and one VDPBF16PS adds
 * them into 16 float32 accumulators, one per output row: no horizontal sums, and the weights
 * stream through memory exactly once per call whatever M (<= 4) is. Accumulation in float32
 * (two partial sums per row over even/odd k-pairs), output rounded to bf16 (nearest even).
 * Requires N % 16 == 0 and K % 4 == 0 (the caller checks). With threads > 1 and N >= MIN_SPLIT
 * the 16-row blocks are split over OpenMP threads (torch's own libgomp, shared by soname): each
 * output row is still computed by one thread in the same order, so results do not depend on the
 * thread count.
 */
#include <immintrin.h>
#include <stdint.h>

#ifndef MIN_SPLIT
#define MIN_SPLIT 512 /* output rows from which a call is split over the threads */
#endif
#define ZERO _mm512_setzero_ps()
#define BCAST(p, k) ((__m512bh)_mm512_set1_epi32((int)(p)[k]))
#define DP(acc, w, p, k) acc = _mm512_dpbf16_ps(acc, w, BCAST(p, k))

static inline void store_bf16(uint16_t *y, __m512 a, __m512 b) {
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, b)));
}

/* One block of 16 output rows for ROWS (1..4) input rows, fully unrolled over ROWS. */
#define BLOCK(ROWS)                                                                            \
    static void block_##ROWS(const uint16_t *w, const uint32_t *const *xs, uint16_t *y,      \
                             int64_t N, int64_t kp) {                                          \
        __m512 a0 = ZERO, a1 = ZERO, a2 = ZERO, a3 = ZERO;                                     \
        __m512 b0 = ZERO, b1 = ZERO, b2 = ZERO, b3 = ZERO;                                     \
        for (int64_t k = 0; k < kp; k += 2) {                                                  \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k * 32);                            \
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k * 32 + 32);                       \
            DP(a0, w0, xs[0], k); DP(b0, w1, xs[0], k + 1);                                    \
            if (ROWS > 1) { DP(a1, w0, xs[1], k); DP(b1, w1, xs[1], k + 1); }                  \
            if (ROWS > 2) { DP(a2, w0, xs[2], k); DP(b2, w1, xs[2], k + 1); }                  \
            if (ROWS > 3) { DP(a3, w0, xs[3], k); DP(b3, w1, xs[3], k + 1); }                  \
        }                                                                                      \
        store_bf16(y, a0, b0);                                                                 \
        if (ROWS > 1) store_bf16(y + N, a1, b1);                                               \
        if (ROWS > 2) store_bf16(y + 2 * N, a2, b2);                                           \
        if (ROWS > 3) store_bf16(y + 3 * N, a3, b3);                                           \
    }

BLOCK(1)
BLOCK(2)
BLOCK(3)
BLOCK(4)

typedef void (*block_fn)(const uint16_t *, const uint32_t *const *, uint16_t *, int64_t, int64_t);

/* wp: packed weights [N/16][K/2][16][2]; x: [M, K] row-major; y: [M, N] row-major; M in 1..4;
 * threads: OpenMP threads to split the output rows over (1 = this thread only). */
int specrl_gemv_bf16(const uint16_t *wp, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                     int64_t K, int threads) {
    static const block_fn blocks[4] = {block_1, block_2, block_3, block_4};
    if (M < 1 || M > 4 || N % 16 != 0 || K % 4 != 0) return 1;
    const uint32_t *xs[4];
    for (int64_t m = 0; m < M; m++) xs[m] = (const uint32_t *)(x + m * K);
    block_fn fn = blocks[M - 1];
    int64_t kp = K / 2;
    int64_t blocks_n = N / 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N >= MIN_SPLIT)
    for (int64_t nb = 0; nb < blocks_n; nb++) fn(wp + nb * kp * 32, xs, y + nb * 16, N, kp);
    return 0;
}
