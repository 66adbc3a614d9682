/* Native bf16 kernels: products y[m, n] = sum_k x[m, k] * W[n, k] (specrl_gemv_bf16 for
 * M <= 4 rows, specrl_gemm_bf16 for any M, the same sums; specrl_gemm_amx_bf16 on AMX CPUs),
 * attention over a KV cache (specrl_attention_bf16), the per-token elementwise ops and a whole
 * stack of decoder layers built from them (specrl_layers_bf16); every output element is
 * computed in one fixed order (batch-invariant).
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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef PREFETCH
#define PREFETCH 2048 /* weight elements (4 KiB) fetched ahead of the products' loads */
#endif
/* Weights stream from memory at every call: without a software prefetch the loads waited on
 * memory while the dot products ran (SmolLM2 at batch 1: a 4-token forward took 1.45x a
 * 1-token one; with it 1.08x, and 1 token itself 4% faster). PREFETCH is a distance, not a
 * result: the numerics do not depend on it. */
#define PF(p) _mm_prefetch((const char *)(p) + 2 * PREFETCH, _MM_HINT_T0)

#ifndef MIN_SPLIT
#define MIN_SPLIT 512 /* output rows from which a call is split over the threads */
#endif
#define ZERO _mm512_setzero_ps()
#define BCAST(p, k) ((__m512bh)_mm512_set1_epi32((int)(p)[k]))
#define DP(acc, w, p, k) acc = _mm512_dpbf16_ps(acc, w, BCAST(p, k))
/* Attention fetches the cache rows it reads next into L2, not L1: fetches into L1 hold the few
 * line-fill buffers that the cache stream itself needs. A distance, not a result: the numerics
 * do not depend on it. */
#define ATT_HINT _MM_HINT_T1

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
            PF(w + k * 32); PF(w + k * 32 + 32);                                               \
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

/* Batch-invariant bf16 GEMM for any M: the same per-element sum as the GEMV above (float32,
 * partial sums over even and odd k-pairs in k order, added at the end, rounded once), so an
 * output element does not depend on M, on the other rows or on the thread count. Tiles of
 * up to 4 input rows x 32 output columns (two packed 16-row blocks) keep 16 accumulators in
 * registers; each thread takes whole column tiles and runs every row group through them, so a
 * weight tile is read from memory once and reused from cache by all rows. With 5 to 8 rows, tiles
 * of all the rows x 16 columns take them in one pass, so the stream of weights from memory
 * overlaps the products of every row (two passes of 4 rows left the second one waiting behind
 * the first one's memory stream). */
static inline __attribute__((always_inline)) void tile(const int rows, const int nb,
                                                       const uint16_t *w, int64_t wstride,
                                                       const uint32_t *const *xs, uint16_t *y,
                                                       int64_t N, int64_t kp) {
    __m512 a[8][2], b[8][2];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < nb; j++) a[r][j] = b[r][j] = ZERO;
    for (int64_t k = 0; k < kp; k += 2) {
        __m512bh w0[2], w1[2];
        for (int j = 0; j < nb; j++) {
            PF(w + j * wstride + k * 32);
            PF(w + j * wstride + k * 32 + 32);
            w0[j] = (__m512bh)_mm512_loadu_si512(w + j * wstride + k * 32);
            w1[j] = (__m512bh)_mm512_loadu_si512(w + j * wstride + k * 32 + 32);
        }
        for (int r = 0; r < rows; r++) {
            __m512bh x0 = BCAST(xs[r], k), x1 = BCAST(xs[r], k + 1);
            for (int j = 0; j < nb; j++) {
                a[r][j] = _mm512_dpbf16_ps(a[r][j], w0[j], x0);
                b[r][j] = _mm512_dpbf16_ps(b[r][j], w1[j], x1);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < nb; j++) store_bf16(y + r * N + j * 16, a[r][j], b[r][j]);
}

#define TILE(R, NB)                                                                            \
    static void tile_##R##_##NB(const uint16_t *w, int64_t ws, const uint32_t *const *xs,     \
                                uint16_t *y, int64_t N, int64_t kp) {                          \
        tile(R, NB, w, ws, xs, y, N, kp);                                                      \
    }
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(1, 2) TILE(2, 2) TILE(3, 2) TILE(4, 2)
TILE(5, 1) TILE(6, 1) TILE(7, 1) TILE(8, 1)

typedef void (*tile_fn)(const uint16_t *, int64_t, const uint32_t *const *, uint16_t *, int64_t,
                        int64_t);

