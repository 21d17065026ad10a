// The driver's own host cost of one cuLaunchKernel (issue 13): how much of a Python call's
// launch time is libcuda's and how much is the binding's. No Python, no ctypes.
//   nvcc -O2 -arch=sm_90 scripts/launch_cost.cu -lcuda -o /tmp/launch_cost && /tmp/launch_cost
// A spin kernel first holds the stream busy for longer than a round, so the launches only
// queue and the time is the host's alone. The launched kernel takes one struct of the size
// of the attention kernel's (DrafterParams plus two 128-byte TMA maps); the kernel does nothing.
// Prints the median and p10/p90 over rounds, us per launch, one and two launches per "call".
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

struct Args { char bytes[384]; };

__global__ void empty_kernel(Args a) {
  if (a.bytes[0] == 42 && threadIdx.x == 1000) a.bytes[1] = 0;  // never true; keeps the param
}

__global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {}
}

#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { \
  std::printf("%s failed: %d\n", #x, (int)r); return 1; } } while (0)

int main() {
  cudaFree(0);
  CUfunction fn;
  if (cudaGetFuncBySymbol(&fn, (const void*)empty_kernel) != cudaSuccess) return 1;
  CUstream stream;
  CK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  Args args{};
  void* params[] = {&args};
  const int calls = 200, rounds = 30;
  for (int per_call : {1, 2}) {
    std::vector<double> us;
    for (int r = 0; r < rounds + 2; ++r) {
      spin<<<1, 1, 0, (cudaStream_t)stream>>>(200000000LL);  // ~0.1 s
      auto t0 = std::chrono::steady_clock::now();
      for (int c = 0; c < calls; ++c)
        for (int k = 0; k < per_call; ++k)
          CK(cuLaunchKernel(fn, 16, 8, 1, 128, 1, 1, 0, stream, params, nullptr));
      auto t1 = std::chrono::steady_clock::now();
      bool busy = cuStreamQuery(stream) == CUDA_ERROR_NOT_READY;
      CK(cuStreamSynchronize(stream));
      if (r >= 2 && busy)
        us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
    }
    std::sort(us.begin(), us.end());
    if (us.empty()) { std::printf("%d launch(es): every round went idle\n", per_call); continue; }
    std::printf("%d launch(es) a call: median %.2f us, p10 %.2f, p90 %.2f (%zu busy rounds)\n",
                per_call, us[us.size() / 2], us[us.size() / 10], us[us.size() * 9 / 10],
                us.size());
  }
  return 0;
}
