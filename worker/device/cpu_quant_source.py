"""The C source of the quantized matmuls (int8 and int4 weights, fp32 activations), appended to
``worker.device.cpu_kernel_source.SOURCE`` (it uses that file's thread pool, ``run_split``).
``worker.device.cpu_quant`` packs the weights and wraps the calls; read its docstring for the
layout. AVX-512 (16 rows per vector) where the compiler flags allow it, else AVX2 (8 rows).
"""

QUANT_SOURCE = r"""
/* ---- quantized weights: per tile of 16 rows [K, 16] int8 or [K / 2, 16] uint8 (two k per
   byte, low nibble the even k), scales (and int4 offsets) [K / gs, 16] fp16; eight tiles'
   streams interleaved in 32-byte units (``tile_stream``). A vector of VW weight rows is one
   load per k; the kernel dequantizes in registers (q * scale (+ offset), one FMA) and
   accumulates x[m, k] * w in fp32, every output one chain over k in order. */
#ifdef __AVX512F__
#define VW 16
typedef __m512 vf;
#define vzero() _mm512_setzero_ps()
#define vset1(v) _mm512_set1_ps(v)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vstore(p, v) _mm512_storeu_ps(p, v)
static inline vf load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf load_h(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline void load_u4(const uint8_t *p, vf *lo, vf *hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#define V1 8 /* vectors in flight for one input row, and for 2-4 rows */
#define V4 4
#else
#define VW 8
typedef __m256 vf;
#define vzero() _mm256_setzero_ps()
#define vset1(v) _mm256_set1_ps(v)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vstore(p, v) _mm256_storeu_ps(p, v)
static inline vf load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf load_h(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline void load_u4(const uint8_t *p, vf *lo, vf *hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#define V1 4
#define V4 2
#endif

struct qgemm_args {
    int64_t M, K, N, gs;
    const float *x;
    const void *w;
    const uint16_t *scales, *offsets; /* offsets NULL: int8 */
    float *out;
};

/* One tile's stream in the packed layout: tiles of 16 rows in blocks of eight, each block's
   streams interleaved in 32-byte units (unit u of tile t at (u * width + t) * 32 from the
   block's start; width 8, fewer in the last block). `at(s, e)`: byte e of the stream. */
struct stream {
    const uint8_t *p;
    int64_t stride; /* bytes from one of the tile's units to its next */
};

static inline struct stream tile_stream(const void *base, int64_t tile, int64_t tile_bytes,
                                        int64_t tiles) {
    const int64_t block = tile / 8;
    const int64_t width = tiles - block * 8 < 8 ? tiles - block * 8 : 8;
    const struct stream s = {(const uint8_t *)base + block * 8 * tile_bytes + (tile % 8) * 32,
                             width * 32};
    return s;
}

static inline const uint8_t *at(const struct stream s, int64_t e) {
    return s.p + (e >> 5) * s.stride + (e & 31);
}

/* vector j (VW rows) of a packed array with `bytes_per_k` bytes per row and column: its tile's
   stream; `*half` the byte offset of its rows in each column (AVX2: 8 of a tile's 16) */
static inline struct stream vec_stream(const void *base, int64_t j, int64_t columns,
                                       int64_t bytes, int64_t N, int64_t *half) {
    *half = (j * VW) % 16 * bytes;
    return tile_stream(base, j * VW / 16, columns * 16 * bytes, N / 16);
}

/* V vectors of weight rows from vector j0 times MC <= 4 input rows (x + m * K):
   out[m * N + (j0 + v) * VW + i] */
static inline __attribute__((always_inline)) void q8_tile(
        const int V, const int MC, const struct qgemm_args *a, const float *x, float *out,
        int64_t j0) {
    const int64_t K = a->K, gs = a->gs, ngroups = K / gs;
    struct stream w[16], s[16];
    int64_t hw[16], hs[16];
    vf acc[16][4];
    for (int v = 0; v < V; v++) {
        w[v] = vec_stream(a->w, j0 + v, K, 1, a->N, &hw[v]);
        s[v] = vec_stream(a->scales, j0 + v, ngroups, 2, a->N, &hs[v]);
        for (int m = 0; m < MC; m++) acc[v][m] = vzero();
    }
    for (int64_t g = 0; g < ngroups; g++) {
        vf sc[16];
        for (int v = 0; v < V; v++) sc[v] = load_h((const uint16_t *)(at(s[v], g * 32) + hs[v]));
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
            vf wv[16];
            for (int v = 0; v < V; v++)
                wv[v] = vmul(load_i8((const int8_t *)at(w[v], k * 16) + hw[v]), sc[v]);
            for (int m = 0; m < MC; m++) {
                const vf xb = vset1(x[m * K + k]);
                for (int v = 0; v < V; v++) acc[v][m] = vfma(wv[v], xb, acc[v][m]);
            }
        }
    }
    for (int v = 0; v < V; v++)
        for (int m = 0; m < MC; m++) vstore(out + m * a->N + (j0 + v) * VW, acc[v][m]);
}

static inline __attribute__((always_inline)) void q4_tile(
        const int V, const int MC, const struct qgemm_args *a, const float *x, float *out,
        int64_t j0) {
    const int64_t K = a->K, gs = a->gs, ngroups = K / gs;
    struct stream w[16], s[16], o[16];
    int64_t hw[16], hs[16];
    vf acc[16][4];
    for (int v = 0; v < V; v++) {
        w[v] = vec_stream(a->w, j0 + v, K / 2, 1, a->N, &hw[v]);
        s[v] = vec_stream(a->scales, j0 + v, ngroups, 2, a->N, &hs[v]);
        o[v] = vec_stream(a->offsets, j0 + v, ngroups, 2, a->N, &hs[v]);
        for (int m = 0; m < MC; m++) acc[v][m] = vzero();
    }
    for (int64_t g = 0; g < ngroups; g++) {
        vf sc[16], off[16];
        for (int v = 0; v < V; v++) {
            sc[v] = load_h((const uint16_t *)(at(s[v], g * 32) + hs[v]));
            off[v] = load_h((const uint16_t *)(at(o[v], g * 32) + hs[v]));
        }
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
            vf lo[16], hi[16];
            for (int v = 0; v < V; v++) {
                load_u4(at(w[v], k / 2 * 16) + hw[v], &lo[v], &hi[v]);
                lo[v] = vfma(lo[v], sc[v], off[v]);
                hi[v] = vfma(hi[v], sc[v], off[v]);
            }
            for (int m = 0; m < MC; m++) {
                const vf x0 = vset1(x[m * K + k]), x1 = vset1(x[m * K + k + 1]);
                for (int v = 0; v < V; v++) {
                    acc[v][m] = vfma(lo[v], x0, acc[v][m]);
                    acc[v][m] = vfma(hi[v], x1, acc[v][m]);
                }
            }
        }
    }
    for (int v = 0; v < V; v++)
        for (int m = 0; m < MC; m++) vstore(out + m * a->N + (j0 + v) * VW, acc[v][m]);
}

/* vectors [j, j + V) against every input row, four at a time */
#define ROWS(TILE, V) do { \
        for (int64_t m0 = 0; m0 < a->M; m0 += 4) { \
            const float *xm = a->x + m0 * a->K; \
            float *om = a->out + m0 * a->N; \
            switch (a->M - m0 < 4 ? a->M - m0 : 4) { \
            case 1: TILE(V, 1, a, xm, om, j); break; \
            case 2: TILE(V, 2, a, xm, om, j); break; \
            case 3: TILE(V, 3, a, xm, om, j); break; \
            default: TILE(V, 4, a, xm, om, j); break; \
            } \
        } \
    } while (0)

#define QPART(NAME, TILE) \
static void NAME(const void *ctx, int64_t j0, int64_t j1) { \
    const struct qgemm_args *a = ctx; \
    int64_t j = j0; \
    if (a->M == 1) \
        for (; j + V1 <= j1; j += V1) TILE(V1, 1, a, a->x, a->out, j); \
    for (; j + V4 <= j1; j += V4) ROWS(TILE, V4); \
    for (; j < j1; j++) ROWS(TILE, 1); \
}
QPART(q8_part, q8_tile)
QPART(q4_part, q4_tile)

/* out [T, K] = rows ids [T] of the dequantized weight (an embedding lookup: int8 q * scale,
   int4 q * scale + offset, one rounding each, as worker.layers.quant.dequantize). 0 on
   success, 1 bad shape or id. */
int tp_quant_rows(const int64_t *ids, int64_t T, const void *w, const uint16_t *scales,
                  const uint16_t *offsets, float *out, int64_t K, int64_t N, int64_t gs) {
    if (N % 16 || gs < 2 || K % gs) return 1;
    const int64_t ngroups = K / gs, tiles = N / 16;
    for (int64_t i = 0; i < T; i++) {
        if (ids[i] < 0 || ids[i] >= N) return 1;
        const int64_t tile = ids[i] / 16, lane = ids[i] % 16;
        const struct stream ws = tile_stream(w, tile, offsets ? K * 8 : K * 16, tiles);
        const struct stream ss = tile_stream(scales, tile, ngroups * 32, tiles);
        const struct stream os = tile_stream(offsets ? offsets : scales, tile, ngroups * 32, tiles);
        float *o = out + i * K;
        for (int64_t g = 0; g < ngroups; g++) {
            const float scale = _cvtsh_ss(((const uint16_t *)at(ss, g * 32))[lane]);
            if (offsets) {
                const float offset = _cvtsh_ss(((const uint16_t *)at(os, g * 32))[lane]);
                for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
                    const uint8_t b = at(ws, k / 2 * 16)[lane];
                    const float lo = (float)(b & 15) * scale, hi = (float)(b >> 4) * scale;
                    o[k] = lo + offset;
                    o[k + 1] = hi + offset;
                }
            } else {
                for (int64_t k = g * gs; k < (g + 1) * gs; k++)
                    o[k] = (float)((const int8_t *)at(ws, k * 16))[lane] * scale;
            }
        }
    }
    return 0;
}

/* rows of weights in one vector register (16 with AVX-512, else 8) */
int tp_vector_rows(void) { return VW; }

/* out [M, N] = x [M, K] @ dequantized(w)^T; 0 on success. int8 when offsets is NULL, else int4
   (asymmetric). N % 16 == 0, K % gs == 0, gs even. */
int tp_quant_gemm(int64_t M, const float *x, const void *w, const uint16_t *scales,
                  const uint16_t *offsets, float *out, int64_t K, int64_t N, int64_t gs,
                  int threads) {
    if (N % 16 || M < 1 || gs < 2 || gs % 2 || K % gs || threads < 1) return 1;
    const struct qgemm_args args = {M, K, N, gs, x, w, scales, offsets, out};
    const int64_t bytes = offsets ? N * K / 2 : N * K;
    run_split(offsets ? q4_part : q8_part, &args, N / VW, V1, bytes, threads);
    return 0;
}

/* ---- one input row against int8 weights with AVX512-VNNI: the row quantized to int8 per
   weight group (scale amax / 127, as llama.cpp's q8 activations), 64 products per vpdpbusd.
   Four k of sixteen rows (64 bytes, k-major in the packed layout) are permuted to row-major
   quads; the weights go in as unsigned (w + 128), so each group's sum is corrected by
   128 * sum(xq). Each group's int32 sum is scaled by w_scale * x_scale into an fp32 chain. */
#include <stdlib.h>
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
struct q8act_args {
    int64_t K, N, gs;
    const int8_t *xq;
    const float *xs;
    const int32_t *xsum;
    const int8_t *w;
    const uint16_t *scales;
    float *out;
};

static void q8act_part(const void *ctx, int64_t j0, int64_t j1) {
    const struct q8act_args *a = ctx;
    const int64_t K = a->K, gs = a->gs, ngroups = K / gs;
    uint8_t order[64];
    for (int r = 0; r < 16; r++)
        for (int q = 0; q < 4; q++) order[4 * r + q] = (uint8_t)(16 * q + r);
    const __m512i perm = _mm512_loadu_si512(order), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t j = j0; j < j1; j++) {
        const struct stream w = tile_stream(a->w, j, K * 16, a->N / 16);
        const struct stream s = tile_stream(a->scales, j, ngroups * 32, a->N / 16);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g = 0; g < ngroups; g++) {
            __m512i sum = _mm512_setzero_si512();
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 4) {
                /* columns k, k + 1 and k + 2, k + 3: two 32-byte units */
                const __m512i four = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)at(w, k * 16))),
                    _mm256_loadu_si256((const __m256i *)at(w, k * 16 + 32)), 1);
                __m512i quads = _mm512_permutexvar_epi8(perm, four);
                int32_t x4;
                memcpy(&x4, a->xq + k, 4);
                sum = _mm512_dpbusd_epi32(sum, _mm512_xor_si512(quads, flip),
                                          _mm512_set1_epi32(x4));
            }
            sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * a->xsum[g]));
            const __m512 scale = _mm512_mul_ps(load_h((const uint16_t *)at(s, g * 32)),
                                               _mm512_set1_ps(a->xs[g]));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc);
        }
        _mm512_storeu_ps(a->out + j * 16, acc);
    }
}

/* out [N] = x [K] @ dequantized(w)^T, int8 w, x quantized per group; 0 on success, 2 where
   the kernel was built without VNNI/VBMI. N % 16 == 0, K % gs == 0, gs % 4 == 0. */
int tp_quant_gemv_q8act(const float *x, const void *w, const uint16_t *scales, float *out,
                        int64_t K, int64_t N, int64_t gs, int threads) {
    if (N % 16 || gs < 4 || gs % 4 || K % gs || threads < 1) return 1;
    const int64_t ngroups = K / gs;
    int8_t *xq = malloc(K);
    float *xs = malloc(ngroups * sizeof(float));
    int32_t *xsum = malloc(ngroups * sizeof(int32_t));
    if (!xq || !xs || !xsum) { free(xq); free(xs); free(xsum); return 3; }
    for (int64_t g = 0; g < ngroups; g++) {
        float amax = 0.0f;
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) amax = fmaxf(amax, fabsf(x[k]));
        const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t total = 0;
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
            xq[k] = (int8_t)nearbyintf(x[k] * inverse);
            total += xq[k];
        }
        xs[g] = scale;
        xsum[g] = total;
    }
    const struct q8act_args args = {K, N, gs, xq, xs, xsum, w, scales, out};
    run_split(q8act_part, &args, N / 16, 1, N * K, threads);
    free(xq); free(xs); free(xsum);
    return 0;
}
#else
int tp_quant_gemv_q8act(const float *x, const void *w, const uint16_t *scales, float *out,
                        int64_t K, int64_t N, int64_t gs, int threads) {
    (void)x; (void)w; (void)scales; (void)out; (void)K; (void)N; (void)gs; (void)threads;
    return 2;
}
#endif

/* ---- int16 activations (the default where the CPU has AVX512-VNNI and VBMI): each input row
   quantized to int16 per weight group (scale amax / 32767: 2^-15 of the group's largest
   value, below fp32 accumulation noise at these sizes), then vpdpwssd: 32 products (two k of
   sixteen rows) per instruction, exact int32 sums per group. int8 weights: the 32 bytes of
   columns k and k + 1 are permuted to row-major pairs and sign-extended to int16; int4: the
   16 bytes of a column pair (low nibble k, high k + 1) are zero-extended to 32 bits and masked
   to the pair of 16-bit lanes in one OR/AND. int4 with gs % 4 == 0 instead multiplies bytes
   (vpdpbusd, 64 products an instruction): the int16 row is split into x = 256 * hi + lo (hi
   signed, lo unsigned bytes), the 32 bytes of two column pairs are spread to one nibble per
   byte (row-major quads: vpermb, vpmultishiftqb, and), and sum(q x) = 256 * sum(q hi) +
   sum(q lo) exactly (q unsigned against hi, lo unsigned against q): the same int32 sums, half
   the instructions. Per row and group: out += xs * s * sum(q x)
   (+ xs * offset * sum(x) for int4), one fp32 chain over the groups in order. A row's result
   does not depend on the other rows, the tile shape or the thread count. The sums stay within
   int32: 127 * 32767 * gs < 2^31 for gs <= 512. */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
struct a16_args {
    int64_t M, K, N, gs;
    const int16_t *xq; /* [M, K] */
    const float *xs;   /* [M, K / gs] */
    const int32_t *xsum;
    const void *w;
    const uint16_t *scales, *offsets; /* offsets NULL: int8 */
    float *out;
    const int8_t *xh;  /* [M, K] the high bytes of xq (int4 with gs % 4 == 0; else NULL) */
    const uint8_t *xl; /* [M, K] its low bytes */
};

/* the 32 bytes of column pairs j, j + 1 of sixteen rows -> row r's four nibbles (k .. k + 3)
   in bytes 4r .. 4r + 3 */
static inline __m512i quads_u4(const uint8_t *p, const __m512i spread, const __m512i shifts) {
    const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    const __m512i bytes = _mm512_permutexvar_epi8(spread, b);
    const __m512i nibbles = _mm512_multishift_epi64_epi8(shifts, bytes);
    return _mm512_and_si512(nibbles, _mm512_set1_epi8(15));
}

static inline __m512i pairs_i8(const int8_t *p, const __m256i perm) {
    return _mm512_cvtepi8_epi16(
        _mm256_permutexvar_epi8(perm, _mm256_loadu_si256((const __m256i *)p)));
}

static inline __m512i pairs_u4(const uint8_t *p) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)),
                            _mm512_set1_epi32(0x000F000F));
}

/* The permutations a part's tiles share (built once per part): `perm` takes the 32 bytes of
   int8 columns k, k + 1 to row-major pairs; quads_u4's `spread` puts rows 2q, 2q + 1 of both
   int4 column pairs in qword q (bytes pair0[2q], pair1[2q], pair0[2q + 1], pair1[2q + 1]) and
   its `shifts` take nibble i of those four bytes into byte i. */
struct a16_tables {
    __m256i perm;
    __m512i spread, shifts;
};

static struct a16_tables a16_tables_make(void) {
    uint8_t pairs[32], order[64], shift[64];
    for (int r = 0; r < 16; r++)
        for (int q = 0; q < 2; q++) pairs[2 * r + q] = (uint8_t)(16 * q + r);
    for (int q = 0; q < 8; q++)
        for (int i = 0; i < 8; i++) {
            order[8 * q + i] = (uint8_t)(i < 4 ? 16 * (i % 2) + 2 * q + i / 2 : 0);
            shift[8 * q + i] = (uint8_t)(4 * i);
        }
    const struct a16_tables t = {_mm256_loadu_si256((const __m256i *)pairs),
                                 _mm512_loadu_si512(order), _mm512_loadu_si512(shift)};
    return t;
}

/* V vectors of sixteen weight rows from j0 times MC <= 4 input rows from m0 */
static inline __attribute__((always_inline)) void a16_tile(
        const int V, const int MC, const int Q4, const struct a16_args *a, int64_t m0, int64_t j0,
        const struct a16_tables *t) {
    const int64_t K = a->K, gs = a->gs, ngroups = K / gs;
    const int64_t tiles = a->N / 16;
    struct stream w[8], s[8], o[8];
    __m512 acc[8][4];
    for (int v = 0; v < V; v++) {
        w[v] = tile_stream(a->w, j0 + v, K * (Q4 ? 8 : 16), tiles);
        s[v] = tile_stream(a->scales, j0 + v, ngroups * 32, tiles);
        o[v] = tile_stream(Q4 ? a->offsets : a->scales, j0 + v, ngroups * 32, tiles);
        for (int m = 0; m < MC; m++) acc[v][m] = _mm512_setzero_ps();
    }
    const __m256i perm = t->perm;
    const __m512i spread = t->spread, shifts = t->shifts;
    for (int64_t g = 0; g < ngroups; g++) {
        __m512i sum[8][4];
        for (int v = 0; v < V; v++)
            for (int m = 0; m < MC; m++) sum[v][m] = _mm512_setzero_si512();
        if (Q4 && a->xh) {
            __m512i low[8][4];
            for (int v = 0; v < V; v++)
                for (int m = 0; m < MC; m++) low[v][m] = _mm512_setzero_si512();
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 4) {
                __m512i hb[4], lb[4];
                for (int m = 0; m < MC; m++) {
                    int32_t h4, l4;
                    memcpy(&h4, a->xh + (m0 + m) * K + k, 4);
                    memcpy(&l4, a->xl + (m0 + m) * K + k, 4);
                    hb[m] = _mm512_set1_epi32(h4);
                    lb[m] = _mm512_set1_epi32(l4);
                }
                for (int v = 0; v < V; v++) {
                    const __m512i q = quads_u4(at(w[v], k * 8), spread, shifts);
                    for (int m = 0; m < MC; m++) {
                        sum[v][m] = _mm512_dpbusd_epi32(sum[v][m], q, hb[m]);
                        low[v][m] = _mm512_dpbusd_epi32(low[v][m], lb[m], q);
                    }
                }
            }
            for (int v = 0; v < V; v++)
                for (int m = 0; m < MC; m++)
                    sum[v][m] = _mm512_add_epi32(_mm512_slli_epi32(sum[v][m], 8), low[v][m]);
        } else
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
            __m512i xb[4];
            for (int m = 0; m < MC; m++) {
                int32_t x2;
                memcpy(&x2, a->xq + (m0 + m) * K + k, 4);
                xb[m] = _mm512_set1_epi32(x2);
            }
            for (int v = 0; v < V; v++) {
                const __m512i wv = Q4 ? pairs_u4(at(w[v], k * 8))
                                      : pairs_i8((const int8_t *)at(w[v], k * 16), perm);
                for (int m = 0; m < MC; m++) sum[v][m] = _mm512_dpwssd_epi32(sum[v][m], wv, xb[m]);
            }
        }
        for (int v = 0; v < V; v++) {
            const __m512 sc = load_h((const uint16_t *)at(s[v], g * 32));
            const __m512 off =
                Q4 ? load_h((const uint16_t *)at(o[v], g * 32)) : _mm512_setzero_ps();
            for (int m = 0; m < MC; m++) {
                const int64_t i = (m0 + m) * ngroups + g;
                __m512 t = _mm512_cvtepi32_ps(sum[v][m]);
                if (Q4)
                    t = _mm512_fmadd_ps(
                        t, sc, _mm512_mul_ps(off, _mm512_set1_ps((float)a->xsum[i])));
                else
                    t = _mm512_mul_ps(t, sc);
                acc[v][m] = _mm512_fmadd_ps(t, _mm512_set1_ps(a->xs[i]), acc[v][m]);
            }
        }
    }
    for (int v = 0; v < V; v++)
        for (int m = 0; m < MC; m++)
            _mm512_storeu_ps(a->out + (m0 + m) * a->N + (j0 + v) * 16, acc[v][m]);
}

#define A16_ROWS(V, Q4) do { \
        for (int64_t m0 = 0; m0 < a->M; m0 += 4) \
            switch (a->M - m0 < 4 ? a->M - m0 : 4) { \
            case 1: a16_tile(V, 1, Q4, a, m0, j, &t); break; \
            case 2: a16_tile(V, 2, Q4, a, m0, j, &t); break; \
            case 3: a16_tile(V, 3, Q4, a, m0, j, &t); break; \
            default: a16_tile(V, 4, Q4, a, m0, j, &t); break; \
            } \
    } while (0)

#define A16_PART(NAME, Q4) \
static void NAME(const void *ctx, int64_t j0, int64_t j1) { \
    const struct a16_args *a = ctx; \
    const struct a16_tables t = a16_tables_make(); \
    int64_t j = j0; \
    if (a->M == 1) \
        for (; j + 8 <= j1; j += 8) a16_tile(8, 1, Q4, a, 0, j, &t); \
    for (; j + 2 <= j1; j += 2) A16_ROWS(2, Q4); \
    for (; j < j1; j++) A16_ROWS(1, Q4); \
}
A16_PART(a16_q8_part, 0)
A16_PART(a16_q4_part, 1)

/* groups [count, gs] of x -> int16 (round to nearest even), their scales amax / 32767 and
   integer sums; sixteen at a time where gs allows (the same bits as the scalar loop) */
static void quantize_rows_i16(const float *x, int64_t count, int64_t gs, int16_t *xq, float *xs,
                              int32_t *xsum) {
    for (int64_t i = 0; i < count; i++) {
        const float *xg = x + i * gs;
        int16_t *qg = xq + i * gs;
        float amax = 0.0f;
        int32_t total = 0;
        if (gs % 16 == 0) {
            __m512 m = _mm512_setzero_ps();
            for (int64_t k = 0; k < gs; k += 16)
                m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xg + k)));
            amax = _mm512_reduce_max_ps(m);
            const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
            __m512i sum = _mm512_setzero_si512();
            for (int64_t k = 0; k < gs; k += 16) {
                const __m512i q =
                    _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + k), inverse));
                _mm256_storeu_si256((__m256i *)(qg + k), _mm512_cvtepi32_epi16(q));
                sum = _mm512_add_epi32(sum, q);
            }
            total = _mm512_reduce_add_epi32(sum);
        } else {
            for (int64_t k = 0; k < gs; k++) amax = fmaxf(amax, fabsf(xg[k]));
            const float inverse = amax > 0.0f ? 32767.0f / amax : 0.0f;
            for (int64_t k = 0; k < gs; k++) {
                qg[k] = (int16_t)nearbyintf(xg[k] * inverse);
                total += qg[k];
            }
        }
        xs[i] = amax / 32767.0f;
        xsum[i] = total;
    }
}

/* out [M, N] = x [M, K] @ dequantized(w)^T with x quantized to int16 per group; int8 w when
   offsets is NULL, else int4. 0 on success, 1 bad shape, 2 built without VNNI/VBMI, 3 memory.
   N % 16 == 0, K % gs == 0, gs even and <= 512. */
int tp_quant_gemm_a16(int64_t M, const float *x, const void *w, const uint16_t *scales,
                      const uint16_t *offsets, float *out, int64_t K, int64_t N, int64_t gs,
                      int threads) {
    if (N % 16 || M < 1 || gs < 2 || gs % 2 || gs > 512 || K % gs || threads < 1) return 1;
    const int64_t ngroups = K / gs;
    int16_t *xq = malloc(M * K * sizeof(int16_t));
    float *xs = malloc(M * ngroups * sizeof(float));
    int32_t *xsum = malloc(M * ngroups * sizeof(int32_t));
    if (!xq || !xs || !xsum) { free(xq); free(xs); free(xsum); return 3; }
    quantize_rows_i16(x, M * ngroups, gs, xq, xs, xsum);
    int8_t *xh = NULL;
    uint8_t *xl = NULL;
    if (offsets && gs % 4 == 0) { /* int4: the byte split of xq (struct a16_args) */
        xh = malloc(M * K);
        xl = malloc(M * K);
        if (!xh || !xl) { free(xq); free(xs); free(xsum); free(xh); free(xl); return 3; }
        for (int64_t i = 0; i < M * K; i++) {
            xh[i] = (int8_t)(xq[i] >> 8);
            xl[i] = (uint8_t)(xq[i] & 255);
        }
    }
    const struct a16_args args = {M, K, N, gs, xq, xs, xsum, w, scales, offsets, out, xh, xl};
    run_split(offsets ? a16_q4_part : a16_q8_part, &args, N / 16, 8,
              offsets ? N * K / 2 : N * K, threads);
    free(xq); free(xs); free(xsum); free(xh); free(xl);
    return 0;
}
#else
int tp_quant_gemm_a16(int64_t M, const float *x, const void *w, const uint16_t *scales,
                      const uint16_t *offsets, float *out, int64_t K, int64_t N, int64_t gs,
                      int threads) {
    (void)M; (void)x; (void)w; (void)scales; (void)offsets; (void)out; (void)K; (void)N;
    (void)gs; (void)threads;
    return 2;
}
#endif
"""
