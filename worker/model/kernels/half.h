/* fp16 <-> fp32 bits, shared by the attention kernels (fp16 caches) and the quantized
 * weights (fp16 block scales). */
#ifndef TOKENRELAY_HALF_H
#define TOKENRELAY_HALF_H
#include <stdint.h>
#include <string.h>

static inline float float_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t bits_from_float(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* IEEE half to float, exact for every input, written with selects on integers
 * (no branches) so the loop using it vectorises where there is no F16C. */
static inline float half_to_float(uint16_t h) {
    const uint32_t em = h & 0x7fffu; /* exponent and mantissa */
    const uint32_t rebias = (em >= 0x7c00u ? 255u - 31u : 127u - 15u) << 23; /* inf/nan: all ones */
    const uint32_t normal = (em << 13) + rebias;
    const uint32_t small = bits_from_float((float)(int32_t)em * 0x1p-24f); /* zero, subnormals */
    const uint32_t is_small = 0u - (uint32_t)(em < 0x0400u);                  /* all ones or 0 */
    return float_from_bits(((small & is_small) | (normal & ~is_small)) | (uint32_t)(h & 0x8000u) << 16);
}

#endif
