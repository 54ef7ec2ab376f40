// The GPU self-test's kernels. agent/gpus/selftest.py loads them as PTX through the driver API
// (cuModuleLoadData), so the self-test needs only the driver on a node: a device-memory pattern
// test (every word written, then read back against the same pattern) and an FMA throughput test.
#include <stdint.h>

__device__ __forceinline__ uint32_t ferry_pattern(uint64_t i, uint32_t seed) {
  // A hash of the word's index: neighbouring words differ in about half their bits, so a stuck
  // bit, a bad row or a wrong address shows wherever it falls.
  uint32_t x = (uint32_t)(i ^ (i >> 32)) ^ seed;
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

extern "C" __global__ void ferry_fill(uint32_t* words, uint64_t n, uint32_t seed) {
  const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    words[i] = ferry_pattern(i, seed);
  }
}

extern "C" __global__ void ferry_check(const uint32_t* words, uint64_t n, uint32_t seed,
                                       unsigned long long* bad) {
  const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
  unsigned long long mine = 0;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    mine += words[i] != ferry_pattern(i, seed);
  }
  if (mine) atomicAdd(bad, mine);
}

// Eight independent FMA chains per thread (16 flops an iteration), so the SMs' FMA pipes, not
// a chain's latency, bound it; the sum is written so that nothing is optimised away.
extern "C" __global__ void ferry_fma(float* out, uint32_t iters) {
  float a[8];
  for (int k = 0; k < 8; k++) a[k] = (threadIdx.x + k) * 1e-3f;
  const float b = 0.999f, c = 1e-4f;
  for (uint32_t it = 0; it < iters; it++) {
#pragma unroll
    for (int k = 0; k < 8; k++) a[k] = fmaf(a[k], b, c);
  }
  float s = 0.0f;
  for (int k = 0; k < 8; k++) s += a[k];
  out[(uint64_t)blockIdx.x * blockDim.x + threadIdx.x] = s;
}