/* wp: packed weights [N/16][K/2][16][2]; x: [M, K]; y: [M, N]; any M >= 1. */
int specrl_gemm_bf16(const uint16_t *wp, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                     int64_t K, int threads) {
    static const tile_fn tiles[2][4] = {{tile_1_1, tile_2_1, tile_3_1, tile_4_1},
                                        {tile_1_2, tile_2_2, tile_3_2, tile_4_2}};
    if (M < 1 || N % 16 != 0 || K % 4 != 0) return 1;
    static const tile_fn one_pass[4] = {tile_5_1, tile_6_1, tile_7_1, tile_8_1};
    if (M <= 4) return specrl_gemv_bf16(wp, x, y, M, N, K, threads); /* same sums, M-way */
    int64_t kp = K / 2, ws = kp * 32, blocks_n = N / 16, tiles_n = (blocks_n + 1) / 2;
    if (M <= 8) { /* every row in one pass over each 16-column block */
        const uint32_t *xs[8];
        for (int64_t m = 0; m < M; m++) xs[m] = (const uint32_t *)(x + m * K);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N * M >= MIN_SPLIT)
        for (int64_t nb = 0; nb < blocks_n; nb++)
            one_pass[M - 5](wp + nb * ws, ws, xs, y + nb * 16, N, kp);
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N * M >= MIN_SPLIT)
    for (int64_t t = 0; t < tiles_n; t++) {
        int nb = (2 * t + 2 <= blocks_n) ? 2 : 1;
        const uint32_t *xs[4];
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int rows = (M - m0) < 4 ? (int)(M - m0) : 4;
            for (int r = 0; r < rows; r++) xs[r] = (const uint32_t *)(x + (m0 + r) * K);
            tiles[nb - 1][rows - 1](wp + 2 * t * ws, ws, xs, y + m0 * N + 2 * t * 16, N, kp);
        }
    }
    return 0;
}

/* exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite reduction and a degree-6
 * polynomial (Cephes expf coefficients), ~1 ulp; the same instructions whatever the caller. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* The 16 horizontal sums of v[0..15] as one vector (lane j = sum of v[j]'s lanes), each in the
 * same order whatever j is: within 128-bit quarters ((0 + 2) + (1 + 3)), then the quarters
 * ((0 + 1) + (2 + 3)). */
static inline __m512 sum16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                               _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                               _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88),
                         _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

/* Scores (float32 dot products times scale) of query q [32 * DC] against the visible keys
 * idx[0..n) of one KV head, 16 keys at a time: s[c] depends on q and key c only (a block's
 * missing keys repeat its last one and are not stored). Returns their maximum. With vh (the
 * group's first head) this block's values are fetched meanwhile (the value pass reads them);
 * the other heads find the keys in cache. DC is a constant at every call (the accumulators
 * stay in registers). */
static inline __attribute__((always_inline)) float scores(const int DC, const uint16_t *q,
                                                          const uint16_t *kh, const uint16_t *vh,
                                                          const int32_t *idx, int64_t n,
                                                          float scale, float *s) {
    const int64_t D = 32 * DC;
    __m512bh qv[8]; /* DC <= 8 */
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int d = 0; d < DC; d++) qv[d] = (__m512bh)_mm512_loadu_si512(q + d * 32);
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
        const int64_t cnt = n - c0 < 16 ? n - c0 : 16;
        __m512 acc[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            const int64_t key = idx[c0 + (j < cnt ? j : cnt - 1)];
            const uint16_t *kr = kh + key * D;
            if (vh) /* the value pass reads this key's value next: fetch it meanwhile */
                for (int d = 0; d < DC; d++) _mm_prefetch((const char *)(vh + key * D + d * 32), ATT_HINT);
            acc[j] = ZERO;
#pragma GCC unroll 8
            for (int d = 0; d < DC; d++)
                acc[j] = _mm512_dpbf16_ps(acc[j], qv[d], (__m512bh)_mm512_loadu_si512(kr + d * 32));
        }
        __m512 sc = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(s + c0, lanes(cnt), sc);
        vmax = _mm512_mask_max_ps(vmax, lanes(cnt), vmax, sc);
    }
    return _mm512_reduce_max_ps(vmax);
}

/* softmax of s[0..n) in place given their maximum mx (subtracted; the polynomial exp);
 * returns 1 / sum. */
