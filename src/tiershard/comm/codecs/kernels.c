/* Block codec kernels: symmetric absmax int8 / packed int4 with fp32 scales (format: format.py beside this file;
   built, loaded and called from Python by native.py).
   Results equal the torch reference bit for bit: fp32 division, round half to even, clamp, fp32 multiply, and
   round-to-nearest-even conversions to bf16 / fp16. One AVX-512 path, and plain loops the compiler vectorizes
   for every other target. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TS_AVX512 1
#include <immintrin.h>
#else
#define TS_AVX512 0
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#endif

#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2
#define TS_INLINE static inline __attribute__((always_inline))  /* bodies specialized by constant arguments */
#define TILE 4096  /* values staged at a time: even, so int4 bytes never straddle two tiles */

#if defined(__FLT16_MAX__)
#define TS_HAVE_F16 1
typedef _Float16 ts_half;
#else
#define TS_HAVE_F16 0
#endif

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u = f32_bits(f);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#if TS_HAVE_F16
static inline float f16_to_f32(uint16_t b) { ts_half h; memcpy(&h, &b, 2); return (float)h; }
static inline uint16_t f32_to_f16(float f) { ts_half h = (ts_half)f; uint16_t b; memcpy(&b, &h, 2); return b; }
#endif
static inline float load_scale(const uint8_t* sc, int64_t j) { float f; memcpy(&f, sc + 4 * j, 4); return f; }
static inline uint8_t quant1(float x, float scale, int32_t qmax, int32_t off) {
    int32_t v = (int32_t)rintf(x / scale);
    v = v > qmax ? qmax : v; v = v < -qmax ? -qmax : v;
    return (uint8_t)(v + off);
}
static inline float dq1(uint8_t q, int32_t off, float s) { return (float)(off ? (int32_t)q - off : (int32_t)(int8_t)q) * s; }

/* Largest |x| as bits: the bit patterns of |x| order like the values, with inf and nan above every finite one, so
   one integer max gives both the scale and whether the block is non-finite. */
static uint32_t absbits32(const uint32_t* restrict u, int64_t m);
static uint16_t absbits16(const uint16_t* restrict u, int64_t m);
/* q[i] = clamp(round_half_even(x[i] / scale), -qmax, qmax) + off as bytes (off 0: int8, 8: int4 offset nibbles). */
static void quant_n(const void* restrict x, int dt, int64_t m, float scale, int32_t qmax, int32_t off, uint8_t* restrict q);
/* Two offset nibbles (1..15) per byte, value 2i in the low nibble, and back. */
static void pack4(const uint8_t* restrict q, int64_t pairs, uint8_t* restrict dst);
static void unpack4(const uint8_t* restrict p, int64_t nbytes, uint8_t* restrict q);
/* o[i] = (q[i] - off) * s, stored as dt (add: added to fp32 o). */
static void dq_n(const uint8_t* restrict q, int32_t off, int64_t m, float s, void* restrict o, int dt, int add);

#if TS_AVX512
static inline __mmask16 tail16(int64_t r) { return (__mmask16)((1u << r) - 1u); }
static uint32_t absbits32(const uint32_t* restrict u, int64_t m) {
    const __m512i lo31 = _mm512_set1_epi32(0x7fffffff);
    __m512i a = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= m; i += 16) a = _mm512_max_epu32(a, _mm512_and_si512(_mm512_loadu_si512(u + i), lo31));
    if (i < m) a = _mm512_max_epu32(a, _mm512_and_si512(_mm512_maskz_loadu_epi32(tail16(m - i), u + i), lo31));
    return _mm512_reduce_max_epu32(a);
}
static uint16_t absbits16(const uint16_t* restrict u, int64_t m) {
    const __m512i lo15 = _mm512_set1_epi32(0x7fff);
    __m512i a = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= m; i += 16)
        a = _mm512_max_epu32(a, _mm512_and_si512(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(u + i))), lo15));
    if (i < m) a = _mm512_max_epu32(a, _mm512_and_si512(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail16(m - i), u + i)), lo15));
    return (uint16_t)_mm512_reduce_max_epu32(a);
}
static inline __m512 load16(const void* x, int dt, int64_t i, __mmask16 k) {
    if (dt == DT_F32) return _mm512_maskz_loadu_ps(k, (const float*)x + i);
    __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t*)x + i);
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
static inline void quant16(const void* x, int dt, int64_t i, __mmask16 k, __m512 vs, __m512i lo, __m512i hi, __m512i off, uint8_t* q) {
    __m512i v = _mm512_cvt_roundps_epi32(_mm512_div_ps(load16(x, dt, i, k), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi), off);
    _mm_mask_storeu_epi8(q + i, k, _mm512_cvtepi32_epi8(v));
}
static void quant_n(const void* restrict x, int dt, int64_t m, float scale, int32_t qmax, int32_t off, uint8_t* restrict q) {
    const __m512 vs = _mm512_set1_ps(scale);
    const __m512i lo = _mm512_set1_epi32(-qmax), hi = _mm512_set1_epi32(qmax), vo = _mm512_set1_epi32(off);
    int64_t i = 0;
    for (; i + 16 <= m; i += 16) quant16(x, dt, i, 0xFFFF, vs, lo, hi, vo, q);
    if (i < m) quant16(x, dt, i, tail16(m - i), vs, lo, hi, vo, q);
}
static void pack4(const uint8_t* restrict q, int64_t pairs, uint8_t* restrict dst) {
    int64_t p = 0;
    for (; p + 32 <= pairs; p += 32) {
        __m512i u = _mm512_loadu_si512(q + 2 * p);
        _mm256_storeu_si256((__m256i*)(dst + p), _mm512_cvtepi16_epi8(_mm512_or_si512(u, _mm512_srli_epi16(u, 4))));
    }
    if (p < pairs) {  /* masked tail: the short blocks of row layouts end here */
        const int64_t r = pairs - p;
        __m512i u = _mm512_maskz_loadu_epi8((__mmask64)((1ull << (2 * r)) - 1u), q + 2 * p);
        _mm256_mask_storeu_epi8(dst + p, (__mmask32)((1ull << r) - 1u), _mm512_cvtepi16_epi8(_mm512_or_si512(u, _mm512_srli_epi16(u, 4))));
    }
}
static void unpack4(const uint8_t* restrict p, int64_t nbytes, uint8_t* restrict q) {
    const __m512i m0f = _mm512_set1_epi16(0x0f), mf0 = _mm512_set1_epi16(0xf0);
    int64_t t = 0;
    for (; t + 32 <= nbytes; t += 32) {
        __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(p + t)));
        _mm512_storeu_si512(q + 2 * t, _mm512_or_si512(_mm512_and_si512(u, m0f), _mm512_slli_epi16(_mm512_and_si512(u, mf0), 4)));
    }
    if (t < nbytes) {  /* masked tail */
        const int64_t r = nbytes - t;
        __m512i u = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8((__mmask32)((1ull << r) - 1u), p + t));
        _mm512_mask_storeu_epi8(q + 2 * t, (__mmask64)((1ull << (2 * r)) - 1u),
                                _mm512_or_si512(_mm512_and_si512(u, m0f), _mm512_slli_epi16(_mm512_and_si512(u, mf0), 4)));
    }
}
static inline void dq16(const uint8_t* q, int32_t off, int64_t i, __mmask16 k, __m512 vs, void* o, int dt, int add) {
    __m128i b = _mm_maskz_loadu_epi8(k, q + i);
    __m512i v = off ? _mm512_sub_epi32(_mm512_cvtepu8_epi32(b), _mm512_set1_epi32(off)) : _mm512_cvtepi8_epi32(b);
    __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), vs);
    if (add) { float* of = (float*)o + i; _mm512_mask_storeu_ps(of, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, of), f)); }
    else if (dt == DT_F32) _mm512_mask_storeu_ps((float*)o + i, k, f);
    else if (dt == DT_BF16) {
        __m512i u = _mm512_castps_si512(f);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
        r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
        _mm256_mask_storeu_epi16((uint16_t*)o + i, k, _mm512_cvtepi32_epi16(r));
    } else _mm256_mask_storeu_epi16((uint16_t*)o + i, k, _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static void dq_n(const uint8_t* restrict q, int32_t off, int64_t m, float s, void* restrict o, int dt, int add) {
    const __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= m; i += 16) dq16(q, off, i, 0xFFFF, vs, o, dt, add);
    if (i < m) dq16(q, off, i, tail16(m - i), vs, o, dt, add);
}

/* Whole blocks whose size is a multiple of 16 (int8) or 32 (int4): no tails, no staging, int4 packed in registers. */
#define TS_FAST_BLOCKS 1
TS_INLINE __m512i absbits16v(const void* x, int dt, int64_t i) {
    if (dt == DT_F32) return _mm512_and_si512(_mm512_loadu_si512((const float*)x + i), _mm512_set1_epi32(0x7fffffff));
    return _mm512_and_si512(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i))), _mm512_set1_epi32(0x7fff));
}
/* round_half_even(x / scale) as int32, clamped to +-qmax only when the scale is subnormal: with a normal scale
   |x| <= absmax gives |x / scale| <= qmax * (1 + 2**-23), which rounds to at most qmax anyway. */
