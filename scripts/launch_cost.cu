// The driver's own host cost of one cuLaunchKernel (issue 13): how much of a Python call's
// launch time is libcuda's and how much is the binding's. No Python, no ctypes.
//   nvcc -O2 -arch=sm_90 scripts/launch_cost.cu -lcuda -o /tmp/launch_cost && /tmp/launch_cost
// A spin kernel first holds the stream busy for longer than a round, so the launches only
// queue and the time is the host's alone. The launched kernel takes one struct of the size
// of the attention kernel's (DrafterParams plus two 128-byte TMA maps); the kernel does nothing.
// Prints the median and p10/p90 over rounds, us per "call": one and two launches, then the
// same two kernels as one instantiated graph (attention-sized struct, then a 48-byte one, as
// the split combine's), launched as it is and after rewriting one or both nodes' arguments
// (cuGraphExecKernelNodeSetParams, what a per-call pointer change costs).
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

struct Args { char bytes[384]; };
struct SmallArgs { char bytes[48]; };

__global__ void empty_kernel(Args a) {
  if (a.bytes[0] == 42 && threadIdx.x == 1000) a.bytes[1] = 0;  // never true; keeps the param
}
__global__ void empty_small(SmallArgs a) {
  if (a.bytes[0] == 42 && threadIdx.x == 1000) a.bytes[1] = 0;
}

__global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {}
}

#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { \
  std::printf("%s failed: %d\n", #x, (int)r); return 1; } } while (0)

template <class F>
int rounds_of(const char* name, CUstream stream, F&& call) {
  const int calls = 200, rounds = 30;
  std::vector<double> us;
  for (int r = 0; r < rounds + 2; ++r) {
    spin<<<1, 1, 0, (cudaStream_t)stream>>>(200000000LL);  // ~0.1 s
    auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < calls; ++c)
      if (call()) return 1;
    auto t1 = std::chrono::steady_clock::now();
    bool busy = cuStreamQuery(stream) == CUDA_ERROR_NOT_READY;
    CK(cuStreamSynchronize(stream));
    if (r >= 2 && busy)
      us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
  }
  std::sort(us.begin(), us.end());
  if (us.empty()) { std::printf("%-44s every round went idle\n", name); return 0; }
  std::printf("%-44s median %.2f us, p10 %.2f, p90 %.2f (%zu busy rounds)\n", name,
              us[us.size() / 2], us[us.size() / 10], us[us.size() * 9 / 10], us.size());
  return 0;
}

int main() {
  cudaFree(0);
  CUfunction fn, small;
  if (cudaGetFuncBySymbol(&fn, (const void*)empty_kernel) != cudaSuccess) return 1;
  if (cudaGetFuncBySymbol(&small, (const void*)empty_small) != cudaSuccess) return 1;
  CUstream stream;
  CK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  Args args{};
  SmallArgs sargs{};
  void* params[] = {&args};
  void* sparams[] = {&sargs};
  auto launch = [&](CUfunction f, void** p) {
    return cuLaunchKernel(f, 16, 8, 1, 128, 1, 1, 0, stream, p, nullptr) != CUDA_SUCCESS;
  };
  if (rounds_of("1 launch a call", stream, [&] { return launch(fn, params); })) return 1;
  if (rounds_of("2 launches a call", stream,
                [&] { return launch(fn, params) || launch(fn, params); })) return 1;
  if (rounds_of("2 launches a call (big + small)", stream,
                [&] { return launch(fn, params) || launch(small, sparams); })) return 1;

  // The same two kernels as a graph: node 2 after node 1.
  CUgraph graph;
  CK(cuGraphCreate(&graph, 0));
  CUDA_KERNEL_NODE_PARAMS kp{}, ks{};
  kp.func = fn; kp.gridDimX = 16; kp.gridDimY = 8; kp.gridDimZ = 1;
  kp.blockDimX = 128; kp.blockDimY = 1; kp.blockDimZ = 1; kp.kernelParams = params;
  ks = kp; ks.func = small; ks.kernelParams = sparams;
  CUgraphNode n1, n2;
  CK(cuGraphAddKernelNode(&n1, graph, nullptr, 0, &kp));
  CK(cuGraphAddKernelNode(&n2, graph, &n1, 1, &ks));
  CUgraphExec exec;
  CK(cuGraphInstantiate(&exec, graph, 0));
  CK(cuGraphUpload(exec, stream));
  CK(cuStreamSynchronize(stream));
  auto glaunch = [&] { return cuGraphLaunch(exec, stream) != CUDA_SUCCESS; };
  auto set1 = [&] {
    args.bytes[0] ^= 1;  // a per-call pointer change
    return cuGraphExecKernelNodeSetParams(exec, n1, &kp) != CUDA_SUCCESS;
  };
  auto set2 = [&] {
    sargs.bytes[0] ^= 1;
    return cuGraphExecKernelNodeSetParams(exec, n2, &ks) != CUDA_SUCCESS;
  };
  if (rounds_of("graph of 2, launched as is", stream, glaunch)) return 1;
  if (rounds_of("graph of 2, 1 node's args set, launched", stream,
                [&] { return set1() || glaunch(); })) return 1;
  if (rounds_of("graph of 2, both nodes' args set, launched", stream,
                [&] { return set1() || set2() || glaunch(); })) return 1;
  if (rounds_of("set one node's args only", stream, set1)) return 1;
  return 0;
}
