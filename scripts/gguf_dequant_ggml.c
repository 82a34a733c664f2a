/* Dequantize every tensor of a GGUF file with ggml's own row converters (ggml_get_type_traits()->to_float), for
 * scripts/make_gguf_fixtures.py to check gguf-py's dequantizers (which make the fixtures' references) against
 * llama.cpp's. Output: for each tensor, u32 name length, the name, u64 element count, that many f32 values.
 * build: cc -O1 -I$LCPP_SRC/ggml/include gguf_dequant_ggml.c -L$LCPP_BIN -lggml-base -Wl,-rpath,$LCPP_BIN
 * usage: gguf_dequant_ggml MODEL.gguf OUT.bin */
#include "ggml.h"
#include "gguf.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.bin\n", argv[0]);
        return 2;
    }
    struct ggml_context * ctx = NULL;
    struct gguf_init_params params = { /*no_alloc =*/ false, /*ctx =*/ &ctx };
    struct gguf_context * g = gguf_init_from_file(argv[1], params);
    if (!g) {
        fprintf(stderr, "cannot read %s\n", argv[1]);
        return 1;
    }
    FILE * out = fopen(argv[2], "wb");
    if (!out) {
        return 1;
    }
    const int64_t n_tensors = gguf_get_n_tensors(g);
    for (int64_t i = 0; i < n_tensors; i++) {
        const char * name = gguf_get_tensor_name(g, i);
        struct ggml_tensor * t = ggml_get_tensor(ctx, name);
        const int64_t n = ggml_nelements(t);
        float * buf = malloc(sizeof(float) * (size_t) n);
        if (t->type == GGML_TYPE_F32) {
            memcpy(buf, t->data, sizeof(float) * (size_t) n);
        } else {
            const struct ggml_type_traits * tr = ggml_get_type_traits(t->type);
            if (!tr->to_float) {
                fprintf(stderr, "no to_float for %s\n", name);
                return 1;
            }
            tr->to_float(t->data, buf, n);
        }
        const uint32_t len = (uint32_t) strlen(name);
        const uint64_t n64 = (uint64_t) n;
        fwrite(&len, 4, 1, out);
        fwrite(name, 1, len, out);
        fwrite(&n64, 8, 1, out);
        fwrite(buf, sizeof(float), (size_t) n, out);
        free(buf);
    }
    fclose(out);
    gguf_free(g);
    ggml_free(ctx);
    return 0;
}