static float softmax(float *s, int64_t n, float mx) {
    __m512 sum = ZERO, vmx = _mm512_set1_ps(mx);
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 live = lanes(n - c);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + c), vmx));
        _mm512_mask_storeu_ps(s + c, live, e);
        sum = _mm512_mask_add_ps(sum, live, sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* out[g] = inv[g] * sum_c s[g * ss + c] * value(idx[c]) for gc <= 16 / DV heads (values of
 * 16 * DV elements): every value row read and widened once, each head's sum over the keys in
 * order. DV is a constant at every call. */
static inline __attribute__((always_inline)) void weighted_values(
    const int DV, const uint16_t *vh, const int32_t *idx, int64_t n, int64_t gc, const float *s,
    int64_t ss, const float *inv, uint16_t *out, const uint16_t *next) {
    const int HB = 16 / DV, D = 16 * DV;
    __m512 o[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) o[i] = ZERO;
    for (int64_t c = 0; c < n; c++) {
        const uint16_t *vr = vh + (int64_t)idx[c] * D;
        if (next)
            for (int d = 0; d < DV; d += 2) _mm_prefetch((const char *)(next + c * D + d * 16), ATT_HINT);
        __m512 v[16];
#pragma GCC unroll 16
        for (int d = 0; d < DV; d++)
            v[d] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(vr + d * 16)));
#pragma GCC unroll 16
        for (int g = 0; g < HB; g++) {
            if (g >= gc) break;
            const __m512 p = _mm512_set1_ps(s[g * ss + c]);
#pragma GCC unroll 16
            for (int d = 0; d < DV; d++) o[g * DV + d] = _mm512_fmadd_ps(p, v[d], o[g * DV + d]);
        }
    }
#pragma GCC unroll 16
    for (int g = 0; g < HB; g++) {
        if (g >= gc) break;
        const __m512 vinv = _mm512_set1_ps(inv[g]);
#pragma GCC unroll 16
        for (int d = 0; d < DV; d++)
            _mm256_storeu_si256((__m256i *)(out + g * D + d * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[g * DV + d], vinv)));
    }
}

/* The G query heads q [G, 32 * DC] that share one KV head, over its visible keys idx[0..n):
 * scores and softmax per head (s: G rows of stride ss floats), then the weighted sums of
 * values, up to 16 / (2 * DC) heads per pass over the values; each head's result is a fixed
 * sequence of operations over the visible keys in order, so it depends on its query and those
 * keys only. */
static inline __attribute__((always_inline)) void attend(const int DC, const uint16_t *q,
                                                         const uint16_t *kh, const uint16_t *vh,
                                                         const int32_t *idx, int64_t n,
                                                         int64_t G, float scale, float *s,
                                                         int64_t ss, uint16_t *out,
                                                         const uint16_t *next) {
    const int64_t D = 32 * DC, hb = DC >= 8 ? 1 : 8 / DC; /* heads per pass: <= 16 sums */
    if (n == 0) { /* nothing visible: zeros, not 0/0 */
        for (int64_t i = 0; i < G * D; i++) out[i] = 0;
        return;
    }
    float inv[G];
    for (int64_t g = 0; g < G; g++) {
        float mx = scores(DC, q + g * D, kh, g == 0 ? vh : NULL, idx, n, scale, s + g * ss);
        inv[g] = softmax(s + g * ss, n, mx);
    }
    for (int64_t g0 = 0; g0 < G; g0 += hb) {
        int64_t gc = G - g0 < hb ? G - g0 : hb;
        weighted_values(2 * DC, vh, idx, n, gc, s + g0 * ss, ss, inv + g0, out + g0 * D,
                        g0 == 0 ? next : NULL);
    }
}

typedef void (*attend_fn)(const uint16_t *, const uint16_t *, const uint16_t *, const int32_t *,
                          int64_t, int64_t, float, float *, int64_t, uint16_t *,
                          const uint16_t *);
#define ATTEND(DC)                                                                                \
    static void attend_##DC(const uint16_t *q, const uint16_t *kh, const uint16_t *vh,           \
                            const int32_t *idx, int64_t n, int64_t G, float scale, float *s,      \
                            int64_t ss, uint16_t *out, const uint16_t *next) {                    \
        attend(DC, q, kh, vh, idx, n, G, scale, s, ss, out, next);                                \
    }
ATTEND(1)
ATTEND(2)
ATTEND(3)
ATTEND(4)
ATTEND(5)
ATTEND(6)
ATTEND(7)
ATTEND(8)
static const attend_fn ATTEND_BY_CHUNKS[9] = {NULL,     attend_1, attend_2, attend_3, attend_4,
                                              attend_5, attend_6, attend_7, attend_8};

/* Attention of queries q [B, T, H, D] (token bt's heads at q + bt * qs) over one layer's cache k/v [slots, KV, Lmax, D] (bf16,
 * contiguous): row b reads slot slots[b]; query (b, t) sees the keys j < lens[b, t] for which
 * mask[b, t, j] is set (mask [B, T, mask_len] bytes, or NULL = all of them). out [B, T, H, D].
 * Query heads h = kv * (H / KV) + g share KV head kv. Work is split over (b, kv) pairs; each
 * query's result is computed by one thread in one fixed order (see attend_group). Requires
 * D % 32 == 0, D <= 256, H % KV == 0, lens[b, t] <= Lmax (and <= mask_len with a mask). */