TS_INLINE __m512i qv(__m512 x, __m512 vs, int clamp, __m512i lo, __m512i hi) {
    __m512i v = _mm512_cvt_roundps_epi32(_mm512_div_ps(x, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return clamp ? _mm512_min_epi32(_mm512_max_epi32(v, lo), hi) : v;
}
/* One whole block of B values, B a multiple of 32; dt, bits and clamp are constants at every call site, so each
   combination compiles to its own straight loop. bf16 reads 32 values per load: the low halves of the 32-bit lanes
   are the even values and the high halves the odd ones, which for int4 are exactly the two nibbles of a byte. */
TS_INLINE void quant_block(const char* x, const int dt, const int64_t B, const int bits, const int clamp,
                           float scale, uint8_t* pay) {
    const int32_t qmax = bits == 8 ? 127 : 7;
    const __m512 vs = _mm512_set1_ps(scale);
    const __m512i lo = _mm512_set1_epi32(-qmax), hi = _mm512_set1_epi32(qmax);
    if (dt == DT_BF16) {
        const __m512i himask = _mm512_set1_epi32((int)0xffff0000u);
        for (int64_t i = 0; i < B; i += 32) {
            __m512i v = _mm512_loadu_si512((const uint16_t*)x + i);
            __m512i qe = qv(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), vs, clamp, lo, hi);
            __m512i qo = qv(_mm512_castsi512_ps(_mm512_and_si512(v, himask)), vs, clamp, lo, hi);
            if (bits == 8) {
                __m512i w = _mm512_or_si512(_mm512_and_si512(qe, _mm512_set1_epi32(0xff)), _mm512_slli_epi32(qo, 8));
                _mm256_storeu_si256((__m256i*)(pay + i), _mm512_cvtepi32_epi16(w));
            } else {
                __m512i w = _mm512_add_epi32(_mm512_add_epi32(qe, _mm512_slli_epi32(qo, 4)), _mm512_set1_epi32(0x88));
                _mm_storeu_si128((__m128i*)(pay + i / 2), _mm512_cvtepi32_epi8(w));
            }
        }
        return;
    }
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t i = 0; i < B; i += 32) {
        __m512i q0 = qv(load16(x, dt, i, 0xFFFF), vs, clamp, lo, hi);
        __m512i q1 = qv(load16(x, dt, i + 16, 0xFFFF), vs, clamp, lo, hi);
        if (bits == 8) {
            _mm_storeu_si128((__m128i*)(pay + i), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i*)(pay + i + 16), _mm512_cvtepi32_epi8(q1));
        } else {
            __m512i qe = _mm512_permutex2var_epi32(q0, even, q1), qo = _mm512_permutex2var_epi32(q0, odd, q1);
            __m512i w = _mm512_add_epi32(_mm512_add_epi32(qe, _mm512_slli_epi32(qo, 4)), _mm512_set1_epi32(0x88));
            _mm_storeu_si128((__m128i*)(pay + i / 2), _mm512_cvtepi32_epi8(w));
        }
    }
}
TS_INLINE void encode_block_fast_t(const char* x, const int dt, const int64_t B, const int bits, uint8_t* pay,
                                   float* scale_out) {
    uint32_t ab;
    if (dt == DT_BF16) {  /* 32 values per load, max of |bits| in 16-bit lanes */
        __m512i a = _mm512_setzero_si512();
        for (int64_t i = 0; i < B; i += 32)
            a = _mm512_max_epu16(a, _mm512_and_si512(_mm512_loadu_si512((const uint16_t*)x + i), _mm512_set1_epi16(0x7fff)));
        ab = _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_and_si512(a, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(a, 16)));
    } else {
        __m512i a = _mm512_setzero_si512();
        for (int64_t i = 0; i < B; i += 16) a = _mm512_max_epu32(a, absbits16v(x, dt, i));
        ab = _mm512_reduce_max_epu32(a);
    }
    const int32_t qmax = bits == 8 ? 127 : 7;
    float amax; int bad;
    if (dt == DT_F32) { bad = ab >= 0x7f800000u; memcpy(&amax, &ab, 4); }
    else if (dt == DT_BF16) { bad = ab >= 0x7f80u; amax = bf16_to_f32((uint16_t)ab); }
    else { bad = ab >= 0x7c00u; amax = f16_to_f32((uint16_t)ab); }
    const float scale = bad ? NAN : amax / (float)qmax;
    *scale_out = scale;
    if (!(scale > 0.f)) memset(pay, bits == 8 ? 0 : 0x88, (size_t)(bits == 8 ? B : B / 2));
    else if (scale >= 0x1p-126f) quant_block(x, dt, B, bits, 0, scale, pay);
    else quant_block(x, dt, B, bits, 1, scale, pay);
}
/* Blocks [j0, j1) of whole blocks of B values (B a multiple of 32), one specialised loop per dtype and width. */
static void encode_blocks_fast(const char* x, int dt, int64_t B, int bits, int64_t j0, int64_t j1, uint8_t* pay, uint8_t* sc) {
    const int64_t es = dt == DT_F32 ? 4 : 2;
#define TS_ENC_LOOP(DT, BITS) \
    for (int64_t j = j0; j < j1; j++) { float s_; \
        encode_block_fast_t(x + j * B * es, DT, B, BITS, pay + (BITS == 8 ? j * B : j * B / 2), &s_); memcpy(sc + 4 * j, &s_, 4); }
    if (bits == 8) {
        if (dt == DT_F32) { TS_ENC_LOOP(DT_F32, 8) } else if (dt == DT_BF16) { TS_ENC_LOOP(DT_BF16, 8) } else { TS_ENC_LOOP(DT_F16, 8) }
    } else {
        if (dt == DT_F32) { TS_ENC_LOOP(DT_F32, 4) } else if (dt == DT_BF16) { TS_ENC_LOOP(DT_BF16, 4) } else { TS_ENC_LOOP(DT_F16, 4) }
    }
#undef TS_ENC_LOOP
}
static void fill_nan(void* o, int64_t m, int dt) {
    if (dt == DT_F32) { float* of = (float*)o; for (int64_t i = 0; i < m; i++) of[i] = NAN; }
    else { uint16_t v = dt == DT_BF16 ? 0x7fc0 : 0x7e00, *oh = (uint16_t*)o; for (int64_t i = 0; i < m; i++) oh[i] = v; }
}
/* 16 fp32 values to o[i] as dt (bf16 rounded to nearest even, nan to 0x7fc0, as f32_to_bf16), or added to fp32 o[i] */
TS_INLINE void st16(__m512 f, void* o, int dt, int64_t i, int add) {
    if (add) { float* of = (float*)o + i; _mm512_storeu_ps(of, _mm512_add_ps(_mm512_loadu_ps(of), f)); }
    else if (dt == DT_F32) _mm512_storeu_ps((float*)o + i, f);
    else if (dt == DT_BF16) {
        __m512i u = _mm512_castps_si512(f);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
        _mm256_storeu_si256((__m256i*)((uint16_t*)o + i), _mm512_cvtepi32_epi16(r));
    } else _mm256_storeu_si256((__m256i*)((uint16_t*)o + i), _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* int4 decodes through a 16-entry table per block, (nibble - 8) * scale: the same single fp32 multiply per value as
   the reference, then one permute per 16 (fp32) or 32 (bf16, fp16) values. */
TS_INLINE void decode_block_fast_t(const uint8_t* pay, float scale, const int64_t B, const int bits, void* o, const int dt,
                                   const int add) {
    if (scale != scale) { fill_nan(o, B, add ? DT_F32 : dt); return; }
    const __m512 vs = _mm512_set1_ps(scale);
    if (bits == 8) {
        if (dt == DT_BF16 && !add) {  /* two vectors, rounded, then one permute picks their high words */
#if defined(__AVX512BF16__)
            if (scale >= 0x1p-126f) {  /* every nonzero output is normal, where the instruction rounds like torch */
                for (int64_t i = 0; i < B; i += 32) {
                    __m512 f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(pay + i)))), vs);
                    __m512 f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(pay + i + 16)))), vs);
                    _mm512_storeu_si512((uint16_t*)o + i, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
                }
                return;
            }
#endif
            const __m512i hi_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                                      31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
            const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
            for (int64_t i = 0; i < B; i += 32) {
                __m512i u0 = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(pay + i)))), vs));
                __m512i u1 = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(pay + i + 16)))), vs));
                u0 = _mm512_add_epi32(_mm512_add_epi32(u0, bias), _mm512_and_si512(_mm512_srli_epi32(u0, 16), one));
                u1 = _mm512_add_epi32(_mm512_add_epi32(u1, bias), _mm512_and_si512(_mm512_srli_epi32(u1, 16), one));
                _mm512_storeu_si512((uint16_t*)o + i, _mm512_permutex2var_epi16(u0, hi_words, u1));
            }
            return;
        }
        for (int64_t i = 0; i < B; i += 16)
            st16(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(pay + i)))), vs), o, dt, i, add);
        return;
    }
    const __m512 tab = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(8))), vs);
    if (dt == DT_F32 || add) {
        const __m256i m0f = _mm256_set1_epi16(0x0f), mf0 = _mm256_set1_epi16(0xf0);
        for (int64_t i = 0; i < B; i += 32) {
            __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(pay + i / 2)));
            __m256i w = _mm256_or_si256(_mm256_and_si256(u, m0f), _mm256_slli_epi16(_mm256_and_si256(u, mf0), 4));
            __m512 f0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(w)), tab);
            __m512 f1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(w, 1)), tab);
            st16(f0, o, DT_F32, i, add);
            st16(f1, o, DT_F32, i + 16, add);
        }
        return;
    }
    /* 16-bit outputs: the table as 16 words (twice), indexed by 32 word lanes lo0, hi0, lo1, hi1, ... */
    __m512i t16;
    if (dt == DT_BF16) {
        __m512i u = _mm512_castps_si512(tab);
        t16 = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    } else t16 = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(tab, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i words = _mm512_cvtepi32_epi16(t16);
    const __m512i lut = _mm512_inserti64x4(_mm512_castsi256_si512(words), words, 1);
    const __m512i m0f = _mm512_set1_epi32(0x0f), mf0 = _mm512_set1_epi32(0xf0);
    for (int64_t i = 0; i < B; i += 32) {
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(pay + i / 2)));
        __m512i idx = _mm512_or_si512(_mm512_and_si512(d, m0f), _mm512_slli_epi32(_mm512_and_si512(d, mf0), 12));
        _mm512_storeu_si512((uint16_t*)o + i, _mm512_permutexvar_epi16(idx, lut));
    }
}
/* Whole blocks [j0, j1) of B values (a multiple of 32), one specialised loop per dtype, width and mode. */
static void decode_blocks_fast(const uint8_t* pay, const uint8_t* sc, int64_t B, int bits, int64_t j0, int64_t j1,
                               char* o, int dt, int add) {
    const int64_t es = add || dt == DT_F32 ? 4 : 2;
#define TS_DEC_LOOP(DT, BITS, ADD) \
    for (int64_t j = j0; j < j1; j++) \
        decode_block_fast_t(pay + (BITS == 8 ? j * B : j * B / 2), load_scale(sc, j), B, BITS, o + j * B * es, DT, ADD);
    if (add) { if (bits == 8) { TS_DEC_LOOP(DT_F32, 8, 1) } else { TS_DEC_LOOP(DT_F32, 4, 1) } }
    else if (bits == 8) {
        if (dt == DT_F32) { TS_DEC_LOOP(DT_F32, 8, 0) } else if (dt == DT_BF16) { TS_DEC_LOOP(DT_BF16, 8, 0) } else { TS_DEC_LOOP(DT_F16, 8, 0) }
    } else {
        if (dt == DT_F32) { TS_DEC_LOOP(DT_F32, 4, 0) } else if (dt == DT_BF16) { TS_DEC_LOOP(DT_BF16, 4, 0) } else { TS_DEC_LOOP(DT_F16, 4, 0) }
    }
#undef TS_DEC_LOOP
}
#else  /* plain loops, vectorized by the compiler where the target allows */
static uint32_t absbits32(const uint32_t* restrict u, int64_t m) {
    uint32_t a = 0;
    for (int64_t i = 0; i < m; i++) { uint32_t v = u[i] & 0x7fffffffu; a = v > a ? v : a; }
    return a;
}
static uint16_t absbits16(const uint16_t* restrict u, int64_t m) {
    uint16_t a = 0;
    for (int64_t i = 0; i < m; i++) { uint16_t v = u[i] & 0x7fffu; a = v > a ? v : a; }
    return a;
}
static void quant_n(const void* restrict x, int dt, int64_t m, float scale, int32_t qmax, int32_t off, uint8_t* restrict q) {
    if (dt == DT_F32) { const float* xf = (const float*)x; for (int64_t i = 0; i < m; i++) q[i] = quant1(xf[i], scale, qmax, off); }
    else if (dt == DT_BF16) { const uint16_t* xh = (const uint16_t*)x; for (int64_t i = 0; i < m; i++) q[i] = quant1(bf16_to_f32(xh[i]), scale, qmax, off); }
#if TS_HAVE_F16
    else { const uint16_t* xh = (const uint16_t*)x; for (int64_t i = 0; i < m; i++) q[i] = quant1(f16_to_f32(xh[i]), scale, qmax, off); }
#endif
}
static void pack4(const uint8_t* restrict q, int64_t pairs, uint8_t* restrict dst) {
    for (int64_t p = 0; p < pairs; p++) dst[p] = (uint8_t)(q[2 * p] | (q[2 * p + 1] << 4));
}
static void unpack4(const uint8_t* restrict p, int64_t nbytes, uint8_t* restrict q) {
    for (int64_t t = 0; t < nbytes; t++) { q[2 * t] = p[t] & 15u; q[2 * t + 1] = p[t] >> 4; }
}
static void dq_n(const uint8_t* restrict q, int32_t off, int64_t m, float s, void* restrict o, int dt, int add) {
    if (add) { float* of = (float*)o; for (int64_t i = 0; i < m; i++) of[i] += dq1(q[i], off, s); }
    else if (dt == DT_F32) { float* of = (float*)o; for (int64_t i = 0; i < m; i++) of[i] = dq1(q[i], off, s); }
    else if (dt == DT_BF16) { uint16_t* oh = (uint16_t*)o; for (int64_t i = 0; i < m; i++) oh[i] = f32_to_bf16(dq1(q[i], off, s)); }
#if TS_HAVE_F16
    else { uint16_t* oh = (uint16_t*)o; for (int64_t i = 0; i < m; i++) oh[i] = f32_to_f16(dq1(q[i], off, s)); }
#endif
}
#endif

/* ---- encode ---- */
static float block_scale(const char* x, int dt, int64_t m, int32_t qmax) {
    float amax; int bad;
    if (dt == DT_F32) { uint32_t a = absbits32((const uint32_t*)x, m); bad = a >= 0x7f800000u; memcpy(&amax, &a, 4); }
    else {
        uint16_t a = absbits16((const uint16_t*)x, m);
        if (dt == DT_BF16) { bad = a >= 0x7f80u; amax = bf16_to_f32(a); }
#if TS_HAVE_F16
        else { bad = a >= 0x7c00u; amax = f16_to_f32(a); }
#else
        else { bad = 1; amax = 0.f; }
#endif
    }
    return bad ? NAN : amax / (float)qmax;  /* a block holding inf or nan gets a nan scale: it decodes to nan */
}

