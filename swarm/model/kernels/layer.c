/* Decode steps through a run of decoder layers in one call: norm, q/k/v, rotary, the cache write,
 * attention, o, residual, norm, gate/up, activation, down, residual, for each layer, with every
 * thread of the call kept inside it from the first layer to the last.
 *
 * Why: between a layer's matmuls, Python and torch's small ops (about 35 a layer) took 60% of the
 * default model's one-row decode and 0.65 ms of each 8B-shaped layer at either thread count,
 * running on caches the layer's weights had just flushed; and each matmul woke the pool anew.
 * Here a layer's serial work (norms, rotary, the cache write, quantizing the next input) runs on
 * the calling thread over small buffers that stay in cache, and the parallel work (matmul units,
 * attention per row and kv head) is shared out unit by unit to whichever threads are there, so
 * a helper that the OS is slow to run delays nothing but the unit it took.
 *
 * The math is the one swarm/model/blocks.py does for a plain llama-like layer (RMSNorm, rotate-half
 * RoPE on the first rot_dim dims of each head, a bfloat16 cache rounded to nearest even, softmax
 * attention in float32 over the positions each row sees, a gated MLP), in float32 throughout.
 * Rows are steps of their own sessions, or consecutive positions of one session (a verification
 * round): each row's k and v go into its cache before any row attends, so a row reads the earlier
 * rows of its round as a sequence of plain steps would (blocks.py keeps rounds that would
 * overwrite a ring's slot a row still reads on its own path). */

#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

/* from quantmm.c and attention.c, linked into the same library */
typedef struct Prepared Prepared;
size_t swq_mm_size(void);
size_t swq_mm_scratch(int fmt, int64_t k, int64_t rows, int terms);
int swq_mm_prepare(Prepared *m, char *scratch, int fmt, const uint8_t *w, int64_t n, int64_t k,
                   const float *x, int64_t rows, float *y, int64_t ldy, int terms);
int64_t swq_mm_units(const Prepared *m);
void swq_mm_unit(Prepared *m, int64_t u);
void swq_team(void (*caller)(void *), void (*helper)(void *, int), void *arg, int threads);
int swq_attn_scores(const float *q, const uint16_t *k, int64_t head_stride, int kv_heads,
                    int group, int d, int64_t seen, float scale, float *scores);
int swq_attn_mix(const float *p, const uint16_t *v, int64_t head_stride, int kv_heads, int group,
                 int d, int64_t seen, float *out);

/* one matrix as swq_pack holds it; bias NULL or [n] */
typedef struct {
    int32_t fmt, terms;
    const uint8_t *w;
    int64_t n;
    const float *bias;
} SwqMat;

enum { MAX_QKV = 3, MAX_GATE_UP = 2 };

/* one layer; ctypes mirrors this (swarm/model/fast_layers.py) */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, rot_dim, ff;
    float eps, scale;
    int32_t act; /* 0 silu, 1 tanh-approximated gelu */
    int32_t nqkv, ngu, pad;
    const float *attn_norm, *mlp_norm; /* [hidden] */
    SwqMat qkv[MAX_QKV];               /* q, k, v side by side, in 1 to 3 matrices */
    SwqMat o;
    SwqMat gu[MAX_GATE_UP];            /* gate then up, in 1 or 2 matrices */
    SwqMat down;
} SwqLayer;

/* row r's cache for layer l: keys and values [kv_heads][capacity][head_dim] bfloat16 */
typedef struct {
    uint16_t *k, *v;
    int64_t capacity;
} SwqCache;

/* ------------------------------------------------------------------ vector math (AVX2 + FMA) */

/* e^x, Cephes' polynomial on x - n ln 2: within 2 ulp where it does not underflow */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static float exp1(float x) {
    float in[8] = {x}, out[8];
    _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
    return out[0];
}

/* out = act(gate) * up over n values */
static void activate(int act, const float *gate, const float *up, float *out, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
        __m256 a;
        if (act == 0) { /* g sigmoid(g) */
            a = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        } else { /* g/2 (1 + tanh(y)), tanh(y) = 1 - 2 / (e^2y + 1) */
            const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
            const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                           _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
            const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                              _mm256_add_ps(exp8(_mm256_add_ps(y, y)), one)));
            a = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, t));
        }
        _mm256_storeu_ps(out + i, _mm256_mul_ps(a, u));
    }
    for (; i < n; i++) {
        const float g = gate[i];
        float a;
        if (act == 0) {
            a = g / (1.0f + exp1(-g));
        } else {
            const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
            a = 0.5f * g * (1.0f + (1.0f - 2.0f / (exp1(2.0f * y) + 1.0f)));
        }
        out[i] = a * up[i];
    }
}

