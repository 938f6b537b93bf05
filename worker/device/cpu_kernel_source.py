"""The C source of the CPU kernel library: the packed matmul (with its thread pool), the RMS
norm, norm + rotary, residual add + norm, and one-token attention helpers.
``worker.device.cpu_gemv`` compiles it once (the cache key is a hash of this text and the
compiler flags) and wraps each function; read its docstring for the layout and the rules.
"""

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* G groups of 8 weight rows (group g: w + g * K * 8, [K][8]) times MC <= 4 input rows:
   out[m * ldo + g * 8 + i] = sum_k x[m * K + k] * w[g * K * 8 + k * 8 + i] */
static inline __attribute__((always_inline)) void groups(
        const int G, const int MC, const float *x, int64_t K, const float *w, float *out,
        int64_t ldo) {
    __m256 acc[8][4];
    for (int g = 0; g < G; g++)
        for (int m = 0; m < MC; m++) acc[g][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 wv[8];
        for (int g = 0; g < G; g++) wv[g] = _mm256_loadu_ps(w + g * K * 8 + k * 8);
        for (int m = 0; m < MC; m++) {
            __m256 xb = _mm256_broadcast_ss(x + m * K + k);
            for (int g = 0; g < G; g++) acc[g][m] = _mm256_fmadd_ps(wv[g], xb, acc[g][m]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int m = 0; m < MC; m++) _mm256_storeu_ps(out + m * ldo + g * 8, acc[g][m]);
}

/* 3 groups against input rows [0, M) in chunks of 4: the groups stay in cache between chunks */
static void groups3_all_rows(int64_t M, const float *x, int64_t K, const float *w, float *out,
                             int64_t N) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float *xm = x + m0 * K;
        float *om = out + m0 * N;
        switch (M - m0 < 4 ? M - m0 : 4) {
        case 1: groups(3, 1, xm, K, w, om, N); break;
        case 2: groups(3, 2, xm, K, w, om, N); break;
        case 3: groups(3, 3, xm, K, w, om, N); break;
        default: groups(3, 4, xm, K, w, om, N); break;
        }
    }
}

/* G groups at a time over groups [g, gend): G * MC accumulators + G weight vectors + 1 broadcast
   <= 16 registers */
#define SWEEP(G, MC) do { \
        for (; g + G <= gend; g += G) groups(G, MC, x, K, w + g * K * 8, out + g * 8, N); \
    } while (0)

/* out[:, g0 * 8 : gend * 8] of the product: weight groups [g0, gend) */
static void gemm_part(int64_t M, const float *x, const float *w, float *out, int64_t K, int64_t N,
                      int64_t g0, int64_t gend) {
    int64_t g = g0;
    switch (M) {
    case 1: SWEEP(8, 1); break;
    case 2: SWEEP(4, 2); break;
    case 3: SWEEP(3, 3); break;
    case 4: SWEEP(3, 4); break;
    default:
        for (; g + 3 <= gend; g += 3) groups3_all_rows(M, x, K, w + g * K * 8, out + g * 8, N);
    }
    for (; g < gend; g++)
        for (int64_t m = 0; m < M; m++)
            groups(1, 1, x + m * K, K, w + g * K * 8, out + m * N + g * 8, N);
}

/* a share of a split job: units [g0, g1) */
typedef void (*part_fn)(const void *ctx, int64_t g0, int64_t g1);

#define SPLIT_ALIGN 24    /* chunks are whole sweeps of 8, 4 and 3 groups */
#define MIN_SPLIT_BYTES (64 * 1024)  /* smaller weights are not worth a second thread */

