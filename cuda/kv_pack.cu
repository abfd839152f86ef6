// Pack and unpack paged KV blocks: the copies a serving engine makes when it sends a
// paged cache as one message (or one per layer) instead of one message per block.
//
//   gather_blocks:  out[i]            = pool[table[i]]   for i in 0..n_blocks-1
//   scatter_blocks: pool[table[i]]    = in[i]
//
// A block is `block_bytes` contiguous bytes ([block_size, kv_heads, head_dim] elements).
// One CUDA block per KV block; threads copy 16-byte words when both sides are 16-byte
// aligned (the usual case: block_bytes is a multiple of 16 for every real model), and
// single bytes otherwise. Plain CUDA C with extern "C" names, so it compiles with nvcc
// on its own and loads at run time through NVRTC (kvbench/cuda_kernels.py).

typedef unsigned char u8;
typedef long long i64;

struct alignas(16) word16 { unsigned int a, b, c, d; };

__device__ __forceinline__ void copy_block(const u8* __restrict__ src, u8* __restrict__ dst,
                                           i64 nbytes) {
    const bool aligned = ((((unsigned long long)src) | ((unsigned long long)dst) | nbytes) & 15) == 0;
    if (aligned) {
        const word16* s = reinterpret_cast<const word16*>(src);
        word16* d = reinterpret_cast<word16*>(dst);
        for (i64 k = threadIdx.x; k < nbytes / 16; k += blockDim.x) d[k] = s[k];
    } else {
        for (i64 k = threadIdx.x; k < nbytes; k += blockDim.x) dst[k] = src[k];
    }
}

extern "C" __global__ void gather_blocks(const u8* __restrict__ pool, const i64* __restrict__ table,
                                         u8* __restrict__ out, i64 block_bytes, i64 n_blocks) {
    for (i64 i = blockIdx.x; i < n_blocks; i += gridDim.x)
        copy_block(pool + table[i] * block_bytes, out + i * block_bytes, block_bytes);
}

extern "C" __global__ void scatter_blocks(const u8* __restrict__ in, const i64* __restrict__ table,
                                          u8* __restrict__ pool, i64 block_bytes, i64 n_blocks) {
    for (i64 i = blockIdx.x; i < n_blocks; i += gridDim.x)
        copy_block(in + i * block_bytes, pool + table[i] * block_bytes, block_bytes);
}

// copy_blocks: dst[i] = src[i] for n_blocks blocks of block_bytes each, src and dst given as
// device tables of byte addresses (one entry per KV block). One launch packs (or unpacks) a
// whole handoff over every layer and part, wherever each pool lies: the tables are built
// once per message plan (kvbench/p2p/cuda_kernels.py, BlockPacker) and reused every handoff.
extern "C" __global__ void copy_blocks(const i64* __restrict__ src, const i64* __restrict__ dst,
                                       i64 block_bytes, i64 n_blocks) {
    for (i64 i = blockIdx.x; i < n_blocks; i += gridDim.x)
        copy_block(reinterpret_cast<const u8*>(src[i]), reinterpret_cast<u8*>(dst[i]), block_bytes);
}
