/* y = x W^T with W in GGUF's blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4) and x float32 rows.
 *
 * Layout. At load, swq_pack moves a matrix's bytes so that 8 output rows sit side by side: in
 * each 32-byte vector, 4-byte lane r holds row r's codes for the same 4 inputs. One vpdpbusd
 * (or vpmaddubsw + vpmaddwd on AVX2) of such a vector against 4 activation bytes broadcast to
 * every lane then advances 8 output rows at once, and a lane's int32 sum belongs to one row:
 * no horizontal sums, and a block's float scales for the 8 rows are one vector. Codes, scales
 * and offsets keep the file's bit patterns (Q8_0 codes are stored + 128 as unsigned bytes; Q4_K's
 * and Q5_K's packed 6-bit scales and mins are widened to bytes: 1184 bytes per 8 Q4_K
 * super-blocks against the file's 1152), so swq_unpack gives the file's bytes back exactly.
 *
 * Arithmetic. Each call quantizes x to int8 once: one scale per 32 inputs for the 32-element
 * formats, per 256 for the K formats, with the sums of each 16/32 inputs that the formats'
 * offsets need. Integer products are exact, so the result differs from x W^T over the
 * dequantized weights only by x's rounding to 8 bits and float32 accumulation.
 *
 * build.py compiles this file per instruction set (SWQ_ISA names it): AVX-512 VNNI on 256-bit
 * registers (Zen 4, Ice Lake and later) and AVX2 + FMA + F16C. Work is split by groups of output
 * rows over a pool of threads that sleep on a condition variable between calls.
 */

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SWQ_ISA "avx512vnni"
#define VNNI 1
/* 16 rows side by side in 512-bit registers: Zen 4 retires vpdpbusd zmm as fast as ymm */
enum { ROWS = 16 };
#define TILE 8 /* (x row, term) pairs a pass over a group's weights */
typedef __m512i vi;
typedef __m512 vf;
static inline vi vld(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi vzero(void) { return _mm512_setzero_si512(); }
static inline vi vset32(int32_t x) { return _mm512_set1_epi32(x); }
static inline vi vset8(char x) { return _mm512_set1_epi8(x); }
static inline vi vand(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vor(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vshr16(vi a, int n) { return _mm512_srli_epi16(a, n); }
static inline vi vshl16(vi a, int n) { return _mm512_slli_epi16(a, n); }
static inline vi vshr32(vi a, int n) { return _mm512_srli_epi32(a, n); }
static inline vi vshl32(vi a, int n) { return _mm512_slli_epi32(a, n); }
static inline vi vsub32(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vi vshuf8(vi table, vi idx) { return _mm512_shuffle_epi8(table, idx); }
static inline vi vtable16(__m128i t) { return _mm512_broadcast_i32x4(t); }
static inline vf vbits(vi a) { return _mm512_castsi512_ps(a); }
static inline vi vadd32(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vmul32(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
static inline vi vmadd16(vi a, vi b) { return _mm512_madd_epi16(a, b); }
static inline vi vdot(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline vi vu8to32(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vi8to32(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vu8to16(const uint8_t *p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vf16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vfzero(void) { return _mm512_setzero_ps(); }
static inline vf vfset(float x) { return _mm512_set1_ps(x); }
static inline vf vfmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf vtof(vi a) { return _mm512_cvtepi32_ps(a); }
static inline void vfst(float *p, vf a) { _mm512_storeu_ps(p, a); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SWQ_ISA "avx2"
enum { ROWS = 8 };
/* 16 ymm registers: 8 pairs a pass spilled, 10-23% slower at 8-64 rows than 4 (one thread,
 * 14336x4096: Q4_K 64 rows, two terms 110 -> 94 ms; Q6_K 181 -> 140; 2 pairs lost on Q6_K) */
#define TILE 4
typedef __m256i vi;
typedef __m256 vf;
static inline vi vld(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vzero(void) { return _mm256_setzero_si256(); }
static inline vi vset32(int32_t x) { return _mm256_set1_epi32(x); }
static inline vi vset8(char x) { return _mm256_set1_epi8(x); }
static inline vi vand(vi a, vi b) { return _mm256_and_si256(a, b); }
static inline vi vor(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vshr16(vi a, int n) { return _mm256_srli_epi16(a, n); }
static inline vi vshl16(vi a, int n) { return _mm256_slli_epi16(a, n); }
static inline vi vshr32(vi a, int n) { return _mm256_srli_epi32(a, n); }
static inline vi vshl32(vi a, int n) { return _mm256_slli_epi32(a, n); }
static inline vi vsub32(vi a, vi b) { return _mm256_sub_epi32(a, b); }
static inline vi vshuf8(vi table, vi idx) { return _mm256_shuffle_epi8(table, idx); }
static inline vi vtable16(__m128i t) { return _mm256_broadcastsi128_si256(t); }
static inline vf vbits(vi a) { return _mm256_castsi256_ps(a); }
static inline vi vadd32(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vmul32(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
static inline vi vmadd16(vi a, vi b) { return _mm256_madd_epi16(a, b); }
/* vpmaddubsw's int16 pair sums never saturate where this is used: u <= 63 (Q6_K), or |q| <= 128
 * against |x| <= 127 (Q8_0's sign trick), 32512 at most */
static inline vi vdot(vi acc, vi u, vi s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
static inline vi vu8to32(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi vi8to32(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi vu8to16(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vf16(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vfzero(void) { return _mm256_setzero_ps(); }
static inline vf vfset(float x) { return _mm256_set1_ps(x); }
static inline vf vfmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vtof(vi a) { return _mm256_cvtepi32_ps(a); }
static inline void vfst(float *p, vf a) { _mm256_storeu_ps(p, a); }
#else
#error "build.py compiles this file with -mavx2 -mfma -mf16c at least"
#endif

/* byte offsets inside a packed block of ROWS rows: a vector of codes is 4 * ROWS bytes, the
 * rows' float16 scales 2 * ROWS */
#define VB (4 * ROWS)
#define HB (2 * ROWS)

enum { FMT_Q4_0, FMT_Q4_1, FMT_Q8_0, FMT_Q4_K, FMT_Q6_K, FMT_Q5_K, FMT_MXFP4, FMT_COUNT };
static const int BLOCK_ELEMS[FMT_COUNT] = {32, 32, 32, 256, 256, 256, 32};
static const int BLOCK_BYTES[FMT_COUNT] = {18, 20, 34, 144, 210, 176, 17};
static const int PACKED_BYTES[FMT_COUNT] = {18 * ROWS, 20 * ROWS, 34 * ROWS, 148 * ROWS, 210 * ROWS, 180 * ROWS, 17 * ROWS};
static const int ACT_GROUP[FMT_COUNT] = {32, 32, 32, 256, 256, 256, 32};

/* Q4_K and Q5_K: the widened scales and mins after d[R] | dmin[R], then (Q5_K) the high bits,
 * then the codes (K_QS; in the file's block at K_FILE_QS) */
#define K_SCALES (2 * HB)
#define K_MINS (2 * HB + 8 * ROWS)
#define Q5_QH (20 * ROWS)
#define K_QS(fmt) ((fmt) == FMT_Q4_K ? 20 * ROWS : 52 * ROWS)
#define K_FILE_QS(fmt) ((fmt) == FMT_Q4_K ? 16 : 48)

/* Q6_K: the vectors of each half h (128 inputs) in the order the kernel first reads them:
 * high 2 bits [c], then low 4 bits [t][c] */
#define Q6_QH(h) (18 * ROWS + 24 * VB * (h))
#define Q6_QL(h, t) (Q6_QH(h) + 8 * VB + 8 * VB * (t))

enum { UNIT_ROWS = 32 }; /* weight rows a unit of work: 2 groups (avx512) or 4 (avx2) */

const char *swq_isa(void) { return SWQ_ISA; }

int swq_rows(void) { return ROWS; }

/* ------------------------------------------------------------------ packing */

int64_t swq_packed_bytes(int fmt, int64_t n, int64_t k) {
    if (fmt < 0 || fmt >= FMT_COUNT || k % BLOCK_ELEMS[fmt]) return -1;
    return (n + ROWS - 1) / ROWS * (k / BLOCK_ELEMS[fmt]) * PACKED_BYTES[fmt];
}

/* the K formats' 12 bytes of 6-bit scales and mins (p) <-> bytes at dst + K_SCALES: scales [8 j][R],
 * mins as int16-ready pairs [4][R][2] */
static void widen_scales(const uint8_t *p, int r, uint8_t *dst) {
    for (int j = 0; j < 4; j++) {
        dst[K_SCALES + ROWS * j + r] = p[j] & 63;
        dst[K_SCALES + ROWS * (j + 4) + r] = (p[j + 8] & 0x0F) | ((p[j] >> 6) << 4);
        const uint8_t m0 = p[j + 4] & 63, m1 = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
        dst[K_MINS + HB * (j / 2) + 2 * r + (j % 2)] = m0;
        dst[K_MINS + HB * ((j + 4) / 2) + 2 * r + (j % 2)] = m1;
    }
}

static void narrow_scales(const uint8_t *src, int r, uint8_t *p) {
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 8; j++)
        sc[j] = src[K_SCALES + ROWS * j + r], mn[j] = src[K_MINS + HB * (j / 2) + 2 * r + (j % 2)];
    for (int j = 0; j < 4; j++) {
        p[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        p[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        p[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
    }
}

/* one block of ROWS rows: src[r] is row r's block in the file (NULL past the last row).
 * Q4_0:  d[R] | codes: vector i, lane r = qs_r[4i .. 4i+3] (low nibbles: inputs 4i.., high: 16+4i..)
 * Q4_1:  d[R] | m[R] | codes as Q4_0
 * Q8_0:  d[R] | codes + 128: vector c, lane r = qs_r[4c .. 4c+3]
 * Q4_K:  d[R] | dmin[R] | scales [8 j][R] | mins [4 pairs][R][2] | codes: run i (64 inputs),
 *        vector c, lane r = qs_r[32i + 4c .. +3] (low nibbles: sub-block 2i, high: 2i+1)
 * Q5_K:  as Q4_K, with the high bits between mins and codes: vector c, lane r = qh_r[4c .. +3]
 *        (bit j: sub-block j)
 * Q6_K:  d[R] | scales [16][R] | for each half h: qh vectors [c] = qh_r[32h + 4c ..], then
 *        ql vectors [t][c] = ql_r[64h + 32t + 4c ..]
 * MXFP4: e[R] (the E8M0 exponent bytes) | codes as Q4_0's */
static void pack_block(int fmt, const uint8_t *src[ROWS], uint8_t *dst) {
    static const uint8_t zero[210];
    const uint8_t *s[ROWS];
    for (int r = 0; r < ROWS; r++) s[r] = src[r] ? src[r] : zero;
    switch (fmt) {
        case FMT_Q4_0:
            for (int r = 0; r < ROWS; r++) memcpy(dst + 2 * r, s[r], 2);
            for (int i = 0; i < 4; i++)
                for (int r = 0; r < ROWS; r++) memcpy(dst + HB + VB * i + 4 * r, s[r] + 2 + 4 * i, 4);
            break;
        case FMT_MXFP4:
            for (int r = 0; r < ROWS; r++) dst[r] = s[r][0];
            for (int i = 0; i < 4; i++)
                for (int r = 0; r < ROWS; r++) memcpy(dst + ROWS + VB * i + 4 * r, s[r] + 1 + 4 * i, 4);
            break;
        case FMT_Q4_1:
            for (int r = 0; r < ROWS; r++) memcpy(dst + 2 * r, s[r], 2), memcpy(dst + HB + 2 * r, s[r] + 2, 2);
            for (int i = 0; i < 4; i++)
                for (int r = 0; r < ROWS; r++) memcpy(dst + 2 * HB + VB * i + 4 * r, s[r] + 4 + 4 * i, 4);
            break;
        case FMT_Q8_0:
            for (int r = 0; r < ROWS; r++) memcpy(dst + 2 * r, s[r], 2);
            for (int c = 0; c < 8; c++)
                for (int r = 0; r < ROWS; r++)
                    for (int j = 0; j < 4; j++) dst[HB + VB * c + 4 * r + j] = s[r][2 + 4 * c + j] ^ 0x80;
            break;
        case FMT_Q4_K:
        case FMT_Q5_K:
            for (int r = 0; r < ROWS; r++) {
                memcpy(dst + 2 * r, s[r], 2);
                memcpy(dst + HB + 2 * r, s[r] + 2, 2);
                widen_scales(s[r] + 4, r, dst);
            }
            if (fmt == FMT_Q5_K)
                for (int c = 0; c < 8; c++)
                    for (int r = 0; r < ROWS; r++) memcpy(dst + Q5_QH + VB * c + 4 * r, s[r] + 16 + 4 * c, 4);
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 8; c++)
                    for (int r = 0; r < ROWS; r++)
                        memcpy(dst + K_QS(fmt) + 8 * VB * i + VB * c + 4 * r, s[r] + K_FILE_QS(fmt) + 32 * i + 4 * c, 4);
            break;
        case FMT_Q6_K:
            for (int r = 0; r < ROWS; r++) {
                memcpy(dst + 2 * r, s[r] + 208, 2);
                for (int k = 0; k < 16; k++) dst[HB + ROWS * k + r] = s[r][192 + k];
            }
            for (int h = 0; h < 2; h++)
                for (int t = 0; t < 2; t++)
                    for (int c = 0; c < 8; c++)
                        for (int r = 0; r < ROWS; r++)
                            memcpy(dst + Q6_QL(h, t) + VB * c + 4 * r, s[r] + 64 * h + 32 * t + 4 * c, 4);
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < 8; c++)
                    for (int r = 0; r < ROWS; r++)
                        memcpy(dst + Q6_QH(h) + VB * c + 4 * r, s[r] + 128 + 32 * h + 4 * c, 4);
            break;
    }
}

/* the inverse of pack_block for one row: the file's block back */
static void unpack_block(int fmt, const uint8_t *src, int r, uint8_t *out) {
    switch (fmt) {
        case FMT_Q4_0:
            memcpy(out, src + 2 * r, 2);
            for (int i = 0; i < 4; i++) memcpy(out + 2 + 4 * i, src + HB + VB * i + 4 * r, 4);
            break;
        case FMT_MXFP4:
            out[0] = src[r];
            for (int i = 0; i < 4; i++) memcpy(out + 1 + 4 * i, src + ROWS + VB * i + 4 * r, 4);
            break;
        case FMT_Q4_1:
            memcpy(out, src + 2 * r, 2), memcpy(out + 2, src + HB + 2 * r, 2);
            for (int i = 0; i < 4; i++) memcpy(out + 4 + 4 * i, src + 2 * HB + VB * i + 4 * r, 4);
            break;
        case FMT_Q8_0:
            memcpy(out, src + 2 * r, 2);
            for (int c = 0; c < 8; c++)
                for (int j = 0; j < 4; j++) out[2 + 4 * c + j] = src[HB + VB * c + 4 * r + j] ^ 0x80;
            break;
        case FMT_Q4_K:
        case FMT_Q5_K:
            memcpy(out, src + 2 * r, 2), memcpy(out + 2, src + HB + 2 * r, 2);
            narrow_scales(src, r, out + 4);
            if (fmt == FMT_Q5_K)
                for (int c = 0; c < 8; c++) memcpy(out + 16 + 4 * c, src + Q5_QH + VB * c + 4 * r, 4);
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 8; c++)
                    memcpy(out + K_FILE_QS(fmt) + 32 * i + 4 * c, src + K_QS(fmt) + 8 * VB * i + VB * c + 4 * r, 4);
            break;
        case FMT_Q6_K:
            memcpy(out + 208, src + 2 * r, 2);
            for (int k = 0; k < 16; k++) out[192 + k] = src[HB + ROWS * k + r];
            for (int h = 0; h < 2; h++)
                for (int t = 0; t < 2; t++)
                    for (int c = 0; c < 8; c++)
                        memcpy(out + 64 * h + 32 * t + 4 * c, src + Q6_QL(h, t) + VB * c + 4 * r, 4);
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < 8; c++) memcpy(out + 128 + 32 * h + 4 * c, src + Q6_QH(h) + VB * c + 4 * r, 4);
            break;
    }
}

/* src: n rows of row_bytes in the file's layout -> dst of swq_packed_bytes (rows past n zero) */
int swq_pack(int fmt, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    const int64_t size = swq_packed_bytes(fmt, n, k);
    if (size < 0) return -1;
    const int64_t nb = k / BLOCK_ELEMS[fmt], row_bytes = nb * BLOCK_BYTES[fmt];
    for (int64_t g = 0; g < (n + ROWS - 1) / ROWS; g++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *rows[ROWS];
            for (int r = 0; r < ROWS; r++)
                rows[r] = g * ROWS + r < n ? src + (g * ROWS + r) * row_bytes + b * BLOCK_BYTES[fmt] : NULL;
            pack_block(fmt, rows, dst + (g * nb + b) * PACKED_BYTES[fmt]);
        }
    return 0;
}

/* rows [r0, r1) of a packed matrix back in the file's layout, (r1 - r0) * row_bytes bytes */
int swq_unpack(int fmt, const uint8_t *src, int64_t k, int64_t r0, int64_t r1, uint8_t *dst) {
    if (fmt < 0 || fmt >= FMT_COUNT || k % BLOCK_ELEMS[fmt]) return -1;
    const int64_t nb = k / BLOCK_ELEMS[fmt], row_bytes = nb * BLOCK_BYTES[fmt];
    for (int64_t row = r0; row < r1; row++)
        for (int64_t b = 0; b < nb; b++)
            unpack_block(fmt, src + ((row / ROWS) * nb + b) * PACKED_BYTES[fmt], (int)(row % ROWS),
                         dst + (row - r0) * row_bytes + b * BLOCK_BYTES[fmt]);
    return 0;
}

/* ------------------------------------------------------------------ activations */

/* x rows as `terms` int8 terms each: x ~ d (q0 + q1 / 254), q1 being x's rounding error in
 * steps of d / 254. One term errs by up to half a step of each group's largest value; measured
 * on the default model, that cut top-1 agreement with float32 from 0.991 (bfloat16 inputs) to
 * 0.956, two terms give 0.997. Term t of row r is stored as row r * terms + t. */
typedef struct {
    int64_t rows, k;
    int group;    /* inputs per scale: 32 or 256 */
    int terms;    /* 1 or 2 */
    int8_t *q;    /* [rows * terms][k] */
    float *d;     /* [rows][k / group]: term t's scale is d / 254^t */
    int16_t *s32; /* [rows * terms][k / 32]: sum of q over each 32 */
    int16_t *s16; /* [rows * terms][k / 16]: sum of q over each 16 */
} Acts;

#define RESIDUAL 254.0f

/* 32 int32 in 4 vectors -> 32 int8 in order, and their sums per 16 and per 32 */
static inline void store_codes(__m256i i0, __m256i i1, __m256i i2, __m256i i3, int8_t *q,
                               int16_t *s16, int16_t *s32) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    p = _mm256_permutevar8x32_epi32(p, order);
    _mm256_storeu_si256((__m256i *)q, p);
    /* sums of each 8 bytes: q + 128 against zero, less 8 * 128 */
    const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(p, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
    int64_t e[4];
    _mm256_storeu_si256((__m256i *)e, sad);
    s16[0] = (int16_t)(e[0] + e[1] - 2048), s16[1] = (int16_t)(e[2] + e[3] - 2048);
    s32[0] = (int16_t)(s16[0] + s16[1]);
}

static void quantize_row(const float *x, const Acts *A, int64_t row) {
    const int64_t k = A->k;
    const int group = A->group;
    const __m256 sign = _mm256_set1_ps(-0.0f), steps = _mm256_set1_ps(RESIDUAL);
    for (int64_t g = 0; g < k / group; g++) {
        const float *xg = x + g * group;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < group; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + i)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        A->d[row * (k / group) + g] = amax / 127.0f;
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        for (int i = 0; i < group; i += 32) {
            const int64_t at = g * group + i;
            __m256 v[4];
            __m256i c[4];
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_mul_ps(_mm256_loadu_ps(xg + i + 8 * j), id); /* in steps of d */
                c[j] = _mm256_cvtps_epi32(v[j]);                           /* nearest, ties even */
            }
            const int64_t t0 = row * A->terms;
            store_codes(c[0], c[1], c[2], c[3], A->q + t0 * k + at, A->s16 + t0 * (k / 16) + at / 16,
                        A->s32 + t0 * (k / 32) + at / 32);
            if (A->terms == 2) {
                for (int j = 0; j < 4; j++) /* the rounding error, within half a step */
                    c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(v[j], _mm256_cvtepi32_ps(c[j])), steps));
                store_codes(c[0], c[1], c[2], c[3], A->q + (t0 + 1) * k + at,
                            A->s16 + (t0 + 1) * (k / 16) + at / 16, A->s32 + (t0 + 1) * (k / 32) + at / 32);
            }
        }
    }
}

/* ------------------------------------------------------------------ kernels */

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define EACH(i, n) _Pragma("GCC unroll 16") for (int i = 0; i < (n); i++)
/* over x rows, and over the R * T (row, term) pairs: v's row is v / T, its term v % T */
#define EACH_ROW EACH(r, R)
#define EACH_V EACH(v, R *T)

/* Software prefetch PREFETCH_AHEAD bytes ahead of the block being read, into L2, where a kernel
 * does enough arithmetic per byte of weights (`work`: vpdpbusd passes over each code byte, 2 for
 * 4-bit codes per (x row, term), 1 for Q8_0, 4 for Q5_K's and Q6_K's two-load codes). There, the
 * hardware prefetcher alone left the stream and the arithmetic one after the other: a 14336x4096
 * Q4_K matrix against one row took 1.33 ms with one term and 1.8 with two, 1.2 with two and this
 * (8 KiB ahead; 4 KiB 1.64, 16 KiB 1.23), and two rows 3.0 -> 1.9 ms. Below PREFETCH_MIN_WORK it
 * cost 1.2-1.4x (one row, one term: Q4_K 1.33 -> 1.62 ms; Q8_0 2.2 -> 3.0; prefetching to L1 or 32
 * KiB ahead the same), the hardware's own prefetch then keeping up by itself. */
enum { PREFETCH_AHEAD = 8192, PREFETCH_MIN_WORK = 4 };

/* the part-th of `parts` shares of the cache lines of `bytes` at blk + PREFETCH_AHEAD: a block's
 * lines spread over its steps, since a burst of them at once measured slower */
ALWAYS_INLINE void prefetch_part(const uint8_t *blk, int part, int parts, int bytes, int work) {
    if (work < PREFETCH_MIN_WORK) return;
    const int lines = (bytes + 63) / 64, per = (lines + parts - 1) / parts;
    EACH(o, per) if (per * part + o < lines) __builtin_prefetch(blk + PREFETCH_AHEAD + 64 * (per * part + o), 0, 1);
}

/* 4 activation bytes at p in every lane */
ALWAYS_INLINE vi bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return vset32(v);
}
/* acc + u . (4 bytes at p in every lane) */
ALWAYS_INLINE vi vdotb(vi acc, vi u, const int8_t *p) {
#if defined(VNNI)
    /* the broadcast folded into the instruction: gcc emits a separate vpbroadcastd */
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
#else
    return vdot(acc, u, bcast4(p));
#endif
}
ALWAYS_INLINE vi lo4(vi v) { return vand(v, vset8(0x0F)); }
ALWAYS_INLINE vi hi4(vi v) { return vand(vshr16(v, 4), vset8(0x0F)); }

/* Independent sums per (row, term): a chain of vpdpbusd on one register waits ~5 cycles a link,
 * so where there are few (row, term) pairs each gets CHAINS(R, T) registers, summed per block
 * (one row's decode measured latency-bound with one). */
#define CHAINS(R, T) ((R) * (T) >= 4 ? 1 : 2)
ALWAYS_INLINE vi chains(vi p[2], const int C) { return C == 2 ? vadd32(p[0], p[1]) : p[0]; }

/* Sums of 4-bit codes against x for up to 32 inputs a lane: dot16 accumulates, dot32 gives the
 * lane's int32 sum (times a per-lane scale in dot32s). VNNI: int32 lanes throughout. AVX2 has no
 * vpdpbusd, and vpmaddubsw + vpmaddwd + vpaddd per vector kept its two multiply ports busy twice
 * over: the int16 pair sums are added as int16 (8 vectors of codes <= 15 against |x| <= 127
 * reach 30480 at most, under int16's 32767) and widened once by vpmaddwd, against ones or the
 * sub-block's scale in both halves of the lane, which also replaces a vpmulld. */
#if defined(VNNI)
#define CHAINS4(R, T) CHAINS(R, T)
ALWAYS_INLINE vi dot16(vi acc, vi u, const int8_t *p) { return vdotb(acc, u, p); }
ALWAYS_INLINE vi dot32(vi p[2], const int C) { return chains(p, C); }
ALWAYS_INLINE vi dot32s(vi p[2], const int C, vi sc) { return vmul32(chains(p, C), sc); }
#else
/* the int16 chain waits one cycle a link */
#define CHAINS4(R, T) 1
ALWAYS_INLINE vi dot16(vi acc, vi u, const int8_t *p) {
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, bcast4(p)));
}
ALWAYS_INLINE vi dot32(vi p[2], const int C) {
    (void)C;
    return _mm256_madd_epi16(p[0], _mm256_set1_epi16(1));
}
ALWAYS_INLINE vi dot32s(vi p[2], const int C, vi sc) {
    (void)C;
    return _mm256_madd_epi16(p[0], _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)));
}
#endif

/* 5-bit codes (Q5_K): AVX2's int16 sums hold 4 vectors of them (4 * 2 * 31 * 127 = 31496), so
 * there every sub-block takes two chains of 4 */
#if defined(VNNI)
#define CHAINS5(R, T) CHAINS(R, T)
#define LINK5(c, C) ((c) % (C))
ALWAYS_INLINE vi dot32s5(vi p[2], const int C, vi sc) { return dot32s(p, C, sc); }
#else
#define CHAINS5(R, T) 2
#define LINK5(c, C) ((c) / 4)
ALWAYS_INLINE vi dot32s5(vi p[2], const int C, vi sc) {
    (void)C;
    const vi both = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
    return _mm256_add_epi32(_mm256_madd_epi16(p[0], both), _mm256_madd_epi16(p[1], both));
}
#endif

/* bit j of each byte of h, at bit 4 (16-bit shifts by <= 4 keep each byte's bits in its byte) */
ALWAYS_INLINE vi bit_to_4(vi h, const int j) {
    return vand(j < 4 ? vshl16(h, 4 - j) : j > 4 ? vshr16(h, j - 4) : h, vset8(0x10));
}

/* row r's integer sums of its T terms as one float vector, in steps of its first term */
ALWAYS_INLINE vf terms(const vi *p, int r, const int T) {
    vf s = vtof(p[r * T]);
    if (T == 2) s = vfma(vtof(p[r * T + 1]), vfset(1.0f / RESIDUAL), s);
    return s;
}

/* One group of ROWS weight rows (nb packed blocks at w) against x rows r0 .. r0+R-1 (T terms
 * each), writing y[r * ldy + 0 .. ROWS-1]. R and T are constants at each call site (see
 * group_kernel). The loop over x rows is innermost: consecutive vpdpbusd feed different rows'
 * sums, so their latencies overlap (one chain per row measured 3x slower). */

ALWAYS_INLINE void group_q4_0(const uint8_t *w, int64_t nb, const Acts *A, int64_t r0, const int R,
                              const int T, float *y, int64_t ldy) {
    vf acc[TILE];
    EACH_ROW acc[r] = vfzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + PACKED_BYTES[FMT_Q4_0] * b;
        prefetch_part(blk, 0, 1, PACKED_BYTES[FMT_Q4_0], 2 * R * T);
        const int8_t *a[TILE];
        vi p[TILE], ch[TILE][2];
        int32_t base[TILE];
        const int C = CHAINS4(R, T);
        /* codes are q - 8: each lane's sum less 8 * sum(x) */
        EACH_V {
            const int64_t tr = (r0 + v / T) * T + v % T;
            a[v] = A->q + tr * A->k + 32 * b, base[v] = -8 * A->s32[tr * nb + b], ch[v][0] = ch[v][1] = vzero();
        }
        EACH(i, 4) {
            const vi c = vld(blk + HB + VB * i), lo = lo4(c), hi = hi4(c);
            EACH_V ch[v][0] = dot16(ch[v][0], lo, a[v] + 4 * i);
            EACH_V ch[v][C - 1] = dot16(ch[v][C - 1], hi, a[v] + 16 + 4 * i);
        }
        EACH_V p[v] = vadd32(dot32(ch[v], C), vset32(base[v]));
        const vf d = vf16(blk);
        EACH_ROW acc[r] = vfma(terms(p, r, T), vfmul(d, vfset(A->d[(r0 + r) * nb + b])), acc[r]);
    }
    EACH_ROW vfst(y + r * ldy, acc[r]);
}

ALWAYS_INLINE void group_q4_1(const uint8_t *w, int64_t nb, const Acts *A, int64_t r0, const int R,
                              const int T, float *y, int64_t ldy) {
    vf acc[TILE];
    EACH_ROW acc[r] = vfzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + PACKED_BYTES[FMT_Q4_1] * b;
        prefetch_part(blk, 0, 1, PACKED_BYTES[FMT_Q4_1], 2 * R * T);
        const int8_t *a[TILE];
        vi p[TILE], ch[TILE][2];
        const int C = CHAINS4(R, T);
        EACH_V a[v] = A->q + ((r0 + v / T) * T + v % T) * A->k + 32 * b, ch[v][0] = ch[v][1] = vzero();
        EACH(i, 4) {
            const vi c = vld(blk + 2 * HB + VB * i), lo = lo4(c), hi = hi4(c);
            EACH_V ch[v][0] = dot16(ch[v][0], lo, a[v] + 4 * i);
            EACH_V ch[v][C - 1] = dot16(ch[v][C - 1], hi, a[v] + 16 + 4 * i);
        }
        EACH_V p[v] = dot32(ch[v], C);
        const vf d = vf16(blk), m = vf16(blk + HB);
        EACH_ROW {
            const float da = A->d[(r0 + r) * nb + b];
            float sum = (float)A->s32[(r0 + r) * T * nb + b]; /* the offsets meet sum(x) */
            if (T == 2) sum += (float)A->s32[((r0 + r) * T + 1) * nb + b] * (1.0f / RESIDUAL);
            acc[r] = vfma(terms(p, r, T), vfmul(d, vfset(da)), acc[r]);
            acc[r] = vfma(m, vfset(da * sum), acc[r]);
        }
    }
    EACH_ROW vfst(y + r * ldy, acc[r]);
}

ALWAYS_INLINE void group_q8_0(const uint8_t *w, int64_t nb, const Acts *A, int64_t r0, const int R,
                              const int T, float *y, int64_t ldy) {
    vf acc[TILE];
    EACH_ROW acc[r] = vfzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + PACKED_BYTES[FMT_Q8_0] * b;
        prefetch_part(blk, 0, 1, PACKED_BYTES[FMT_Q8_0], 1 * R * T);
        const int8_t *a[TILE];
        vi p[TILE], ch[TILE][2];
        const int C = CHAINS(R, T);
#if defined(VNNI)
        /* (q + 128) x, less 128 * sum(x) */
        EACH_V {
            const int64_t tr = (r0 + v / T) * T + v % T;
            a[v] = A->q + tr * A->k + 32 * b, ch[v][0] = vset32(-128 * A->s32[tr * nb + b]), ch[v][1] = vzero();
        }
        EACH(c, 8) {
            const vi q = vld(blk + HB + VB * c);
            EACH_V ch[v][c % C] = vdotb(ch[v][c % C], q, a[v] + 4 * c);
        }
#else
        /* vpmaddubsw would saturate on q + 128: |q| against x carrying q's sign instead */
        EACH_V a[v] = A->q + ((r0 + v / T) * T + v % T) * A->k + 32 * b, ch[v][0] = ch[v][1] = vzero();
        EACH(c, 8) {
            const vi q = _mm256_xor_si256(vld(blk + HB + VB * c), vset8((char)0x80)), u = _mm256_abs_epi8(q);
            EACH_V ch[v][c % C] = vdot(ch[v][c % C], u, _mm256_sign_epi8(bcast4(a[v] + 4 * c), q));
        }
#endif
        EACH_V p[v] = chains(ch[v], C);
        const vf d = vf16(blk);
        EACH_ROW acc[r] = vfma(terms(p, r, T), vfmul(d, vfset(A->d[(r0 + r) * nb + b])), acc[r]);
    }
    EACH_ROW vfst(y + r * ldy, acc[r]);
}

/* MXFP4 (OCP microscaling): 32 E2M1 codes, whose values doubled are the integers 0, 1, 2, 3, 4,
 * 6, 8, 12 with a sign bit, and one E8M0 exponent byte e: w = code's value * 2^(e - 127). A byte
 * shuffle maps a code to its doubled value + 12, 0..24 unsigned for vpdpbusd, and each lane's sum
 * less 12 * sum(x) is then exact; the block's scale 2^(e - 128) takes the doubling back. AVX2
 * adds pairs as int16: 8 vectors at 2 * 24 * 127 a pair would overflow, so low and high nibbles
 * keep a chain each (4 vectors, 24384 at most) and meet in int32. */
#if defined(VNNI)
#define CHAINS_MX(R, T) CHAINS(R, T)
ALWAYS_INLINE vi dot32_mx(vi p[2], const int C) { return chains(p, C); }
#else
#define CHAINS_MX(R, T) 2
ALWAYS_INLINE vi dot32_mx(vi p[2], const int C) {
    (void)C;
    const vi ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(p[0], ones), _mm256_madd_epi16(p[1], ones));
}
#endif

/* 2^(e - 128) for ROWS exponent bytes at p, exact for every e: the product of two normal
 * floats 2^(a - 64) * 2^(e - a - 64), a = e / 2, so that e = 0 and 1 (2^-128 and 2^-127, below
 * float32's normal range) need no case of their own; e = 255 (a NaN to OCP) reads 2^127 */
ALWAYS_INLINE vf e8m0_half(const uint8_t *p) {
    const vi e = vu8to32(p), a = vshr32(e, 1), bias = vset32(63);
    return vfmul(vbits(vshl32(vadd32(a, bias), 23)), vbits(vshl32(vadd32(vsub32(e, a), bias), 23)));
}

ALWAYS_INLINE void group_mxfp4(const uint8_t *w, int64_t nb, const Acts *A, int64_t r0, const int R,
                               const int T, float *y, int64_t ldy) {
    const vi table = vtable16(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    vf acc[TILE];
    EACH_ROW acc[r] = vfzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + PACKED_BYTES[FMT_MXFP4] * b;
        prefetch_part(blk, 0, 1, PACKED_BYTES[FMT_MXFP4], 2 * R * T);
        const int8_t *a[TILE];
        vi p[TILE], ch[TILE][2];
        int32_t base[TILE];
        const int C = CHAINS_MX(R, T);
        EACH_V {
            const int64_t tr = (r0 + v / T) * T + v % T;
            a[v] = A->q + tr * A->k + 32 * b, base[v] = -12 * A->s32[tr * nb + b], ch[v][0] = ch[v][1] = vzero();
        }
        EACH(i, 4) {
            const vi c = vld(blk + ROWS + VB * i), lo = vshuf8(table, lo4(c)), hi = vshuf8(table, hi4(c));
            EACH_V ch[v][0] = dot16(ch[v][0], lo, a[v] + 4 * i);
            EACH_V ch[v][C - 1] = dot16(ch[v][C - 1], hi, a[v] + 16 + 4 * i);
        }
        EACH_V p[v] = vadd32(dot32_mx(ch[v], C), vset32(base[v]));
        const vf d = e8m0_half(blk);
        EACH_ROW acc[r] = vfma(terms(p, r, T), vfmul(d, vfset(A->d[(r0 + r) * nb + b])), acc[r]);
    }
    EACH_ROW vfst(y + r * ldy, acc[r]);
}

/* Q4_K, and Q5_K (five: a fifth bit per code from its high-bit vectors) */
ALWAYS_INLINE void group_k(const uint8_t *w, int64_t nb, const Acts *A, int64_t r0, const int R,
                           const int T, float *y, int64_t ldy, const int five) {
    vf acc[TILE];
    const int fmt = five ? FMT_Q5_K : FMT_Q4_K, bytes = PACKED_BYTES[fmt];
    EACH_ROW acc[r] = vfzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + bytes * b;
        const int8_t *a[TILE];
        vi isum[TILE], imin[TILE];
        EACH_V a[v] = A->q + ((r0 + v / T) * T + v % T) * A->k + 256 * b, isum[v] = imin[v] = vzero();
        /* sum over sub-blocks j of min_rj * sum(x over j): int16 pairs of mins per lane */
        EACH(pr, 4) {
            const vi mins = vu8to16(blk + K_MINS + HB * pr);
            EACH_V {
                int32_t pair;
                memcpy(&pair, A->s32 + ((r0 + v / T) * T + v % T) * (A->k / 32) + 8 * b + 2 * pr, 4);
                imin[v] = vadd32(imin[v], vmadd16(mins, vset32(pair)));
            }
        }
        EACH(j, 8) { /* sub-block j: run j / 2, low nibbles for even j */
            const uint8_t *codes = blk + K_QS(fmt) + 8 * VB * (j / 2);
            prefetch_part(blk, j, 8, bytes, (five ? 4 : 2) * R * T);
            vi ch[TILE][2];
            const int C = five ? CHAINS5(R, T) : CHAINS4(R, T);
            EACH_V ch[v][0] = ch[v][1] = vzero();
            EACH(c, 8) {
                const vi cv = vld(codes + VB * c);
                vi q = j % 2 ? hi4(cv) : lo4(cv);
                if (five) q = vor(q, bit_to_4(vld(blk + Q5_QH + VB * c), j));
                const int link = five ? LINK5(c, C) : c % C;
                EACH_V ch[v][link] = dot16(ch[v][link], q, a[v] + 32 * j + 4 * c);
            }
            const vi sc = vu8to32(blk + K_SCALES + ROWS * j);
            EACH_V isum[v] = vadd32(isum[v], five ? dot32s5(ch[v], C, sc) : dot32s(ch[v], C, sc));
        }
        const vf d = vf16(blk), dmin = vf16(blk + HB);
        EACH_ROW {
            const vf da = vfset(A->d[(r0 + r) * nb + b]);
            acc[r] = vfma(terms(isum, r, T), vfmul(d, da), acc[r]);
            acc[r] = vfnma(terms(imin, r, T), vfmul(dmin, da), acc[r]);
        }
    }
    EACH_ROW vfst(y + r * ldy, acc[r]);
}

ALWAYS_INLINE void group_q4_k(const uint8_t *w, int64_t nb, const Acts *A, int64_t r0, const int R,
                              const int T, float *y, int64_t ldy) {
    group_k(w, nb, A, r0, R, T, y, ldy, 0);
}

ALWAYS_INLINE void group_q5_k(const uint8_t *w, int64_t nb, const Acts *A, int64_t r0, const int R,
                              const int T, float *y, int64_t ldy) {
    group_k(w, nb, A, r0, R, T, y, ldy, 1);
}

/* Q6_K's 6-bit codes of inputs 128h + 32e + 4c .. +3 for the ROWS rows (e: which quarter) */
ALWAYS_INLINE vi q6_codes(const uint8_t *blk, int h, int e, int c) {
    const vi l = vld(blk + Q6_QL(h, e % 2) + VB * c), hb = vld(blk + Q6_QH(h) + VB * c);
    const vi lo = e < 2 ? lo4(l) : hi4(l);
    const vi hi = e == 0 ? vshl16(hb, 4) : e == 1 ? vshl16(hb, 2) : e == 2 ? hb : vshr16(hb, 2);
    return vor(lo, vand(hi, vset8(0x30)));
}

ALWAYS_INLINE void group_q6_k(const uint8_t *w, int64_t nb, const Acts *A, int64_t r0, const int R,
                              const int T, float *y, int64_t ldy) {
    vf acc[TILE];
    EACH_ROW acc[r] = vfzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + PACKED_BYTES[FMT_Q6_K] * b;
        const int8_t *a[TILE];
        const int16_t *s[TILE];
        vi isum[TILE];
        EACH_V {
            const int64_t tr = (r0 + v / T) * T + v % T;
            a[v] = A->q + tr * A->k + 256 * b;
            s[v] = A->s16 + tr * (A->k / 16) + 16 * b;
            isum[v] = vzero();
        }
        EACH(i, 16) { /* sub-block k16 (inputs 16 k16 .. +15), in the order of the layout */
            const int h = i / 8, t = (i / 4) % 2, half = (i / 2) % 2, e = t + 2 * (i % 2);
            const int k16 = 8 * h + 2 * e + half, c0 = 4 * half;
            prefetch_part(blk, i, 16, PACKED_BYTES[FMT_Q6_K], 4 * R * T);
            vi ch[TILE][2];
            const int C = CHAINS(R, T);
            /* codes are q - 32: each lane starts at -32 * sum(x over the 16) */
            EACH_V ch[v][0] = vset32(-32 * s[v][k16]), ch[v][1] = vzero();
            EACH(c, 4) {
                const vi q = q6_codes(blk, h, e, c0 + c);
                EACH_V ch[v][c % C] = vdotb(ch[v][c % C], q, a[v] + 16 * k16 + 4 * c);
            }
            const vi sc = vi8to32(blk + HB + ROWS * k16);
            EACH_V isum[v] = vadd32(isum[v], vmul32(chains(ch[v], C), sc));
        }
        const vf d = vf16(blk);
        EACH_ROW acc[r] = vfma(terms(isum, r, T), vfmul(d, vfset(A->d[(r0 + r) * nb + b])), acc[r]);
    }
    EACH_ROW vfst(y + r * ldy, acc[r]);
}

/* ------------------------------------------------------------------ work split */

typedef struct {
    int fmt;
    const uint8_t *w;
    int64_t n, nb, groups;
    const Acts *A;
    float *y; /* [rows][ldy]: row r's n outputs at y + r * ldy */
    int64_t ldy;
    int64_t units;
    atomic_long next;
} Job;

/* R x rows of T terms, R * T <= TILE */
#if TILE == 8
#define DISPATCH(KERNEL)                                                     \
    if (T == 1) switch (R) {                                                 \
            case 1: KERNEL(w, nb, A, r0, 1, 1, y, ldy); break;               \
            case 2: KERNEL(w, nb, A, r0, 2, 1, y, ldy); break;               \
            case 3: KERNEL(w, nb, A, r0, 3, 1, y, ldy); break;               \
            case 4: KERNEL(w, nb, A, r0, 4, 1, y, ldy); break;               \
            case 5: KERNEL(w, nb, A, r0, 5, 1, y, ldy); break;               \
            case 6: KERNEL(w, nb, A, r0, 6, 1, y, ldy); break;               \
            case 7: KERNEL(w, nb, A, r0, 7, 1, y, ldy); break;               \
            default: KERNEL(w, nb, A, r0, 8, 1, y, ldy); break;              \
        }                                                                    \
    else switch (R) {                                                        \
            case 1: KERNEL(w, nb, A, r0, 1, 2, y, ldy); break;               \
            case 2: KERNEL(w, nb, A, r0, 2, 2, y, ldy); break;               \
            case 3: KERNEL(w, nb, A, r0, 3, 2, y, ldy); break;               \
            default: KERNEL(w, nb, A, r0, 4, 2, y, ldy); break;              \
        }
#else
#define DISPATCH(KERNEL)                                                     \
    if (T == 1) switch (R) {                                                 \
            case 1: KERNEL(w, nb, A, r0, 1, 1, y, ldy); break;               \
            case 2: KERNEL(w, nb, A, r0, 2, 1, y, ldy); break;               \
            case 3: KERNEL(w, nb, A, r0, 3, 1, y, ldy); break;               \
            default: KERNEL(w, nb, A, r0, 4, 1, y, ldy); break;              \
        }                                                                    \
    else switch (R) {                                                        \
            case 1: KERNEL(w, nb, A, r0, 1, 2, y, ldy); break;               \
            default: KERNEL(w, nb, A, r0, 2, 2, y, ldy); break;              \
        }
#endif

static void group_kernel(int fmt, const uint8_t *w, int64_t nb, const Acts *A, int64_t r0, int R,
                         float *y, int64_t ldy) {
    const int T = A->terms;
    switch (fmt) {
        case FMT_Q4_0: DISPATCH(group_q4_0); break;
        case FMT_Q4_1: DISPATCH(group_q4_1); break;
        case FMT_Q8_0: DISPATCH(group_q8_0); break;
        case FMT_Q4_K: DISPATCH(group_q4_k); break;
        case FMT_Q6_K: DISPATCH(group_q6_k); break;
        case FMT_Q5_K: DISPATCH(group_q5_k); break;
        case FMT_MXFP4: DISPATCH(group_mxfp4); break;
    }
}

/* a unit: UNIT_ROWS weight rows against every x row, a TILE of x rows per pass: the unit's
 * weights stay in cache while the activations stream past them */
static void run_unit(Job *j, int64_t u) {
    const int64_t per = UNIT_ROWS / ROWS, g0 = u * per, g1 = g0 + per < j->groups ? g0 + per : j->groups;
    const int64_t rows = j->A->rows, gbytes = j->nb * PACKED_BYTES[j->fmt], tile = TILE / j->A->terms;
    for (int64_t r0 = 0; r0 < rows; r0 += tile) {
        const int R = rows - r0 < tile ? (int)(rows - r0) : (int)tile;
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *w = j->w + g * gbytes;
            if ((g + 1) * ROWS <= j->n) {
                group_kernel(j->fmt, w, j->nb, j->A, r0, R, j->y + r0 * j->ldy + ROWS * g, j->ldy);
            } else { /* the last rows of a matrix whose height is no multiple of ROWS */
                float part[TILE * ROWS];
                group_kernel(j->fmt, w, j->nb, j->A, r0, R, part, ROWS);
                for (int r = 0; r < R; r++)
                    memcpy(j->y + (r0 + r) * j->ldy + ROWS * g, part + r * ROWS, (j->n - ROWS * g) * sizeof(float));
            }
        }
    }
}

static void run_units(Job *j) {
    for (;;) {
        const int64_t u = atomic_fetch_add(&j->next, 1);
        if (u >= j->units) return;
        run_unit(j, u);
    }
}

/* ------------------------------------------------------------------ thread pool */

enum { MAX_THREADS = 64 };
#define MIN_SPLIT_MACS 1e7 /* multiply-adds below which a call runs on the calling thread alone */
/* one call at a time uses the pool; calls that find it taken run on their own thread, so a
 * decode step's matmul never waits behind a prompt pass's (a 64-token pass through one of an
 * 8B model's 14336x4096 matrices takes ~100 ms at one thread: with one lock for every call, a
 * node's decode steps took 25x longer while a prompt was in flight) */
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;
/* what the pool's threads run: helper(arg, i) on helper i < helpers, while the caller runs its own
 * part of the same work */
typedef struct {
    void (*helper)(void *arg, int index);
    void *arg;
    int helpers;
} Task;
static Task *current;
static unsigned long generation;
static int workers, pending;

typedef struct {
    int index;
    unsigned long seen;
} WorkerStart;

static void *worker_main(void *arg) {
    WorkerStart start = *(WorkerStart *)arg;
    free(arg);
    unsigned long seen = start.seen;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (generation == seen) pthread_cond_wait(&wake, &mu);
        seen = generation;
        Task *t = current;
        pthread_mutex_unlock(&mu);
        if (start.index < t->helpers) t->helper(t->arg, start.index);
        pthread_mutex_lock(&mu);
        if (--pending == 0) pthread_cond_signal(&done);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    /* the child has none of the parent's threads */
    workers = 0;
    pthread_mutex_init(&call_mu, NULL);
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&wake, NULL);
    pthread_cond_init(&done, NULL);
}

static void grow_pool(int helpers) {
    static int fork_hook;
    if (!fork_hook) fork_hook = !pthread_atfork(NULL, NULL, after_fork_in_child);
    pthread_mutex_lock(&mu);
    while (workers < helpers) {
        WorkerStart *s = malloc(sizeof *s);
        pthread_t t;
        if (!s) break;
        s->index = workers;
        s->seen = generation;
        if (pthread_create(&t, NULL, worker_main, s) != 0) {
            free(s);
            break;
        }
        pthread_detach(t);
        workers++;
    }
    pthread_mutex_unlock(&mu);
}

/* caller(arg) here and helper(arg, i) on up to threads - 1 pool threads; returns when all have.
 * The caller holds call_mu. */
static void run_task(void (*caller)(void *), void (*helper)(void *, int), void *arg, int threads) {
    int helpers = threads - 1;
    if (helpers > MAX_THREADS - 1) helpers = MAX_THREADS - 1;
    if (helpers > 0) grow_pool(helpers);
    if (helpers > workers) helpers = workers;
    if (helpers <= 0) {
        caller(arg);
        return;
    }
    Task t = {helper, arg, helpers};
    pthread_mutex_lock(&mu);
    current = &t;
    pending = workers;
    generation++;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&mu);
    caller(arg);
    pthread_mutex_lock(&mu);
    while (pending > 0) pthread_cond_wait(&done, &mu);
    pthread_mutex_unlock(&mu);
}