#ifdef TP_POOL
/* A matmul split between the calling thread and helper threads, robust to a busy machine:
   the weight groups are cut into chunks that any thread claims (a compare-and-swap on one
   word), so the caller never waits for a helper that has not started; it runs every chunk
   left itself and waits only for chunks a helper already claimed. Helpers spin briefly for
   the next call (decode calls come every few tens of microseconds), then sleep on a futex.
   Each output element is computed by exactly one thread, as in the one-thread loop: the
   results are the same bits whatever the thread count. */
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_HELPERS 31
#define CHUNKS_PER_THREAD 16
/* Another process on our cores: a helper preempted in the middle of a chunk keeps the caller
   waiting for the rest of the scheduler's time slice (milliseconds, for microseconds of work).
   A call whose wait for helpers exceeds both its own work and STALL_NS is a stall. When a
   window of STALL_WINDOW calls holds at least STALL_LIMIT stalls and their waits are more than
   1 / STALL_SHARE of the window's time, the pool runs on the caller alone for SOLO_CALLS calls
   (the helpers sleep, so the caller gets a core of its own), then tries the helpers again. A
   stray preemption on a quiet machine (a few hundred microseconds now and then) stays under
   the share. Results are the same bits either way. */
#define STALL_NS 150000
#define STALL_WINDOW 64
#define STALL_LIMIT 2
#define STALL_SHARE 8
#define SOLO_CALLS 8192
#define HELPER_SPIN_NS 300000 /* a helper's wait for the next call before it sleeps */
#define FIELD 20              /* claim word: seq << 40 | chunks << 20 | next chunk */
#define FIELD_MASK ((UINT64_C(1) << FIELD) - 1)

/* a job: part(ctx, g0, g1) over units [0, ngroups), cut into chunks of chunk_groups */
static struct {
    int64_t ngroups, chunk_groups;
    part_fn part;
    const void *ctx;
} job;
static _Atomic uint64_t claims;
static _Atomic int64_t done_chunks;
static _Atomic uint32_t wake_word; /* bumped for every job; sleeping helpers wait on it */
static _Atomic int sleepers;
static _Atomic int wanted_helpers; /* helpers with a smaller index take part */
static int started_helpers;
static uint64_t job_seq;
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int64_t solo_left;   /* calls still to run on the caller alone */
static int window_calls, window_stalls;
static int64_t window_ns, window_wait_ns;
static _Atomic int64_t stalls_seen, solo_periods; /* totals, for tp_pool_stats */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* 1 and *chunk: a chunk of the current job, now owned by this thread; 0: none left */
static int claim(uint64_t *chunk) {
    uint64_t word = atomic_load_explicit(&claims, memory_order_acquire);
    for (;;) {
        const uint64_t next = word & FIELD_MASK, total = (word >> FIELD) & FIELD_MASK;
        if (next >= total) return 0;
        if (atomic_compare_exchange_weak_explicit(&claims, &word, word + 1,
                                                  memory_order_acq_rel, memory_order_acquire)) {
            *chunk = next;
            return 1;
        }
    }
}

static void run_chunks(void) {
    uint64_t c;
    while (claim(&c)) {
        const int64_t g0 = (int64_t)c * job.chunk_groups;
        const int64_t g1 = g0 + job.chunk_groups < job.ngroups ? g0 + job.chunk_groups
                                                               : job.ngroups;
        job.part(job.ctx, g0, g1);
        atomic_fetch_add_explicit(&done_chunks, 1, memory_order_release);
    }
}

static void *helper_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = atomic_load_explicit(&wake_word, memory_order_acquire);
    for (;;) {
        int64_t spin_start = now_ns();
        for (int spins = 0; atomic_load_explicit(&wake_word, memory_order_acquire) == seen;
             spins++) {
            _mm_pause();
            if ((spins & 63) || now_ns() - spin_start < HELPER_SPIN_NS) continue;
            atomic_fetch_add(&sleepers, 1);
            if (atomic_load(&wake_word) == seen)
                syscall(SYS_futex, &wake_word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&sleepers, 1);
            spin_start = now_ns();
        }
        seen = atomic_load_explicit(&wake_word, memory_order_acquire);
        if (index < atomic_load_explicit(&wanted_helpers, memory_order_relaxed)) run_chunks();
    }
    return NULL;
}

/* part over units [0, ngroups) split between the caller and threads - 1 helpers, in chunks
   of whole multiples of align units; 0 where it cannot be */