static void rms_norm(const float *x, const float *w, float eps, int64_t n, float *out) {
    double sum = 0.0; /* a double sum: the order of float32 partial sums stops mattering */
    for (int64_t i = 0; i < n; i++) sum += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(sum / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

/* softmax over n scores in place */
static void softmax(float *s, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) sum += lanes[j];
    for (; i < n; i++) sum += (s[i] = exp1(s[i] - m));
    const float inv = 1.0f / sum;
    for (i = 0; i < n; i++) s[i] *= inv;
}

/* float32 -> bfloat16 rounded to nearest even, NaN kept a NaN: torch's own rounding */
static inline uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ------------------------------------------------------------------ the team */

enum { MAX_STAGES = 8, STOP = 1 << 30 };

typedef struct Run Run;
typedef void (*UnitFn)(Run *, int64_t unit, int thread);

typedef struct {
    UnitFn fn;
    int64_t units;
    atomic_long next, done;
} Stage;

struct Run {
    const SwqLayer *layers;
    int nl, threads;
    float *x;
    int64_t rows;
    const int64_t *pos;
    const float *cos, *sin;
    const SwqCache *caches;
    int rc;
    /* the layer in flight and its buffers */
    const SwqLayer *L;
    int layer;
    float *xn, *qkv, *attn, *tmp, *gu, *act, *scores;
    int64_t qkv_width, max_seen;
    Prepared *mm[MAX_QKV];
    int nmm;
    char *acts[MAX_QKV];
    /* the stages: a helper takes units of the stage `current` names until it has none */
    Stage stages[MAX_STAGES];
    atomic_int current, joined;
    int nstages;
};

static void take_units(Run *run, Stage *s, int thread) {
    for (;;) {
        const int64_t u = atomic_fetch_add(&s->next, 1);
        if (u >= s->units) return;
        s->fn(run, u, thread);
        atomic_fetch_add_explicit(&s->done, 1, memory_order_release);
    }
}

/* the caller: `units` of fn over the team, back when every unit is done */
static void stage(Run *run, UnitFn fn, int64_t units) {
    if (run->threads < 2) {
        for (int64_t u = 0; u < units; u++) fn(run, u, 0);
        return;
    }
    const int i = run->nstages++ % MAX_STAGES; /* a helper still reading stage i - 8: none */
    Stage *s = &run->stages[i];
    s->fn = fn, s->units = units;
    /* done before next: a helper that read an older stage number and takes a unit of this one
     * counts it here */
    atomic_store(&s->done, 0);
    atomic_store(&s->next, 0);
    atomic_store_explicit(&run->current, run->nstages, memory_order_release);
    take_units(run, s, 0);
    while (atomic_load_explicit(&s->done, memory_order_acquire) < units) _mm_pause();
}

static void helper(void *arg, int index) {
    (void)index;
    Run *run = arg;
    const int thread = 1 + atomic_fetch_add(&run->joined, 1);
    int seen = 0;
    long idle = 0;
    for (;;) {
        const int now = atomic_load_explicit(&run->current, memory_order_acquire);
        if (now == STOP) return;
        if (now != seen) {
            seen = now, idle = 0;
            take_units(run, &run->stages[(now - 1) % MAX_STAGES], thread);
        } else if (++idle < 20000) {
            _mm_pause();
        } else {
            sched_yield(); /* the caller's serial part is long, or the core is wanted */
        }
    }
}

/* ------------------------------------------------------------------ a layer's units */

static void matmul_unit(Run *run, int64_t u, int thread) {
    (void)thread;
    for (int i = 0; i < run->nmm; i++) {
        const int64_t n = swq_mm_units(run->mm[i]);
        if (u < n) {
            swq_mm_unit(run->mm[i], u);
            return;
        }
        u -= n;
    }
}

static int64_t seen_of(const Run *run, int64_t row) {
    const int64_t cap = run->caches[(int64_t)run->layer * run->rows + row].capacity;
    return run->pos[row] + 1 < cap ? run->pos[row] + 1 : cap;
}

/* row u / kv_heads, kv head u % kv_heads: its query heads over the positions the row sees */
static void attention_unit(Run *run, int64_t u, int thread) {
    const SwqLayer *L = run->L;
    const int64_t row = u / L->kv_heads, kh = u % L->kv_heads, d = L->head_dim;
    const int group = (int)(L->heads / L->kv_heads);
    const SwqCache *c = &run->caches[(int64_t)run->layer * run->rows + row];
    const int64_t seen = seen_of(run, row), stride = c->capacity * d;
    float *scores = run->scores + (int64_t)thread * group * run->max_seen;
    const float *q = run->qkv + row * run->qkv_width + kh * group * d;
    swq_attn_scores(q, c->k + kh * stride, stride, 1, group, (int)d, seen, L->scale, scores);
    for (int g = 0; g < group; g++) softmax(scores + g * seen, seen);
    swq_attn_mix(scores, c->v + kh * stride, stride, 1, group, (int)d, seen,
                 run->attn + row * L->heads * d + kh * group * d);
}

/* mats' outputs side by side in y [rows][width], from x [rows][k], on the team, biases added */
static int matmuls(Run *run, const SwqMat *mats, int count, const float *x, int64_t k, float *y,
                   int64_t width) {
    int64_t col = 0, units = 0;
    run->nmm = count;
    for (int i = 0; i < count; i++) {
        const SwqMat *m = &mats[i];
        if (swq_mm_prepare(run->mm[i], run->acts[i], m->fmt, m->w, m->n, k, x, run->rows, y + col,
                           width, m->terms))
            return -1;
        col += m->n, units += swq_mm_units(run->mm[i]);
    }
    if (col != width) return -1;
    stage(run, matmul_unit, units);
    col = 0;
    for (int i = 0; i < count; i++) {
        if (mats[i].bias)
            for (int64_t r = 0; r < run->rows; r++)
                for (int64_t j = 0; j < mats[i].n; j++) y[r * width + col + j] += mats[i].bias[j];
        col += mats[i].n;
    }
    return 0;
}

/* q and k of each row turned to its position, k and v into the row's cache slot */
static void rotate_and_store(Run *run) {
    const SwqLayer *L = run->L;
    const int64_t d = L->head_dim, half = L->rot_dim / 2, qk = L->heads + L->kv_heads;
    for (int64_t r = 0; r < run->rows; r++) {
        float *row = run->qkv + r * run->qkv_width;
        const float *cs = run->cos + r * L->rot_dim, *sn = run->sin + r * L->rot_dim;
        for (int64_t h = 0; h < qk; h++) {
            float *v = row + h * d;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * cs[i] - b * sn[i];
                v[i + half] = b * cs[i + half] + a * sn[i + half];
            }
        }
        const SwqCache *c = &run->caches[(int64_t)run->layer * run->rows + r];
        const int64_t slot = run->pos[r] % c->capacity;
        const float *k = row + L->heads * d, *vv = k + L->kv_heads * d;
        for (int64_t h = 0; h < L->kv_heads; h++) {
            uint16_t *kd = c->k + (h * c->capacity + slot) * d, *vd = c->v + (h * c->capacity + slot) * d;
            for (int64_t i = 0; i < d; i++) kd[i] = bf16(k[h * d + i]), vd[i] = bf16(vv[h * d + i]);
        }
    }
}

