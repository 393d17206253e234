// ggml's 8-lane SiLU (`ggml_v_silu` for AVX2 + FMA, from ggml-cpu/vec.h) on the same values as
// ops.cpp's SiLU, compiled without AVX-512 so that this machine runs the code an AVX2-only
// llama.cpp build runs. Output: {"x": [f32 bits], "y": [f32 bits]}. Built and run by
// scripts/check-ggml-ops.sh for the engine's ignored test
// `activation::tests::silu8_equals_ggmls_avx2_build`.
#include "vec.h"

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

static unsigned bits(float f) { unsigned u; memcpy(&u, &f, 4); return u; }

int main() {
    std::vector<float> x = {0.0f, -0.0f, 88.0f, -88.0f, 104.0f, -104.0f, 150.0f, -150.0f};
    for (double v = 1e-30; v < 1e6; v *= 1.0013) {
        x.push_back((float) v);
        x.push_back((float) -v);
    }
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int i = 0; i < 20000; i++) x.push_back(nd(rng) * 8.0f);
    while (x.size() % 8) x.push_back(1.0f);
    printf("{\"x\": [");
    for (size_t i = 0; i < x.size(); i++) printf("%s%u", i ? ", " : "", bits(x[i]));
    printf("], \"y\": [");
    for (size_t i = 0; i < x.size(); i += 8) {
        float o[8];
        _mm256_storeu_ps(o, ggml_v_silu(_mm256_loadu_ps(&x[i])));
        for (int j = 0; j < 8; j++) printf("%s%u", (i + j) ? ", " : "", bits(o[j]));
    }
    printf("]}\n");
    return 0;
}
