// The exchange's signal pads and the steps of its protocol on them (attnmerge.h, "Context
// parallelism on one node", says what the protocol promises): one pad per rank, its words, the
// loads and stores that order the ranks (acquire and release at system scope), the clock a wait
// is timed by, a bounded wait, and the record of why a rank gave up.  Host C++ and CUDA device
// code alike, so that the GPU kernels (exchange_kernels.cuh) and the CPU path (ranks as threads of
// one process) run one protocol.
#pragma once

#include <cstdint>

#include "attnmerge/numeric.h"

#if !defined(__CUDA_ARCH__)
#include <chrono>
#include <thread>
#endif

namespace attnmerge {
namespace exchange {

// The most ranks an exchange has (attnmerge.h's ATTNMERGE_EXCHANGE_MAX_WORLD): every GPU of an
// NVLink domain (GB200 NVL72).  Each kernel takes every rank's pointers as parameters.
constexpr int kMaxWorld = 72;

// A pad: 64-bit words, zeroed before its first use (every epoch starts at 0; the first is 1).
// Words a rank writes in its own pad:
//   kPublished  the last epoch it published;
//   kArrivals   the blocks of its running merge that have read their rows (ATTNMERGE_EXCHANGE_WAIT_READERS);
//   kFailure .. the record of why it gave up (Record), kFailure 0 while there is none.
// Slots its peers write, one per rank p (the rank's own too):
//   ready(p)    the newest epoch whose state rank p has published;
//   done(p)     the newest epoch at which rank p has read this rank's state.
enum Word : int {
  kPublished = 0,
  kArrivals = 1,
  kFailure = 2,  // Failure
  kFailedPeer = 3,
  kFailedEpoch = 4,
  kFailedSeen = 5,
  kFailedTimeout = 6,
  kSlots = 8,  // ready(0)
};
ATTNMERGE_HD constexpr int ready(int p) { return kSlots + p; }
ATTNMERGE_HD constexpr int done(int world, int p) { return kSlots + world + p; }
ATTNMERGE_HD constexpr int64_t pad_words(int world) { return kSlots + 2 * int64_t{world}; }

// Why a rank gave up, in its pad's kFailure word.
enum class Failure : uint64_t {
  kNone = 0,
  kReadyTimeout = 1,  // a merge waited for a peer's publish of its epoch (peer, epoch, the slot's value)
  kDoneTimeout = 2,   // a merge waited for a peer to read this rank's state (peer, epoch, the slot's value)
  kStalePublish = 3,  // a publish of an epoch not newer than the last published (epoch, the last)
  kStaleMerge = 4,    // a merge of an epoch older than the last published (epoch, the last)
  kEarlyMerge = 5,    // a merge of an epoch newer than the last published (epoch, the last)
  kNoEpoch = 6,       // a merge of the pad's epoch (0) before any publish
};

// How a rank may write its buffer again (attnmerge.h's attnmerge_exchange_reuse).
enum class Reuse : int32_t { kWaitReaders = 0, kAlternate = 1 };

// What a kernel or the CPU path needs of the protocol: every rank's pad as this rank addresses it,
// who this rank is, the epoch asked for (0: the pad's) and how long a wait may last.
struct Sync {
  uint64_t* pads[kMaxWorld];
  int32_t rank, world;
  uint64_t epoch;
  uint64_t timeout_ns;
  Reuse reuse;

