#include "transport/host.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

namespace jcoccl::transport {

void HostGroup::Break(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (broken_.empty()) broken_ = why;
  cv_.notify_all();
}

Status HostGroup::WaitLocked(std::unique_lock<std::mutex>& lk, const std::shared_ptr<Slot>& slot,
                             bool leaving, const CallCtx& ctx, int64_t seq) {
  // ctx.timeout_s is at most kMaxTimeoutSeconds, so the deadline cannot overflow.
  const double timeout = std::min(ctx.timeout_s, kMaxTimeoutSeconds);
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(timeout));
  // Once every rank has arrived, each one only copies and leaves, so the leaving wait ends
  // without help; it must not end early on a break, or a rank would release its buffer
  // while a peer still copies from it.
  auto done = [&] {
    return (!leaving && !broken_.empty()) || (leaving ? slot->left : slot->arrived) == size_;
  };
  if (!cv_.wait_until(lk, deadline, done)) {
    int have = leaving ? slot->left : slot->arrived;
    if (!broken_.empty()) return Status::Error(broken_);
    broken_ = "jcoccl host transport: timed out after " + std::to_string(timeout) +
              " s (jcoccl.config timeout_s / JCOCCL_TIMEOUT_S) waiting for peers in collective #" +
              std::to_string(seq) + " of run " + std::to_string(ctx.run_id) + ": " +
              std::to_string(have) + " of " + std::to_string(size_) +
              " ranks arrived. The communicator is now unusable; call jcoccl.shutdown() "
              "and jcoccl.init(mesh) again.";
    cv_.notify_all();
    return Status::Error(broken_);
  }
  // A rank that has already consumed its data succeeds even if the group broke later.
  if ((leaving ? slot->left : slot->arrived) == size_) return Status::Ok();
  return Status::Error(broken_);
}

HostTransport::HostTransport(std::shared_ptr<HostGroup> group, int rank)
    : group_(std::move(group)), rank_(rank) {}

void HostTransport::Abort(const std::string& why) { group_->Break(why); }

int HostTransport::size() const { return group_->size(); }

int64_t HostTransport::NextSeq(int64_t run_id) {
  std::lock_guard<std::mutex> lk(mu_);
  // Executions finish in launch order on one device; keep only recent counters.
  while (seq_.size() > 256) seq_.erase(seq_.begin());
  return seq_[run_id]++;
}

// Tags catch mismatched programs: op kind in the low 3 bits, byte count above.
static int64_t Tag(int kind, int64_t bytes) { return bytes * 8 + kind; }

// out[i] = ((src[0][i] + src[1][i]) + ...) + src[n-1][i], each source offset by `off`
// floats. Summing source by source gives every element the same sequence of float32 adds
// as an element-wise left fold (the compiler is not allowed to reassociate: no fast-math).
static void LeftFold(const std::vector<const void*>& src, int64_t off, int64_t count, float* out) {
  std::memcpy(out, static_cast<const float*>(src[0]) + off, count * sizeof(float));
  for (size_t r = 1; r < src.size(); ++r) {
    const float* s = static_cast<const float*>(src[r]) + off;
    for (int64_t i = 0; i < count; ++i) out[i] += s[i];
  }
}

Status HostTransport::AllGather(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) {
  const int n = size();
  return group_->Exchange(rank_, ctx, NextSeq(ctx.run_id), send, Tag(0, bytes),
                          [&](const std::vector<const void*>& ptr) {
                            for (int r = 0; r < n; ++r)
                              std::memcpy(static_cast<char*>(recv) + r * bytes, ptr[r], bytes);
                          });
}

Status HostTransport::AllToAll(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) {
  const int n = size();
  return group_->Exchange(rank_, ctx, NextSeq(ctx.run_id), send, Tag(1, bytes),
                          [&](const std::vector<const void*>& ptr) {
                            for (int r = 0; r < n; ++r)
                              std::memcpy(static_cast<char*>(recv) + r * bytes,
                                          static_cast<const char*>(ptr[r]) + rank_ * bytes, bytes);
                          });
}

Status HostTransport::SendRecv(const CallCtx& ctx, const void* send, int dst, void* recv, int src,
                               int64_t bytes) {
  (void)dst;  // the receiver reads from its source; the sender only has to be present
  return group_->Exchange(rank_, ctx, NextSeq(ctx.run_id), send, Tag(2, bytes),
                          [&](const std::vector<const void*>& ptr) {
                            if (src >= 0) std::memcpy(recv, ptr[src], bytes);
                          });
}

Status HostTransport::AllReduceSum(const CallCtx& ctx, const float* send, int64_t count,
                                   float* recv) {
  return group_->Exchange(
      rank_, ctx, NextSeq(ctx.run_id), send, Tag(3, count * sizeof(float)),
      [&](const std::vector<const void*>& ptr) { LeftFold(ptr, 0, count, recv); });
}

Status HostTransport::ReduceScatterSum(const CallCtx& ctx, const float* send,
                                       int64_t count_per_rank, float* recv) {
  return group_->Exchange(rank_, ctx, NextSeq(ctx.run_id), send,
                          Tag(4, count_per_rank * sizeof(float)),
                          [&](const std::vector<const void*>& ptr) {
                            LeftFold(ptr, rank_ * count_per_rank, count_per_rank, recv);
                          });
}

}  // namespace jcoccl::transport
