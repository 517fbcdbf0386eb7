// Where a validated call runs (route.h).
#include "route.h"

#include "cuda_builds.h"

#include <algorithm>

namespace attnmerge {
namespace detail {

attnmerge_status locate(Views views, const float* scale, bool no_rows, int& device, bool& go) {
  device = ATTNMERGE_HOST;
  go = false;
  const View* first = nullptr;
  for (const View& v : views) {
    if (!v.present() || v.empty) continue;  // an empty tensor is never touched, wherever it lives
    if (first == nullptr) {
      first = &v;
      device = v.t->device;
    } else if (v.t->device != device) {
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected the device of %s (%d), got device %d (-1 is the host)", v.name(),
                  first->name(), device, v.t->device);
    }
  }
  // A dtype of host arrays alone (float64) on a GPU: the first input's named, else an output's.
  for (const bool outputs : {false, true})
    for (const View& v : views)
      if (device != ATTNMERGE_HOST && v.present() && v.spec->is_output() == outputs &&
          in_set(host_only_dtypes(), v.t->dtype))
        return fail(ATTNMERGE_ERROR_TYPE,
                    "%s: expected dtype %s on CUDA device %d (%s runs on the CPU path only: host arrays), got %s",
                    v.name(), DtypesText(dtypes_of(v.spec->role) & ~host_only_dtypes()).text, device,
                    dtype_name(v.t->dtype), dtype_name(v.t->dtype));
  go = first != nullptr && !no_rows;
  if (!go) return ATTNMERGE_SUCCESS;
  if (device == ATTNMERGE_HOST) {
    // Device memory handed to the CPU path would crash the process: refuse it where CUDA can tell.
    if (gpu_device_count() > 0)
      for (const View& v : views)
        if (v.present() && !v.empty && !(v.t->flags & ATTNMERGE_DEVICE_KNOWN) &&
            gpu_pointer_device(v.t->data) != ATTNMERGE_HOST)
          return fail(ATTNMERGE_ERROR_VALUE, "%s: expected host memory (device -1), got memory of CUDA device %d",
                      v.name(), gpu_pointer_device(v.t->data));
    if (scale != nullptr && gpu_device_count() > 0 && gpu_pointer_device(scale) != ATTNMERGE_HOST)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected host memory (device -1), got memory of CUDA device %d",
                  views.names->of("output_scale"), gpu_pointer_device(scale));
    return ATTNMERGE_SUCCESS;
  }
  const int count = gpu_device_count();
  if (count == 0) {
    char why[512];
    if (describe_old_driver(why, sizeof why, gpu_driver_version(), gpu_build_version()))
      return fail(ATTNMERGE_ERROR_NO_DEVICE, "%s: lives on CUDA device %d, but %s", first->name(), device, why);
    return fail(ATTNMERGE_ERROR_NO_DEVICE, "%s: lives on CUDA device %d, but no CUDA driver or device is available",
                first->name(), device);
  }
  if (device >= count)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a CUDA device below %d, got device %d", first->name(), count,
                device);
  attnmerge_status s;
  for (const View& v : views)
    if (v.present() && !v.empty && !(v.t->flags & ATTNMERGE_DEVICE_KNOWN) &&
        (s = gpu_check_pointer(v.t->data, device, *views.names, v.spec->name)))
      return s;
  if (scale != nullptr && (s = gpu_check_pointer(scale, device, *views.names, "output_scale"))) return s;
  return ATTNMERGE_SUCCESS;
}

CallFacts call_facts(Views views, int64_t head_size, uint32_t flags) {
  CallFacts facts;
  facts.vec = choose_vec(views, head_size);
  facts.access_bytes = static_cast<int>(facts.vec * widest_o(views));
  facts.pdl = (flags & ATTNMERGE_PDL) != 0;
  for (const View& v : views) {
    if (!v.present() || v.empty) continue;
    facts.max_offset = std::max(facts.max_offset, v.last);
    // The bytes moved: each view's span, twice for one that is read and written (in place).
    const int64_t span = (v.last + 1) * static_cast<int64_t>(dtype_size(v.t->dtype));  // < 2^63 (describe)
    for (int pass = v.spec->use == Use::kReadWrite ? 2 : 1; pass > 0; --pass)
      if (__builtin_add_overflow(facts.bytes, span, &facts.bytes)) facts.bytes = INT64_MAX;
    if (v.ndim == 2 && v.strides[0] < v.strides[1]) facts.lse_tokens_inner = true;  // a two-axis LSE
  }
  return facts;
}

}  // namespace detail
}  // namespace attnmerge