/* Encode the values of blocks j0..j1-1 of one chunk of n values (the first one even): scales, then payload by tiles. */
static void encode_range(const char* x, int dt, int64_t n, int64_t block, int bits, int64_t j0, int64_t j1,
                         uint8_t* pay, uint8_t* sc) {
    const int32_t qmax = bits == 8 ? 127 : 7, off = bits == 8 ? 0 : 8;
    const int64_t es = dt == DT_F32 ? 4 : 2, a = j0 * block, b = j1 * block < n ? j1 * block : n;
    uint8_t qbuf[TILE];
    for (int64_t j = j0; j < j1; j++) {
        const int64_t s = j * block, m = (s + block < n ? s + block : n) - s;
        const float scale = block_scale(x + s * es, dt, m, qmax);
        memcpy(sc + 4 * j, &scale, 4);
    }
    for (int64_t t = a; t < b; t += TILE) {
        const int64_t te = t + TILE < b ? t + TILE : b;
        uint8_t* q = bits == 8 ? pay + t : qbuf;
        for (int64_t s = t; s < te;) {  /* the block segments inside this tile */
            const int64_t j = s / block, e = (j + 1) * block < te ? (j + 1) * block : te;
            const float scale = load_scale(sc, j);
            if (scale > 0.f) quant_n(x + s * es, dt, e - s, scale, qmax, off, q + (s - t));
            else memset(q + (s - t), off, (size_t)(e - s));  /* zero block (scale 0) or non-finite (nan) */
            s = e;
        }
        if (bits == 4) {
            int64_t cnt = te - t;
            if (cnt & 1) qbuf[cnt++] = 8;  /* odd n: the last high nibble holds 0 */
            pack4(qbuf, cnt / 2, pay + t / 2);
        }
    }
}

#ifdef TS_FAST_BLOCKS
static int fast_block(int64_t block, int bits) { (void)bits; return block % 32 == 0; }
#endif

static void encode_unit(const char* x, int dt, int64_t n, int64_t block, int bits, int64_t j0, int64_t j1,
                        uint8_t* pay, uint8_t* sc, int64_t ppad) {
#ifdef TS_FAST_BLOCKS
    if (fast_block(block, bits)) {
        const int64_t whole = n / block, jf = j1 < whole ? j1 : whole;  /* blocks j0..jf-1 are whole */
        if (jf > j0) encode_blocks_fast(x, dt, block, bits, j0, jf, pay, sc);
        if (jf < j1) encode_range(x, dt, n, block, bits, jf > j0 ? jf : j0, j1, pay, sc);
    } else
#endif
    encode_range(x, dt, n, block, bits, j0, j1, pay, sc);
    if (j1 * block >= n && ppad > 0) memset(pay + (bits == 8 ? n : (n + 1) / 2), 0, (size_t)ppad);
}

/* Blocks per work unit: about 8192 values, and an even number of values so int4 units start on a byte. */
static int64_t group_blocks(int64_t block) {
    int64_t g = 8192 / block;
    if (g < 1) g = 1;
    if ((block & 1) && (g & 1)) g++;
    return g;
}

int ts_has_f16(void) { return TS_HAVE_F16; }
int ts_simd(void) { return TS_AVX512 ? 512 : 0; }

/* Encode k chunks of n values: chunk order[i] (or i) of x -> payload at pay + i*pstride, fp32 scales at
   sc + i*sstride, then ppad zero bytes after each payload. */
int ts_encode(const void* x, int dt, int64_t n, int64_t k, const int64_t* order, int64_t block, int bits,
              uint8_t* pay, int64_t pstride, uint8_t* sc, int64_t sstride, int64_t ppad, int nthreads) {
    if (dt == DT_F16 && !TS_HAVE_F16) return -1;
    const int64_t nb = (n + block - 1) / block, g = group_blocks(block), nu = (nb + g - 1) / g, total = k * nu;
    const int64_t es = dt == DT_F32 ? 4 : 2;
    if (nb == 0) {
        for (int64_t i = 0; i < k && ppad > 0; i++) memset(pay + i * pstride, 0, (size_t)ppad);
        return 0;
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads) if(nthreads > 1 && total > 1)
    for (int64_t t = 0; t < total; t++) {
        const int64_t i = t / nu, u = t % nu, c = order ? order[i] : i;
        const int64_t j1 = (u + 1) * g < nb ? (u + 1) * g : nb;
        encode_unit((const char*)x + c * n * es, dt, n, block, bits, u * g, j1, pay + i * pstride, sc + i * sstride, ppad);
    }
    return 0;
}

/* ---- decode ---- */
/* Decode the values of blocks j0..j1-1 of one chunk into o (the chunk's first value); add: accumulate into fp32. */
static void decode_range(const uint8_t* pay, const uint8_t* sc, int64_t n, int64_t block, int bits,
                         int64_t j0, int64_t j1, char* o, int dt, int add) {
    const int64_t es = add || dt == DT_F32 ? 4 : 2, a = j0 * block, b = j1 * block < n ? j1 * block : n;
    const int32_t off = bits == 8 ? 0 : 8;
    uint8_t qbuf[TILE];
    for (int64_t t = a; t < b; t += TILE) {
        const int64_t te = t + TILE < b ? t + TILE : b;
        const uint8_t* q = pay + t;
        if (bits == 4) { unpack4(pay + t / 2, (te - t + 1) / 2, qbuf); q = qbuf; }
        for (int64_t s = t; s < te;) {
            const int64_t j = s / block, e = (j + 1) * block < te ? (j + 1) * block : te;
            dq_n(q + (s - t), off, e - s, load_scale(sc, j), o + s * es, dt, add);
            s = e;
        }
    }
}

static void decode_unit(const uint8_t* pay, const uint8_t* sc, int64_t n, int64_t block, int bits,
                        int64_t j0, int64_t j1, char* o, int dt, int add) {
#ifdef TS_FAST_BLOCKS
    if (fast_block(block, bits)) {
        const int64_t whole = n / block, jf = j1 < whole ? j1 : whole;  /* blocks j0..jf-1 are whole */
        if (jf > j0) decode_blocks_fast(pay, sc, block, bits, j0, jf, o, dt, add);
        if (jf < j1) decode_range(pay, sc, n, block, bits, jf > j0 ? jf : j0, j1, o, dt, add);
        return;
    }
#endif
    decode_range(pay, sc, n, block, bits, j0, j1, o, dt, add);
}

/* sum == 0: chunk i -> out + i * ostride values of dtype dt. sum == 1: out (fp32, n values) = the k chunks added
   in order i = 0..k-1. */
int ts_decode(const uint8_t* pay, int64_t pstride, const uint8_t* sc, int64_t sstride, int64_t k, int64_t n,
              int64_t block, int bits, void* out, int dt, int64_t ostride, int sum, int nthreads) {
    if (dt == DT_F16 && !TS_HAVE_F16) return -1;
    if (sum && dt != DT_F32) return -2;
    const int64_t nb = (n + block - 1) / block, g = group_blocks(block), nu = (nb + g - 1) / g;
    const int64_t es = dt == DT_F32 ? 4 : 2;
    if (sum) {
        if (k == 0) { memset(out, 0, (size_t)(n * 4)); return 0; }
        #pragma omp parallel for schedule(static) num_threads(nthreads) if(nthreads > 1 && nu > 1)
        for (int64_t u = 0; u < nu; u++) {
            const int64_t j1 = (u + 1) * g < nb ? (u + 1) * g : nb;
            for (int64_t i = 0; i < k; i++)
                decode_unit(pay + i * pstride, sc + i * sstride, n, block, bits, u * g, j1, (char*)out, DT_F32, i > 0);
        }
        return 0;
    }
    const int64_t total = k * nu;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if(nthreads > 1 && total > 1)
    for (int64_t t = 0; t < total; t++) {
        const int64_t i = t / nu, u = t % nu, j1 = (u + 1) * g < nb ? (u + 1) * g : nb;
        decode_unit(pay + i * pstride, sc + i * sstride, n, block, bits, u * g, j1, (char*)out + i * ostride * es, dt, 0);
    }
    return 0;
}

/* ---- row layouts (segments) ----
   A chunk of n = rows * U values is `rows` rows of one layout whose blocks are given by bs[0..nbr]: block b of a row
   covers columns [bs[b], bs[b+1]) (bs[0] = 0, bs[nbr] = U, every block at least one value), and block J of the chunk
   is block J % nbr of row J / nbr, at value (J / nbr) * U + bs[J % nbr], with scale J. Blocks start anywhere, so
   int4 blocks may start on an odd value (the high nibble of a byte). Work units are runs of whole blocks; an int4
   unit writes its payload as a stream of nibbles: the byte holding values 2p and 2p+1 is written by the unit owning
   value 2p, which quantizes value 2p+1 with the next block's scale, recomputed from the input (a thread never reads
   what another writes); a unit starting on an odd value leaves the byte before it to the unit before. */

/* int4 stream state inside a unit: `have` says the offset nibble of value p-1 (p odd, the next value to write)
   waits in `carry` for its partner; `skip` that the unit starts on an odd value whose byte is not its own. */
typedef struct { uint8_t carry; int have, skip; } nib_t;

#define TS_ODD_MAX 4096  /* largest odd-start int4 block the fast path stages (in a stack buffer) */

/* Blocks Ja..Jb-1 of a chunk (block Ja is block b of the row starting at value base; the run ends at value e) the
   general way: int8 block by block (scale, then values); int4 by tiles staged as one byte per value and packed,
   through the stream state (an odd first value pairs with the carried nibble, an odd end leaves its last nibble in
   the carry). */
__attribute__((noinline)) static void encode_seg_run(const char* x, int dt, const int64_t* bs, int64_t nbr,
                                                     int64_t U, int bits, int64_t Ja, int64_t Jb, int64_t b,
                                                     int64_t base, int64_t e, uint8_t* pay, uint8_t* sc, nib_t* st) {
    const int32_t qmax = bits == 8 ? 127 : 7, off = bits == 8 ? 0 : 8;
    const int64_t es = dt == DT_F32 ? 4 : 2;
    if (bits == 8) {
        for (int64_t J = Ja; J < Jb; J++) {
            const int64_t s = base + bs[b], m = bs[b + 1] - bs[b];
            const float scale = block_scale(x + s * es, dt, m, qmax);
            memcpy(sc + 4 * J, &scale, 4);
            if (scale > 0.f) quant_n(x + s * es, dt, m, scale, qmax, 0, pay + s);
            else memset(pay + s, 0, (size_t)m);
            if (++b == nbr) { b = 0; base += U; }
        }
        return;
    }
    int64_t J = Ja, s = base + bs[b], m = bs[b + 1] - bs[b];  /* int4: the tiles find the blocks up to e */
    const int64_t a = s, t0 = a & ~(int64_t)1;
    float scale = block_scale(x + s * es, dt, m, qmax);
    memcpy(sc + 4 * J, &scale, 4);
    uint8_t qbuf[TILE + 2];
    for (int64_t t = t0; t < e; t += TILE) {
        const int64_t te = t + TILE < e ? t + TILE : e;
        int64_t p = t;
        if (p < a) { qbuf[0] = st->have ? st->carry : 8; p = a; }  /* a odd: the carried nibble, or a byte to skip */
        while (p < te) {
            while (p >= s + m) {  /* the next block: its scale is computed just before its values are read */
                J++;
                if (++b == nbr) { b = 0; base += U; }
                s = base + bs[b]; m = bs[b + 1] - bs[b];
                scale = block_scale(x + s * es, dt, m, qmax);
                memcpy(sc + 4 * J, &scale, 4);
            }
            const int64_t pe = s + m < te ? s + m : te;
            if (scale > 0.f) quant_n(x + p * es, dt, pe - p, scale, qmax, off, qbuf + (p - t));
            else memset(qbuf + (p - t), off, (size_t)(pe - p));
            p = pe;
        }
        int64_t cnt = te - t;
        st->have = (int)(cnt & 1);  /* only the last tile can end on an odd value */
        if (cnt & 1) st->carry = qbuf[--cnt];
        const int64_t skip = t == t0 && (a & 1) && st->skip;
        if (cnt / 2 > skip) pack4(qbuf + 2 * skip, cnt / 2 - skip, pay + t / 2 + skip);
    }
    st->skip = 0;
}