static void units_of(void *j) { run_units((Job *)j); }
static void units_helper(void *j, int index) { (void)index; run_units((Job *)j); }

static void run_job(Job *j, int threads) {
    if (j->units < 2) run_units(j);
    else run_task(units_of, units_helper, j, threads);
}

/* layer.c's team: caller(arg) on this thread, helper(arg, i) on threads - 1 of the pool's, or
 * caller alone where another call holds the pool (as swq_matmul does) */
void swq_team(void (*caller)(void *), void (*helper)(void *, int), void *arg, int threads) {
    if (threads > 1 && pthread_mutex_trylock(&call_mu) == 0) {
        run_task(caller, helper, arg, threads);
        pthread_mutex_unlock(&call_mu);
    } else {
        caller(arg);
    }
}

/* ------------------------------------------------------------------ entry point */

/* per calling thread (a node's decode and prefill lanes call at once) */
static __thread void *scratch;
static __thread size_t scratch_bytes;

static void *scratch_for(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = malloc(bytes);
        scratch_bytes = scratch ? bytes : 0;
    }
    return scratch;
}

/* The bytes of x [rows][k]'s int8 terms and sums (Acts) in one buffer; where buf is given,
 * A's arrays carved from it and the rows quantized into them */
static size_t acts_in(Acts *A, char *buf, int fmt, int64_t k, const float *x, int64_t rows, int terms) {
    const int group = ACT_GROUP[fmt];
    const int64_t tr = rows * terms;
    const size_t qb = ((size_t)(tr * k) + 63) & ~(size_t)63;
    const size_t db = (size_t)(rows * (k / group)) * sizeof(float);
    const size_t sb32 = (size_t)(tr * (k / 32)) * sizeof(int16_t);
    const size_t sb16 = (size_t)(tr * (k / 16)) * sizeof(int16_t);
    if (buf) {
        *A = (Acts){rows, k, group, terms, (int8_t *)buf, (float *)(buf + qb), (int16_t *)(buf + qb + db),
                    (int16_t *)(buf + qb + db + sb32)};
        for (int64_t r = 0; r < rows; r++) quantize_row(x + r * k, A, r);
    }
    return qb + db + sb32 + sb16 + 64;
}

