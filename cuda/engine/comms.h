// Registry of jcoccl's communicators: (communicator id, device ordinal) -> transport.
//
// Python (jcoccl.init) creates one communicator id per mesh axis tuple and registers each
// member device's transport here; a fused custom call carries the id as an attribute and
// reads its device ordinal from the FFI context to find its rank. Each native module
// (jcoccl._cpu, jcoccl._cuda) has its own registry.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace jcoccl::engine {

class CommRegistry {
 public:
  using Key = std::pair<int64_t, int32_t>;
  void Add(int64_t comm, int32_t device, std::shared_ptr<transport::Transport> t) {
    std::lock_guard<std::mutex> lk(mu_);
    map_[{comm, device}] = std::move(t);
  }
  // Null if this device is not a member of `comm`.
  std::shared_ptr<transport::Transport> Find(int64_t comm, int32_t device) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = map_.find({comm, device});
    return it == map_.end() ? nullptr : it->second;
  }
  // Drops every member of `comm` and aborts what is still waiting on it (a program that was
  // in flight at jcoccl.shutdown() fails at once instead of after the timeout); returns how
  // many members there were.
  int Remove(int64_t comm) {
    std::vector<std::shared_ptr<transport::Transport>> gone;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto it = map_.begin(); it != map_.end();) {
        if (it->first.first == comm) {
          gone.push_back(std::move(it->second));
          it = map_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& t : gone)
      t->Abort("jcoccl: communicator " + std::to_string(comm) +
               " was destroyed (jcoccl.shutdown or jcoccl.init) while a collective waited on "
               "it; call jcoccl.init(mesh) and run the program again");
    return static_cast<int>(gone.size());
  }
  std::vector<Key> Keys() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<Key> k;
    for (auto& [key, v] : map_) k.push_back(key);
    return k;
  }

 private:
  std::mutex mu_;
  std::map<Key, std::shared_ptr<transport::Transport>> map_;
};

inline CommRegistry& Comms() {
  static CommRegistry* r = new CommRegistry();  // never destroyed: handlers may outlive exit
  return *r;
}

// A transport that only knows its size: lets WorkspaceBytes run without a communicator.
class SizeOnlyTransport final : public transport::Transport {
 public:
  explicit SizeOnlyTransport(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  transport::Status AllGather(const transport::CallCtx&, const void*, int64_t, void*) override {
    return transport::Status::Error("size-only transport");
  }
  transport::Status AllToAll(const transport::CallCtx&, const void*, int64_t, void*) override {
    return transport::Status::Error("size-only transport");
  }
  transport::Status SendRecv(const transport::CallCtx&, const void*, int, void*, int,
                             int64_t) override {
    return transport::Status::Error("size-only transport");
  }
  transport::Status AllReduceSum(const transport::CallCtx&, const float*, int64_t,
                                 float*) override {
    return transport::Status::Error("size-only transport");
  }
  transport::Status ReduceScatterSum(const transport::CallCtx&, const float*, int64_t,
                                     float*) override {
    return transport::Status::Error("size-only transport");
  }

 private:
  int size_;
};

}  // namespace jcoccl::engine