/* One block of m values at value s, decoded the general way; add: accumulate into fp32 o. */
static void decode_seg_block(const uint8_t* pay, int64_t s, int64_t m, float scale, int bits, char* o, int dt, int add) {
    const int64_t es = add || dt == DT_F32 ? 4 : 2;
    if (bits == 8) { dq_n(pay + s, 0, m, scale, o + s * es, dt, add); return; }
    uint8_t qbuf[TILE + 2];
    for (int64_t t = s; t < s + m; t += TILE) {
        const int64_t te = t + TILE < s + m ? t + TILE : s + m, t0 = t & ~(int64_t)1;
        unpack4(pay + t0 / 2, (te - t0 + 1) / 2, qbuf);
        dq_n(qbuf + (t - t0), 8, te - t, scale, o + t * es, dt, add);
    }
}

/* An int4 unit that ends on an odd value e: its last byte pairs the carried nibble with value e, quantized with the
   scale of the block starting there (block b of the row at base), or with the padding nibble at the chunk's end. */
static void finish_unit4(const char* x, int dt, int64_t n, const int64_t* bs, int64_t b, int64_t base, uint8_t* pay,
                         const nib_t* st) {
    if (!st->have) return;
    const int64_t es = dt == DT_F32 ? 4 : 2, e = base + bs[b];
    uint8_t v = 8;
    if (e < n) {
        const float s1 = block_scale(x + e * es, dt, bs[b + 1] - bs[b], 7);
        if (s1 > 0.f) quant_n(x + e * es, dt, 1, s1, 7, 8, &v);
    }
    pay[(e - 1) / 2] = (uint8_t)(st->carry | (v << 4));
}

/* dst[j] = high nibble of src[j] | low nibble of src[j + 1] << 4, j < cnt: shifts a packed int4 stream by one value,
   between the odd-aligned payload and the even-aligned bytes the fast block code reads and writes. */
static inline void shift_nibbles(const uint8_t* restrict src, int64_t cnt, uint8_t* restrict dst) {
    int64_t j = 0;
#if TS_AVX512
    const __m256i lo = _mm256_set1_epi8(0x0f), hi = _mm256_set1_epi8((char)0xf0);
    for (; j + 32 <= cnt; j += 32) {
        __m256i a = _mm256_loadu_si256((const __m256i*)(src + j)), c = _mm256_loadu_si256((const __m256i*)(src + j + 1));
        _mm256_storeu_si256((__m256i*)(dst + j), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), lo),
                                                                  _mm256_and_si256(_mm256_slli_epi16(c, 4), hi)));
    }
    if (j < cnt) {
        const __mmask32 k = (__mmask32)((1ull << (cnt - j)) - 1u);
        __m256i a = _mm256_maskz_loadu_epi8(k, src + j), c = _mm256_maskz_loadu_epi8(k, src + j + 1);
        _mm256_mask_storeu_epi8(dst + j, k, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), lo),
                                                           _mm256_and_si256(_mm256_slli_epi16(c, 4), hi)));
    }
#else
    for (; j < cnt; j++) dst[j] = (uint8_t)((src[j] >> 4) | (src[j + 1] << 4));
#endif
}

#ifdef TS_FAST_BLOCKS
/* Blocks J0..J1-1 of a chunk. rl[b] counts the whole blocks of B values (B a multiple of 32) that follow one another
   from block b of a row (within the row), so such runs go through the same straight loop as unsegmented chunks; other blocks of a
   multiple of 32 values go one at a time, the rest by runs to encode_seg_run. int4 runs that start on an odd value
   are encoded into a staging buffer as if aligned and shifted by one nibble into the payload, up to TS_ODD_MAX values
   at a time. One specialised loop per dtype and width. */
static void encode_unit_seg(const char* x, int dt, int64_t n, const int64_t* bs, const int64_t* rl, int64_t nbr,
                            int64_t U, int64_t B, int bits, int64_t J0, int64_t J1, uint8_t* pay, uint8_t* sc) {
    const int64_t es = dt == DT_F32 ? 4 : 2;
    int64_t r = J0 / nbr, b = J0 - r * nbr, base = r * U, run = -1, run_b = 0, run_base = 0;
    nib_t st = {0, 0, (int)((base + bs[b]) & 1)};
    uint8_t L[TS_ODD_MAX / 2 + 1];
#define TS_SEG_ENC(DT, BITS) \
    for (int64_t J = J0; J < J1;) { \
        const int64_t s = base + bs[b], m = bs[b + 1] - bs[b]; \
        int64_t q = rl[b], Bq = B; \
        if (q > J1 - J) q = J1 - J; \
        if (q == 0 && m % 32 == 0) { q = 1; Bq = m; } \
        if (q > 0 && (BITS == 8 || !(s & 1) || Bq <= TS_ODD_MAX)) { \
            if (run >= 0) { encode_seg_run(x, DT, bs, nbr, U, BITS, run, J, run_b, run_base, s, pay, sc, &st); run = -1; } \
            if (BITS == 8 || !(s & 1)) { \
                for (int64_t i = 0; i < q; i++) { \
                    const int64_t v = s + i * Bq; float s_; \
                    encode_block_fast_t(x + v * es, DT, Bq, BITS, pay + (BITS == 8 ? v : v / 2), &s_); \
                    memcpy(sc + 4 * (J + i), &s_, 4); \
                } \
            } else { \
                const int64_t per = TS_ODD_MAX / Bq; \
                for (int64_t i0 = 0; i0 < q; i0 += per) { \
                    const int64_t cq = q - i0 < per ? q - i0 : per, v0 = s + i0 * Bq, nb2 = cq * Bq / 2; \
                    for (int64_t i = 0; i < cq; i++) { \
                        float s_; \
                        encode_block_fast_t(x + (v0 + i * Bq) * es, DT, Bq, 4, L + 1 + i * Bq / 2, &s_); \
                        memcpy(sc + 4 * (J + i0 + i), &s_, 4); \
                    } \
                    L[0] = (uint8_t)(st.carry << 4); \
                    if (st.skip) shift_nibbles(L + 1, nb2 - 1, pay + v0 / 2 + 1); \
                    else shift_nibbles(L, nb2, pay + v0 / 2); \
                    st.carry = L[nb2] >> 4; st.have = 1; st.skip = 0; \
                } \
            } \
        } else { \
            q = 1; \
            if (run < 0) { run = J; run_b = b; run_base = base; } \
        } \
        J += q; b += q; \
        if (b == nbr) { b = 0; base += U; } \
    }
    if (bits == 8) {
        if (dt == DT_F32) { TS_SEG_ENC(DT_F32, 8) } else if (dt == DT_BF16) { TS_SEG_ENC(DT_BF16, 8) } else { TS_SEG_ENC(DT_F16, 8) }
    } else {
        if (dt == DT_F32) { TS_SEG_ENC(DT_F32, 4) } else if (dt == DT_BF16) { TS_SEG_ENC(DT_BF16, 4) } else { TS_SEG_ENC(DT_F16, 4) }
    }
#undef TS_SEG_ENC
    if (run >= 0) encode_seg_run(x, dt, bs, nbr, U, bits, run, J1, run_b, run_base, base + bs[b], pay, sc, &st);
    if (bits == 4) finish_unit4(x, dt, n, bs, b, base, pay, &st);
}
static void decode_unit_seg(const uint8_t* pay, const uint8_t* sc, const int64_t* bs, const int64_t* rl, int64_t nbr,
                            int64_t U, int64_t B, int bits, int64_t J0, int64_t J1, char* o, int dt, int add) {
    const int64_t es = add || dt == DT_F32 ? 4 : 2;
    int64_t r = J0 / nbr, b = J0 - r * nbr, base = r * U;
    uint8_t L[TS_ODD_MAX / 2];
#define TS_SEG_DEC(DT, BITS, ADD) \
    for (int64_t J = J0; J < J1;) { \
        const int64_t s = base + bs[b], m = bs[b + 1] - bs[b]; \
        int64_t q = rl[b], Bq = B; \
        if (q > J1 - J) q = J1 - J; \
        if (q == 0 && m % 32 == 0) { q = 1; Bq = m; } \
        if (q > 0 && (BITS == 8 || !(s & 1))) { \
            for (int64_t i = 0; i < q; i++) { \
                const int64_t v = s + i * Bq; \
                decode_block_fast_t(pay + (BITS == 8 ? v : v / 2), load_scale(sc, J + i), Bq, BITS, o + v * es, DT, ADD); \
            } \
        } else if (q > 0 && Bq <= TS_ODD_MAX) { \
            const int64_t per = TS_ODD_MAX / Bq; \
            for (int64_t i0 = 0; i0 < q; i0 += per) { \
                const int64_t cq = q - i0 < per ? q - i0 : per, v0 = s + i0 * Bq; \
                shift_nibbles(pay + v0 / 2, cq * Bq / 2, L); \
                for (int64_t i = 0; i < cq; i++) \
                    decode_block_fast_t(L + i * Bq / 2, load_scale(sc, J + i0 + i), Bq, 4, o + (v0 + i * Bq) * es, DT, ADD); \
            } \
        } else { \
            q = 1; \
            decode_seg_block(pay, s, m, load_scale(sc, J), BITS, o, DT, ADD); \
        } \
        J += q; b += q; \
        if (b == nbr) { b = 0; base += U; } \
    }
    if (add) { if (bits == 8) { TS_SEG_DEC(DT_F32, 8, 1) } else { TS_SEG_DEC(DT_F32, 4, 1) } }
    else if (bits == 8) {
        if (dt == DT_F32) { TS_SEG_DEC(DT_F32, 8, 0) } else if (dt == DT_BF16) { TS_SEG_DEC(DT_BF16, 8, 0) } else { TS_SEG_DEC(DT_F16, 8, 0) }
    } else {
        if (dt == DT_F32) { TS_SEG_DEC(DT_F32, 4, 0) } else if (dt == DT_BF16) { TS_SEG_DEC(DT_BF16, 4, 0) } else { TS_SEG_DEC(DT_F16, 4, 0) }
    }
#undef TS_SEG_DEC
}
#else
static void encode_unit_seg(const char* x, int dt, int64_t n, const int64_t* bs, const int64_t* rl, int64_t nbr,
                            int64_t U, int64_t B, int bits, int64_t J0, int64_t J1, uint8_t* pay, uint8_t* sc) {
    (void)rl; (void)B;
    const int64_t r = J0 / nbr, b = J0 - r * nbr, r1 = J1 / nbr, b1 = J1 - r1 * nbr;
    nib_t st = {0, 0, (int)((r * U + bs[b]) & 1)};
    encode_seg_run(x, dt, bs, nbr, U, bits, J0, J1, b, r * U, r1 * U + bs[b1], pay, sc, &st);
    if (bits == 4) finish_unit4(x, dt, n, bs, b1, r1 * U, pay, &st);
}
static void decode_unit_seg(const uint8_t* pay, const uint8_t* sc, const int64_t* bs, const int64_t* rl, int64_t nbr,
                            int64_t U, int64_t B, int bits, int64_t J0, int64_t J1, char* o, int dt, int add) {
    (void)rl; (void)B;
    int64_t r = J0 / nbr, b = J0 - r * nbr, base = r * U;
    for (int64_t J = J0; J < J1; J++) {
        decode_seg_block(pay, base + bs[b], bs[b + 1] - bs[b], load_scale(sc, J), bits, o, dt, add);
        if (++b == nbr) { b = 0; base += U; }
    }
}
#endif

/* ts_encode / ts_decode for chunks of n = rows * U values laid out by the block table bs: nbr + 1 block offsets in a
   row (see above), then rl, nbr counts of the whole blocks of `block` values that follow one another from each block of
   a row (all 0 unless block is a multiple of 32). Work units are about 8192 values of blocks. */