static int pooled_run(part_fn part, const void *ctx, int64_t ngroups, int64_t align,
                      int threads) {
    if (pthread_mutex_trylock(&job_lock) != 0) return 0; /* another caller: run alone */
    int helpers = threads - 1 < MAX_HELPERS ? threads - 1 : MAX_HELPERS;
    while (started_helpers < helpers) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper_main, (void *)(intptr_t)started_helpers)) break;
        pthread_detach(thread);
        started_helpers++;
    }
    if (started_helpers < helpers) helpers = started_helpers;
    if (helpers < 1) {
        pthread_mutex_unlock(&job_lock);
        return 0;
    }
    int64_t chunks = (int64_t)(helpers + 1) * CHUNKS_PER_THREAD;
    if (chunks > ngroups / align) chunks = ngroups / align;
    if (chunks < 1) chunks = 1;
    int64_t chunk_groups = (ngroups + chunks - 1) / chunks;
    chunk_groups = (chunk_groups + align - 1) / align * align;
    chunks = (ngroups + chunk_groups - 1) / chunk_groups;
    job.ngroups = ngroups, job.chunk_groups = chunk_groups, job.part = part, job.ctx = ctx;
    atomic_store_explicit(&done_chunks, 0, memory_order_relaxed);
    atomic_store_explicit(&wanted_helpers, helpers, memory_order_relaxed);
    job_seq = (job_seq + 1) & 0xffffff;
    atomic_store_explicit(&claims, job_seq << (2 * FIELD) | (uint64_t)chunks << FIELD,
                          memory_order_release);
    atomic_fetch_add_explicit(&wake_word, 1, memory_order_release);
    if (atomic_load(&sleepers) > 0)
        syscall(SYS_futex, &wake_word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    const int64_t started = now_ns();
    run_chunks();
    const int64_t own_done = now_ns();
    /* only chunks a helper claimed are left: wait for them, yielding if one is slow */
    for (int spins = 0; atomic_load_explicit(&done_chunks, memory_order_acquire) < chunks;
         spins++) {
        if (spins < 4096) _mm_pause();
        else sched_yield();
    }
    const int64_t ended = now_ns(), waited = ended - own_done;
    window_ns += ended - started;
    if (waited > STALL_NS && waited > own_done - started) {
        window_stalls++;
        window_wait_ns += waited;
        atomic_fetch_add_explicit(&stalls_seen, 1, memory_order_relaxed);
    }
    if (++window_calls >= STALL_WINDOW) {
        if (window_stalls >= STALL_LIMIT && window_wait_ns * STALL_SHARE > window_ns) {
            atomic_store_explicit(&solo_left, SOLO_CALLS, memory_order_relaxed);
            atomic_fetch_add_explicit(&solo_periods, 1, memory_order_relaxed);
        }
        window_calls = window_stalls = 0;
        window_ns = window_wait_ns = 0;
    }
    pthread_mutex_unlock(&job_lock);
    return 1;
}

/* 1 while the pool runs on the caller alone (helpers seen stalled); the totals of stalled
   calls and of solo periods since the library loaded */
int tp_pool_stats(int64_t *stalls, int64_t *periods) {
    *stalls = atomic_load(&stalls_seen);
    *periods = atomic_load(&solo_periods);
    return atomic_load(&solo_left) > 0;
}
#endif

#ifndef TP_POOL
int tp_pool_stats(int64_t *stalls, int64_t *periods) {
    *stalls = 0, *periods = 0;
    return 0;
}
#endif

/* 1 when built with the thread pool (TP_POOL) */
int tp_threaded(void) {
#ifdef TP_POOL
    return 1;
#else
    return 0;
#endif
}

struct gemm_args {
    int64_t M, K, N;
    const float *x, *w;
    float *out;
};

static void gemm_job(const void *ctx, int64_t g0, int64_t g1) {
    const struct gemm_args *a = ctx;
    gemm_part(a->M, a->x, a->w, a->out, a->K, a->N, g0, g1);
}

