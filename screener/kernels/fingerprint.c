/* Exact tensor fingerprints in one pass over the bytes (see screener/fingerprint.py for the definition).
 *
 * For a tensor read as n integers v_0 .. v_{n-1} (1-byte elements unsigned, wider ones signed, each
 * widened to 64 bits) the fingerprint is
 *
 *     S = sum_j v_j        and     W = sum_j (j + 1) v_j        both modulo 2**64.
 *
 * All arithmetic here is on unsigned 64-bit integers, whose wrapping is exactly arithmetic modulo
 * 2**64, so every regrouping below gives bit-identical results whatever the order of the work.
 *
 * No multiply per element: the elements are dealt to L lanes (element q of a block goes to lane q % L)
 * and each lane keeps a running sum s and a running sum of running sums t. After M rows,
 *     s_l = sum_r v_{r,l}      t_l = sum_r (M - r) v_{r,l}      so  sum_r r v_{r,l} = M s_l - t_l,
 * and a block of L*M elements starting at element j0 contributes
 *     S += sum_l s_l
 *     W += (j0 + 1) sum_l s_l + L sum_l (M s_l - t_l) + sum_l l s_l.
 * The lanes are vector registers: AVX-512 or AVX2 intrinsics where the CPU has them (chosen at run
 * time), else GCC/Clang vector extensions (the x86 byte kernels differ: see avx2_u8). 1- and 2-byte elements
 * are summed in 32-bit lanes, flushed every
 * M = 256 rows so that no lane can overflow: |v| <= 2**15 gives |s| <= 2**23 and
 * |t| <= 2**15 * 256 * 257 / 2 < 2**31. 4- and 8-byte elements use 64-bit lanes, in which wrapping is
 * harmless, so one block spans the whole piece.
 *
 * Threads: one parallel region per call. The caller builds a list of pieces (whole small tensors
 * grouped together, large tensors cut into ~1 MiB pieces); detached worker threads and the caller claim
 * pieces from an atomic counter. The caller returns as soon as every piece is done: a worker that was
 * descheduled before it claimed anything does not hold the call up, and finds no work when it runs;
 * the job is freed by whichever thread drops the last reference. A worker descheduled while holding
 * a piece can still stall a call, but once per call, not once per chunk.
 * Results are added to the output with atomic adds (exact and commutative modulo 2**64).
 * Creating the threads per call (rather than keeping a pool) keeps the library safe across fork().
 *
 * The library has a C ABI and no Python or torch headers: it is loaded with ctypes.
 */

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SFP_ABI_VERSION 2 /* 2: sfp_sums takes a kernel set, not a generic flag */

#define LANES 16
#define ROWS32 256 /* rows per flush of the 32-bit lanes (see the bound above) */

typedef struct {
    uint64_t s, w;
} sums_t;

/* Fold a block's lane sums (as signed 64-bit values in u64) into the running sums; j0 = first element. */
static inline void fold(sums_t *acc, uint64_t j0, uint64_t rows, const uint64_t *s, const uint64_t *t) {
    uint64_t ssum = 0, inner = 0, lanew = 0;
    for (int l = 0; l < LANES; l++) {
        ssum += s[l];
        inner += rows * s[l] - t[l];
        lanew += (uint64_t)l * s[l];
    }
    acc->s += ssum;
    acc->w += (j0 + 1) * ssum + (uint64_t)LANES * inner + lanew;
}

/* The ragged tail, straight from the definition. */
#define TAIL(acc, p, j, n)                                  \
    for (; (j) < (n); (j)++) {                              \
        uint64_t v_ = (uint64_t)(int64_t)(p)[(j)];          \
        (acc).s += v_;                                      \
        (acc).w += ((uint64_t)(j) + 1) * v_;                \
    }

/* The lanes live in 32-byte vectors (GCC/Clang vector extensions; 32 bytes because wider generic
 * vectors compile badly without AVX-512): 16 lanes are 2 vectors of 32-bit lanes or 4 of 64-bit ones.
 * Unaligned loads go through types with aligned(1). */
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint64_t u64x4 __attribute__((vector_size(32)));
typedef int64_t i64x4 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint8_t u8x16_u __attribute__((vector_size(16), aligned(1), may_alias));
typedef int16_t i16x8_u __attribute__((vector_size(16), aligned(1), may_alias));
typedef int32_t i32x4_u __attribute__((vector_size(16), aligned(1), may_alias));
typedef uint64_t u64x4_u __attribute__((vector_size(32), aligned(1), may_alias));