int ts_encode_seg(const void* x, int dt, int64_t n, int64_t k, const int64_t* order, const int64_t* bs, int64_t nbr,
                  int64_t U, int64_t block, int bits, uint8_t* pay, int64_t pstride, uint8_t* sc, int64_t sstride,
                  int64_t ppad, int nthreads) {
    if (dt == DT_F16 && !TS_HAVE_F16) return -1;
    if (U < 1 || nbr < 1 || n % U) return -3;
    const int64_t nb = n / U * nbr, g = block < 8192 ? 8192 / block : 1, nu = (nb + g - 1) / g, total = k * nu;
    const int64_t es = dt == DT_F32 ? 4 : 2, P = bits == 8 ? n : (n + 1) / 2;
    for (int64_t i = 0; i < k && ppad > 0; i++) memset(pay + i * pstride + P, 0, (size_t)ppad);
    if (nb == 0) return 0;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if(nthreads > 1 && total > 1)
    for (int64_t t = 0; t < total; t++) {
        const int64_t i = t / nu, u = t % nu, c = order ? order[i] : i;
        const int64_t j1 = (u + 1) * g < nb ? (u + 1) * g : nb;
        encode_unit_seg((const char*)x + c * n * es, dt, n, bs, bs + nbr + 1, nbr, U, block, bits, u * g, j1, pay + i * pstride,
                        sc + i * sstride);
    }
    return 0;
}

int ts_decode_seg(const uint8_t* pay, int64_t pstride, const uint8_t* sc, int64_t sstride, int64_t k, int64_t n,
                  const int64_t* bs, int64_t nbr, int64_t U, int64_t block, int bits, void* out, int dt,
                  int64_t ostride, int sum, int nthreads) {
    if (dt == DT_F16 && !TS_HAVE_F16) return -1;
    if (sum && dt != DT_F32) return -2;
    if (U < 1 || nbr < 1 || n % U) return -3;
    const int64_t nb = n / U * nbr, g = block < 8192 ? 8192 / block : 1, nu = (nb + g - 1) / g;
    const int64_t es = dt == DT_F32 ? 4 : 2;
    if (sum) {
        if (k == 0) { memset(out, 0, (size_t)(n * 4)); return 0; }
        #pragma omp parallel for schedule(static) num_threads(nthreads) if(nthreads > 1 && nu > 1)
        for (int64_t u = 0; u < nu; u++) {
            const int64_t j1 = (u + 1) * g < nb ? (u + 1) * g : nb;
            for (int64_t i = 0; i < k; i++)
                decode_unit_seg(pay + i * pstride, sc + i * sstride, bs, bs + nbr + 1, nbr, U, block, bits, u * g, j1, (char*)out,
                                DT_F32, i > 0);
        }
        return 0;
    }
    const int64_t total = k * nu;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if(nthreads > 1 && total > 1)
    for (int64_t t = 0; t < total; t++) {
        const int64_t i = t / nu, u = t % nu, j1 = (u + 1) * g < nb ? (u + 1) * g : nb;
        decode_unit_seg(pay + i * pstride, sc + i * sstride, bs, bs + nbr + 1, nbr, U, block, bits, u * g, j1,
                        (char*)out + i * ostride * es, dt, 0);
    }
    return 0;
}

/* ---- rotated and stochastic formats (format.py: "Rotation", "Stochastic rounding") ----
   One general path for codecs with rotate or stochastic set, flat (bs == NULL: block j covers [j*block, ...)) or
   with a row layout (bs as above). Each block's whole 32-value groups are loaded into four 8-lane registers, rotated
   there and stored to an fp32 buffer with their absmax taken on the way (the rest of the block is copied as it is;
   up to 8 blocks a batch), then its scale is taken and its values quantized 32 at a time by the product with the
   scale's reciprocal (nearest, or floor(t + u) with u from the counter hash, sixteen hashes per vector). Decoding
   takes each group's q into registers, rotates it, multiplies it by its scale and stores it. Work units start on even values (flat: group_blocks; layouts: whole rows, an even number when U is
   odd), so int4 bytes are staged one value a byte per unit and packed without two threads sharing a byte. */
#define TS_NORM32 0.17677669529663687f  /* fp32(32 ** -0.5) */
/* The counter hash's steps, for a uint32_t or a vector of them (GCC/clang vector types take the same operators). */
#define TS_MIX(v) do { v ^= v >> 16; v *= 0x7FEB352Du; v ^= v >> 15; v *= 0x846CA68Bu; v ^= v >> 16; } while (0)
static inline uint32_t ts_mix(uint32_t v) {
    TS_MIX(v);
    return v;
}
static inline uint32_t ts_row_key(uint64_t seed, int64_t i) {
    return ts_mix(ts_mix(ts_mix((uint32_t)seed ^ 0x243F6A88u) ^ (uint32_t)(seed >> 32)) ^ (uint32_t)i);
}
/* Five butterfly stages h = 1..16 in the format's order, then the product by f: fp32(32 ** -0.5) to rotate,
   fp32(scale * fp32(32 ** -0.5)) to decode a group of q (integers, so the stages are exact and the product is the one
   rounding). Every output is the a + b or a - b of the same two values whichever way it is computed, so the vector
   forms give the scalar bits. */
static inline void fwht32(float* restrict v, float f) {
    for (int h = 1; h < 32; h <<= 1)
        for (int p = 0; p < 32; p += 2 * h)
            for (int t = p; t < p + h; t++) { const float a = v[t], b = v[t + h]; v[t] = a + b; v[t + h] = a - b; }
    for (int t = 0; t < 32; t++) v[t] *= f;
}
static void load_f32(const char* x, int dt, int64_t m, float* restrict v) {
    if (dt == DT_F32) { memcpy(v, x, (size_t)(4 * m)); return; }
    const uint16_t* xh = (const uint16_t*)x;
    if (dt == DT_BF16) { for (int64_t i = 0; i < m; i++) v[i] = bf16_to_f32(xh[i]); }
#if TS_HAVE_F16
    else { for (int64_t i = 0; i < m; i++) v[i] = f16_to_f32(xh[i]); }
#endif
}
static void store_f32(const float* restrict v, int64_t m, char* o, int dt, int add) {
    if (add) { float* of = (float*)o; for (int64_t i = 0; i < m; i++) of[i] += v[i]; }
    else if (dt == DT_F32) memcpy(o, v, (size_t)(4 * m));
    else if (dt == DT_BF16) { uint16_t* oh = (uint16_t*)o; for (int64_t i = 0; i < m; i++) oh[i] = f32_to_bf16(v[i]); }
#if TS_HAVE_F16
    else { uint16_t* oh = (uint16_t*)o; for (int64_t i = 0; i < m; i++) oh[i] = f32_to_f16(v[i]); }
#endif
}
/* values p..p+m-1 of a payload row, dequantized (q * scale) into v */
static void dq_values(const uint8_t* prow, int64_t p, int64_t m, int bits, float scale, float* restrict v) {
    if (bits == 8) { for (int64_t j = 0; j < m; j++) v[j] = (float)(int8_t)prow[p + j] * scale; }
    else if (!(p & 1)) {  /* an even start: two values a byte */
        const uint8_t* b = prow + p / 2;
        for (int64_t j = 0; j < m / 2; j++) {
            v[2 * j] = (float)((int32_t)(b[j] & 15u) - 8) * scale;
            v[2 * j + 1] = (float)((int32_t)(b[j] >> 4) - 8) * scale;
        }
        if (m & 1) v[m - 1] = (float)((int32_t)(b[m / 2] & 15u) - 8) * scale;
    } else for (int64_t j = 0; j < m; j++) {
        const int64_t t = p + j;
        v[j] = (float)((int32_t)((prow[t >> 1] >> (4 * (t & 1))) & 15u) - 8) * scale;
    }
}

/* A group of 32 values in four 8-lane registers, r[R] holding values 8R..8R+7. The stages h = 1, 2, 4 pair values
   inside a register: one one-input shuffle brings every lane its partner b (lane p ^ h), and lane p becomes
   fma(x, s, b) with s = +1 where p & h == 0 (x + b: a + b of the pair) and -1 elsewhere (-x + b: a - b). A product
   by +-1 is exact and -x + b rounds as b - x, so the bits equal the scalar order's. The stages h = 8, 16 add and
   subtract whole registers. One shuffle per register and stage: 12 a group, where trading index bits between
   registers took 20 (the shuffle port is what the transform waits on). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX__)  /* 8-lane vectors; plain loops elsewhere */
#define TS_VEC 1
typedef float ts_v8f __attribute__((vector_size(32)));
typedef int32_t ts_v8i __attribute__((vector_size(32)));
typedef uint32_t ts_v8u __attribute__((vector_size(32)));
typedef uint16_t ts_v8h __attribute__((vector_size(16)));
typedef int8_t ts_v8b __attribute__((vector_size(8)));
static inline __attribute__((always_inline)) ts_v8f ts_pm(ts_v8f x, ts_v8f s, ts_v8f b) {  /* x * s + b, s = +-1 */
#if defined(__FMA__)
    return (ts_v8f)_mm256_fmadd_ps((__m256)x, (__m256)s, (__m256)b);
#else
    return x * s + b;  /* the product is exact: one rounding, as the fused form */
#endif
}
#define TS_STAGE(S, ...) do { \
        for (int R_ = 0; R_ < 4; R_++) r[R_] = ts_pm(r[R_], S, __builtin_shuffle(r[R_], (ts_v8i){__VA_ARGS__})); \
    } while (0)
static inline __attribute__((always_inline)) void fwht_v(ts_v8f* restrict r, float f) {
    const ts_v8f s1 = {1, -1, 1, -1, 1, -1, 1, -1}, s2 = {1, 1, -1, -1, 1, 1, -1, -1};
    const ts_v8f s4 = {1, 1, 1, 1, -1, -1, -1, -1};
    TS_STAGE(s1, 1, 0, 3, 2, 5, 4, 7, 6);    /* h = 1 */
    TS_STAGE(s2, 2, 3, 0, 1, 6, 7, 4, 5);    /* h = 2 */
    TS_STAGE(s4, 4, 5, 6, 7, 0, 1, 2, 3);    /* h = 4 */
    ts_v8f a = r[0], b = r[1];               /* h = 8 */
    r[0] = a + b; r[1] = a - b;
    a = r[2]; b = r[3];
    r[2] = a + b; r[3] = a - b;
    a = r[0]; b = r[2];                      /* h = 16 */
    r[0] = a + b; r[2] = a - b;
    a = r[1]; b = r[3];
    r[1] = a + b; r[3] = a - b;
    const ts_v8f n = {f, f, f, f, f, f, f, f};
    r[0] *= n; r[1] *= n; r[2] *= n; r[3] *= n;
}
/* lane-wise max of a and the |f| bits of f (|f| bits order like the values, nan above all: see absbits32) */
static inline __attribute__((always_inline)) ts_v8u amax8(ts_v8u a, ts_v8f f) {
    const ts_v8u u = (ts_v8u)f & 0x7fffffffu;
#if defined(__AVX2__)
    return (ts_v8u)_mm256_max_epu32((__m256i)a, (__m256i)u);
#else
    const ts_v8u gt = (ts_v8u)(u > a);
    return (a & ~gt) | (u & gt);
#endif
}
/* 8 values from x[i] as fp32 */
static inline __attribute__((always_inline)) ts_v8f ld8(const char* x, int dt, int64_t i) {
    ts_v8f f;
    if (dt == DT_F32) memcpy(&f, (const float*)x + i, 32);
    else if (dt == DT_BF16) {
#if defined(__AVX2__)
        const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + i));
        const ts_v8u u = (ts_v8u)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
        ts_v8h h; memcpy(&h, (const uint16_t*)x + i, 16);
        const ts_v8u u = __builtin_convertvector(h, ts_v8u) << 16;
#endif
        memcpy(&f, &u, 32);
    } else {
#if defined(__F16C__)
        f = (ts_v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)x + i)));
#else
        float t[8]; load_f32(x + 2 * i, dt, 8, t); memcpy(&f, t, 32);
