/* The lm_head of up to MAX_ROWS decode rows from int8 weights with one scale per block of 32
 * inputs (a GGUF Q8_0 head), built and loaded by kvsplice.layers.native_build, called by
 * kvsplice.layers.block_int8_head (which documents the layout and the numerics).
 *
 *   values [T][K/32][16 steps][16 lanes][2] int8   values[t][b][s][l][j] = q[16 t + l][32 b + 2 s + j]
 *   scales [T][K/32][16]                  fp16     scales[t][b][l]       = d[16 t + l][b]
 *   x      [R][K] fp32     y [R][16 T] fp32
 *
 * Each 16-output tile's blocks are 512 adjacent bytes, read once for all R rows, so the loop
 * streams the weights at the machine's read bandwidth. Each row's block of x is first scaled to
 * int16 (sx = max |x| / 32767, xq = round(x / sx)); then per block
 *
 *   acc[l] += (float) (sum_i q[l][i] xq[i]) * (d[l] * sx)      (the integer sum exact in int32:
 *                                                              32 |q xq| <= 32 * 127 * 32767 < 2^31)
 *
 * The three code paths (AVX-512 VNNI, AVX2, plain C) compute the same integers and the same fp32
 * operations in the same order, so they give the same bits; one row's logits do not depend on how
 * many rows are computed beside it, nor on the thread count. Work is split between `threads`
 * OpenMP threads by tiles.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_ROWS 8
#define TILE 16            /* outputs per tile */
#define BLOCK 32           /* inputs per scale */
#define STEPS (BLOCK / 2)  /* input pairs per block */
#define PREFETCH_BLOCKS 4  /* blocks read ahead: the hardware prefetcher alone left a third of the bandwidth */

