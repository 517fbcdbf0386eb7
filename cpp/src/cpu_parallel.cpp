// The CPU path's threads (cpu_parallel.h): their number, and a pool started on first use and kept,
// so that a call wakes threads rather than starting and joining them.  No OpenMP: GNU libgomp's
// pool does not survive fork() (a child that merges after its parent did would hang), and the
// wheel would carry another runtime.
#include "cpu_parallel.h"

#include "errors.h"

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace attnmerge {
namespace detail {

namespace {

// One call's rows, cut into `ranges` ranges of `chunk` rows (the last shorter) that its caller and
// the pool's threads take in turn.  Lives on the caller's stack until every range is done.
struct Job {
  void (*run)(void*, int64_t, int64_t);
  void* ctx;
  int64_t rows, chunk, ranges;
  int64_t taken = 0;  // ranges taken (under the pool's mutex)
  int64_t done = 0;  // ranges finished (under the pool's mutex)
  Job* next = nullptr;  // the next job with ranges left to take
};

class Pool {
 public:
  // Runs `job` on the calling thread and up to `helpers` of the pool's.
  void run(Job& job, int64_t helpers) {
    std::unique_lock<std::mutex> lock(mutex_);
    grow(helpers);
    enqueue(job);
    lock.unlock();
    for (int64_t i = 0; i < helpers; ++i) wake_.notify_one();
    lock.lock();
    int64_t begin, end;
    while (take(job, begin, end)) {
      lock.unlock();
      job.run(job.ctx, begin, end);
      lock.lock();
      ++job.done;
    }
    finished_.wait(lock, [&] { return job.done == job.ranges; });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

 private:
  // Starts threads until the pool has `count` (fewer where the system gives no more: the caller
  // takes what no thread does).  Under mutex_.
  void grow(int64_t count) {
    try {
      while (static_cast<int64_t>(threads_.size()) < count) threads_.emplace_back([this] { work(); });
    } catch (...) {
    }
  }

  // A pool thread: takes a range of the first job that has one, runs it, and sleeps when none has.
  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || head_ != nullptr; });
      if (stop_) return;
      Job& job = *head_;
      int64_t begin, end;
      take(job, begin, end);  // a queued job has a range left
      lock.unlock();
      job.run(job.ctx, begin, end);
      lock.lock();
      if (++job.done == job.ranges) finished_.notify_all();
    }
  }

  void enqueue(Job& job) {
    (head_ == nullptr ? head_ : tail_->next) = &job;
    tail_ = &job;
  }

  // The next range of `job`, if it has one left; its last range takes it off the queue.  Under mutex_.
  bool take(Job& job, int64_t& begin, int64_t& end) {
    if (job.taken == job.ranges) return false;
    begin = job.taken * job.chunk;
    end = std::min(job.rows, begin + job.chunk);
    if (++job.taken == job.ranges) {
      Job** link = &head_;
      Job* previous = nullptr;
      while (*link != &job) previous = *link, link = &(*link)->next;
      *link = job.next;
      if (tail_ == &job) tail_ = previous;
    }
    return true;
  }

  std::mutex mutex_;
  std::condition_variable wake_;  // the pool's threads: a job was queued, or stop_
  std::condition_variable finished_;  // callers: a job's last range is done
  Job* head_ = nullptr;  // the jobs with ranges left to take, in the order they came
  Job* tail_ = nullptr;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

std::atomic<Pool*> g_pool{nullptr};

// A forked child has none of its parent's threads, and the pool's mutex may have been held by one
// of them: the child starts a pool of its own on first use, the parent's abandoned.
void forget_pool_in_child() { g_pool.store(nullptr, std::memory_order_relaxed); }
const int g_atfork = pthread_atfork(nullptr, nullptr, forget_pool_in_child);

// Stops and joins the pool's threads when the library is unloaded or the process exits.
struct PoolOwner {
  ~PoolOwner() { delete g_pool.exchange(nullptr); }
} g_owner;

// The pool, started on first use; null where not even that can be had.
Pool* pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return p;
  Pool* fresh = new (std::nothrow) Pool;
  if (fresh == nullptr || g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return fresh;
  delete fresh;  // another thread's came first
  return p;
}

// The most threads ATTNMERGE_NUM_THREADS may ask for.
constexpr int64_t kMaxThreads = 1024;

// ATTNMERGE_NUM_THREADS, read once: a whole number from 1 to kMaxThreads, or unset (the hardware's
// threads).  Any other value is kept as text, for every CPU call to refuse by name.
struct ThreadLimit {
  int64_t threads = 1;
  bool refused = false;
  char text[48] = "";  // the refused value, its first 40 characters
};

const ThreadLimit& thread_limit() {
  static const ThreadLimit limit = [] {
    ThreadLimit l;
    const char* env = std::getenv("ATTNMERGE_NUM_THREADS");
    if (env == nullptr) {
      l.threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
      return l;
    }
    int64_t n = 0;
    const char* c = env;
    for (; *c >= '0' && *c <= '9' && n <= kMaxThreads; ++c) n = 10 * n + (*c - '0');
    l.threads = n;
    if (*env == '\0' || *c != '\0' || n < 1 || n > kMaxThreads) {
      l.refused = true;
      std::snprintf(l.text, sizeof l.text, "%.40s%s", env, std::strlen(env) > 40 ? "..." : "");
    }
    return l;
  }();
  return limit;
}

}  // namespace

attnmerge_status check_cpu_threads() {
  const ThreadLimit& limit = thread_limit();
  if (!limit.refused) return ATTNMERGE_SUCCESS;
  return fail(ATTNMERGE_ERROR_VALUE,
              "ATTNMERGE_NUM_THREADS: expected a whole number from 1 to %lld (the most threads a CPU call takes), or "
              "the variable unset, got \"%s\"",
              static_cast<long long>(kMaxThreads), limit.text);
}

int64_t cpu_threads(int64_t accesses) {
  return std::max<int64_t>(1, std::min<int64_t>(thread_limit().threads, accesses >> 21));
}

void run_on_pool(int64_t rows, int64_t threads, void (*run)(void*, int64_t, int64_t), void* ctx) {
  Pool* p = pool();
  if (p == nullptr) return run(ctx, 0, rows);
  const int64_t chunk = (rows + threads - 1) / threads;
  Job job{run, ctx, rows, chunk, (rows + chunk - 1) / chunk};
  p->run(job, job.ranges - 1);
}

}  // namespace detail
}  // namespace attnmerge