#endif
    }
    return f;
}
/* 8 fp32 values to o[i] as dt, or added to fp32 o[i] */
static inline __attribute__((always_inline)) void st8(ts_v8f f, char* o, int dt, int64_t i, int add) {
    if (add) { ts_v8f c; memcpy(&c, (float*)o + i, 32); c += f; memcpy((float*)o + i, &c, 32); }
    else if (dt == DT_F32) memcpy((float*)o + i, &f, 32);
    else if (dt == DT_BF16) {  /* round to nearest even; nan to 0x7fc0, as f32_to_bf16 */
        ts_v8u u; memcpy(&u, &f, 32);
        const ts_v8u nan = (ts_v8u)(f != f);
        const ts_v8u r = (((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan) | (nan & 0x7fc0u);
#if defined(__AVX2__)
        const __m256i w = _mm256_packus_epi32((__m256i)r, (__m256i)r);  /* r < 2**16: no saturation */
        _mm_storeu_si128((__m128i*)((uint16_t*)o + i), _mm256_castsi256_si128(_mm256_permute4x64_epi64(w, 0x08)));
#else
        const ts_v8h h = __builtin_convertvector(r, ts_v8h);
        memcpy((uint16_t*)o + i, &h, 16);
#endif
    } else {
#if defined(__F16C__)
        _mm_storeu_si128((__m128i*)((uint16_t*)o + i),
                         _mm256_cvtps_ph((__m256)f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
        float t[8]; memcpy(t, &f, 32); store_f32(t, 8, o + 2 * i, dt, 0);
#endif
    }
}
/* values p..p+7 of a payload row, q * scale */
static inline __attribute__((always_inline)) ts_v8f dq8(const uint8_t* prow, int64_t p, int bits, ts_v8f vs) {
    ts_v8i q;
    if (bits == 8) {
#if defined(__AVX2__)
        q = (ts_v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(prow + p)));
#else
        ts_v8b b; memcpy(&b, prow + p, 8); q = __builtin_convertvector(b, ts_v8i);
#endif
    }
    else {  /* value p + l is nibble l of the bytes from p / 2 (one nibble further when p is odd) */
        const uint8_t* b = prow + (p >> 1);
        uint32_t w; memcpy(&w, b, 4);
        if (p & 1) w = (uint32_t)(((uint64_t)w | ((uint64_t)b[4] << 32)) >> 4);
        const ts_v8u sh = {0, 4, 8, 12, 16, 20, 24, 28};
        q = (ts_v8i)(((ts_v8u){w, w, w, w, w, w, w, w} >> sh) & 15u) - 8;
    }
    return __builtin_convertvector(q, ts_v8f) * vs;
}
#endif
#if TS_AVX512
/* A group of 32 values in two 16-lane registers, r0 holding values 0..15, r1 16..31. Stages h = 1, 2, 4, 8 pair
   lanes of one register: t is the register with each lane's partner (lane ^ h) in its place, and a lane takes
   fma(r, s, t) with s = +1 where bit h of its index is clear (r + t: a + b) and -1 where it is set (t - r: a - b; a
   product by +-1 is exact, so one rounding as the subtraction's). Stage 16 pairs the registers. Every output is the
   a + b or a - b of the same two values as the scalar order's, so the bits are the same; per group, 8 shuffles
   where the 8-lane form needs 12, and one instruction per lane and stage besides. */
static inline __attribute__((always_inline)) __m512 ts_zsign(__mmask16 set) {
    return _mm512_mask_blend_ps(set, _mm512_set1_ps(1.f), _mm512_set1_ps(-1.f));
}
#define TS_ZSTAGE(R, T, S) do { R = _mm512_fmadd_ps(R, (S), (T)); } while (0)
static inline __attribute__((always_inline)) void fwht_z(__m512* restrict r0, __m512* restrict r1, float f) {
    const __m512 s1 = ts_zsign(0xAAAA), s2 = ts_zsign(0xCCCC), s4 = ts_zsign(0xF0F0), s8 = ts_zsign(0xFF00);
    TS_ZSTAGE(*r0, _mm512_permute_ps(*r0, 0xB1), s1); TS_ZSTAGE(*r1, _mm512_permute_ps(*r1, 0xB1), s1);
    TS_ZSTAGE(*r0, _mm512_permute_ps(*r0, 0x4E), s2); TS_ZSTAGE(*r1, _mm512_permute_ps(*r1, 0x4E), s2);
    TS_ZSTAGE(*r0, _mm512_shuffle_f32x4(*r0, *r0, 0xB1), s4);
    TS_ZSTAGE(*r1, _mm512_shuffle_f32x4(*r1, *r1, 0xB1), s4);
    TS_ZSTAGE(*r0, _mm512_shuffle_f32x4(*r0, *r0, 0x4E), s8);
    TS_ZSTAGE(*r1, _mm512_shuffle_f32x4(*r1, *r1, 0x4E), s8);
    const __m512 a = *r0, b = *r1, n = _mm512_set1_ps(f);
    *r0 = _mm512_mul_ps(_mm512_add_ps(a, b), n);
    *r1 = _mm512_mul_ps(_mm512_sub_ps(a, b), n);
}
/* 16 values from x[i] (dt) as fp32 */
static inline __attribute__((always_inline)) __m512 ld16(const char* x, int dt, int64_t i) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float*)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i));
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
/* 32 values from x[i] (dt) as fp32 in two registers. bf16: one load and a word permutation per register that puts
   value l in the top half of lane l and zeros the bottom one, where a widening and a shift took two instructions. */
static inline __attribute__((always_inline)) void ld32(const char* x, int dt, int64_t i, __m512* r0, __m512* r1) {
    if (dt != DT_BF16) { *r0 = ld16(x, dt, i); *r1 = ld16(x, dt, i + 16); return; }
    const __m512i h = _mm512_loadu_si512((const uint16_t*)x + i);
    const __m512i lo = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
                                        7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi32(16 << 16));
    *r0 = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, lo, h));
    *r1 = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, hi, h));
}
#endif
/* Block of m values at x (dt) into fp32 v, its whole groups rotated (rotate); returns the largest |value| as bits.
   The values stay in x when nothing changes them (fp32, no rotation): *src says where they are. */
static uint32_t load_block_x(const char* x, int dt, int64_t m, int rotate, float* restrict v, const float** src) {
    int64_t g = 0;
    uint32_t ab = 0;
    *src = v;
    if (rotate) {
#if TS_AVX512  /* 16-lane stores, read back by quant_fast_x16's 16-lane loads (a wider load than the store that wrote
                  it is not forwarded from the store buffer, and stalls) */
        __m512i a = _mm512_setzero_si512();
        for (; g + 32 <= m; g += 32) {
            __m512 r0, r1;
            ld32(x, dt, g, &r0, &r1);
            fwht_z(&r0, &r1, TS_NORM32);
#if defined(__AVX512DQ__)
            /* The larger |value| of lanes i and i + 16 in one instruction, then the largest bits so far. The
               instruction returns the other operand where one is a nan, but here that other one is then a nan or an
               infinity: they are (a + b) n and (a - b) n of the last butterfly, both nan if a or b is, and one is a nan
               alone only as inf - inf, where the other is inf + inf. So a block with a non-finite value still reads
               as one (bits at or above 0x7f800000, a nan scale), as with the and-and-max; the codec tests decode
               blocks with nans and infinities in them. */
            a = _mm512_max_epu32(a, _mm512_castps_si512(_mm512_range_ps(r0, r1, 0x0B)));
#else
            const __m512i absm = _mm512_set1_epi32(0x7fffffff);
            a = _mm512_max_epu32(a, _mm512_and_si512(_mm512_castps_si512(r0), absm));
            a = _mm512_max_epu32(a, _mm512_and_si512(_mm512_castps_si512(r1), absm));
#endif
            _mm512_storeu_ps(v + g, r0); _mm512_storeu_ps(v + g + 16, r1);
        }
        ab = _mm512_reduce_max_epu32(a);
#elif defined(TS_VEC)
        ts_v8u a = {0, 0, 0, 0, 0, 0, 0, 0};
        for (; g + 32 <= m; g += 32) {
            ts_v8f r[4] = {ld8(x, dt, g), ld8(x, dt, g + 8), ld8(x, dt, g + 16), ld8(x, dt, g + 24)};
            fwht_v(r, TS_NORM32);
            a = amax8(amax8(amax8(amax8(a, r[0]), r[1]), r[2]), r[3]);
            memcpy(v + g, &r[0], 32); memcpy(v + g + 8, &r[1], 32);
            memcpy(v + g + 16, &r[2], 32); memcpy(v + g + 24, &r[3], 32);
        }
        for (int l = 0; l < 8; l++) ab = a[l] > ab ? a[l] : ab;
#else
        for (; g + 32 <= m; g += 32) { load_f32(x + g * (dt == DT_F32 ? 4 : 2), dt, 32, v + g); fwht32(v + g, TS_NORM32); }
        ab = absbits32((const uint32_t*)v, g);
#endif
    } else if (dt == DT_F32) {
        *src = (const float*)x;
        return absbits32((const uint32_t*)x, m);
    }
    if (g < m) {
        load_f32(x + g * (dt == DT_F32 ? 4 : 2), dt, m - g, v + g);
        const uint32_t t = absbits32((const uint32_t*)(v + g), m - g);
        ab = t > ab ? t : ab;
    }
    return ab;
}
/* The rotated and stochastic formats quantize t = fp32(y * r), r = fp32(1 / scale) (format.py: "Quantizing by the
   reciprocal"): a product, where the exact quotient of the plain formats costs a division per value (one vector
   every 5-7 cycles on AVX2 machines, 10 on AVX-512 ones). The fast paths below take normal scales, whose values
   need no lifting; they round t to nearest even or take floor(t + u) (u = c24 * 2**-24 exactly, so a fused product
   and sum rounds once, as the sum does), with no clamp for nearest: |t| <= qmax (1 + 2**-22) rounds to at most qmax. */
#if defined(__AVX2__)
typedef uint32_t ts_u32x8 __attribute__((vector_size(32)));
static inline __m256i ts_mix8(__m256i v) {
    ts_u32x8 u = (ts_u32x8)v;
    TS_MIX(u);
    return (__m256i)u;
}
static inline __m256 ts_fma8(__m256 a, __m256 b, __m256 c) {  /* a * b + c, a * b exact at every call */
#if defined(__FMA__)
    return _mm256_fmadd_ps(a, b, c);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}
/* q + off of values [0, m - m % 32) of v into bytes at q; returns how many it did. bits and sr are constants at
   each call of this body (quant_fast_x below), so the loop's constants stay in registers. */
static inline __attribute__((always_inline)) int64_t quant_fast_xt(const float* restrict v, int64_t m, float r,
                                                                   const int bits, const int sr, uint32_t bkey,
                                                                   uint8_t* restrict q) {
    const int32_t qmax = bits == 8 ? 127 : 7, bias = bits == 8 ? 128 : 8;
    const __m256 vy = _mm256_set1_ps(r), u24 = _mm256_set1_ps(0x1p-24f);
    const __m256i gold8 = _mm256_set1_epi32((int)(8u * 0x9E3779B9u)), key = _mm256_set1_epi32((int)bkey);
    __m256i jg = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)0x9E3779B9u));
    int64_t j = 0;
    for (; j + 32 <= m; j += 32) {
        __m256i w[4];
        for (int c = 0; c < 4; c++) {
            const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(v + j + 8 * c), vy);
            __m256 e;
            if (sr) {
                const __m256 c24 = _mm256_cvtepi32_ps(_mm256_srli_epi32(ts_mix8(_mm256_xor_si256(key, jg)), 8));
                jg = _mm256_add_epi32(jg, gold8);
                e = _mm256_floor_ps(ts_fma8(c24, u24, t));
            } else e = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            w[c] = _mm256_add_epi32(_mm256_cvttps_epi32(e), _mm256_set1_epi32(bias));  /* 0 <= q + bias <= 256 */
        }
        /* q + bias in 0..256 as bytes (256 saturates to 255); int8: flipping the top bit gives q */
        __m256i p = _mm256_packus_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
        if (bits == 8) p = _mm256_xor_si256(p, _mm256_set1_epi8((char)0x80));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if (sr) p = bits == 8 ? _mm256_min_epi8(_mm256_max_epi8(p, _mm256_set1_epi8((char)-qmax)), _mm256_set1_epi8((char)qmax))
                              : _mm256_min_epu8(_mm256_max_epu8(p, _mm256_set1_epi8(1)), _mm256_set1_epi8(15));
        _mm256_storeu_si256((__m256i*)(q + j), p);
    }
    return j;
}
#if !TS_AVX512  /* AVX-512 builds quantize by quant_fast_x16 */
static int64_t quant_fast_x(const float* restrict v, int64_t m, float r, int bits, int sr, uint32_t bkey,
                            uint8_t* restrict q) {
    if (bits == 8) return sr ? quant_fast_xt(v, m, r, 8, 1, bkey, q) : quant_fast_xt(v, m, r, 8, 0, bkey, q);
    return sr ? quant_fast_xt(v, m, r, 4, 1, bkey, q) : quant_fast_xt(v, m, r, 4, 0, bkey, q);
}
#endif
#endif
#if TS_AVX512
typedef uint32_t ts_u32x16 __attribute__((vector_size(64)));
static inline __m512i ts_mix16(__m512i v) {
    ts_u32x16 u = (ts_u32x16)v;
    TS_MIX(u);
    return (__m512i)u;
}
/* q + off of 16 * nr values at v (nr = 2 or 4) into bytes at q; jg holds the hash's counters of the next 16 lanes.
   The four registers' q are packed by two saturating packs and put in order by one dword permutation (each dword
   holds 4 consecutive values), where a conversion per register took two instructions on the shuffle port. */