static int attention(const uint16_t *q, int64_t qs, const uint16_t *kc, const uint16_t *vc,
                     const int64_t *slots, const int32_t *lens, const uint8_t *mask,
                     int64_t mask_len, uint16_t *out, int64_t B, int64_t T, int64_t H, int64_t KV,
                     int64_t D, int64_t Lmax, float scale, int threads) {
    if (D % 32 != 0 || D > 256 || KV < 1 || H % KV != 0) return 1;
    for (int64_t i = 0; i < B * T; i++)
        if (lens[i] < 0 || lens[i] > Lmax || (mask && lens[i] > mask_len)) return 1;
    const int64_t G = H / KV;
    const attend_fn attend_d = ATTEND_BY_CHUNKS[D / 32];
    int bad = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && B * KV > 1)
    {
        float *s = malloc(sizeof(float) * G * (Lmax + 16));
        int32_t *idx = malloc(sizeof(int32_t) * (Lmax + 1));
        if (!s || !idx) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t kv = 0; kv < KV; kv++) {
                if (!s || !idx) continue;
                const uint16_t *kh = kc + (slots[b] * KV + kv) * Lmax * D;
                const uint16_t *vh = vc + (slots[b] * KV + kv) * Lmax * D;
                const int64_t f = b * KV + kv + 1; /* the next pair's keys, fetched meanwhile */
                const uint16_t *nk = f < B * KV ? kc + (slots[f / KV] * KV + f % KV) * Lmax * D : NULL;
                for (int64_t t = 0; t < T; t++) {
                    int64_t bt = b * T + t, n = 0;
                    const uint8_t *m = mask ? mask + bt * mask_len : NULL;
                    for (int64_t j = 0; j < lens[bt]; j++)
                        if (!m || m[j]) idx[n++] = (int32_t)j;
                    attend_d(q + bt * qs + kv * G * D, kh, vh, idx, n, G, scale, s, Lmax + 16,
                             out + (bt * H + kv * G) * D, t == T - 1 ? nk : NULL);
                }
            }
        free(s);
        free(idx);
    }
    return bad ? 2 : 0;
}

int specrl_attention_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                          const int64_t *slots, const int32_t *lens, const uint8_t *mask,
                          int64_t mask_len, uint16_t *out, int64_t B, int64_t T, int64_t H,
                          int64_t KV, int64_t D, int64_t Lmax, float scale, int threads) {
    return attention(q, H * D, kc, vc, slots, lens, mask, mask_len, out, B, T, H, KV, D, Lmax,
                     scale, threads);
}

/* ------------------------------------------------------------------ elementwise (per token)
 * The decoder's per-token work besides products and attention, one call each instead of five
 * to ten PyTorch ops. Each output element depends only on its own token's inputs, computed in a
 * fixed order (batch-invariant), with the bf16 roundings of the PyTorch code they replace. */

static inline __m512 ld_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, p));
}
static inline void st_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
static inline __m512 round_bf16(__m512 v) { /* float -> nearest bf16 -> float */
    return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v));
}

/* RMSNorm of R rows of H: s = x (+ d, rounded to bf16, written to sum when d is given);
 * out = bf16(w * bf16(s * rsqrt(mean(s^2) + eps))), the mean a float32 sum in lane order. */
int specrl_rmsnorm_bf16(const uint16_t *x, const uint16_t *d, const uint16_t *w, uint16_t *out,
                        uint16_t *sum, int64_t R, int64_t H, float eps, int threads) {
    if (R < 1 || H < 1 || (d && !sum)) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && R >= 16)
    for (int64_t r = 0; r < R; r++) {
        const uint16_t *xr = x + r * H;
        const uint16_t *src = d ? sum + r * H : xr;
        __m512 acc = ZERO;
        for (int64_t c = 0; c < H; c += 16) {
            __mmask16 m = lanes(H - c);
            __m512 v = ld_bf16(xr + c, m);
            if (d) {
                v = round_bf16(_mm512_add_ps(v, ld_bf16(d + r * H + c, m)));
                st_bf16(sum + r * H + c, v, m);
            }
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)H + eps));
        for (int64_t c = 0; c < H; c += 16) {
            __mmask16 m = lanes(H - c);
            __m512 y = round_bf16(_mm512_mul_ps(ld_bf16(src + c, m), scale));
            st_bf16(out + r * H + c, _mm512_mul_ps(y, ld_bf16(w + c, m)), m);
        }
    }
    return 0;
}

