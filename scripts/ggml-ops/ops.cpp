// Dumps what ggml's CPU backend computes for the ops `--numerics llama-cpp` reproduces, so that
// engine tests can compare bit for bit (scripts/check-ggml-ops.sh builds this against the
// llama.cpp build of scripts/build-llamacpp.sh and runs the ignored tests that read the dump):
//   - activation quantization: `from_float` of Q8_1 and Q8_0 (ggml's x86 `quantize_row_q8_1` /
//     `quantize_row_q8_0`) on blocks of 32 finite values at many scales, with exact ties;
//   - GELU: `ggml_gelu` on every finite f16 value and on values beyond ±10;
//   - SiLU: `ggml_silu` (the vector `expf` of the CPU ggml was built for) over magnitudes 1e-30
//     to 1e6 of both signs, zeros, saturation, and 20,000 normal samples.
// Output (stdout), one JSON object: {"blocks": [{"x": [f32 bits], "q8_1": {"d": f16 bits,
// "s": f16 bits, "qs": [...]}, "q8_0": {"d", "qs"}}], "gelu": {"x": [f32 bits], "y": [f32 bits]},
// "silu": {"x", "y"}}.
#include "ggml.h"
#include "ggml-cpu.h"
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

static uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

int main() {
    ggml_cpu_init();
    std::mt19937 rng(20261205);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<std::vector<float>> blocks;
    for (float scale : {1e-20f, 1e-6f, 0.01f, 1.0f, 3.0f, 127.0f, 3e5f, 1e20f}) {
        for (int b = 0; b < 16; b++) {
            std::vector<float> x(32);
            for (auto & v : x) v = nd(rng) * scale;
            blocks.push_back(x);
        }
    }
    // Exact ties: amax 127 makes 127/amax = 1, so j + 0.5 lands on .5.
    {
        std::vector<float> x(32);
        for (int j = 0; j < 32; j++) x[j] = j == 0 ? 127.0f : (float)(j - 16) + 0.5f;
        blocks.push_back(x);
        for (auto & v : x) v = -v;
        blocks.push_back(x);
    }
    blocks.push_back(std::vector<float>(32, 0.0f));
    const auto * q81 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_1);
    const auto * q80 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_0);
    printf("{\"blocks\": [");
    for (size_t i = 0; i < blocks.size(); i++) {
        const auto & x = blocks[i];
        uint8_t b1[36], b0[34];  // block_q8_1: d, s (f16), qs[32]; block_q8_0: d, qs[32]
        q81->from_float(x.data(), b1, 32);
        q80->from_float(x.data(), b0, 32);
        uint16_t d1, s1, d0;
        memcpy(&d1, b1, 2); memcpy(&s1, b1 + 2, 2); memcpy(&d0, b0, 2);
        printf("%s{\"x\": [", i ? ", " : "");
        for (int j = 0; j < 32; j++) printf("%s%u", j ? ", " : "", bits(x[j]));
        printf("], \"q8_1\": {\"d\": %u, \"s\": %u, \"qs\": [", d1, s1);
        for (int j = 0; j < 32; j++) printf("%s%d", j ? ", " : "", (int)(int8_t)b1[4 + j]);
        printf("]}, \"q8_0\": {\"d\": %u, \"qs\": [", d0);
        for (int j = 0; j < 32; j++) printf("%s%d", j ? ", " : "", (int)(int8_t)b0[2 + j]);
        printf("]}}");
    }
    printf("], ");
    // GELU on every finite f16 value, and beyond the table's ±10 range.
    std::vector<float> gx;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = ggml_fp16_to_fp32((ggml_fp16_t)h);
        if (std::isfinite(f)) gx.push_back(f);
    }
    for (float f : {-1e6f, -10.5f, -10.0f, -9.99f, 9.99f, 10.0f, 10.5f, 1e6f}) gx.push_back(f);
    ggml_init_params ip = { gx.size() * 8 + 64 * 1024 * 1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * t = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, (int64_t)gx.size());
    memcpy(t->data, gx.data(), gx.size() * 4);
    ggml_tensor * g = ggml_gelu(ctx, t);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, g);
    ggml_graph_compute_with_ctx(ctx, gf, 1);
    const float * gy = (const float *) g->data;
    printf("\"gelu\": {\"x\": [");
    for (size_t i = 0; i < gx.size(); i++) printf("%s%u", i ? ", " : "", bits(gx[i]));
    printf("], \"y\": [");
    for (size_t i = 0; i < gx.size(); i++) printf("%s%u", i ? ", " : "", bits(gy[i]));
    printf("]}, ");
    // SiLU over magnitudes 1e-30 .. 1e6 of both signs (geometric steps), zeros, and where the
    // vector expf saturates; a multiple of 16 values, so every one takes the vector path.
    std::vector<float> sx = {0.0f, -0.0f, 88.0f, -88.0f, 104.0f, -104.0f, 150.0f, -150.0f};
    for (double v = 1e-30; v < 1e6; v *= 1.0013) {
        sx.push_back((float) v);
        sx.push_back((float) -v);
    }
    for (int i = 0; i < 20000; i++) sx.push_back(nd(rng) * 8.0f);
    while (sx.size() % 16) sx.push_back(1.0f);
    ggml_tensor * st = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, (int64_t) sx.size());
    memcpy(st->data, sx.data(), sx.size() * 4);
    ggml_tensor * sl = ggml_silu(ctx, st);
    ggml_cgraph * sg = ggml_new_graph(ctx);
    ggml_build_forward_expand(sg, sl);
    ggml_graph_compute_with_ctx(ctx, sg, 1);
    const float * sy = (const float *) sl->data;
    printf("\"silu\": {\"x\": [");
    for (size_t i = 0; i < sx.size(); i++) printf("%s%u", i ? ", " : "", bits(sx[i]));
    printf("], \"y\": [");
    for (size_t i = 0; i < sx.size(); i++) printf("%s%u", i ? ", " : "", bits(sy[i]));
    printf("]}}\n");
    ggml_free(ctx);
    return 0;
}