static int one_layer(Run *run) {
    const SwqLayer *L = run->L;
    const int64_t rows = run->rows, hidden = L->hidden, q = L->heads * L->head_dim;
    float *x = run->x;
    for (int64_t r = 0; r < rows; r++) rms_norm(x + r * hidden, L->attn_norm, L->eps, hidden, run->xn + r * hidden);
    if (matmuls(run, L->qkv, L->nqkv, run->xn, hidden, run->qkv, run->qkv_width)) return -1;
    rotate_and_store(run);
    stage(run, attention_unit, rows * L->kv_heads);
    if (matmuls(run, &L->o, 1, run->attn, q, run->tmp, hidden)) return -1;
    for (int64_t i = 0; i < rows * hidden; i++) x[i] += run->tmp[i];
    for (int64_t r = 0; r < rows; r++) rms_norm(x + r * hidden, L->mlp_norm, L->eps, hidden, run->xn + r * hidden);
    if (matmuls(run, L->gu, L->ngu, run->xn, hidden, run->gu, 2 * L->ff)) return -1;
    for (int64_t r = 0; r < rows; r++)
        activate(L->act, run->gu + r * 2 * L->ff, run->gu + r * 2 * L->ff + L->ff, run->act + r * L->ff, L->ff);
    if (matmuls(run, &L->down, 1, run->act, L->ff, run->tmp, hidden)) return -1;
    for (int64_t i = 0; i < rows * hidden; i++) x[i] += run->tmp[i];
    return 0;
}

static void drive(void *arg) {
    Run *run = arg;
    for (int l = 0; l < run->nl && run->rc == 0; l++) {
        run->layer = l, run->L = &run->layers[l];
        run->rc = one_layer(run);
    }
    atomic_store_explicit(&run->current, STOP, memory_order_release);
}

/* ------------------------------------------------------------------ entry point */

static __thread char *scratch;
static __thread size_t scratch_bytes;

static size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