/* SwiGLU's elementwise part: gu [R, 2I] = (gate | up) -> out [R, I] = bf16(bf16(silu(g)) * u),
 * silu(g) = g / (1 + exp(-g)) from exp(-|g|) (the polynomial exp above, ~1 ulp). */
int specrl_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t R, int64_t I, int threads) {
    if (R < 1 || I < 1) return 1;
    const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && R >= 16)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t c = 0; c < I; c += 16) {
            __mmask16 m = lanes(I - c);
            __m512 g = ld_bf16(gu + r * 2 * I + c, m), u = ld_bf16(gu + r * 2 * I + I + c, m);
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
            __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
            __m512 num = _mm512_mask_mul_ps(g, neg, g, e); /* g >= 0: g; else g * e */
            __m512 s = round_bf16(_mm512_div_ps(num, _mm512_add_ps(one, e)));
            st_bf16(out + r * I + c, _mm512_mul_ps(s, u), m);
        }
    }
    return 0;
}

/* Rotary embedding of N tokens' NH heads of D (D % 32 == 0): token n's heads start at
 * src + n * stride (elements); cos/sin [N, D]; dst [N, NH, D] =
 * bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = (-x[D/2:], x[:D/2]). */
int specrl_rope_bf16(const uint16_t *src, int64_t stride, const uint16_t *cosv,
                     const uint16_t *sinv, uint16_t *dst, int64_t N, int64_t NH, int64_t D,
                     int threads) {
    if (N < 1 || NH < 1 || D % 32 != 0) return 1;
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N >= 16)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t h = 0; h < NH; h++) {
            const uint16_t *x = src + n * stride + h * D;
            uint16_t *y = dst + (n * NH + h) * D;
            for (int64_t c = 0; c < D; c += 16) {
                __m512 v = ld_bf16(x + c, 0xFFFF);
                __m512 rot = c < half ? _mm512_sub_ps(_mm512_setzero_ps(),
                                                      ld_bf16(x + c + half, 0xFFFF))
                                      : ld_bf16(x + c - half, 0xFFFF);
                __m512 a = round_bf16(_mm512_mul_ps(v, ld_bf16(cosv + n * D + c, 0xFFFF)));
                __m512 b = round_bf16(_mm512_mul_ps(rot, ld_bf16(sinv + n * D + c, 0xFFFF)));
                st_bf16(y + c, _mm512_add_ps(a, b), 0xFFFF);
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ AMX products
 * On CPUs with AMX (amx_tile, amx_bf16) every product of a weight with K % 32 == 0 runs here,
 * whatever M: tiles of 16 rows x 16 float32 columns (C), 16 rows x 32 bf16 of x (A) and the
 * packed weight itself as B (its [N/16][K/2][16][2] layout is AMX's pair-interleaved B tile:
 * 16 k-pairs x 16 columns = 1 KiB, row stride 64 bytes), accumulated over K in chunks of 32 in
 * k order. Each output element is the same instruction sequence whatever M, the other rows or
 * the thread count (batch-invariant), like the AVX512 path, but not the same sums as it: a
 * machine uses one path for a weight, never both. x is copied into a zero-padded buffer of whole
 * 16-row tiles, so one tile configuration serves every M. specrl_amx_init asks Linux for the
 * tile state once per process (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). */
#define AMX_PF_CHUNKS 4 /* B tiles fetched ahead */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

int specrl_amx_init(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : 1; }

static void amx_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { /* C00, C01, C10, C11, A0, A1, B0, B1: 16 rows x 64 bytes */
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

static inline void prefetch_tile(const uint16_t *b) {
    for (int r = 0; r < 16; r++) _mm_prefetch((const char *)(b + r * 32), _MM_HINT_T0);
}

/* Rows [m0, m0 + 16) of tile C(i, j) (c + (2i + j) * 256, 16 x 16 floats) -> bf16 y. */
static inline void amx_store(const float *c, int64_t m0, int64_t M, int nb, int i, uint16_t *y,
                             int64_t N) {
    int64_t rows = M - m0 < 16 ? M - m0 : 16;
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < nb; j++)
            _mm256_storeu_si256((__m256i *)(y + (m0 + r) * N + j * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + (2 * i + j) * 256 + r * 16)));
}

/* Columns [n0, n0 + 16 * nb) (nb = 1 or 2 packed blocks) for the 16-row tiles of xp in rows
 * [m_lo, m_hi), two row tiles per pass over K (up to four accumulators in flight: the dot
 * products of one accumulator wait on each other, so one or two alone leave the unit idle).
 * Each output element is still one accumulator's chain over k in order, whatever rows share
 * its pass. */
static void amx_columns(const uint16_t *w, int64_t ws, int nb, const uint16_t *xp, int64_t m_lo,
                        int64_t m_hi, int64_t M, int64_t K, uint16_t *y, int64_t N, float *c) {
    const int64_t chunks = K / 32;
    for (int64_t m0 = m_lo; m0 < m_hi; m0 += 32) {
        const int two = m0 + 16 < m_hi;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kc = 0; kc < chunks; kc++) {
            if (m0 == m_lo && kc + AMX_PF_CHUNKS < chunks) { /* later passes: in cache */
                prefetch_tile(w + (kc + AMX_PF_CHUNKS) * 512);
                if (nb == 2) prefetch_tile(w + ws + (kc + AMX_PF_CHUNKS) * 512);
            }
            _tile_loadd(6, w + kc * 512, 64);
            if (nb == 2) _tile_loadd(7, w + ws + kc * 512, 64);
            _tile_loadd(4, xp + m0 * K + kc * 32, K * 2);
            _tile_dpbf16ps(0, 4, 6);
            if (nb == 2) _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, xp + (m0 + 16) * K + kc * 32, K * 2);
                _tile_dpbf16ps(2, 5, 6);
                if (nb == 2) _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
        amx_store(c, m0, M, nb, 0, y, N);
        if (two) {
            _tile_stored(2, c + 512, 64);
            _tile_stored(3, c + 768, 64);
            amx_store(c, m0 + 16, M, nb, 1, y, N);
        }
    }
}