/* Widen 16 (narrow: into lo and hi) or 4 (wide) elements at q: 1-byte zero-extended, wider ones
 * sign-extended. Bytes go through 16 bits: compilers of today turn that into vpmovzx instructions,
 * but a direct 8-to-32-bit conversion into a scalar loop. */
#define WIDEN_U8(q, lo, hi)                                                                  \
    do {                                                                                     \
        u16x16 w_ = __builtin_convertvector(*(const u8x16_u *)(q), u16x16);                 \
        u16x8 a_, b_;                                                                        \
        memcpy(&a_, &w_, 16), memcpy(&b_, (const char *)&w_ + 16, 16);                       \
        lo = __builtin_convertvector(a_, u32x8), hi = __builtin_convertvector(b_, u32x8);     \
    } while (0)
#define WIDEN_I16(q, lo, hi)                                                                 \
    do {                                                                                     \
        lo = (u32x8)__builtin_convertvector(*(const i16x8_u *)(q), i32x8);                   \
        hi = (u32x8)__builtin_convertvector(*(const i16x8_u *)((q) + 8), i32x8);             \
    } while (0)
#define WIDEN_I32(q) ((u64x4)__builtin_convertvector(*(const i32x4_u *)(q), i64x4))
#define WIDEN_I64(q) (*(const u64x4_u *)(q))

/* 1- and 2-byte elements: 32-bit lanes (unsigned, so that wrapping is defined; the bound above means
 * they never wrap as signed values, so the cast back to int32 recovers the exact lane sums). */
#define NARROW_KERNEL(name, T, widen)                                                        \
    static sums_t name(const void *pv, int64_t n) {                                   \
        const T *p = (const T *)pv;                                                          \
        sums_t acc = {0, 0};                                                                 \
        int64_t j = 0;                                                                       \
        const int64_t block = (int64_t)LANES * ROWS32;                                       \
        for (; j + block <= n; j += block) {                                                 \
            u32x8 s0 = {0}, s1 = {0}, t0 = {0}, t1 = {0};                                    \
            const T *q = p + j;                                                              \
            for (int r = 0; r < ROWS32; r++, q += LANES) {                                   \
                u32x8 lo, hi;                                                                \
                widen(q, lo, hi);                                                            \
                s0 += lo;                                                                    \
                s1 += hi;                                                                    \
                t0 += s0;                                                                    \
                t1 += s1;                                                                    \
            }                                                                                \
            uint32_t s32[LANES], t32[LANES];                                                 \
            memcpy(s32, &s0, 32), memcpy(s32 + 8, &s1, 32);                                  \
            memcpy(t32, &t0, 32), memcpy(t32 + 8, &t1, 32);                                  \
            uint64_t s64[LANES], t64[LANES];                                                 \
            for (int l = 0; l < LANES; l++) {                                                \
                s64[l] = (uint64_t)(int64_t)(int32_t)s32[l];                                 \
                t64[l] = (uint64_t)(int64_t)(int32_t)t32[l];                                 \
            }                                                                                \
            fold(&acc, (uint64_t)j, ROWS32, s64, t64);                                       \
        }                                                                                    \
        TAIL(acc, p, j, n)                                                                   \
        return acc;                                                                          \
    }

/* 4- and 8-byte elements: 64-bit lanes over the whole piece. */
#define WIDE_KERNEL(name, T, widen)                                                          \
    static sums_t name(const void *pv, int64_t n) {                                   \
        const T *p = (const T *)pv;                                                          \
        sums_t acc = {0, 0};                                                                 \
        int64_t rows = n / LANES, j = 0;                                                     \
        if (rows > 0) {                                                                      \
            u64x4 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                    \
            u64x4 t0 = {0}, t1 = {0}, t2 = {0}, t3 = {0};                                    \
            const T *q = p;                                                                  \
            for (int64_t r = 0; r < rows; r++, q += LANES) {                                 \
                s0 += widen(q);                                                              \
                s1 += widen(q + 4);                                                          \
                s2 += widen(q + 8);                                                          \
                s3 += widen(q + 12);                                                         \
                t0 += s0;                                                                    \
                t1 += s1;                                                                    \
                t2 += s2;                                                                    \
                t3 += s3;                                                                    \
            }                                                                                \
            uint64_t s64[LANES], t64[LANES];                                                 \
            memcpy(s64, &s0, 32), memcpy(s64 + 4, &s1, 32);                                  \
            memcpy(s64 + 8, &s2, 32), memcpy(s64 + 12, &s3, 32);                             \
            memcpy(t64, &t0, 32), memcpy(t64 + 4, &t1, 32);                                  \
            memcpy(t64 + 8, &t2, 32), memcpy(t64 + 12, &t3, 32);                             \
            fold(&acc, 0, (uint64_t)rows, s64, t64);                                         \
            j = rows * LANES;                                                                \
        }                                                                                    \
        TAIL(acc, p, j, n)                                                                   \
        return acc;                                                                          \
    }

