// Launcher-API helpers shared by every GPU kernel file: status text and the warp size.
#include "launch.h"
#include "portability.h"

namespace moelab::gpu {

const char* status_string(int status) {
  switch (status) {
    case kOk: return "ok";
    case kBadArgument: return "bad argument (a size, pointer or stride the kernel cannot take)";
    case kUnsupported: return "unsupported by the GPU kernel";
    default: break;
  }
#if MOELAB_HIP
  return status > 0 ? hipGetErrorString(static_cast<hipError_t>(status)) : "unknown status";
#else
  return status > 0 ? cudaGetErrorString(static_cast<cudaError_t>(status)) : "unknown status";
#endif
}

int warp_size() { return kWarp; }

}  // namespace moelab::gpu