TS_INLINE void quant_group_z(const float* restrict v, const int nr, __m512 vy, const int bits, const int sr,
                             __m512i key, __m512i* jg, uint8_t* restrict q) {
    const int32_t qmax = bits == 8 ? 127 : 7, off = bits == 8 ? 0 : 8;
    const __m512i gold16 = _mm512_set1_epi32((int)(16u * 0x9E3779B9u));
    const __m512 u24 = _mm512_set1_ps(0x1p-24f);
    __m512i w[4];
    for (int c = 0; c < 4; c++) w[c] = _mm512_setzero_si512();
    for (int c = 0; c < nr; c++) {
        const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(v + 16 * c), vy);
        if (sr) {
            const __m512 c24 = _mm512_cvtepi32_ps(_mm512_srli_epi32(ts_mix16(_mm512_xor_si512(key, *jg)), 8));
            *jg = _mm512_add_epi32(*jg, gold16);
            w[c] = _mm512_cvt_roundps_epi32(_mm512_fmadd_ps(c24, u24, t), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        } else w[c] = _mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    /* |q| <= qmax + 1 (stochastic; nearest <= qmax): the packs keep it, the clamp follows, then q + off fits a byte */
    __m512i b = _mm512_packs_epi16(_mm512_packs_epi32(w[0], w[1]), _mm512_packs_epi32(w[2], w[3]));
    b = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), b);
    if (sr) b = _mm512_max_epi8(b, _mm512_set1_epi8((char)-qmax));
    if (sr && bits == 4) b = _mm512_min_epi8(b, _mm512_set1_epi8((char)qmax));
    if (off) b = _mm512_add_epi8(b, _mm512_set1_epi8((char)off));
    if (nr == 4) _mm512_storeu_si512(q, b);
    else _mm256_storeu_si256((__m256i*)q, _mm512_castsi512_si256(b));
}
/* quant_fast_x on 16 lanes; bits and sr constant per body. */
TS_INLINE int64_t quant_fast_zt(const float* restrict v, int64_t m, float r, const int bits, const int sr,
                                uint32_t bkey, uint8_t* restrict q) {
    const __m512 vy = _mm512_set1_ps(r);
    const __m512i key = _mm512_set1_epi32((int)bkey);
    __m512i jg = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                    _mm512_set1_epi32((int)0x9E3779B9u));
    int64_t j = 0;
    for (; j + 64 <= m; j += 64) quant_group_z(v + j, 4, vy, bits, sr, key, &jg, q + j);
    if (j + 32 <= m) { quant_group_z(v + j, 2, vy, bits, sr, key, &jg, q + j); j += 32; }
    return j;
}
static int64_t quant_fast_x16(const float* restrict v, int64_t m, float r, int bits, int sr, uint32_t bkey,
                              uint8_t* restrict q) {
    if (bits == 8) return sr ? quant_fast_zt(v, m, r, 8, 1, bkey, q) : quant_fast_zt(v, m, r, 8, 0, bkey, q);
    return sr ? quant_fast_zt(v, m, r, 4, 1, bkey, q) : quant_fast_zt(v, m, r, 4, 0, bkey, q);
}
#endif
/* Block of m fp32 values (rotated already) whose largest |value| has the bits ab: its scale, and q + off as bytes
   into q. Stochastic rounding draws u from the block's key bkey and each value's offset j. */
static float quant_block_x(const float* restrict v, int64_t m, uint32_t ab, int bits, int sr, uint32_t bkey,
                           uint8_t* restrict q) {
    const int32_t qmax = bits == 8 ? 127 : 7, off = bits == 8 ? 0 : 8;
    float amax; memcpy(&amax, &ab, 4);
    const float scale = ab >= 0x7f800000u ? NAN : amax / (float)qmax;
    if (!(scale > 0.f)) { memset(q, off, (size_t)m); return scale; }
    const float up = scale < 0x1p-126f ? 0x1p24f : 1.f, r = 1.f / (scale * up);  /* a subnormal scale lifted */
    int64_t j0 = 0;
#if TS_AVX512
    if (up == 1.f) j0 = quant_fast_x16(v, m, r, bits, sr, bkey, q);
#elif defined(__AVX2__)
    if (up == 1.f) j0 = quant_fast_x(v, m, r, bits, sr, bkey, q);
#endif
    if (!sr) {
        for (int64_t j = j0; j < m; j++) {
            int32_t t = (int32_t)rintf((v[j] * up) * r);
            t = t > qmax ? qmax : t; t = t < -qmax ? -qmax : t;
            q[j] = (uint8_t)(t + off);
        }
        return scale;
    }
    const uint32_t mu = (uint32_t)m;
    for (uint32_t j = (uint32_t)j0; j < mu; j++) {  /* a 32-bit counter, so the hash vectorizes */
        const float u = (float)(int32_t)(ts_mix(bkey ^ (j * 0x9E3779B9u)) >> 8) * 0x1p-24f;
        const float t = (v[j] * up) * r + u;
        int32_t k = (int32_t)t;  /* floor by truncation and a correction: vectorizes without SSE4.1 too */
        k -= (float)k > t;
        k = k > qmax ? qmax : k; k = k < -qmax ? -qmax : k;
        q[j] = (uint8_t)(k + off);
    }
    return scale;
}
static inline void block_at(const int64_t* bs, int64_t nbr, int64_t U, int64_t block, int64_t n, int64_t J,
                            int64_t* s, int64_t* m) {
    if (!bs) { *s = J * block; *m = (*s + block < n ? *s + block : n) - *s; return; }
    const int64_t r = J / nbr, b = J - r * nbr;
    *s = r * U + bs[b]; *m = bs[b + 1] - bs[b];
}
/* Blocks J0, J0 + 1, ... in turn, as block_at gives them, without a division per block. */
typedef struct { const int64_t* bs; int64_t nbr, U, block, n, r, b; } ts_cursor;
static inline ts_cursor cursor_at(const int64_t* bs, int64_t nbr, int64_t U, int64_t block, int64_t n, int64_t J0) {
    ts_cursor c = {bs, nbr, U, block, n, bs ? J0 / nbr : 0, bs ? J0 % nbr : J0};
    return c;
}
static inline void cursor_next(ts_cursor* c, int64_t* s, int64_t* m) {
    if (!c->bs) { *s = c->b * c->block; *m = (*s + c->block < c->n ? *s + c->block : c->n) - *s; c->b++; return; }
    *s = c->r * c->U + c->bs[c->b]; *m = c->bs[c->b + 1] - c->bs[c->b];
    if (++c->b == c->nbr) { c->b = 0; c->r++; }
}
/* Units of work: [first block, end block) of unit u, and the first value of each. */
static void unit_blocks(const int64_t* bs, int64_t nbr, int64_t U, int64_t block, int64_t n, int64_t u,
                        int64_t* J0, int64_t* J1) {
    const int64_t nb = bs ? n / U * nbr : (n + block - 1) / block;
    int64_t g;
    if (bs) { int64_t R = U < 8192 ? 8192 / U : 1; if ((U & 1) && (R & 1)) R++; g = R * nbr; }
    else g = group_blocks(block);
    *J0 = u * g; *J1 = (u + 1) * g < nb ? (u + 1) * g : nb;
}
/* Unit u's blocks [J0, J1) and the values [s0, e) they cover. */
static void unit_extent(const int64_t* bs, int64_t nbr, int64_t U, int64_t block, int64_t n, int64_t u,
                        int64_t* J0, int64_t* J1, int64_t* s0, int64_t* e) {
    int64_t s, m;
    unit_blocks(bs, nbr, U, block, n, u, J0, J1);
    block_at(bs, nbr, U, block, n, *J0, s0, &m);
    block_at(bs, nbr, U, block, n, *J1 - 1, &s, &m);
    *e = s + m;
}
static int64_t unit_count(const int64_t* bs, int64_t nbr, int64_t U, int64_t block, int64_t n) {
    int64_t J0, J1; unit_blocks(bs, nbr, U, block, n, 0, &J0, &J1);
    const int64_t nb = bs ? n / U * nbr : (n + block - 1) / block, g = J1 - J0;
    return g > 0 ? (nb + g - 1) / g : 0;
}
#include <stdlib.h>
#define TS_BATCH 8             /* blocks loaded before any is quantized (ts_encode_x) */
#define TS_BATCH_VALUES 1024    /* ... or fewer, so that a batch holds about this many values */
int ts_encode_x(const void* x, int dt, int64_t n, int64_t k, const int64_t* order, const int64_t* bs, int64_t nbr,
                int64_t U, int64_t block, int bits, int rotate, int sr, uint64_t seed, uint8_t* pay, int64_t pstride,
                uint8_t* sc, int64_t sstride, int64_t ppad, int nthreads) {
    if (dt == DT_F16 && !TS_HAVE_F16) return -1;
    if (bs && (U < 1 || nbr < 1 || n % U)) return -3;
    const int64_t es = dt == DT_F32 ? 4 : 2, P = bits == 8 ? n : (n + 1) / 2;
    for (int64_t i = 0; i < k && ppad > 0; i++) memset(pay + i * pstride + P, 0, (size_t)ppad);
    const int64_t nu = unit_count(bs, nbr, U, block, n), total = k * nu;
    int64_t span = 0;  /* values of the largest unit (the first: units differ only in the last one's length) */
    if (total > 0) {
        int64_t J0, J1, s0, e;
        unit_extent(bs, nbr, U, block, n, 0, &J0, &J1, &s0, &e);
        span = e - s0;
    }
    /* Blocks are loaded (rotated, absmax taken) a batch at a time and then quantized, so that a block's scale, a
       chain of dependent steps (the absmax's reduction, two divisions), is ready before its quantizing starts
       instead of stalling it: int8:128:h encodes 1.1-1.2x as fast (docs/codecs.md). */
    int64_t nbat = TS_BATCH_VALUES / block;
    nbat = nbat < 1 ? 1 : nbat > TS_BATCH ? TS_BATCH : nbat;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if(nthreads > 1 && total > 1)
    {  /* scratch once per thread and call, not per unit: freed blocks of a thread's arena are trimmed and fault
          back in on the next allocation */
    float* v = (float*)malloc((size_t)(4 * block * nbat));
    uint8_t* qs = bits == 4 ? (uint8_t*)malloc((size_t)(span + 1)) : NULL;
    const int ok = v && (bits == 8 || qs);
    if (!ok) failed = 1;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < total; t++) {
        if (!ok) continue;
        const int64_t i = t / nu, u = t % nu, c = order ? order[i] : i;
        const char* xc = (const char*)x + c * n * es;
        uint8_t* prow = pay + i * pstride;
        int64_t J0, J1, s0, e;
        unit_extent(bs, nbr, U, block, n, u, &J0, &J1, &s0, &e);
        const uint32_t rkey = ts_row_key(seed, i);
        ts_cursor cur = cursor_at(bs, nbr, U, block, n, J0);
        for (int64_t Ja = J0; Ja < J1; Ja += nbat) {  /* a batch: every block loaded, then every block quantized */
            const int64_t nj = J1 - Ja < nbat ? J1 - Ja : nbat;
            int64_t bstart[TS_BATCH], blen[TS_BATCH];
            const float* src[TS_BATCH];
            uint32_t ab[TS_BATCH];
            for (int64_t b = 0; b < nj; b++) {
                cursor_next(&cur, &bstart[b], &blen[b]);
                ab[b] = load_block_x(xc + bstart[b] * es, dt, blen[b], rotate, v + b * block, &src[b]);
            }
            for (int64_t b = 0; b < nj; b++) {
                const int64_t J = Ja + b;
                const float scale = quant_block_x(src[b], blen[b], ab[b], bits, sr, ts_mix(rkey ^ (uint32_t)J),
                                                  bits == 8 ? prow + bstart[b] : qs + (bstart[b] - s0));
                memcpy(sc + i * sstride + 4 * J, &scale, 4);
            }
        }
        if (bits == 4) {
            int64_t cnt = e - s0;
            if (cnt & 1) qs[cnt++] = 8;  /* odd n: the last high nibble holds 0 */
            int64_t p = 0;
#if TS_AVX512  /* 64 staged values to 32 bytes: lo + 16 hi per pair (both < 16), then the low byte of each sum */
            const __m512i pair = _mm512_set1_epi16(0x1001);
            for (; p + 32 <= cnt / 2; p += 32)
                _mm256_storeu_si256((__m256i*)(prow + s0 / 2 + p),
                                    _mm512_cvtepi16_epi8(_mm512_maddubs_epi16(_mm512_loadu_si512(qs + 2 * p), pair)));
#endif
            for (; p < cnt / 2; p++) prow[s0 / 2 + p] = (uint8_t)(qs[2 * p] | (qs[2 * p + 1] << 4));
        }
    }
    free(v); free(qs);
    }
    return failed ? -4 : 0;
}
#if TS_AVX512
/* The whole groups of a rotated block (values [0, m - m % 32) from s): dequantized, rotated back in registers and
   stored as out says: 0 through st16 (bf16 rounded by hand, fp16), 1 bf16 by the conversion instruction, 2 fp32,
   3 added to fp32. bits and out are constants per body, so the loop holds no test of either. q goes into the
   butterflies as it is (int4 by a 16-entry table of nibble - 8, one permutation per 16 values; int8 by conversion)
   and the transform's last product is by fp32(scale * norm). Returns the values done. */