typedef struct {
    const int8_t *values;
    const uint16_t *scales;
    const int32_t *pairs;  /* [R][K/2]: row r's xq[2 i] in the low half, xq[2 i + 1] in the high half */
    const float *row_scales;  /* [R][K/32]: sx */
    float *y;
    int64_t blocks, out_stride;
    int rows;
} Job;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static void tile_rows(const Job *job, int64_t t) {
    const int8_t *tile = job->values + t * job->blocks * TILE * BLOCK;
    const uint16_t *scales = job->scales + t * job->blocks * TILE;
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < job->rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < job->blocks; b++) {
        const int8_t *block = tile + b * TILE * BLOCK;
        for (int line = 0; line < TILE * BLOCK / 64; line++)
            _mm_prefetch((const char *)(block + PREFETCH_BLOCKS * TILE * BLOCK + 64 * line), _MM_HINT_T0);
        __m512i sums[MAX_ROWS];
        for (int r = 0; r < job->rows; r++) sums[r] = _mm512_setzero_si512();
        for (int s = 0; s < STEPS; s++) {
            __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(block + 2 * TILE * s)));
            for (int r = 0; r < job->rows; r++) {
                __m512i x = _mm512_set1_epi32(job->pairs[(int64_t)r * job->blocks * STEPS + b * STEPS + s]);
                sums[r] = _mm512_dpwssd_epi32(sums[r], w, x);
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + b * TILE)));
        for (int r = 0; r < job->rows; r++) {
            __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(job->row_scales[(int64_t)r * job->blocks + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), scale, acc[r]);
        }
    }
    for (int r = 0; r < job->rows; r++) _mm512_storeu_ps(job->y + r * job->out_stride + t * TILE, acc[r]);
}
#define PATH "avx512_vnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static void tile_rows(const Job *job, int64_t t) {
    /* two 8-lane halves per tile: lanes 0-7 are bytes 0-15 of a step, lanes 8-15 bytes 16-31 */
    const int8_t *tile = job->values + t * job->blocks * TILE * BLOCK;
    const uint16_t *scales = job->scales + t * job->blocks * TILE;
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < job->rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < job->blocks; b++) {
        const int8_t *block = tile + b * TILE * BLOCK;
        for (int line = 0; line < TILE * BLOCK / 64; line++)
            _mm_prefetch((const char *)(block + PREFETCH_BLOCKS * TILE * BLOCK + 64 * line), _MM_HINT_T0);
        __m256i sums[MAX_ROWS][2];
        for (int r = 0; r < job->rows; r++) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
        for (int s = 0; s < STEPS; s++) {
            const int8_t *step = block + 2 * TILE * s;
            __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)step));
            __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(step + 16)));
            for (int r = 0; r < job->rows; r++) {
                __m256i x = _mm256_set1_epi32(job->pairs[(int64_t)r * job->blocks * STEPS + b * STEPS + s]);
                sums[r][0] = _mm256_add_epi32(sums[r][0], _mm256_madd_epi16(lo, x));
                sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(hi, x));
            }
        }
        for (int half = 0; half < 2; half++) {
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + b * TILE + 8 * half)));
            for (int r = 0; r < job->rows; r++) {
                __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(job->row_scales[(int64_t)r * job->blocks + b]));
                acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][half]), scale, acc[r][half]);
            }
        }
    }
    for (int r = 0; r < job->rows; r++) {
        _mm256_storeu_ps(job->y + r * job->out_stride + t * TILE, acc[r][0]);
        _mm256_storeu_ps(job->y + r * job->out_stride + t * TILE + 8, acc[r][1]);
    }
}
#define PATH "avx2"
#else
static float half_to_float(uint16_t h) {
    /* IEEE binary16 to binary32, exact (subnormals included) */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {
        int shift = 0;
        while (!(mant & 0x400)) { mant <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mant & 0x3ff) << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static void tile_rows(const Job *job, int64_t t) {
    const int8_t *tile = job->values + t * job->blocks * TILE * BLOCK;
    const uint16_t *scales = job->scales + t * job->blocks * TILE;
    for (int r = 0; r < job->rows; r++) {
        float acc[TILE] = {0};
        for (int64_t b = 0; b < job->blocks; b++) {
            const int8_t *block = tile + b * TILE * BLOCK;
            const int32_t *pairs = job->pairs + (int64_t)r * job->blocks * STEPS + b * STEPS;
            int32_t sums[TILE] = {0};
            for (int s = 0; s < STEPS; s++) {
                int32_t x0 = (int16_t)(pairs[s] & 0xffff), x1 = (int16_t)((uint32_t)pairs[s] >> 16);
                for (int l = 0; l < TILE; l++)
                    sums[l] += block[2 * TILE * s + 2 * l] * x0 + block[2 * TILE * s + 2 * l + 1] * x1;
            }
            float sx = job->row_scales[(int64_t)r * job->blocks + b];
            for (int l = 0; l < TILE; l++)
                acc[l] = fmaf((float)sums[l], half_to_float(scales[b * TILE + l]) * sx, acc[l]);
        }
        memcpy(job->y + r * job->out_stride + t * TILE, acc, sizeof acc);
    }
}
#define PATH "portable"
#endif

/* Row r's blocks of x as int16 pairs and their scales; 0 when every value is finite, else -1. */
static int quantize_rows(const float *x, int64_t in_features, int rows, int32_t *pairs, float *row_scales) {
    int64_t blocks = in_features / BLOCK;
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + r * in_features + b * BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
            if (!isfinite(amax)) return -1;
            float sx = amax > 0.0f ? amax / 32767.0f : 1.0f;
            row_scales[r * blocks + b] = sx;
            for (int s = 0; s < STEPS; s++) {
                int32_t lo = (int32_t)lrintf(xb[2 * s] / sx), hi = (int32_t)lrintf(xb[2 * s + 1] / sx);
                pairs[(r * blocks + b) * STEPS + s] = (int32_t)(((uint32_t)hi << 16) | ((uint32_t)lo & 0xffffu));
            }
        }
    return 0;
}

const char *int8_tiles_path(void) { return PATH; }

int int8_tiles_max_rows(void) { return MAX_ROWS; }

/* y[r][0 .. 16 tiles) = the rows of x times the tiles. pairs [rows][K/2] int32 and row_scales
 * [rows][K/32] fp32 are the caller's scratch. Returns 0; -1 (y untouched) for a bad count or a
 * row holding a value that is not finite. Blocks the caller until every thread has finished. */
int int8_tiles_rows(const int8_t *values, const uint16_t *scales, int64_t tiles, int64_t in_features,
                    const float *x, int rows, float *y, int threads, int32_t *pairs, float *row_scales) {
    if (rows < 1 || rows > MAX_ROWS || in_features % BLOCK || tiles < 1) return -1;
    if (quantize_rows(x, in_features, rows, pairs, row_scales)) return -1;
    if (threads < 1) threads = 1;
    Job job = {values, scales, pairs, row_scales, y, in_features / BLOCK, tiles * TILE, rows};
    /* on torch's own OpenMP threads (the library loads the libgomp torch loaded): threads of our
       own would contend with torch's, which spin for a while after each of its parallel regions */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) tile_rows(&job, t);
    return 0;
}