static int check(const SwqLayer *L) {
    int64_t qkv = 0, gu = 0;
    if (L->nqkv < 1 || L->nqkv > MAX_QKV || L->ngu < 1 || L->ngu > MAX_GATE_UP) return -1;
    for (int i = 0; i < L->nqkv; i++) qkv += L->qkv[i].n;
    for (int i = 0; i < L->ngu; i++) gu += L->gu[i].n;
    if (L->heads < 1 || L->kv_heads < 1 || L->heads % L->kv_heads || L->rot_dim % 2 ||
        L->rot_dim > L->head_dim || qkv != (L->heads + 2 * L->kv_heads) * L->head_dim ||
        gu != 2 * L->ff || L->o.n != L->hidden || L->down.n != L->hidden || L->act < 0 || L->act > 1)
        return -1;
    return 0;
}

/* x [rows][hidden] through layers[0..nl), row r at position pos[r] (cos, sin [rows][rot_dim] of
 * it), in caches[l * rows + r], on `threads` threads. 0, or -1 for arguments that do not fit,
 * -2 out of memory. Every layer has the first one's widths. */
int swq_layers(const SwqLayer *layers, int nl, float *x, int64_t rows, const int64_t *pos,
               const float *cos, const float *sin, const SwqCache *caches, int threads) {
    if (nl < 1 || rows < 1) return -1;
    const SwqLayer *L0 = &layers[0];
    int64_t max_seen = 1, k_max = L0->hidden > L0->ff ? L0->hidden : L0->ff;
    k_max = k_max > L0->heads * L0->head_dim ? k_max : L0->heads * L0->head_dim; /* o's input */
    for (int l = 0; l < nl; l++) {
        if (check(&layers[l]) || layers[l].hidden != L0->hidden || layers[l].ff != L0->ff ||
            layers[l].heads != L0->heads || layers[l].kv_heads != L0->kv_heads ||
            layers[l].head_dim != L0->head_dim || layers[l].rot_dim != L0->rot_dim)
            return -1;
        for (int64_t r = 0; r < rows; r++) {
            const SwqCache *c = &caches[(int64_t)l * rows + r];
            if (c->capacity < 1 || pos[r] < 0 || !c->k || !c->v) return -1;
            const int64_t seen = pos[r] + 1 < c->capacity ? pos[r] + 1 : c->capacity;
            max_seen = seen > max_seen ? seen : max_seen;
        }
    }
    if (threads < 1) threads = 1;
    const int64_t hidden = L0->hidden, q = L0->heads * L0->head_dim;
    const int64_t width = q + 2 * L0->kv_heads * L0->head_dim, group = L0->heads / L0->kv_heads;
    size_t acts = 0;
    for (int fmt = 0; fmt < 8; fmt++) {
        const size_t a = swq_mm_scratch(fmt, k_max, rows, 2);
        acts = a > acts ? a : acts;
    }
    const size_t sizes[] = {up64(rows * hidden * 4), up64(rows * width * 4), up64(rows * q * 4),
                            up64(rows * hidden * 4), up64(rows * 2 * L0->ff * 4), up64(rows * L0->ff * 4),
                            up64((size_t)threads * group * max_seen * 4), up64(swq_mm_size()) * MAX_QKV,
                            up64(acts) * MAX_QKV};
    size_t total = 64;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += sizes[i];
    if (total > scratch_bytes) {
        free(scratch);
        scratch = aligned_alloc(64, up64(total));
        scratch_bytes = scratch ? up64(total) : 0;
        if (!scratch) return -2;
    }
    Run *run = calloc(1, sizeof *run); /* calloc: its atomics start at zero */
    if (!run) return -2;
    char *p = scratch;
    float **bufs[] = {&run->xn, &run->qkv, &run->attn, &run->tmp, &run->gu, &run->act, &run->scores};
    for (int i = 0; i < 7; i++) *bufs[i] = (float *)p, p += sizes[i];
    for (int i = 0; i < MAX_QKV; i++) run->mm[i] = (Prepared *)p, p += up64(swq_mm_size());
    for (int i = 0; i < MAX_QKV; i++) run->acts[i] = p, p += up64(acts);
    run->layers = layers, run->nl = nl, run->x = x, run->rows = rows, run->pos = pos;
    run->cos = cos, run->sin = sin, run->caches = caches, run->qkv_width = width;
    run->max_seen = max_seen;
    /* small layers on one thread, as swq_matmul keeps matmuls under 1e7 multiply-adds: a
     * stage's hand-over costs a helper's wake-up wherever the OS has not run it lately */
    const double macs = (double)rows * (double)hidden * (double)(width + hidden + 3 * L0->ff);
    run->threads = macs < 1e7 ? 1 : threads;
    if (run->threads > 1) swq_team(drive, helper, run, run->threads);
    else drive(run);
    const int rc = run->rc;
    free(run);
    return rc;
}
