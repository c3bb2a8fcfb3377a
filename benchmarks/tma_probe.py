"""Does a page-major V box work? One TMA load of a 5-D map whose strides do not increase.

    PYTHONPATH=. python benchmarks/tma_probe.py

A page pool [P, Hkv, ps, D] (bf16, D 128) seen as (64, ps, D / 64, Hkv, P), innermost first,
with byte strides (row 256, panel 128, head, page): the panel stride (128 B) is below the row
stride (256 B). One box (64, ps, D / 64, 1, 1) would bring a whole page of one head as
[panel][row] 128-byte swizzled rows in one issue, where the pool maps now take one box per
64-column panel. The probe encodes that map (does the driver accept the strides?), loads one
box with one thread into 1024-aligned shared memory, copies the bytes out and compares them
with the 128-byte swizzle of the expected [panel][row] order. It prints what it found.
"""
import ctypes
import sys

import numpy as np
import torch

from prims_ts.cuda import runtime

SOURCE = r'''
struct ProbeArgs {  // one by-value struct, as the package's kernels take (PreparedLaunch passes one pointer)
    const unsigned long long* tmap;
    unsigned int* out;
    int page, head;
};
extern "C" __global__ void pt_tma_probe(const ProbeArgs a) {
    const unsigned long long* tmap = a.tmap;
    unsigned int* out = a.out;
    const int page = a.page, head = a.head;
    extern __shared__ unsigned char raw[];
    unsigned char* smem = raw + ((1024 - ((unsigned long long)raw & 1023)) & 1023);
    __shared__ __align__(8) unsigned long long bar;
    const unsigned int bytes = BOX_BYTES;
    unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
    unsigned int b = (unsigned int)__cvta_generic_to_shared(&bar);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(bytes) : "memory");
        asm volatile(
            "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
            :: "r"(s), "l"(tmap), "r"(0), "r"(0), "r"(0), "r"(head), "r"(page), "r"(b) : "memory");
        asm volatile(
            "{\n .reg .pred p;\n WAIT:\n"
            " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n"
            " @!p bra WAIT;\n}" :: "r"(b) : "memory");
    }
    __syncthreads();
    for (unsigned int i = threadIdx.x; i < bytes / 4; i += blockDim.x)
        out[i] = reinterpret_cast<const unsigned int*>(smem)[i];
}
'''


class Args(ctypes.Structure):
    _fields_ = [("tmap", ctypes.c_void_p), ("out", ctypes.c_void_p), ("page", ctypes.c_int32),
                ("head", ctypes.c_int32)]


def main() -> int:
    ps, hkv, d, pages = 16, 2, 128, 5
    panels = d // 64
    pool = torch.arange(pages * hkv * ps * d, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    pool = pool.view(pages, hkv, ps, d).cuda()
    es = 2
    dims = (64, ps, panels, hkv, pages)
    strides = (d * es, 64 * es, ps * d * es, hkv * ps * d * es)  # row, panel, head, page (bytes)
    box = (64, ps, panels, 1, 1)
    box_bytes = 64 * ps * panels * es
    try:
        enc = runtime.TileMapEncoder("bf16", dims, strides, box, "page-major V")
        tmap = runtime.TensorMap()
        enc.encode(tmap, pool.data_ptr())
    except Exception as e:
        print(f"encode refused: {e}")
        return 1
    print("encode accepted: dims", dims, "strides", strides, "box", box)
    ks = runtime.KernelSource("probe:tma5d", "pt_tma_probe", SOURCE.replace("BOX_BYTES", str(box_bytes)))
    kernel = runtime.get_kernel(0, ks, box_bytes + 1024, 128)
    tmap_dev = torch.empty(16, dtype=torch.int64, device="cuda")
    tmap_dev.copy_(torch.from_numpy(np.array(list(tmap.opaque), dtype=np.uint64).view(np.int64)))
    ok = True
    for page, head in ((0, 0), (3, 1), (4, 0)):
        out = torch.full((box_bytes // 4,), -1, dtype=torch.int32, device="cuda")
        args = Args(tmap_dev.data_ptr(), out.data_ptr(), page, head)
        runtime.PreparedLaunch(kernel, "pt_tma_probe", (1, 1, 1), args).launch(runtime.current_stream(0))
        torch.cuda.synchronize()
        got = out.cpu().view(torch.uint8).numpy()
        src = pool[page, head].cpu().view(torch.uint8).numpy().reshape(ps, panels, 128)  # [row][panel][128 B]
        want = bytearray(box_bytes)
        for p in range(panels):
            for r in range(ps):
                for c in range(8):  # 16-byte chunks, 128-byte swizzle: chunk ^ (row % 8) within 1024 B
                    at = p * ps * 128 + r * 128 + ((c ^ (r % 8)) * 16)
                    want[at:at + 16] = src[r, p, c * 16:(c + 1) * 16].tobytes()
        same = bytes(got) == bytes(want)
        plain = bytes(got) == src.transpose(1, 0, 2).tobytes()
        print(f"page {page} head {head}: [panel][row] swizzled {'matches' if same else 'differs'}"
              f"{' (unswizzled [panel][row] matches)' if plain else ''}")
        ok &= same
    print("page-major V box:", "usable" if ok else "NOT as expected")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