/* part over units [0, units) on threads, or on the caller alone when the work is small */
static void run_split(part_fn part, const void *ctx, int64_t units, int64_t align,
                      int64_t bytes, int threads) {
#ifdef TP_POOL
    if (threads > 1 && units >= 2 * align && bytes >= MIN_SPLIT_BYTES) {
        if (atomic_load_explicit(&solo_left, memory_order_relaxed) > 0)
            atomic_fetch_sub_explicit(&solo_left, 1, memory_order_relaxed);
        else if (pooled_run(part, ctx, units, align, threads))
            return;
    }
#else
    (void)align, (void)bytes, (void)threads;
#endif
    part(ctx, 0, units);
}

int tp_packed_gemm(int64_t M, const float *x, const float *w, float *out, int64_t K, int64_t N,
                   int threads) {
    if (N % 8 || M < 1 || threads < 1) return 1;
    const struct gemm_args args = {M, K, N, x, w, out};
    run_split(gemm_job, &args, N / 8, SPLIT_ALIGN, N * K * 4, threads);
    return 0;
}

/* 1 / sqrt(mean(x^2) + eps) of one row of dim floats */
static inline float inv_rms(const float *x, int64_t dim, float eps) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    float sum = _mm_cvtss_f32(lo);
    for (; i < dim; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)dim + eps);
}

/* o = x * inv * scale (scale may be NULL) */
static inline void scale_row(const float *x, float inv, const float *scale, float *o,
                             int64_t dim) {
    if (scale)
        for (int64_t i = 0; i < dim; i++) o[i] = x[i] * inv * scale[i];
    else
        for (int64_t i = 0; i < dim; i++) o[i] = x[i] * inv;
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * scale (scale may be NULL), rows of dim floats */
void tp_rms_norm(const float *x, const float *scale, float *out, int64_t rows, int64_t dim,
                 float eps) {
    for (int64_t r = 0; r < rows; r++)
        scale_row(x + r * dim, inv_rms(x + r * dim, dim, eps), scale, out + r * dim, dim);
}

/* Head h of token t is x[t * ldx + h * D, +D). out [T, H, D] = rotary(norm(x) * scale) with the
   rotate-half layout (dim i pairs with i + D/2) and cos, sin [T, D]: the torch path's
   rms_norm then x * cos + cat(-x2, x1) * sin, in one pass. norm == 0: rotary only. */
void tp_norm_rope(const float *x, int64_t ldx, int64_t T, int64_t H, int64_t D,
                  const float *scale, float eps, int norm, const float *cos, const float *sin,
                  float *out) {
    float normed[D];
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + t * ldx + h * D;
            float *o = out + (t * H + h) * D;
            if (norm) {
                scale_row(xr, inv_rms(xr, D, eps), scale, normed, D);
                xr = normed;
            }
            for (int64_t i = 0; i < half; i++) o[i] = xr[i] * c[i] + (-xr[i + half]) * s[i];
            for (int64_t i = half; i < D; i++) o[i] = xr[i] * c[i] + xr[i - half] * s[i];
        }
    }
}

/* A residual step over rows of dim floats: resid_out = resid + (norm_y ? norm(y) * wy : y),
   then, if h_out, h_out = norm(resid_out) * wh (wy, wh may be NULL: no weight). */
void tp_add_rms_norm(const float *resid, const float *y, int norm_y, const float *wy, float eps_y,
                     const float *wh, float eps_h, float *resid_out, float *h_out, int64_t rows,
                     int64_t dim) {
    float normed[dim];
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = resid + r * dim, *yr = y + r * dim;
        float *ro = resid_out + r * dim;
        if (norm_y) {
            scale_row(yr, inv_rms(yr, dim, eps_y), wy, normed, dim);
            yr = normed;
        }
        for (int64_t i = 0; i < dim; i++) ro[i] = xr[i] + yr[i];
        if (h_out) scale_row(ro, inv_rms(ro, dim, eps_h), wh, h_out + r * dim, dim);
    }
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* A decode step's attention for one sequence: the new key and value go into the cache slot
   (k_new, v_new [KVH, D] at index write_index; none when it is < 0), then each query head
   attends over L cached entries from index first: softmax(q k^T * scale + mask) v.
   Slot layout: entry l of KV head g at k_slot + g * head_stride + l * D (v_slot alike);
   query head h reads KV head h / (H / KVH). q [H, D]; mask [L] additive (0 / -inf) or NULL;
   out [H, D]; scores: L floats of scratch. D % 8 == 0. The cache (and k_new, v_new) holds
   floats, or with fp8 set e4m3 bytes (`--kv-cache-dtype fp8`), widened as they are read. */