NARROW_KERNEL(sums_u8, uint8_t, WIDEN_U8)
NARROW_KERNEL(sums_i16, int16_t, WIDEN_I16)
WIDE_KERNEL(sums_i32, int32_t, WIDEN_I32)
WIDE_KERNEL(sums_i64, int64_t, WIDEN_I64)

typedef sums_t (*kernel_fn)(const void *, int64_t);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The same kernels with AVX2 intrinsics, chosen at run time when the CPU has AVX2: compilers lower the
 * generic widening conversions above into several shuffles each, where one vpmovsx/vpmovzx from
 * memory does. Same lanes, same blocks, same fold: identical results by construction (and tested). */
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))

#define AVX2_NARROW_KERNEL(name, T, widen_lo, widen_hi)                                      \
    AVX2 static sums_t name(const void *pv, int64_t n) {                                         \
        const T *p = (const T *)pv;                                                          \
        sums_t acc = {0, 0};                                                                 \
        int64_t j = 0;                                                                       \
        const int64_t block = (int64_t)LANES * ROWS32;                                       \
        for (; j + block <= n; j += block) {                                                 \
            __m256i s0 = _mm256_setzero_si256(), s1 = s0, t0 = s0, t1 = s0;                 \
            const T *q = p + j;                                                              \
            for (int r = 0; r < ROWS32; r++, q += LANES) {                                   \
                s0 = _mm256_add_epi32(s0, widen_lo(q));                                      \
                s1 = _mm256_add_epi32(s1, widen_hi(q));                                      \
                t0 = _mm256_add_epi32(t0, s0);                                               \
                t1 = _mm256_add_epi32(t1, s1);                                               \
            }                                                                                \
            int32_t s32[LANES], t32[LANES];                                                  \
            _mm256_storeu_si256((__m256i *)s32, s0), _mm256_storeu_si256((__m256i *)(s32 + 8), s1); \
            _mm256_storeu_si256((__m256i *)t32, t0), _mm256_storeu_si256((__m256i *)(t32 + 8), t1); \
            uint64_t s64[LANES], t64[LANES];                                                 \
            for (int l = 0; l < LANES; l++) {                                                \
                s64[l] = (uint64_t)(int64_t)s32[l];                                          \
                t64[l] = (uint64_t)(int64_t)t32[l];                                          \
            }                                                                                \
            fold(&acc, (uint64_t)j, ROWS32, s64, t64);                                       \
        }                                                                                    \
        TAIL(acc, p, j, n)                                                                   \
        return acc;                                                                          \
    }