/* wp: packed weights [N/16][K/2][16][2]; x: [M, K]; y: [M, N]; any M >= 1; K % 32 == 0.
 * Rows go in blocks of AMX_ROW_BLOCK (that block of x stays in L2 while every column tile
 * passes over it: a long prefill no longer streams all of x from memory once per tile), the
 * column tiles of a block split over the threads. The order of work changes nothing in any
 * output element's sums. */
#define AMX_ROW_BLOCK 128
int specrl_gemm_amx_bf16(const uint16_t *wp, const uint16_t *x, uint16_t *y, int64_t M,
                         int64_t N, int64_t K, int threads) {
    if (M < 1 || N % 16 != 0 || K % 32 != 0) return 1;
    const int64_t mp = (M + 15) / 16 * 16, ws = K / 2 * 32, blocks_n = N / 16;
    const int64_t tiles_n = (blocks_n + 1) / 2;
    uint16_t *xp = aligned_alloc(64, (size_t)(mp * K * 2));
    if (!xp) return 2;
    memcpy(xp, x, (size_t)(M * K * 2));
    memset(xp + M * K, 0, (size_t)((mp - M) * K * 2));
#pragma omp parallel num_threads(threads) if (threads > 1 && tiles_n > 1)
    {
        float c[1024] __attribute__((aligned(64)));
        amx_configure();
        for (int64_t m_lo = 0; m_lo < mp; m_lo += AMX_ROW_BLOCK) {
            const int64_t m_hi = m_lo + AMX_ROW_BLOCK < mp ? m_lo + AMX_ROW_BLOCK : mp;
#pragma omp for schedule(static) nowait /* a thread's columns: the same in every block */
            for (int64_t t = 0; t < tiles_n; t++) {
                const int nb = (2 * t + 2 <= blocks_n) ? 2 : 1;
                amx_columns(wp + 2 * t * ws, ws, nb, xp, m_lo, m_hi, M, K, y + 2 * t * 16, N, c);
            }
        }
        _tile_release();
    }
    free(xp);
    return 0;
}

/* ------------------------------------------------------------------ KV cache writes
 * N tokens' KV heads of D elements (token n's heads start at src + n * stride, head h at
 * + h * D) into a cache layer [slots, KV, Lmax, D] at slot rows[n], position pos[n]. Nothing is
 * written unless every (slot, position) is inside the cache (returns 1). */
int specrl_cache_write_bf16(const uint16_t *src, int64_t stride, uint16_t *cache,
                            const int64_t *rows, const int64_t *pos, int64_t N, int64_t KV,
                            int64_t D, int64_t slots, int64_t Lmax) {
    for (int64_t n = 0; n < N; n++)
        if (rows[n] < 0 || rows[n] >= slots || pos[n] < 0 || pos[n] >= Lmax) return 1;
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < KV; h++)
            memcpy(cache + ((rows[n] * KV + h) * Lmax + pos[n]) * D, src + n * stride + h * D,
                   (size_t)D * 2);
    return 0;
}

