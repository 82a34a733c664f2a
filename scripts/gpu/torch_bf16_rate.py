#!/usr/bin/env python3
"""PyTorch's bf16 matmul rate on this GPU (8192³, best of 20, CUDA events) and its device copy bandwidth (1 GiB,
best of 10, read + write bytes): the references for cuda_bench's figures. Prints one JSON object."""
import json

import torch


def best_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def main():
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = best_ms(lambda: a @ b, 20)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = best_ms(lambda: dst.copy_(src), 10)
    print(json.dumps({
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "bf16_matmul_8192_ms": ms,
        "bf16_matmul_tflops": 2 * n**3 / (ms / 1e3) / 1e12,
        "copy_dtod_gbs": 2 * (1 << 30) / (copy_ms / 1e3) / 1e9,
    }, indent=1))


if __name__ == "__main__":
    main()