#define AVX2_WIDE_KERNEL(name, T, widen4)                                                    \
    AVX2 static sums_t name(const void *pv, int64_t n) {                                         \
        const T *p = (const T *)pv;                                                          \
        sums_t acc = {0, 0};                                                                 \
        int64_t rows = n / LANES, j = 0;                                                     \
        if (rows > 0) {                                                                      \
            __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;                 \
            __m256i t0 = s0, t1 = s0, t2 = s0, t3 = s0;                                      \
            const T *q = p;                                                                  \
            for (int64_t r = 0; r < rows; r++, q += LANES) {                                 \
                s0 = _mm256_add_epi64(s0, widen4(q));                                        \
                s1 = _mm256_add_epi64(s1, widen4(q + 4));                                    \
                s2 = _mm256_add_epi64(s2, widen4(q + 8));                                    \
                s3 = _mm256_add_epi64(s3, widen4(q + 12));                                   \
                t0 = _mm256_add_epi64(t0, s0);                                               \
                t1 = _mm256_add_epi64(t1, s1);                                               \
                t2 = _mm256_add_epi64(t2, s2);                                               \
                t3 = _mm256_add_epi64(t3, s3);                                               \
            }                                                                                \
            uint64_t s64[LANES], t64[LANES];                                                 \
            _mm256_storeu_si256((__m256i *)s64, s0), _mm256_storeu_si256((__m256i *)(s64 + 4), s1); \
            _mm256_storeu_si256((__m256i *)(s64 + 8), s2), _mm256_storeu_si256((__m256i *)(s64 + 12), s3); \
            _mm256_storeu_si256((__m256i *)t64, t0), _mm256_storeu_si256((__m256i *)(t64 + 4), t1); \
            _mm256_storeu_si256((__m256i *)(t64 + 8), t2), _mm256_storeu_si256((__m256i *)(t64 + 12), t3); \
            fold(&acc, 0, (uint64_t)rows, s64, t64);                                         \
            j = rows * LANES;                                                                \
        }                                                                                    \
        TAIL(acc, p, j, n)                                                                   \
        return acc;                                                                          \
    }

#define I16_LO(q) _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(q)))
#define I16_HI(q) _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)((q) + 8)))
#define I32_4(q) _mm256_cvtepi32_epi64(_mm_loadu_si128((const __m128i *)(q)))
#define I64_4(q) _mm256_loadu_si256((const __m256i *)(q))

/* Bytes: widening each byte to a 32-bit lane costs more than the read, so rows of 32 bytes are taken
 * whole. vpsadbw sums each 8-byte group into a 64-bit lane (4 lanes, 64-bit s and t: no flush), and
 * vpmaddubsw/vpmaddwd give each group's sum of i * v_i for i = 0..7 within the group, accumulated in
 * 32-bit lanes u (per row and lane at most (4+5+6+7) * 255 = 5610, so 2**16 rows stay below 2**31).
 * Element 32 r + 8 g + i has position 32 r + 8 g + i + 1, hence for R rows
 *     W = 32 sum_g (R s_g - t_g) + sum_g (8 g + 1) s_g + sum u. */
#define U8_FLUSH_ROWS (1 << 16)

AVX2 static sums_t avx2_u8(const void *pv, int64_t n) {
    const uint8_t *p = (const uint8_t *)pv;
    sums_t acc = {0, 0};
    int64_t rows = n / 32, j = rows * 32;
    const __m256i zero = _mm256_setzero_si256(), ones16 = _mm256_set1_epi16(1);
    const __m256i in_group = _mm256_set1_epi64x(0x0706050403020100LL); /* byte i of a group: i */
    __m256i s = zero, t = zero;
    uint64_t u = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += U8_FLUSH_ROWS) {
        int64_t r1 = rows - r0 < U8_FLUSH_ROWS ? rows : r0 + U8_FLUSH_ROWS;
        __m256i u32 = zero;
        for (int64_t r = r0; r < r1; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * r));
            s = _mm256_add_epi64(s, _mm256_sad_epu8(v, zero));
            t = _mm256_add_epi64(t, s);
            u32 = _mm256_add_epi32(u32, _mm256_madd_epi16(_mm256_maddubs_epi16(v, in_group), ones16));
        }
        uint32_t ul[8];
        _mm256_storeu_si256((__m256i *)ul, u32);
        for (int l = 0; l < 8; l++)
            u += ul[l];
    }
    uint64_t sl[4], tl[4], inner = 0, groupw = 0;
    _mm256_storeu_si256((__m256i *)sl, s);
    _mm256_storeu_si256((__m256i *)tl, t);
    for (int g = 0; g < 4; g++) {
        acc.s += sl[g];
        inner += (uint64_t)rows * sl[g] - tl[g];
        groupw += (uint64_t)(8 * g + 1) * sl[g];
    }
    acc.w = 32 * inner + groupw + u;
    TAIL(acc, p, j, n)
    return acc;
}
AVX2_NARROW_KERNEL(avx2_i16, int16_t, I16_LO, I16_HI)
AVX2_WIDE_KERNEL(avx2_i32, int32_t, I32_4)
AVX2_WIDE_KERNEL(avx2_i64, int64_t, I64_4)