/* ------------------------------------------------------------------ sampling at temperature 1
 * Inverse-CDF sampling from logits [N, V] (bf16, or float32 when is_bf16 == 0) with uniforms
 * u [N]: per row the max m, e = exp(l - m) in float32 (0 for -inf logits), masses of chunks of
 * SAMPLE_CHUNK tokens (float32 lanes, summed in one fixed order) accumulated in double; the first
 * chunk whose running mass passes u * total, then the first token inside it whose running
 * double sum passes what is left (a token of mass 0 is never taken: when rounding runs past the
 * chunk's end, its last token of nonzero mass); logprob = (l - m) - log(total). One pass over the logits plus one chunk, each row
 * by one thread in one order (batch-invariant). tokens int64 [N], logprobs float32 [N]. */
#define SAMPLE_CHUNK 1024

static inline __m512 logits16(const void *row, int is_bf16, int64_t c, __mmask16 m) {
    const __m512 none = _mm512_set1_ps(-INFINITY); /* lanes past the row: no mass, not the max */
    if (is_bf16) return _mm512_mask_mov_ps(none, m, ld_bf16((const uint16_t *)row + c, m));
    return _mm512_mask_loadu_ps(none, m, (const float *)row + c);
}

static inline __m512 masses16(__m512 l, __m512 vmax) { /* exp(l - max), 0 where l = -inf */
    __mmask16 live = _mm512_cmp_ps_mask(l, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(l, vmax)));
}

static inline float logit_at(const void *row, int is_bf16, int64_t i) {
    if (!is_bf16) return ((const float *)row)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void sample_row(const void *row, int is_bf16, int64_t V, double u, int64_t *token,
                       float *logprob) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < V; c += 16)
        vm = _mm512_max_ps(vm, logits16(row, is_bf16, c, lanes(V - c)));
    float mx = _mm512_reduce_max_ps(vm);
    __m512 vmax = _mm512_set1_ps(mx);
    int64_t chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    double total = 0.0, masses[chunks];
    for (int64_t k = 0; k < chunks; k++) {
        __m512 acc = ZERO;
        int64_t end = (k + 1) * SAMPLE_CHUNK < V ? (k + 1) * SAMPLE_CHUNK : V;
        for (int64_t c = k * SAMPLE_CHUNK; c < end; c += 16)
            acc = _mm512_add_ps(acc, masses16(logits16(row, is_bf16, c, lanes(end - c)), vmax));
        masses[k] = (double)_mm512_reduce_add_ps(acc);
        total += masses[k];
    }
    double target = u * total, run = 0.0;
    int64_t k = 0;
    while (k < chunks - 1 && run + masses[k] <= target) run += masses[k++];
    int64_t start = k * SAMPLE_CHUNK, end = start + SAMPLE_CHUNK < V ? start + SAMPLE_CHUNK : V;
    int64_t pick = -1, last = -1; /* last: the chunk's last token of nonzero mass so far */
    for (int64_t i = start; i < end && pick < 0; i++) {
        float e = _mm512_cvtss_f32(masses16(_mm512_set1_ps(logit_at(row, is_bf16, i)), vmax));
        if (e <= 0.0f) continue;
        last = i;
        run += e;
        if (run > target) pick = i;
    }
    if (pick < 0) pick = last; /* rounding ran past the chunk's end: its last nonzero token */
    for (int64_t c = 0; pick < 0 && c < V; c++) /* no mass in the chunk at all: the argmax */
        if (logit_at(row, is_bf16, c) == mx) pick = c;
    *token = pick;
    *logprob = (float)((double)(logit_at(row, is_bf16, pick) - mx) - log(total));
}

int specrl_sample_t1(const void *logits, int is_bf16, int64_t N, int64_t V, const double *u,
                     int64_t *tokens, float *logprobs, int threads) {
    if (N < 1 || V < 1) return 1;
    const int64_t width = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N > 1)
    for (int64_t r = 0; r < N; r++)
        sample_row((const char *)logits + r * V * width, is_bf16, V, u[r], tokens + r, logprobs + r);
    return 0;
}

/* ------------------------------------------------------------------ decoder layers, one call
 * L decoder layers of a Llama-family model (no biases, no q/k norms) over a KV cache for
 * N = B * T tokens that read cached keys (a decode step or a verify pass), in ONE call: the
 * per-module path's kernels in its order (specrl/models/fused.py), so its bits exactly:
 *   h = rmsnorm(x); per layer: qkv = h Wqkv; q|k = rope(q|k); cache <- k, v; a = attention;
 *   x, h = x + a Wo, rmsnorm; act = silu_mul(h Wgate_up); x, h = x + act Wdown, rmsnorm (the
 *   next layer's attention norm; after the last layer, the final norm into h_out).
 * x [N, Hd] is the residual stream, updated in place (the last layer's output at the end); a
 * layer with a capture buffer [N, Hd] gets a copy of its output. dims: B, T, Hd, NH, KV, D, I,
 * slots, Lmax, mask_len. Shapes the kernels refuse or a cache write outside the cache return
 * nonzero before anything is computed or written. */
