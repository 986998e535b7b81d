// nanobind: NCCL communicators for the fused engine (jcoccl._cuda).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "engine/comms.h"
#include "transport/nccl.h"

namespace jcoccl::engine {

inline void BindNcclComms(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "nccl_unique_id",
      []() {
        std::string id;
        transport::Status s = transport::NcclUniqueId(&id);
        if (!s.ok()) throw std::runtime_error(s.msg);
        return nb::bytes(id.data(), id.size());
      },
      "A fresh ncclUniqueId (128 bytes).");
  m.def(
      "nccl_comm_init",
      [](int64_t comm, nb::bytes uid, int nranks, const std::vector<std::pair<int, int>>& members) {
        std::vector<ncclComm_t> comms;
        transport::Status s;
        {
          nb::gil_scoped_release release;  // blocks until every rank of the group joins
          s = transport::NcclInit(std::string(uid.c_str(), uid.size()), nranks, members, &comms);
        }
        if (!s.ok()) throw std::runtime_error(s.msg);
        for (size_t i = 0; i < members.size(); ++i)
          Comms().Add(comm, members[i].first,
                      std::make_shared<transport::NcclTransport>(comms[i], members[i].second,
                                                                 nranks, members[i].first));
      },
      nb::arg("comm"), nb::arg("uid"), nb::arg("nranks"), nb::arg("members"),
      "Creates this process's ranks of one NCCL group: members = [(device ordinal, rank)].");
  m.def(
      "nccl_version",
      []() {
        std::string err;
        const transport::NcclApi* api = transport::Nccl(&err);
        if (api == nullptr) throw std::runtime_error(err);
        int v = 0;
        api->GetVersion(&v);
        return v;
      },
      "The loaded NCCL's version code.");
}

}  // namespace jcoccl::engine