/* The same kernels with AVX-512 (F and BW), chosen at run time where the CPU has both: the AVX2 ones
 * take twice the instructions per byte and on such CPUs (Xeon since Skylake-SP) run at about 0.7 of a
 * read pass, which torch's own AVX-512 kernels reach. The 16 lanes are one 512-bit vector of 32-bit
 * lanes or two of 64-bit lanes: same lanes, same blocks, same fold as above. The byte kernel takes
 * rows of 64 bytes: 8 groups of 8 instead of 4, so W = 64 sum_g (R s_g - t_g) + sum_g (8 g + 1) s_g
 * + sum u, with the same bound on u per 32-bit lane and row. */
#define AVX512 __attribute__((target("avx512f,avx512bw")))

/* The AVX-512 loops also prefetch 4 KiB ahead, once per 64-byte line: with ~20 GB/s of work in cache
 * they keep pace with memory only if the loads are in flight early enough (measured on a Xeon with
 * AMX, one thread, 256 MiB: 0.79-0.84 of a read pass without the prefetch, 0.95-1.0 with it).
 * A prefetch never faults, so reading past the end of the tensor is harmless. */
#define PREFETCH_AHEAD 4096
#define PREFETCH(q) _mm_prefetch((const char *)(q) + PREFETCH_AHEAD, _MM_HINT_T0)

AVX512 static sums_t avx512_u8(const void *pv, int64_t n) {
    const uint8_t *p = (const uint8_t *)pv;
    sums_t acc = {0, 0};
    int64_t rows = n / 64, j = rows * 64;
    const __m512i zero = _mm512_setzero_si512(), ones16 = _mm512_set1_epi16(1);
    const __m512i in_group = _mm512_set1_epi64(0x0706050403020100LL);
    __m512i s = zero, t = zero;
    uint64_t u = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += U8_FLUSH_ROWS) {
        int64_t r1 = rows - r0 < U8_FLUSH_ROWS ? rows : r0 + U8_FLUSH_ROWS;
        __m512i u32 = zero;
        for (int64_t r = r0; r < r1; r++) {
            PREFETCH(p + 64 * r);
            __m512i v = _mm512_loadu_si512((const void *)(p + 64 * r));
            s = _mm512_add_epi64(s, _mm512_sad_epu8(v, zero));
            t = _mm512_add_epi64(t, s);
            u32 = _mm512_add_epi32(u32, _mm512_madd_epi16(_mm512_maddubs_epi16(v, in_group), ones16));
        }
        uint32_t ul[16];
        _mm512_storeu_si512((void *)ul, u32);
        for (int l = 0; l < 16; l++)
            u += ul[l];
    }
    uint64_t sl[8], tl[8], inner = 0, groupw = 0;
    _mm512_storeu_si512((void *)sl, s);
    _mm512_storeu_si512((void *)tl, t);
    for (int g = 0; g < 8; g++) {
        acc.s += sl[g];
        inner += (uint64_t)rows * sl[g] - tl[g];
        groupw += (uint64_t)(8 * g + 1) * sl[g];
    }
    acc.w = 64 * inner + groupw + u;
    TAIL(acc, p, j, n)
    return acc;
}

AVX512 static sums_t avx512_i16(const void *pv, int64_t n) {
    const int16_t *p = (const int16_t *)pv;
    sums_t acc = {0, 0};
    int64_t j = 0;
    const int64_t block = (int64_t)LANES * ROWS32;
    for (; j + block <= n; j += block) {
        __m512i s = _mm512_setzero_si512(), t = s;
        const int16_t *q = p + j;
        for (int r = 0; r < ROWS32; r++, q += LANES) {
            if (r % 2 == 0) /* a row is 32 bytes: one prefetch per line */
                PREFETCH(q);
            s = _mm512_add_epi32(s, _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)q)));
            t = _mm512_add_epi32(t, s);
        }
        int32_t s32[LANES], t32[LANES];
        _mm512_storeu_si512((void *)s32, s), _mm512_storeu_si512((void *)t32, t);
        uint64_t s64[LANES], t64[LANES];
        for (int l = 0; l < LANES; l++) {
            s64[l] = (uint64_t)(int64_t)s32[l];
            t64[l] = (uint64_t)(int64_t)t32[l];
        }
        fold(&acc, (uint64_t)j, ROWS32, s64, t64);
    }
    TAIL(acc, p, j, n)
    return acc;
}

