// Exports the C++ enums that cross the FFI boundary (codec kinds, element types, fp8
// formats, engine ops) as name -> value dicts on the native module, so Python reads the
// values instead of keeping its own copy, and the codec descriptor's schema
// (codecs/bind_descriptor.h: CODEC_FIELDS, codec_descriptor). Included by cuda/bindings_*.cc
// only.
#pragma once
#include <nanobind/nanobind.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "codecs/bind_descriptor.h"
#include "codecs/codec.h"
#include "engine/engine.h"

namespace jcoccl::engine {

namespace nb = nanobind;

template <typename E>
nb::dict EnumDict(std::initializer_list<std::pair<const char*, E>> items) {
  nb::dict d;
  for (const auto& [name, value] : items) d[name] = static_cast<int32_t>(value);
  return d;
}

inline void BindEnums(nb::module_& m) {
  using codecs::DType;
  using codecs::Fp8Format;
  using codecs::Kind;
  m.attr("CODEC_KINDS") = EnumDict<Kind>({{"none", Kind::kNone},
                                          {"cast", Kind::kCast},
                                          {"int", Kind::kInt},
                                          {"fp8", Kind::kFp8},
                                          {"error_bounded", Kind::kErrorBounded},
                                          {"plugin", Kind::kPlugin}});
  m.attr("DTYPES") = EnumDict<DType>(
      {{"float32", DType::kF32}, {"bfloat16", DType::kBF16}, {"float16", DType::kF16}});
  m.attr("FP8_FORMATS") =
      EnumDict<Fp8Format>({{"e4m3", Fp8Format::kE4M3}, {"e5m2", Fp8Format::kE5M2}});
  m.attr("OPS") = EnumDict<Op>({{"all_reduce_one_shot", Op::kAllReduceOneShot},
                                {"all_reduce_two_shot", Op::kAllReduceTwoShot},
                                {"all_reduce_hierarchical", Op::kAllReduceHierarchical},
                                {"reduce_scatter", Op::kReduceScatter},
                                {"all_gather", Op::kAllGather},
                                {"all_to_all", Op::kAllToAll},
                                {"ppermute", Op::kPpermute},
                                {"plain_all_reduce", Op::kPlainAllReduce},
                                {"plain_reduce_scatter", Op::kPlainReduceScatter},
                                {"plain_all_gather", Op::kPlainAllGather}});
  codecs::BindDescriptor(m);
}

}  // namespace jcoccl::engine
