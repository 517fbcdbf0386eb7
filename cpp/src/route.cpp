// Where a validated call runs (route.h).
#include "route.h"

#include "cuda_builds.h"

#include <algorithm>
#include <cstdio>

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
  facts.vec = choose_vec(views, head_size, (flags & ATTNMERGE_BLOCK_NVFP4) != 0);
  facts.access_bytes = static_cast<int>(facts.vec * widest_o(views));
  facts.pdl = (flags & ATTNMERGE_PDL) != 0;
  facts.batch_invariant = (flags & ATTNMERGE_BATCH_INVARIANT) != 0;
  for (const View& v : views) {
    if (!v.present() || v.empty) continue;
    facts.max_offset = std::max(facts.max_offset, v.last);
    // The bytes moved: each view's span, twice for one that is read and written (in place).
    const int64_t span = (v.last + 1) * static_cast<int64_t>(dtype_size(v.t->dtype));  // < 2^63 (describe)
    for (int pass = v.spec->use == Use::kReadWrite ? 2 : 1; pass > 0; --pass)
      if (__builtin_add_overflow(facts.bytes, span, &facts.bytes)) facts.bytes = INT64_MAX;
    if (v.spec->role == ATTNMERGE_ROLE_LSE && v.ndim == 2 && v.strides[0] < v.strides[1])
      facts.lse_tokens_inner = true;  // a two-axis LSE (or softmax sum)
  }
  return facts;
}

namespace {

// Where the GPU path can read `ptr` (gpu_check_peer_pointer), or, for the CPU path, host memory.
attnmerge_status check_rank_pointer(const void* ptr, int device, const char* exchange, const char* field, int p) {
  char name[160];
  std::snprintf(name, sizeof name, "%s.%s[%d]", exchange, field, p);
  if (device != ATTNMERGE_HOST) return gpu_check_peer_pointer(ptr, device, name);
  const int on = gpu_device_count() > 0 ? gpu_pointer_device(ptr) : ATTNMERGE_HOST;
  if (on != ATTNMERGE_HOST)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected host memory (device -1), got memory of CUDA device %d", name, on);
  return ATTNMERGE_SUCCESS;
}

}  // namespace

attnmerge_status locate_exchange(Views views, const float* scale, const attnmerge_exchange* x, ExchangeUse use,
                                 int& device) {
  const char* name = views.names->of("exchange");
  device = x->o_layout.device;
  if (use == ExchangeUse::kStates) {
    int located;
    bool go;
    if (attnmerge_status s = locate(views, scale, false, located, go)) return s;
    if (go && located != device)  // o is empty, out is not: out's device is not the layout's
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected the device of %s.o_layout (%d), got device %d (-1 is the host)",
                  views.v[0].name(), name, device, located);
  }
  if (device < ATTNMERGE_HOST)
    return fail(ATTNMERGE_ERROR_VALUE, "%s.o_layout.device: expected a device >= -1 (the host), got %d", name, device);
  if (device != ATTNMERGE_HOST) {
    const int count = gpu_device_count();
    if (count == 0)
      return fail(ATTNMERGE_ERROR_NO_DEVICE, "%s: lives on CUDA device %d, but no CUDA driver or device is available",
                  name, device);
    if (device >= count)
      return fail(ATTNMERGE_ERROR_VALUE, "%s.o_layout.device: expected a CUDA device below %d, got device %d", name,
                  count, device);
  }
  const bool o_known = (x->o_layout.flags & ATTNMERGE_DEVICE_KNOWN) != 0;  // the pads' too
  attnmerge_status s;
  for (int p = 0; p < x->world_size; ++p) {
    if (!o_known && (s = check_rank_pointer(x->pads[p], device, name, "pads", p))) return s;
    if (use == ExchangeUse::kPads) continue;
    if (!o_known && (s = check_rank_pointer(x->o[p], device, name, "o", p))) return s;
    if (!(x->lse_layout.flags & ATTNMERGE_DEVICE_KNOWN) && (s = check_rank_pointer(x->lse[p], device, name, "lse", p)))
      return s;
    if (x->sum != nullptr && !(x->lse_layout.flags & ATTNMERGE_DEVICE_KNOWN) &&
        (s = check_rank_pointer(x->sum[p], device, name, "sum", p)))
      return s;
  }
  return ATTNMERGE_SUCCESS;
}

CallFacts exchange_facts(Views views, const attnmerge_exchange* x, int64_t head_size, int out_dtype, uint32_t flags) {
  CallFacts facts;
  facts.pdl = (flags & ATTNMERGE_PDL) != 0;
  const std::size_t in_size = dtype_size(x->o_layout.dtype), out_size = dtype_size(out_dtype);
  const int vec = static_cast<int>(16 / in_size);
  bool wide = head_size % vec == 0;
  for (const View& v : views) {
    if (!wide || !v.present() || !v.spec->is_o() || v.empty) continue;
    const std::size_t bytes = std::min<std::size_t>(16, vec * dtype_size(v.t->dtype));  // out's packs past 16: 16 each
    wide = reinterpret_cast<uintptr_t>(v.t->data) % bytes == 0;
    for (int axis = 0; wide && axis < v.ndim - 1; ++axis) wide = v.shape[axis] <= 1 || v.strides[axis] % vec == 0;
  }
  for (int p = 0; wide && p < x->world_size; ++p) wide = reinterpret_cast<uintptr_t>(x->o[p]) % 16 == 0;
  facts.vec = wide ? vec : 1;
  facts.access_bytes = static_cast<int>(facts.vec * std::max(in_size, out_size));
  return facts;
}

attnmerge_status run_exchange(Views views, const MergeShape& shape, const ExchangeSource& src, const OutView& out,
                              const exchange::Sync& sync, const attnmerge_exchange* x, int in_dtype, int out_dtype,
                              void* stream, uint32_t flags) {
  int device;
  attnmerge_status s = locate_exchange(views, out.scale, x, ExchangeUse::kStates, device);
  if (s) return s;
  if (device == ATTNMERGE_HOST) {
    if ((s = check_cpu_threads())) return s;
    return cpu_merge_exchange(shape, src, out, sync, in_dtype, out_dtype);
  }
  return gpu_merge_exchange(shape, src, out, sync, exchange_facts(views, x, shape.head_size, out_dtype, flags),
                            in_dtype, out_dtype, device, stream);
}

}  // namespace detail
}  // namespace attnmerge