#define AVX512_WIDE_KERNEL(name, T, widen8)                                                  \
    AVX512 static sums_t name(const void *pv, int64_t n) {                                   \
        const T *p = (const T *)pv;                                                          \
        sums_t acc = {0, 0};                                                                 \
        int64_t rows = n / LANES, j = 0;                                                     \
        if (rows > 0) {                                                                      \
            __m512i s0 = _mm512_setzero_si512(), s1 = s0, t0 = s0, t1 = s0;                 \
            const T *q = p;                                                                  \
            for (int64_t r = 0; r < rows; r++, q += LANES) {                                 \
                for (size_t b_ = 0; b_ < sizeof(T) * LANES; b_ += 64)                        \
                    PREFETCH((const char *)q + b_);                                          \
                s0 = _mm512_add_epi64(s0, widen8(q));                                        \
                s1 = _mm512_add_epi64(s1, widen8(q + 8));                                    \
                t0 = _mm512_add_epi64(t0, s0);                                               \
                t1 = _mm512_add_epi64(t1, s1);                                               \
            }                                                                                \
            uint64_t s64[LANES], t64[LANES];                                                 \
            _mm512_storeu_si512((void *)s64, s0), _mm512_storeu_si512((void *)(s64 + 8), s1); \
            _mm512_storeu_si512((void *)t64, t0), _mm512_storeu_si512((void *)(t64 + 8), t1); \
            fold(&acc, 0, (uint64_t)rows, s64, t64);                                         \
            j = rows * LANES;                                                                \
        }                                                                                    \
        TAIL(acc, p, j, n)                                                                   \
        return acc;                                                                          \
    }

#define I32_8(q) _mm512_cvtepi32_epi64(_mm256_loadu_si256((const __m256i *)(q)))
#define I64_8(q) _mm512_loadu_si512((const void *)(q))
AVX512_WIDE_KERNEL(avx512_i32, int32_t, I32_8)
AVX512_WIDE_KERNEL(avx512_i64, int64_t, I64_8)

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
static int cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
#else
static int cpu_has_avx2(void) { return 0; }
static int cpu_has_avx512(void) { return 0; }
#endif

/* Kernels by log2 of the element size, chosen once per process (pthread_once: concurrent first calls
 * must not see a half-filled table). */
static kernel_fn kernels[4];
static const char *isa = "generic";

/* Every kernel set this build has, by the name sfp_sums takes: the tests run each one this CPU can. */
static const kernel_fn generic_kernels[4] = {sums_u8, sums_i16, sums_i32, sums_i64};
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
static const kernel_fn avx2_kernels[4] = {avx2_u8, avx2_i16, avx2_i32, avx2_i64};
static const kernel_fn avx512_kernels[4] = {avx512_u8, avx512_i16, avx512_i32, avx512_i64};
#endif

static pthread_once_t kernels_once = PTHREAD_ONCE_INIT;

static void choose_kernels(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (cpu_has_avx512()) {
        isa = "avx512";
        memcpy(kernels, avx512_kernels, sizeof kernels);
        return;
    }
    if (cpu_has_avx2()) {
        isa = "avx2";
        memcpy(kernels, avx2_kernels, sizeof kernels);
        return;
    }
#endif
    (void)cpu_has_avx2;
    (void)cpu_has_avx512;
    memcpy(kernels, generic_kernels, sizeof kernels);
}

static void pick_kernels(void) { pthread_once(&kernels_once, choose_kernels); }

/* Sums of elements [start, start + count) of one tensor, with positions counted from start. */
static sums_t piece_sums(const void *base, int64_t elem, int64_t start, int64_t count) {
    const char *p = (const char *)base + start * elem;
    int log2 = elem == 1 ? 0 : elem == 2 ? 1 : elem == 4 ? 2 : 3;
    return kernels[log2](p, count);
}

/* A piece of work: tensors [first, last] (indices into the descriptor list); for a piece of one large
 * tensor (first == last), elements [start, start + count). */
typedef struct {
    int64_t first, last, start, count;
} piece_t;

typedef struct {
    const int64_t *desc; /* 3 per tensor: address, number of elements, element size */
    _Atomic uint64_t *out; /* 2 per tensor: S, W */
    piece_t *pieces;
    int64_t npieces;
    atomic_llong next;
    atomic_llong done; /* pieces finished */
    atomic_int refs;
} job_t;

