// In-process transport: the ranks are XLA CPU devices of one process, each running its
// program on its own thread. Ranks meet in a rendezvous keyed by (RunId, per-rank op
// sequence number) and copy straight out of each other's buffers.
#pragma once
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace jcoccl::transport {

class HostGroup;

class HostTransport final : public Transport {
 public:
  HostTransport(std::shared_ptr<HostGroup> group, int rank);
  int rank() const override { return rank_; }
  int size() const override;
  Status AllGather(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) override;
  Status AllToAll(const CallCtx& ctx, const void* send, int64_t bytes, void* recv) override;
  Status SendRecv(const CallCtx& ctx, const void* send, int dst, void* recv, int src,
                  int64_t bytes) override;
  Status AllReduceSum(const CallCtx& ctx, const float* send, int64_t count, float* recv) override;
  Status ReduceScatterSum(const CallCtx& ctx, const float* send, int64_t count_per_rank,
                          float* recv) override;
  void Abort(const std::string& why) override;

 private:
  int64_t NextSeq(int64_t run_id);

  std::shared_ptr<HostGroup> group_;
  int rank_;
  std::mutex mu_;
  // Op counter per execution; every rank issues the same ops in the same order.
  std::map<int64_t, int64_t> seq_;
};

// The state the members of one communicator share.
class HostGroup {
 public:
  explicit HostGroup(int size) : size_(size) {}
  int size() const { return size_; }
  // Posts `send` (with `tag` describing the op), waits for every rank, runs `consume`
  // with all ranks' send pointers, then waits until every rank has consumed so that no
  // buffer is released while a peer still reads it. Each wait gives up after
  // ctx.timeout_s seconds.
  template <class F>
  Status Exchange(int rank, const CallCtx& ctx, int64_t seq, const void* send, int64_t tag,
                  F&& consume);
  // Fails every current and future op of the group (a peer was lost). Ranks of an op that
  // every rank has already joined still finish it (they are reading each other's buffers).
  void Break(const std::string& why);

 private:
  struct Slot {
    explicit Slot(int n) : ptr(n, nullptr), tag(n, -1) {}
    std::vector<const void*> ptr;
    std::vector<int64_t> tag;
    int arrived = 0;
    int left = 0;
  };
  Status WaitLocked(std::unique_lock<std::mutex>& lk, const std::shared_ptr<Slot>& slot,
                    bool leaving, const CallCtx& ctx, int64_t seq);

  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<Slot>> slots_;
  std::string broken_;
};

template <class F>
Status HostGroup::Exchange(int rank, const CallCtx& ctx, int64_t seq, const void* send, int64_t tag,
                           F&& consume) {
  const int64_t run_id = ctx.run_id;
  std::shared_ptr<Slot> slot;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (!broken_.empty()) return Status::Error(broken_);
    auto& s = slots_[{run_id, seq}];
    if (!s) s = std::make_shared<Slot>(size_);
    slot = s;
    slot->ptr[rank] = send;
    slot->tag[rank] = tag;
    slot->arrived++;
    cv_.notify_all();
    JCOCCL_RETURN_IF_ERROR(WaitLocked(lk, slot, false, ctx, seq));
    for (int r = 0; r < size_; ++r) {
      if (slot->tag[r] != tag) {
        Break("jcoccl host transport: ranks issued different collectives (op " +
              std::to_string(seq) + ": rank " + std::to_string(rank) + " tag " +
              std::to_string(tag) + ", rank " + std::to_string(r) + " tag " +
              std::to_string(slot->tag[r]) + ")");
        return Status::Error(broken_);
      }
    }
  }
  consume(slot->ptr);
  std::unique_lock<std::mutex> lk(mu_);
  slot->left++;
  if (slot->left == size_) slots_.erase({run_id, seq});
  cv_.notify_all();
  return WaitLocked(lk, slot, true, ctx, seq);
}

}  // namespace jcoccl::transport
