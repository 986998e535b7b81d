// nanobind: creates host-transport communicators (jcoccl._cpu).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>
#include <vector>

#include "engine/comms.h"
#include "transport/host.h"

namespace jcoccl::engine {

inline void BindHostComms(nanobind::module_& m) {
  m.def(
      "fused_host_comm_create",
      [](int64_t comm, const std::vector<int32_t>& devices) {
        if (devices.empty()) throw std::invalid_argument("devices must be non-empty");
        auto group = std::make_shared<transport::HostGroup>(static_cast<int>(devices.size()));
        for (size_t r = 0; r < devices.size(); ++r)
          Comms().Add(comm, devices[r],
                      std::make_shared<transport::HostTransport>(group, static_cast<int>(r)));
      },
      nanobind::arg("comm"), nanobind::arg("devices"),
      "Registers an in-process communicator: devices[r] (a CPU device ordinal) is rank r.");
}

}  // namespace jcoccl::engine