static void add_row(job_t *job, int64_t k, uint64_t s, uint64_t w) {
    atomic_fetch_add_explicit(&job->out[2 * k], s, memory_order_relaxed);
    atomic_fetch_add_explicit(&job->out[2 * k + 1], w, memory_order_relaxed);
}

static void run_piece(job_t *job, const piece_t *pc) {
    const int64_t *d = job->desc;
    if (pc->first == pc->last && pc->count >= 0) {
        int64_t k = pc->first;
        sums_t r = piece_sums((const void *)(uintptr_t)d[3 * k], d[3 * k + 2], pc->start, pc->count);
        /* Positions in this piece start at element `start` of the tensor. */
        add_row(job, k, r.s, r.w + (uint64_t)pc->start * r.s);
        return;
    }
    for (int64_t k = pc->first; k <= pc->last; k++) {
        if (d[3 * k + 1] <= 0)
            continue;
        sums_t r = piece_sums((const void *)(uintptr_t)d[3 * k], d[3 * k + 2], 0, d[3 * k + 1]);
        add_row(job, k, r.s, r.w);
    }
}

static void release(job_t *job) {
    if (atomic_fetch_sub_explicit(&job->refs, 1, memory_order_acq_rel) == 1) {
        free(job->pieces);
        free(job);
    }
}

/* Claim and run pieces until none are left; returns how many this thread ran. */
static int64_t drain(job_t *job) {
    int64_t ran = 0;
    for (;;) {
        long long i = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
        if (i >= job->npieces)
            return ran;
        run_piece(job, &job->pieces[i]);
        ran++;
    }
}

static void finish(job_t *job, int64_t ran) {
    if (ran == 0)
        return;
    /* Release: the caller that sees the count also sees this thread's atomic adds to out. */
    atomic_fetch_add_explicit(&job->done, ran, memory_order_release);
}

static void *worker(void *arg) {
    job_t *job = (job_t *)arg;
    finish(job, drain(job));
    release(job);
    return NULL;
}

/* Pieces: each large tensor cut into pieces of about `piece_bytes`; runs of small tensors grouped until
 * they reach that size. Returns the number of pieces, or -1 if out of memory. */
