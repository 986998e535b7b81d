// nanobind functions shared by jcoccl._cpu and jcoccl._cuda for the fused engine:
// communicator bookkeeping and workspace sizing. Included by cuda/bindings_*.cc only.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

#include "codecs/bind_descriptor.h"  // SpecFromPy
#include "codecs/codec.h"
#include "engine/comms.h"
#include "engine/engine.h"
#include "engine/ffi_call.h"

namespace jcoccl::engine {

namespace nb = nanobind;

inline void BindFusedCommon(nb::module_& m) {
  m.def(
      "fused_workspace_bytes",
      [](int op, int64_t k, int64_t mlen, int size, int outer_size, nb::dict codec,
         std::optional<nb::dict> outer, int dtype) {
        const CodecSpec oc =
            outer_size > 0 && outer ? codecs::SpecFromPy(*outer, "outer") : CodecSpec{};
        return FusedWorkspaceBytes(static_cast<Op>(op), k, mlen, size, outer_size,
                                   codecs::SpecFromPy(codec), oc, static_cast<DType>(dtype));
      },
      nb::arg("op"), nb::arg("k"), nb::arg("m"), nb::arg("size"), nb::arg("outer_size"),
      nb::arg("codec"), nb::arg("outer").none(), nb::arg("dtype"),
      "Workspace bytes a fused collective needs (its extra uint8 output): the engine's own "
      "dry run (engine/ffi_call.h FusedWorkspaceBytes) over the codec descriptors `codec` and "
      "`outer` (hierarchical; else None).");
  m.def(
      "fused_comm_destroy", [](int64_t comm) { return Comms().Remove(comm); }, nb::arg("comm"),
      "Drops every member of communicator `comm`; returns their count.");
  m.def(
      "fused_comm_keys", []() { return Comms().Keys(); },
      "(communicator id, device ordinal) pairs currently registered.");
  m.def(
      "fused_check_timeout",
      [](double s) {
        double out = transport::kDefaultTimeoutSeconds;
        if (!transport::CheckTimeoutSeconds(s, &out))
          throw std::invalid_argument("timeout_s must be a positive number of seconds");
        return out;
      },
      nb::arg("seconds"),
      "The timeout a fused call runs with for a timeout_s attribute of `seconds` (clamped to "
      "1e8); ValueError where the engine would refuse it.");
}

}  // namespace jcoccl::engine
