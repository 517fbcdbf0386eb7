// The text of a GPU call's error when the driver is too old for the build (cpp/src/cuda_builds.h),
// as a command-line probe for the tests: each line of standard input is "driver build" (CUDA
// versions as cudaDriverGetVersion and CUDART_VERSION give them, 12080 for 12.8), each line of
// output the text, or "-" where the driver is not the reason.  No GPU or CUDA needed.
#include <cstdio>
#include <iostream>

#include "cuda_builds.h"

int main() {
  int driver = 0, build = 0;
  while (std::cin >> driver >> build) {
    char why[512];
    std::puts(attnmerge::detail::describe_old_driver(why, sizeof why, driver, build) ? why : "-");
  }
  return 0;
}