TS_INLINE int64_t decode_groups_zt(const uint8_t* prow, int64_t s, int64_t m, float scale, const int bits,
                                   const int out, char* ob, int dt) {
    const float f = scale * TS_NORM32;
    const __m512 tab = _mm512_cvtepi32_ps(_mm512_setr_epi32(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
    const __m128i m4 = _mm_set1_epi8(15);
    int64_t g = 0;
    for (; g + 32 <= m; g += 32) {
        __m512 r0, r1;
        if (bits == 8) {
            r0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(prow + s + g))));
            r1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(prow + s + g + 16))));
        } else {  /* lo: values p, p + 2, ..., hi: p + 1, p + 3, ...; from 16 bytes, or 17 when p is odd */
            const int64_t p = s + g;
            const __m128i b = _mm_loadu_si128((const __m128i*)(prow + p / 2));
            __m128i lo, hi;
            if (!(p & 1)) { lo = _mm_and_si128(b, m4); hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4); }
            else {
                lo = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
                hi = _mm_and_si128(_mm_loadu_si128((const __m128i*)(prow + p / 2 + 1)), m4);
            }
            r0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), tab);
            r1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), tab);
        }
        fwht_z(&r0, &r1, f);
        if (out == 2) { _mm512_storeu_ps((float*)ob + g, r0); _mm512_storeu_ps((float*)ob + g + 16, r1); }
        else if (out == 3) { st16(r0, ob, DT_F32, g, 1); st16(r1, ob, DT_F32, g + 16, 1); }
#if defined(__AVX512BF16__)
        else if (out == 1) _mm512_storeu_si512((uint16_t*)ob + g, (__m512i)_mm512_cvtne2ps_pbh(r1, r0));
#endif
        else { st16(r0, ob, dt, g, 0); st16(r1, ob, dt, g + 16, 0); }
    }
    return g;
}
#endif
#if defined(TS_VEC) && !TS_AVX512
/* 16 values of two 8-lane registers to bf16 at o[i], rounded to nearest even as f32_to_bf16 (no nan among them). */
TS_INLINE void st16_bf16_v(ts_v8f a, ts_v8f b, char* o, int64_t i) {
    ts_v8u ua, ub; memcpy(&ua, &a, 32); memcpy(&ub, &b, 32);
    const ts_v8u ra = (ua + 0x7fffu + ((ua >> 16) & 1u)) >> 16, rb = (ub + 0x7fffu + ((ub >> 16) & 1u)) >> 16;
#if defined(__AVX2__)  /* both < 2**16, so the pack does not saturate; it interleaves 128-bit halves, the permutation
                          puts them back in order */
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32((__m256i)ra, (__m256i)rb), 0xD8);
    _mm256_storeu_si256((__m256i*)((uint16_t*)o + i), w);
#else
    const ts_v8h ha = __builtin_convertvector(ra, ts_v8h), hb = __builtin_convertvector(rb, ts_v8h);
    memcpy((uint16_t*)o + i, &ha, 16); memcpy((uint16_t*)o + i + 8, &hb, 16);
#endif
}
/* decode_groups_zt with 8-lane vectors: the whole groups of a rotated block dequantized, rotated back and stored as
   out says (0 through st8, 1 bf16, 2 fp32, 3 added to fp32); bits and out constant per body. bf16 rounds 16 values
   per pack, a group with a nan goes through st8. Returns the values done. */
TS_INLINE int64_t decode_groups_vt(const uint8_t* prow, int64_t s, int64_t m, float scale, const int bits,
                                   const int out, char* ob, int dt) {
    const ts_v8f one = {1, 1, 1, 1, 1, 1, 1, 1};  /* q as it is; the transform's last product takes the scale */
    const float f = scale * TS_NORM32;
    int64_t g = 0;
    for (; g + 32 <= m; g += 32) {
        ts_v8f r[4];
#if defined(__AVX2__)
        if (bits == 4 && !((s + g) & 1)) {  /* 16 bytes: low nibbles are the even values, high the odd ones */
            const __m128i b = _mm_loadu_si128((const __m128i*)(prow + (s + g) / 2)), m4 = _mm_set1_epi8(15);
            const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
            const __m128i e8 = _mm_set1_epi8(8);
            const __m128i v0 = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), e8);
            const __m128i v1 = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), e8);
            r[0] = (ts_v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
            r[1] = (ts_v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
            r[2] = (ts_v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
            r[3] = (ts_v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
        } else
#endif
        for (int R = 0; R < 4; R++) r[R] = dq8(prow, s + g + 8 * R, bits, one);
        fwht_v(r, f);
        if (out == 1) {
            const ts_v8i nan = (r[0] != r[0]) | (r[1] != r[1]) | (r[2] != r[2]) | (r[3] != r[3]);
            ts_v8i none = {0, 0, 0, 0, 0, 0, 0, 0};
            if (!memcmp(&nan, &none, 32)) { st16_bf16_v(r[0], r[1], ob, g); st16_bf16_v(r[2], r[3], ob, g + 16); continue; }
        }
        for (int R = 0; R < 4; R++) st8(r[R], ob, out == 0 || out == 1 ? dt : DT_F32, g + 8 * R, out == 3);
    }
    return g;
}
#endif
/* FN (decode_groups_zt or decode_groups_vt) with its output kind out as a constant, so each kind gets its own body */
#define TS_DEC_GROUPS(FN, BITS) \
    (out == 1 ? FN(prow, s, m, scale, BITS, 1, ob, dt) : out == 2 ? FN(prow, s, m, scale, BITS, 2, ob, dt) \
     : out == 3 ? FN(prow, s, m, scale, BITS, 3, ob, dt) : FN(prow, s, m, scale, BITS, 0, ob, dt))
/* Decode one block: dequantize, rotate back (rotate) and store or add; whole groups in registers, the rest in v. */
static void decode_block_x(const uint8_t* prow, const uint8_t* scrow, int64_t J, int64_t s, int64_t m, int bits,
                           int rotate, float* restrict v, char* o, int dt, int add) {
    const float scale = load_scale(scrow, J);
    const int64_t es = add || dt == DT_F32 ? 4 : 2;
    char* ob = o + s * es;
    int64_t g = 0;
    if (rotate) {
#if TS_AVX512
        int out = add ? 3 : dt == DT_F32 ? 2 : 0;
#if defined(__AVX512BF16__)
        /* bf16 output by the conversion instruction, which rounds like torch but flushes subnormals (a nan keeps
           its payload, which the format leaves open). No output is subnormal when scale >= 2**-100: a nonzero
           output is a nonzero integer times fp32(scale * 0.177) >= 2**-103. */
        if (dt == DT_BF16 && !add && scale >= 0x1p-100f) out = 1;
#endif
        g = bits == 8 ? TS_DEC_GROUPS(decode_groups_zt, 8) : TS_DEC_GROUPS(decode_groups_zt, 4);
#elif defined(TS_VEC)
        const int out = add ? 3 : dt == DT_F32 ? 2 : dt == DT_BF16 ? 1 : 0;
        g = bits == 8 ? TS_DEC_GROUPS(decode_groups_vt, 8) : TS_DEC_GROUPS(decode_groups_vt, 4);
#else
        for (; g + 32 <= m; g += 32) {
            dq_values(prow, s + g, 32, bits, 1.f, v);
            fwht32(v, scale * TS_NORM32);
            store_f32(v, 32, ob + g * es, dt, add);
        }
#endif
    }
    if (g < m) {
        dq_values(prow, s + g, m - g, bits, scale, v);
        store_f32(v, m - g, ob + g * es, dt, add);
    }
}
int ts_decode_x(const uint8_t* pay, int64_t pstride, const uint8_t* sc, int64_t sstride, int64_t k, int64_t n,
                const int64_t* bs, int64_t nbr, int64_t U, int64_t block, int bits, int rotate, void* out, int dt,
                int64_t ostride, int sum, int nthreads) {
    if (dt == DT_F16 && !TS_HAVE_F16) return -1;
    if (sum && dt != DT_F32) return -2;
    if (bs && (U < 1 || nbr < 1 || n % U)) return -3;
    if (sum && k == 0) { memset(out, 0, (size_t)(n * 4)); return 0; }
    const int64_t nu = unit_count(bs, nbr, U, block, n), total = sum ? nu : k * nu, es = dt == DT_F32 ? 4 : 2;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) if(nthreads > 1 && total > 1)
    {  /* scratch once per thread and call (see ts_encode_x) */
    float* v = (float*)malloc((size_t)(4 * block));
    if (!v) failed = 1;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < total; t++) {
        if (!v) continue;
        const int64_t i0 = sum ? 0 : t / nu, u = sum ? t : t % nu, i1 = sum ? k : i0 + 1;
        int64_t J0, J1, s, m;
        unit_blocks(bs, nbr, U, block, n, u, &J0, &J1);
        for (int64_t i = i0; i < i1; i++) {  /* row order, as the reference adds */
            ts_cursor cur = cursor_at(bs, nbr, U, block, n, J0);
            for (int64_t J = J0; J < J1; J++) {
                cursor_next(&cur, &s, &m);
                decode_block_x(pay + i * pstride, sc + i * sstride, J, s, m, bits, rotate, v,
                               sum ? (char*)out : (char*)out + i * ostride * es, sum ? DT_F32 : dt, sum && i > 0);
            }
        }
    }
    free(v);
    }
    return failed ? -4 : 0;
}