  ATTNMERGE_HD uint64_t* own() const { return pads[rank]; }
};

// ---- the accesses that order the ranks ---------------------------------------------------------
// A slot is read with acquire and written with release semantics at system scope (another GPU, or
// the host), so that what a rank wrote before it signals is seen by the rank that reads the
// signal.  On the host, the compiler's atomics (ranks as threads of one process).

// A word no order hangs on (a rank's own kPublished and kFailure): issued before an acquire, it is
// in flight together with it rather than one memory round trip before.
ATTNMERGE_HD uint64_t load_relaxed(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

ATTNMERGE_HD uint64_t load_acquire(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

ATTNMERGE_HD void store_release(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

// Everything this thread (and, on the GPU, the kernels before it on its stream) wrote, ordered
// before what it writes next, for every observer: before a publish's signal.
ATTNMERGE_HD void fence_system() {
#if defined(__CUDA_ARCH__)
  asm volatile("fence.sc.sys;" ::: "memory");
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

// *p += v, returning the old value: a rank's own arrivals counter (its GPU's blocks, or the host).
ATTNMERGE_HD uint64_t fetch_add(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  uint64_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
#else
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#endif
}

// *p = desired where *p == 0; whether it was (the first failure of a rank is the one recorded).
ATTNMERGE_HD bool claim(uint64_t* p, uint64_t desired) {
#if defined(__CUDA_ARCH__)
  uint64_t old;
  asm volatile("atom.acq_rel.gpu.global.cas.b64 %0, [%1], 0, %2;" : "=l"(old) : "l"(p), "l"(desired) : "memory");
  return old == 0;
#else
  uint64_t expected = 0;
  return __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
#endif
}

// Nanoseconds on a clock that every thread of a rank reads alike: the GPU's %globaltimer, the
// host's steady clock.
ATTNMERGE_HD uint64_t clock_ns() {
#if defined(__CUDA_ARCH__)
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
#endif
}

// Between two looks at a slot: nothing on the GPU (a wait is a merge's latency); on the host the
// processor is handed to the other ranks' threads, which may outnumber the cores.
ATTNMERGE_HD void pause() {
#if !defined(__CUDA_ARCH__)
  std::this_thread::yield();
#endif
}

// ---- the record of a failure -------------------------------------------------------------------

// Records why this rank gave up, in its own pad, unless a failure is recorded already (the first
// one stands).  The fields are written after the claim; whoever reads them does so after the
// kernel or call that wrote them has ended.
ATTNMERGE_HD void record(uint64_t* own, Failure why, int64_t peer, uint64_t epoch, uint64_t seen, uint64_t timeout) {
  if (!claim(own + kFailure, static_cast<uint64_t>(why))) return;
  own[kFailedPeer] = static_cast<uint64_t>(peer);
  own[kFailedEpoch] = epoch;
  own[kFailedSeen] = seen;
  own[kFailedTimeout] = timeout;
}

// What a rank's record says, read after the calls that wrote it.
struct Record {
  Failure why = Failure::kNone;
  int64_t peer = 0;
  uint64_t epoch = 0, seen = 0, timeout = 0;
};

// The epoch of a merge: the one asked for, or (0) the last this rank published (`published`);
// why it cannot be merged: kNone where it can.
ATTNMERGE_HD Failure merge_epoch(uint64_t asked, uint64_t published, uint64_t& epoch) {
  epoch = asked != 0 ? asked : published;
  return epoch == 0 ? Failure::kNoEpoch
         : epoch < published ? Failure::kStaleMerge
         : epoch > published ? Failure::kEarlyMerge
                             : Failure::kNone;
}

// The epoch of a publish: the one asked for, or (0) the last this rank published + 1; why it
// cannot be published (not newer than the last): kNone where it can.
ATTNMERGE_HD Failure publish_epoch(uint64_t asked, uint64_t published, uint64_t& epoch) {
  epoch = asked != 0 ? asked : published + 1;
  return epoch <= published ? Failure::kStalePublish : Failure::kNone;
}

// Waits until *slot >= epoch (the peer's signal of this epoch, or of a newer one): true; false where
// this rank's pad records a failure meanwhile (another thread's, or an earlier call's), or where
// `timeout_ns` pass from `start`, which it records as `why` (peer, epoch, the slot's value).
// `seen`: the slot as the caller read it (with acquire) last.
ATTNMERGE_HD bool wait_for(const Sync& sync, const uint64_t* slot, uint64_t epoch, int peer, Failure why,
                           uint64_t start, uint64_t seen) {
  while (seen < epoch) {
    if (load_relaxed(sync.own() + kFailure) != 0) return false;
    if (clock_ns() - start > sync.timeout_ns) {
      record(sync.own(), why, peer, epoch, seen, sync.timeout_ns);
      return false;
    }
    pause();
    seen = load_acquire(slot);
  }
  return true;
}

// A publish of the state of an epoch, by `lanes` threads (thread `lane` signals ranks lane, lane +
// lanes, ...).  `published`: the pad's kPublished as every lane read it before any wrote; the
// epoch is the one asked for, or the last published + 1.  Stale: recorded once (lane 0), no
// signal.  Otherwise lane 0 keeps the epoch in the pad, and each lane signals its ranks, after a
// fence that orders the state's writes (this rank's, before the publish) before the signal.
ATTNMERGE_HD void publish(const Sync& sync, uint64_t published, int lane, int lanes) {
  uint64_t epoch;
  uint64_t* const own = sync.own();
  if (const Failure why = publish_epoch(sync.epoch, published, epoch); why != Failure::kNone) {
    if (lane == 0) record(own, why, sync.rank, epoch, published, 0);
    return;
  }
  if (lane == 0) own[kPublished] = epoch;  // read by this rank's later calls alone
  fence_system();
  for (int p = lane; p < sync.world; p += lanes) store_release(sync.pads[p] + ready(sync.rank), epoch);
}

// ---- a merge's steps ----------------------------------------------------------------------------
// Taken by `lanes` threads together (a GPU block's, or the host's one): lane takes ranks lane,
// lane + lanes, ..., so that their loads are in flight at once.

// The first: the epoch (merge_epoch), then every rank's state of it published.  False where this
// rank gives up (a failure recorded, by this call or an earlier one).  `start`: when the wait began.
ATTNMERGE_HD bool await_states(const Sync& sync, int lane, int lanes, uint64_t start, uint64_t& epoch) {
  uint64_t* const own = sync.own();
  for (int p = lane; p < sync.world; p += lanes) {
    const uint64_t published = load_relaxed(own + kPublished);  // both in flight with the slot's load
    const uint64_t failure = load_relaxed(own + kFailure);
    const uint64_t seen = load_acquire(own + ready(p));
    if (failure != 0) return false;
    if (const Failure why = merge_epoch(sync.epoch, published, epoch); why != Failure::kNone) {
      record(own, why, sync.rank, epoch, published, 0);
      return false;
    }
    if (!wait_for(sync, own + ready(p), epoch, p, Failure::kReadyTimeout, start, seen)) return false;
  }
  return true;
}

// The last two, under Reuse::kWaitReaders, once every row of this rank's merge has been read: tell
// every rank that this one has read its state of `epoch`, then (after every lane has told its
// ranks: a lane that waited first could keep its peers' signals from being sent) wait until every
// rank has read this one's, after which this rank may write its state again.  Nothing where this
// rank has given up: its peers then give up in turn, each naming it.
ATTNMERGE_HD bool signal_read(const Sync& sync, int lane, int lanes, uint64_t epoch) {
  if (load_relaxed(sync.own() + kFailure) != 0) return false;
  for (int p = lane; p < sync.world; p += lanes) store_release(sync.pads[p] + done(sync.world, sync.rank), epoch);
  return true;
}

ATTNMERGE_HD bool await_readers(const Sync& sync, int lane, int lanes, uint64_t epoch) {
  const uint64_t start = clock_ns();
  for (int p = lane; p < sync.world; p += lanes) {
    const uint64_t* slot = sync.own() + done(sync.world, p);
    if (!wait_for(sync, slot, epoch, p, Failure::kDoneTimeout, start, load_acquire(slot))) return false;
  }
  return true;
}

}  // namespace exchange
}  // namespace attnmerge
