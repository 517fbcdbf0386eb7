// The C ABI's queries: version, build, driver and devices, the last launch, and a stream wait.
#include "cuda_builds.h"
#include "internal.h"

#ifndef ATTNMERGE_CUDA_ARCHS
#define ATTNMERGE_CUDA_ARCHS "unknown"
#endif
#ifndef ATTNMERGE_CUDA_PTX_ARCHS
#define ATTNMERGE_CUDA_PTX_ARCHS "unknown"
#endif
#ifndef ATTNMERGE_CUDA_ARCHS_CHOICE
#define ATTNMERGE_CUDA_ARCHS_CHOICE "unknown"
#endif

using namespace attnmerge::detail;

extern "C" {

void attnmerge_last_launch(attnmerge_launch_info* info) {
  if (info != nullptr) *info = last_launch();
}

int attnmerge_version(void) { return ATTNMERGE_VERSION_NUMBER; }
const char* attnmerge_version_string(void) { return ATTNMERGE_VERSION_STRING; }
const char* attnmerge_cuda_architectures(void) { return ATTNMERGE_CUDA_ARCHS; }
const char* attnmerge_cuda_ptx_architectures(void) { return ATTNMERGE_CUDA_PTX_ARCHS; }
const char* attnmerge_cuda_architectures_choice(void) { return ATTNMERGE_CUDA_ARCHS_CHOICE; }
int attnmerge_cuda_build_version(void) { return gpu_build_version(); }
int attnmerge_cuda_driver_version(void) { return gpu_driver_version(); }
int attnmerge_device_count(void) { return gpu_device_count(); }
int attnmerge_pointer_device(const void* ptr) { return gpu_pointer_device(ptr); }
const attnmerge_dtype_info* attnmerge_dtype_info_of(int32_t dtype) { return dtype_info(dtype); }

attnmerge_status attnmerge_stream_synchronize(int32_t device, void* stream) {
  clear_error();
  char why[512];
  if (gpu_device_count() == 0 && describe_old_driver(why, sizeof why, gpu_driver_version(), gpu_build_version()))
    return fail(ATTNMERGE_ERROR_NO_DEVICE, "device %d: %s", device, why);
  if (device < 0 || device >= gpu_device_count())
    return fail(ATTNMERGE_ERROR_VALUE, "device: expected a CUDA device below %d, got %d", gpu_device_count(), device);
  return gpu_stream_synchronize(device, stream);
}

}  // extern "C"
