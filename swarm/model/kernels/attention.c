/* A decode step's attention for one session: each of kv_heads * group query heads against the
 * `seen` cached rows of its kv head (head h reads kv head h / group), the cache in bfloat16 as
 * the node keeps it, the arithmetic in float32. k and v point at kv head 0's first row; a kv
 * head's rows are d apart and the heads head_stride apart (the cache's capacity * d). Torch's
 * own path widened the whole cache to float32 and ran a kernel meant for many query rows: 0.5 ms
 * a layer of 8B shape at 500 positions, 7 ms at 2,000. The softmax between the two runs in torch.
 *
 * A file of its own, linked into quantmm.c's library after it, so that the matmuls' object code
 * is the one measured before. (A 10% move of the Q4_0 matmul's speed first blamed on sharing a
 * translation unit was the memory each packed matrix got: see kernels.huge_page_tensor.) */

#include <stdint.h>
#include <immintrin.h>

#if defined(__AVX512F__)
typedef __m512 vf;
static inline vf vfzero(void) { return _mm512_setzero_ps(); }
static inline vf vfset(float x) { return _mm512_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vfld(const float *p) { return _mm512_loadu_ps(p); }
static inline void vfst(float *p, vf a) { _mm512_storeu_ps(p, a); }
/* bfloat16 is float32's upper half: widening is exact */
static inline vf vbf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline float vfsum(vf a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
static inline vf vfzero(void) { return _mm256_setzero_ps(); }
static inline vf vfset(float x) { return _mm256_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfld(const float *p) { return _mm256_loadu_ps(p); }
static inline void vfst(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vbf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float vfsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#error "build.py compiles this file with -mavx2 -mfma at least"
#endif

#define VL ((int)(sizeof(vf) / sizeof(float)))
#define ATT_G 4 /* query heads sharing each widened key or value row */

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}

/* scores [kv_heads * group][seen] = scale * q [kv_heads * group][d] . keys */
int swq_attn_scores(const float *q, const uint16_t *k, int64_t head_stride, int kv_heads,
                    int group, int d, int64_t seen, float scale, float *scores) {
    if (kv_heads < 1 || group < 1 || d < 1 || seen < 0) return -1;
    const int dv = d / VL * VL;
    for (int kh = 0; kh < kv_heads; kh++) {
        const uint16_t *kb = k + kh * head_stride;
        for (int g0 = 0; g0 < group; g0 += ATT_G) {
            const int G = group - g0 < ATT_G ? group - g0 : ATT_G;
            const float *qh = q + (int64_t)(kh * group + g0) * d;
            float *out = scores + (int64_t)(kh * group + g0) * seen;
            for (int64_t j = 0; j < seen; j++) {
                const uint16_t *row = kb + j * d;
                vf acc[ATT_G];
                for (int g = 0; g < ATT_G; g++) acc[g] = vfzero();
                for (int i = 0; i < dv; i += VL) {
                    const vf kv = vbf16(row + i);
                    for (int g = 0; g < G; g++) acc[g] = vfma(vfld(qh + g * d + i), kv, acc[g]);
                }
                for (int g = 0; g < G; g++) {
                    float sum = vfsum(acc[g]);
                    for (int i = dv; i < d; i++) sum += qh[g * d + i] * bf16_to_f32(row[i]);
                    out[g * seen + j] = sum * scale;
                }
            }
        }
    }
    return 0;
}

/* out [kv_heads * group][d] = p [kv_heads * group][seen] . values */
int swq_attn_mix(const float *p, const uint16_t *v, int64_t head_stride, int kv_heads, int group,
                 int d, int64_t seen, float *out) {
    enum { CH = 4 }; /* vectors of d at a time: 4 x ATT_G accumulators */
    if (kv_heads < 1 || group < 1 || d < 1 || seen < 0) return -1;
    const int dv = d / VL * VL;
    for (int kh = 0; kh < kv_heads; kh++) {
        const uint16_t *vb = v + kh * head_stride;
        for (int g0 = 0; g0 < group; g0 += ATT_G) {
            const int G = group - g0 < ATT_G ? group - g0 : ATT_G;
            const float *ph = p + (int64_t)(kh * group + g0) * seen;
            float *oh = out + (int64_t)(kh * group + g0) * d;
            for (int i0 = 0; i0 < dv; i0 += CH * VL) {
                const int C = (dv - i0) / VL < CH ? (dv - i0) / VL : CH;
                vf acc[ATT_G][CH];
                for (int g = 0; g < ATT_G; g++)
                    for (int c = 0; c < CH; c++) acc[g][c] = vfzero();
                for (int64_t j = 0; j < seen; j++) {
                    const uint16_t *row = vb + j * d + i0;
                    vf val[CH];
                    for (int c = 0; c < C; c++) val[c] = vbf16(row + c * VL);
                    for (int g = 0; g < G; g++) {
                        const vf pj = vfset(ph[g * seen + j]);
                        for (int c = 0; c < C; c++) acc[g][c] = vfma(pj, val[c], acc[g][c]);
                    }
                }
                for (int g = 0; g < G; g++)
                    for (int c = 0; c < C; c++) vfst(oh + g * d + i0 + c * VL, acc[g][c]);
            }
            for (int g = 0; g < G; g++)
                for (int i = dv; i < d; i++) {
                    float sum = 0.0f;
                    for (int64_t j = 0; j < seen; j++) sum += ph[g * seen + j] * bf16_to_f32(vb[j * d + i]);
                    oh[g * d + i] = sum;
                }
        }
    }
    return 0;
}