#define HB 4 /* query heads per pass over K and V */

/* 8 e4m3 bytes as floats times 2^-8: moved into fp16's bit layout (sign to bit 15, exponent
   and mantissa up 7 bits: the value times 2^-8, subnormals included, since fp16's exponent
   bias is 8 more) and widened by F16C; 0x7f / 0xff (e4m3's NaN) become fp16 NaN. The 2^-8
   is an exact power of two, folded into the scale and the softmax's normalizer. */
static inline __m256 e4m3x8(const uint8_t *p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
    __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                             _mm_slli_epi16(mag, 7));
    h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)),
                                      _mm_set1_epi16(0x7e00)));
    return _mm256_cvtph_ps(h);
}

/* 8 entries of row p from element i: floats, or (fp8) e4m3 bytes as floats times 2^-8 */
static inline __attribute__((always_inline)) __m256 kv8(const void *p, int64_t i, int fp8) {
    return fp8 ? e4m3x8((const uint8_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

/* nh (<= HB) query heads q [nh, D] over one KV head's rows k, v [L, D]: out [nh, D]. With fp8
   the rows are e4m3 bytes read as 2^-8 of their value: the scale and the normalizer take the
   2^8 back (exact: products of the same reals, rounded once). */
static inline __attribute__((always_inline)) void attend_rows(
    const float *q, const void *k, const void *v, int64_t L, int64_t nh, int64_t D,
    const float *mask, float scale, float *out, float *scores, int fp8) {
    const int64_t esize = fp8 ? 1 : 4;
    const float unit = fp8 ? 256.0f : 1.0f;
    scale *= unit;
    float top[HB], total[HB];
    for (int64_t j = 0; j < nh; j++) top[j] = -INFINITY, total[j] = 0.0f;
    for (int64_t l = 0; l < L; l++) {
        const void *kl = (const char *)k + l * D * esize;
        __m256 a0[HB], a1[HB];
        for (int64_t j = 0; j < nh; j++) a0[j] = _mm256_setzero_ps(), a1[j] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= D; i += 16) {
            const __m256 k0 = kv8(kl, i, fp8), k1 = kv8(kl, i + 8, fp8);
            for (int64_t j = 0; j < nh; j++) {
                a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + i), k0, a0[j]);
                a1[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + i + 8), k1, a1[j]);
            }
        }
        for (; i < D; i += 8) {
            const __m256 k0 = kv8(kl, i, fp8);
            for (int64_t j = 0; j < nh; j++)
                a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + i), k0, a0[j]);
        }
        for (int64_t j = 0; j < nh; j++) {
            float sc = hsum(_mm256_add_ps(a0[j], a1[j])) * scale;
            if (mask) sc += mask[l];
            scores[j * L + l] = sc;
            if (sc > top[j]) top[j] = sc;
        }
    }
    for (int64_t j = 0; j < nh; j++)
        for (int64_t l = 0; l < L; l++) {
            const float p = expf(scores[j * L + l] - top[j]);
            scores[j * L + l] = p;
            total[j] += p;
        }
    for (int64_t i0 = 0; i0 < D; i0 += 16) { /* 16 output floats of every head at a time */
        const int two = D - i0 >= 16;
        __m256 acc0[HB], acc1[HB];
        for (int64_t j = 0; j < nh; j++) acc0[j] = _mm256_setzero_ps(), acc1[j] = acc0[j];
        for (int64_t l = 0; l < L; l++) {
            const void *vl = (const char *)v + l * D * esize;
            const __m256 v0 = kv8(vl, i0, fp8), v1 = two ? kv8(vl, i0 + 8, fp8) : v0;
            for (int64_t j = 0; j < nh; j++) {
                const __m256 p = _mm256_set1_ps(scores[j * L + l]);
                acc0[j] = _mm256_fmadd_ps(p, v0, acc0[j]);
                if (two) acc1[j] = _mm256_fmadd_ps(p, v1, acc1[j]);
            }
        }
        for (int64_t j = 0; j < nh; j++) {
            const __m256 inv_total = _mm256_set1_ps(unit / total[j]);
            _mm256_storeu_ps(out + j * D + i0, _mm256_mul_ps(acc0[j], inv_total));
            if (two) _mm256_storeu_ps(out + j * D + i0 + 8, _mm256_mul_ps(acc1[j], inv_total));
        }
    }
}