/* A matmul prepared for layer.c, whose threads run its units between their other work */
typedef struct {
    Job j;
    Acts A;
} Prepared;

size_t swq_mm_size(void) { return sizeof(Prepared); }

size_t swq_mm_scratch(int fmt, int64_t k, int64_t rows, int terms) {
    return fmt < 0 || fmt >= FMT_COUNT ? 0 : acts_in(NULL, NULL, fmt, k, NULL, rows, terms);
}

/* m: x [rows][k] quantized into scratch (swq_mm_scratch bytes), outputs to y [rows][ldy] */
int swq_mm_prepare(Prepared *m, char *scratch, int fmt, const uint8_t *w, int64_t n, int64_t k,
                   const float *x, int64_t rows, float *y, int64_t ldy, int terms) {
    if (swq_packed_bytes(fmt, n, k) < 0 || terms < 1 || terms > 2 || ldy < n) return -1;
    acts_in(&m->A, scratch, fmt, k, x, rows, terms);
    m->j = (Job){fmt, w, n, k / BLOCK_ELEMS[fmt], (n + ROWS - 1) / ROWS, &m->A, y, ldy,
                 (n + UNIT_ROWS - 1) / UNIT_ROWS, 0};
    return 0;
}

int64_t swq_mm_units(const Prepared *m) { return m->j.units; }

