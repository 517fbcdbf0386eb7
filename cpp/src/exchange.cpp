// The exchange on the host: the CPU twin of its kernels (exchange_kernels.cuh), each call running
// this rank's part on the calling thread through the same steps (exchange.h) and the same CPU
// merge as merge_states (merge_cpu.cpp), so that its rows are those merge_states gives over the
// states gathered, bit for bit; and the words of a rank's failure record, which the host calls
// return and attnmerge_exchange_status returns on either device.
#include <cinttypes>

#include "internal.h"

namespace attnmerge {
namespace detail {
namespace {

using exchange::Failure;
using exchange::Record;

// The record in this rank's pad (host memory), read after the calls that wrote it.
Record read_record(const uint64_t* own) {
  Record r;
  r.why = static_cast<Failure>(exchange::load_acquire(own + exchange::kFailure));
  r.peer = static_cast<int64_t>(own[exchange::kFailedPeer]);
  r.epoch = own[exchange::kFailedEpoch];
  r.seen = own[exchange::kFailedSeen];
  r.timeout = own[exchange::kFailedTimeout];
  return r;
}

// A failure recorded in this rank's pad, returned (by every call until attnmerge_exchange_status
// clears it); ATTNMERGE_SUCCESS where there is none.
attnmerge_status recorded(const exchange::Sync& sync) {
  const Record r = read_record(sync.own());
  return r.why == Failure::kNone ? ATTNMERGE_SUCCESS : exchange_failure(r, sync.rank);
}

// A stale epoch, refused before anything is done (on the host the call can read the pad): the
// kernels' rule (exchange.h's publish_epoch or merge_epoch, `rule`), with nothing recorded.
attnmerge_status check_epoch(const exchange::Sync& sync, Failure (*rule)(uint64_t, uint64_t, uint64_t&)) {
  Record r;
  r.seen = exchange::load_relaxed(sync.own() + exchange::kPublished);
  r.why = rule(sync.epoch, r.seen, r.epoch);
  return exchange_failure(r, sync.rank);
}

}  // namespace

attnmerge_status exchange_failure(const Record& r, int rank) {
  const auto epoch = static_cast<unsigned long long>(r.epoch), seen = static_cast<unsigned long long>(r.seen);
  const auto timeout = static_cast<unsigned long long>(r.timeout);
  switch (r.why) {
    case Failure::kNone: return ATTNMERGE_SUCCESS;
    case Failure::kReadyTimeout:
      return fail(ATTNMERGE_ERROR_TIMEOUT,
                  "exchange: rank %d waited %llu ns for rank %" PRId64 " to publish epoch %llu and gave up (its ready "
                  "slot held epoch %llu)",
                  rank, timeout, r.peer, epoch, seen);
    case Failure::kDoneTimeout:
      return fail(ATTNMERGE_ERROR_TIMEOUT,
                  "exchange: rank %d waited %llu ns for rank %" PRId64 " to read its state of epoch %llu and gave up "
                  "(its done slot held epoch %llu)",
                  rank, timeout, r.peer, epoch, seen);
    case Failure::kStalePublish:
      return fail(ATTNMERGE_ERROR_VALUE,
                  "epoch: expected an epoch newer than %llu (the last rank %d published), got %llu (stale)", seen, rank,
                  epoch);
    case Failure::kStaleMerge:
      return fail(ATTNMERGE_ERROR_VALUE, "epoch: expected %llu (the last epoch rank %d published), got %llu (stale)",
                  seen, rank, epoch);
    case Failure::kEarlyMerge:
      return fail(ATTNMERGE_ERROR_VALUE,
                  "epoch: expected %llu (the last epoch rank %d published), got %llu (not published yet)", seen, rank,
                  epoch);
    case Failure::kNoEpoch:
      return fail(ATTNMERGE_ERROR_VALUE, "epoch: expected an epoch rank %d has published, got 0 and it has published none",
                  rank);
  }
  return fail(ATTNMERGE_ERROR_VALUE, "exchange: rank %d's pad records failure %llu, which this library does not know",
              rank, static_cast<unsigned long long>(r.why));
}

attnmerge_status cpu_exchange_publish(const exchange::Sync& sync) {
  attnmerge_status s;
  if ((s = recorded(sync)) || (s = check_epoch(sync, exchange::publish_epoch))) return s;
  exchange::publish(sync, exchange::load_relaxed(sync.own() + exchange::kPublished), 0, 1);
  return ATTNMERGE_SUCCESS;
}

attnmerge_status cpu_merge_exchange(const MergeShape& shape, const ExchangeSource& src, const OutView& out,
                                    const exchange::Sync& sync, int in_dtype, int out_dtype) {
  attnmerge_status s;
  if ((s = recorded(sync)) || (s = check_epoch(sync, exchange::merge_epoch))) return s;
  uint64_t epoch = 0;
  if (!exchange::await_states(sync, 0, 1, exchange::clock_ns(), epoch)) return recorded(sync);
  if (shape.rows > 0 && (s = cpu_merge(shape, src, out, in_dtype, out_dtype))) return s;
  if (sync.reuse == exchange::Reuse::kWaitReaders &&
      !(exchange::signal_read(sync, 0, 1, epoch) && exchange::await_readers(sync, 0, 1, epoch)))
    return recorded(sync);
  return ATTNMERGE_SUCCESS;
}

attnmerge_status exchange_status(const exchange::Sync& sync, int device, void* stream) {
  Record r;
  if (device == ATTNMERGE_HOST) {
    r = read_record(sync.own());
    for (int w = exchange::kFailure; w <= exchange::kFailedTimeout; ++w) exchange::store_release(sync.own() + w, 0);
  } else if (attnmerge_status s = gpu_take_record(sync.own(), device, stream, r)) {
    return s;
  }
  return exchange_failure(r, sync.rank);
}

}  // namespace detail
}  // namespace attnmerge