static void attend_heads(const float *q, const void *k, const void *v, int64_t L, int64_t nh,
                         int64_t D, const float *mask, float scale, float *out, float *scores) {
    attend_rows(q, k, v, L, nh, D, mask, scale, out, scores, 0);
}

static void attend_heads_fp8(const float *q, const void *k, const void *v, int64_t L,
                             int64_t nh, int64_t D, const float *mask, float scale, float *out,
                             float *scores) {
    attend_rows(q, k, v, L, nh, D, mask, scale, out, scores, 1);
}

void tp_decode_attention(const float *q, void *k_slot, void *v_slot, int64_t head_stride,
                         int64_t write_index, const void *k_new, const void *v_new,
                         int64_t first, int64_t L, int64_t H, int64_t KVH, int64_t D,
                         const float *mask, float scale, float *out, float *scores, int fp8) {
    const int64_t esize = fp8 ? 1 : 4, row = D * esize, stride = head_stride * esize;
    char *ks = k_slot, *vs = v_slot;
    if (write_index >= 0)
        for (int64_t g = 0; g < KVH; g++) {
            memcpy(ks + g * stride + write_index * row, (const char *)k_new + g * row, row);
            memcpy(vs + g * stride + write_index * row, (const char *)v_new + g * row, row);
        }
    /* the query heads of one KV head together, up to HB at a time: each key and value row is
       read once for all of them (a long context's K and V do not stay in cache between heads).
       Per head the arithmetic and its order are the one-head loop's: the same bits. */
    const int64_t group = H / KVH;
    for (int64_t h0 = 0; h0 < H;) {
        const int64_t kv = h0 / group;
        int64_t nh = (kv + 1) * group - h0; /* heads of this KV head not yet done */
        if (nh > HB) nh = HB;
        (fp8 ? attend_heads_fp8 : attend_heads)(q + h0 * D, ks + kv * stride + first * row,
                                                 vs + kv * stride + first * row, L, nh, D, mask,
                                                 scale, out + h0 * D, scores);
        h0 += nh;
    }
}

/* torch.argmax(x, dim=-1) of rows [rows, n] floats: the first index of the largest value, a
   NaN counting as the largest (the first NaN wins). One pass for the maximum (and any NaN),
   one for its first index: ~0.4 ms of torch's become tens of us over a 262,144 vocabulary. */
void tp_argmax(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * n;
        __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(p + i);
            best = _mm256_max_ps(best, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8], m = -INFINITY;
        _mm256_storeu_ps(lanes, best);
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
        int has_nan = _mm256_movemask_ps(nan) != 0;
        for (; i < n; i++) {
            if (p[i] != p[i]) has_nan = 1;
            else if (p[i] > m) m = p[i];
        }
        int64_t found = 0;
        if (has_nan) {
            for (i = 0; i < n; i++)
                if (p[i] != p[i]) { found = i; break; }
        } else {
            __m256 mv = _mm256_set1_ps(m);
            for (i = 0; i + 8 <= n; i += 8) {
                int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), mv, _CMP_EQ_OQ));
                if (hit) { found = i + __builtin_ctz(hit); break; }
            }
            if (i + 8 > n)
                for (; i < n; i++)
                    if (p[i] == m) { found = i; break; }
        }
        out[r] = found;
    }
}
"""
