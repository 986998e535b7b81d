// The fused engine's codec (engine/engine.h Codec) on a platform P of codecs/handlers.h
// (cpu/platform.h, gpu/platform.h): the same row operations as the codec handlers, chosen
// between a plugin's kernels and the built-in ones by the same RunRowOps.
//
// Example:
//   PlatformCodec<codecs::CpuPlatform> codec(spec, dtype);
//   Status s = codec.EncodeRows(lanes.stream(kEncode), x, rows, n, out);
#pragma once

#include <cstdint>
#include <string>

#include "codecs/handlers.h"
#include "engine/engine.h"

namespace jcoccl::engine {

template <class P>
class PlatformCodec final : public Codec {
 public:
  using Codec::Codec;
  Status EncodeRows(void* s, const void* x, int64_t rows, int64_t n, uint8_t* out) override {
    return Run([&](auto ops) { return ops.Encode(spec_, dtype_, x, rows, n, out, St(s)); });
  }
  Status DecodeRows(void* s, const uint8_t* in, int64_t rows, int64_t n, void* out) override {
    return Run([&](auto ops) { return ops.Decode(spec_, dtype_, in, rows, n, out, St(s)); });
  }
  // The engine's nrows payloads are contiguous: one reduction of rows Payload(n) apart.
  Status DecodeSum(void* s, const uint8_t* in, int nrows, int64_t n, void* out) override {
    return Run([&](auto ops) {
      return ops.DecodeSum(spec_, dtype_, in, nrows, Payload(n), 1, n, out, St(s));
    });
  }
  Status DecodeSumEncode(void* s, const uint8_t* in, int nrows, int64_t n, uint8_t* out) override {
    return Run([&](auto ops) {
      return ops.DecodeSumEncode(spec_, dtype_, in, nrows, Payload(n), 1, n, out, St(s));
    });
  }

 private:
  static typename P::Stream St(void* s) { return P::StreamOf(s); }
  template <class F>
  Status Run(F&& f) const {
    const std::string e = codecs::RunRowOps<P>(spec_, f);
    return e.empty() ? Status::Ok() : Status::Error(e);
  }
};

}  // namespace jcoccl::engine