typedef struct {
    const uint16_t *attn_norm, *qkv, *o, *mlp_norm, *gate_up, *down;
    uint16_t *cache_k, *cache_v, *capture;
} layer_ptrs;

static int product(const uint16_t *wp, const uint16_t *x, uint16_t *y, int64_t M, int64_t N,
                   int64_t K, int amx, int threads) { /* the path GemvKernel.matmul takes */
    return amx && K % 32 == 0 ? specrl_gemm_amx_bf16(wp, x, y, M, N, K, threads)
                              : specrl_gemm_bf16(wp, x, y, M, N, K, threads);
}

static int layers_refuse(const int64_t *dims, const int64_t *wrows, const int64_t *wpos,
                         const int32_t *lens, const uint8_t *mask) {
    const int64_t B = dims[0], T = dims[1], Hd = dims[2], NH = dims[3], KV = dims[4];
    const int64_t D = dims[5], I = dims[6], slots = dims[7], Lmax = dims[8];
    if (B < 1 || T < 1 || KV < 1 || NH % KV != 0 || D % 32 != 0 || D > 256 || I < 1 ||
        Hd % 16 != 0 || I % 16 != 0)
        return 1;
    for (int64_t n = 0; n < B * T; n++)
        if (wrows[n] < 0 || wrows[n] >= slots || wpos[n] < 0 || wpos[n] >= Lmax || lens[n] < 0 ||
            lens[n] > Lmax || (mask && lens[n] > dims[9]))
            return 1;
    return 0;
}

int specrl_layers_bf16(const layer_ptrs *ls, int64_t L, const uint16_t *final_norm, uint16_t *x,
                       uint16_t *h_out, const uint16_t *cosv, const uint16_t *sinv,
                       const int64_t *wrows, const int64_t *wpos, const int64_t *slots,
                       const int32_t *lens, const uint8_t *mask, const int64_t *dims, float eps,
                       float scale, int amx, int threads) {
    if (L < 1 || layers_refuse(dims, wrows, wpos, lens, mask)) return 1;
    const int64_t B = dims[0], T = dims[1], Hd = dims[2], NH = dims[3], KV = dims[4];
    const int64_t D = dims[5], I = dims[6], S = dims[7], Lmax = dims[8], N = B * T;
    const int64_t QKV = (NH + 2 * KV) * D, QK = (NH + KV) * D;
    uint16_t *work = malloc(sizeof(uint16_t) * N * (2 * Hd + QKV + QK + NH * D + 3 * I));
    if (!work) return 2;
    uint16_t *h = work, *qkv = h + N * Hd, *qk = qkv + N * QKV, *att = qk + N * QK;
    uint16_t *proj = att + N * NH * D, *gu = proj + N * Hd, *act = gu + N * 2 * I;
    int rc = specrl_rmsnorm_bf16(x, NULL, ls[0].attn_norm, h, NULL, N, Hd, eps, threads);
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const layer_ptrs *p = ls + l;
        rc |= product(p->qkv, h, qkv, N, QKV, Hd, amx, threads);
        rc |= specrl_rope_bf16(qkv, QKV, cosv, sinv, qk, N, NH + KV, D, threads);
        rc |= specrl_cache_write_bf16(qk + NH * D, QK, p->cache_k, wrows, wpos, N, KV, D, S, Lmax);
        rc |= specrl_cache_write_bf16(qkv + QK, QKV, p->cache_v, wrows, wpos, N, KV, D, S, Lmax);
        rc |= attention(qk, QK, p->cache_k, p->cache_v, slots, lens, mask, dims[9], att, B, T, NH,
                        KV, D, Lmax, scale, threads);
        rc |= product(p->o, att, proj, N, Hd, NH * D, amx, threads);
        rc |= specrl_rmsnorm_bf16(x, proj, p->mlp_norm, h, x, N, Hd, eps, threads);
        rc |= product(p->gate_up, h, gu, N, 2 * I, Hd, amx, threads);
        rc |= specrl_silu_mul_bf16(gu, act, N, I, threads);
        rc |= product(p->down, act, proj, N, Hd, I, amx, threads);
        const uint16_t *next = l + 1 < L ? ls[l + 1].attn_norm : final_norm;
        rc |= specrl_rmsnorm_bf16(x, proj, next, l + 1 < L ? h : h_out, x, N, Hd, eps, threads);
        if (p->capture) memcpy(p->capture, x, sizeof(uint16_t) * N * Hd);
    }
    free(work);
    return rc ? 3 : 0;
}