static int64_t make_pieces(const int64_t *desc, int64_t ntensors, int64_t piece_bytes, piece_t **out) {
    int64_t cap = 16, n = 0;
    piece_t *pcs = (piece_t *)malloc(cap * sizeof(piece_t));
    if (!pcs)
        return -1;
    int64_t group_first = -1, group_bytes = 0;
    for (int64_t k = 0; k < ntensors; k++) {
        int64_t numel = desc[3 * k + 1], elem = desc[3 * k + 2];
        int64_t bytes = numel * elem;
        /* Elements per piece of a large tensor: a whole number of 32-bit-lane blocks. */
        int64_t per = piece_bytes / elem;
        per = per < LANES * ROWS32 ? LANES * ROWS32 : per - per % (LANES * ROWS32);
        int64_t need = bytes > piece_bytes ? numel / per + 3 : 2;
        if (n + need > cap) {
            while (n + need > cap)
                cap *= 2;
            piece_t *grown = (piece_t *)realloc(pcs, cap * sizeof(piece_t));
            if (!grown) {
                free(pcs);
                return -1;
            }
            pcs = grown;
        }
        if (bytes <= piece_bytes) {
            if (group_first < 0)
                group_first = k;
            group_bytes += bytes;
            if (group_bytes >= piece_bytes) {
                pcs[n++] = (piece_t){group_first, k, 0, -1};
                group_first = -1;
                group_bytes = 0;
            }
            continue;
        }
        if (group_first >= 0) { /* close the open group: it must not span this large tensor */
            pcs[n++] = (piece_t){group_first, k - 1, 0, -1};
            group_first = -1;
            group_bytes = 0;
        }
        for (int64_t start = 0; start < numel; start += per) {
            int64_t count = numel - start < per ? numel - start : per;
            pcs[n++] = (piece_t){k, k, start, count};
        }
    }
    if (group_first >= 0)
        pcs[n++] = (piece_t){group_first, ntensors - 1, 0, -1};
    *out = pcs;
    return n;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

int sfp_abi_version(void) { return SFP_ABI_VERSION; }

/* One tensor's sums, single-threaded, with the kernel set named by `set`: 0 the one this CPU runs,
 * 1 the generic kernels, 2 AVX2, 3 AVX-512. Lets the tests check every set this CPU can run (a CPU
 * with AVX-512 still checks the AVX2 and generic kernels other machines run). Returns -3 for a set
 * this build or this CPU cannot run. */
int sfp_sums(const void *p, int64_t n, int64_t elem, int set, int64_t *out) {
    if ((elem != 1 && elem != 2 && elem != 4 && elem != 8) || n < 0)
        return -2;
    pick_kernels();
    const kernel_fn *k = set == 0 ? kernels : set == 1 ? generic_kernels : NULL;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (set == 2 && cpu_has_avx2())
        k = avx2_kernels;
    if (set == 3 && cpu_has_avx512())
        k = avx512_kernels;
#endif
    if (k == NULL)
        return -3;
    int log2 = elem == 1 ? 0 : elem == 2 ? 1 : elem == 4 ? 2 : 3;
    sums_t r = k[log2](p, n);
    out[0] = (int64_t)r.s;
    out[1] = (int64_t)r.w;
    return 0;
}

/* Which kernels run on this CPU: "avx512", "avx2" or "generic". */
const char *sfp_isa(void) {
    pick_kernels();
    return isa;
}

/* Fingerprint `ntensors` contiguous tensors described by `desc` (address, elements, element size in
 * 1/2/4/8, three int64 per tensor) into `out` (two int64 per tensor, which the caller zeroes), with up
 * to `nthreads` threads (the caller's included), each with at least `parallel_min_bytes` of the work.
 * Returns 0, or -1 if out of memory (out untouched), or -2 for a bad descriptor. */
int sfp_fingerprints(const int64_t *desc, int64_t ntensors, int64_t *out, int nthreads,
                     int64_t piece_bytes, int64_t parallel_min_bytes) {
    pick_kernels();
    int64_t total = 0;
    for (int64_t k = 0; k < ntensors; k++) {
        int64_t e = desc[3 * k + 2];
        if ((e != 1 && e != 2 && e != 4 && e != 8) || desc[3 * k + 1] < 0)
            return -2;
        total += desc[3 * k + 1] * e;
    }
    /* Each thread gets at least parallel_min_bytes: creating one costs tens of microseconds. */
    if (parallel_min_bytes > 0 && nthreads > total / parallel_min_bytes)
        nthreads = total / parallel_min_bytes > 1 ? (int)(total / parallel_min_bytes) : 1;
    job_t *job = (job_t *)calloc(1, sizeof(job_t));
    if (!job)
        return -1;
    job->desc = desc;
    job->out = (_Atomic uint64_t *)(void *)out;
    job->npieces = make_pieces(desc, ntensors, piece_bytes > 0 ? piece_bytes : (1 << 20), &job->pieces);
    if (job->npieces < 0) {
        free(job);
        return -1;
    }
    atomic_init(&job->next, 0);
    atomic_init(&job->refs, 1);
    atomic_init(&job->done, 0);

    int64_t helpers = nthreads - 1;
    if (helpers > job->npieces - 1)
        helpers = job->npieces - 1;
    if (helpers > 0) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        for (int64_t i = 0; i < helpers; i++) {
            pthread_t tid;
            atomic_fetch_add_explicit(&job->refs, 1, memory_order_relaxed);
            if (pthread_create(&tid, &attr, worker, job) != 0) {
                /* No thread: the caller does the work itself. */
                atomic_fetch_sub_explicit(&job->refs, 1, memory_order_relaxed);
                break;
            }
        }
        pthread_attr_destroy(&attr);
    }
    finish(job, drain(job));
    /* Wait only for pieces that some worker has claimed and not finished. */
    /* The wait is at most one piece of a running worker (tens of microseconds), so spin rather than
     * sleep: waking from a sleep on a busy machine costs a scheduling latency of milliseconds. After a
     * while, yield the CPU, which may be the one the (descheduled) worker needs. */
    for (long spins = 0; atomic_load_explicit(&job->done, memory_order_acquire) < job->npieces; spins++) {
        if (spins < 20000)
            cpu_relax();
        else
            sched_yield();
    }
    release(job);
    return 0;
}