void swq_mm_unit(Prepared *m, int64_t u) { run_unit(&m->j, u); }

/* y [rows, n] = x [rows, k] W^T for W [n, k] packed by swq_pack in format fmt, x taken as
 * `terms` int8 terms (1 or 2, see Acts), on `threads` threads. Returns 0, or -1 for an unknown
 * format, k not a multiple of its block or terms not 1 or 2; -2 when out of memory. */
int swq_matmul(int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows,
               float *y, int terms, int threads) {
    if (swq_packed_bytes(fmt, n, k) < 0 || terms < 1 || terms > 2) return -1;
    char *buf = scratch_for(acts_in(NULL, NULL, fmt, k, NULL, rows, terms));
    if (!buf) return -2;
    Prepared m;
    swq_mm_prepare(&m, buf, fmt, w, n, k, x, rows, y, n, terms);
    Job *j = &m.j;
    /* waking the pool (~60 us here) costs more than splitting a small matmul saves: one
     * Q4_K row against 1024x4096 took 88 us on 2 threads, 62 on one (4096x4096: 178 vs 230),
     * and the default model's decode (576-wide matrices) ran at 40 tok/s on 2 threads, 79 on 1 */
    if ((double)rows * (double)n * (double)k < MIN_SPLIT_MACS || threads < 2) {
        run_units(j);
    } else if (pthread_mutex_trylock(&call_mu) == 0) {
        run_job(j, threads);
        pthread_mutex_unlock(&call_mu);
    } else {
        run_units(j); /* the pool is another call's: this thread alone, not after it */
    }
    return 0;
}
