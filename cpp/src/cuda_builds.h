// The published builds of libattnmerge, one per CUDA major version, and the drivers each runs on:
// what the error of a GPU call says when the driver is too old for this build.  Header-only and
// free of CUDA so that tests/native/driver_probe.cpp can print the texts on any machine; the
// build backend's FLAVORS names the same distributions (tests/packaging/test_cuda_builds.py holds the two
// to agree).
#pragma once

#include <cstddef>
#include <cstdio>

namespace attnmerge {
namespace detail {

struct CudaBuild {
  int major;  // the CUDA major version the build was compiled with
  const char* driver;  // the oldest driver branch of that CUDA major (CUDA x.0's)
  const char* distribution;  // the Python distribution that ships it
};

inline constexpr CudaBuild kCudaBuilds[] = {
    {12, "R525", "attnmerge-cu12"},
    {13, "R580", "attnmerge-cu13"},
};

inline const CudaBuild* cuda_build(int major) {
  for (const CudaBuild& b : kCudaBuilds)
    if (b.major == major) return &b;
  return nullptr;
}

// When the driver (cudaDriverGetVersion's `driver`, 0 for none) is of an older CUDA major than the
// build (CUDART_VERSION's `build`), the runtime refuses every device; this writes why into `buf`
// and returns true: both versions, the driver the build needs, and the build that fits the driver.
// Within one major, minor-version compatibility runs a newer build on an older driver: false.
inline bool describe_old_driver(char* buf, std::size_t size, int driver, int build) {
  const int driver_major = driver / 1000, build_major = build / 1000;
  if (driver <= 0 || driver_major >= build_major) return false;
  const CudaBuild* needs = cuda_build(build_major);
  const CudaBuild* fits = cuda_build(driver_major);
  int n = std::snprintf(buf, size,
                        "the NVIDIA driver supports CUDA %d.%d, older than this attnmerge build's CUDA %d.%d, "
                        "which needs a driver of CUDA %d.0 (%s) or newer: ",
                        driver_major, driver % 1000 / 10, build_major, build % 1000 / 10, build_major,
                        needs != nullptr ? needs->driver : "its branch");
  if (n < 0 || static_cast<std::size_t>(n) >= size) return true;
  if (fits != nullptr)
    std::snprintf(buf + n, size - n, "install %s (the CUDA %d build, for drivers from %s on) or update the driver",
                  fits->distribution, fits->major, fits->driver);
  else
    std::snprintf(buf + n, size - n, "update the driver (no attnmerge build runs on CUDA %d)", driver_major);
  return true;
}

}  // namespace detail
}  // namespace attnmerge
