// Leaf bucketing on CPU (jcoccl/_src/compressors/layout.py run_packed): the leaves of one bucket
// laid end to end in one padded row by ONE call, and the results cut back out by ONE call. XLA:CPU
// runs every pad, slice or gather index as a kernel (or a constant) of its own; with 200 leaves a
// bucket paid 200 unpack kernels per device, more than its collective.
//
// Layout (the same as run_packed's jnp path, so the bits are the same): every one of the
// `rows` rows holds, for leaf i in order, counts[i] segments of lengths[i] elements, each
// followed by padded[i] - lengths[i] zeros; then zeros up to the row's width. Leaf i's own
// rows are counts[i] * lengths[i] contiguous elements.
//
//   jcoccl_pack_rows:   leaves... [rows, counts[i] * lengths[i]] -> row [rows, width]
//   jcoccl_unpack_rows: row [rows, width] -> leaves... [rows, counts[i] * lengths[i]]
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jcoccl::pack {
namespace {

using Lens = ffi::Span<const int64_t>;

// The packed width the attributes describe, or -1 if they disagree with each other.
int64_t Described(Lens lengths, Lens padded, Lens counts) {
  if (lengths.size() != padded.size() || lengths.size() != counts.size()) return -1;
  int64_t w = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 0 || padded[i] < lengths[i] || counts[i] < 0) return -1;
    w += counts[i] * padded[i];
  }
  return w;
}

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jcoccl pack_rows/unpack_rows: " + what);
}

// Checks one leaf buffer against its attributes and the packed row; `eb` its element bytes.
ffi::Error CheckLeaf(size_t i, const ffi::AnyBuffer& leaf, const ffi::AnyBuffer& row, int64_t rows,
                     int64_t count, int64_t length) {
  if (leaf.element_type() != row.element_type())
    return Invalid("leaf " + std::to_string(i) + " has another dtype than the packed row");
  if (static_cast<int64_t>(leaf.element_count()) != rows * count * length)
    return Invalid("leaf " + std::to_string(i) + " has " + std::to_string(leaf.element_count()) +
                   " elements, not rows x counts x lengths");
  return ffi::Error::Success();
}

// Calls fn(leaf index, row, segment, byte offset in the leaf, byte offset in the row) for
// every segment, and zero(byte offset in the row, bytes) for every gap, row by row.
template <class Seg, class Gap>
void Walk(Lens lengths, Lens padded, Lens counts, int64_t rows, int64_t width, size_t eb, Seg fn,
          Gap zero) {
  for (int64_t r = 0; r < rows; ++r) {
    int64_t at = r * width;
    for (size_t i = 0; i < lengths.size(); ++i) {
      for (int64_t s = 0; s < counts[i]; ++s) {
        fn(i, r, s, (r * counts[i] + s) * lengths[i] * eb, at * eb, lengths[i] * eb);
        if (padded[i] > lengths[i]) zero((at + lengths[i]) * eb, (padded[i] - lengths[i]) * eb);
        at += padded[i];
      }
    }
    if (at < (r + 1) * width) zero(at * eb, ((r + 1) * width - at) * eb);
  }
}

ffi::Error PackImpl(ffi::RemainingArgs leaves, ffi::Result<ffi::AnyBuffer> row, Lens lengths,
                    Lens padded, Lens counts, int64_t rows) {
  const int64_t described = Described(lengths, padded, counts);
  if (described < 0 || leaves.size() != lengths.size() || rows <= 0)
    return Invalid("one (length, padded, count) per leaf, padded >= length, rows > 0");
  const int64_t total = static_cast<int64_t>(row->element_count());
  if (total % rows != 0 || total / rows < described)
    return Invalid("the packed row is narrower than its leaves");
  const int64_t width = total / rows;
  const size_t eb = row->size_bytes() / (total ? total : 1);
  std::vector<const uint8_t*> src(leaves.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    auto leaf = leaves.get<ffi::AnyBuffer>(i);
    if (leaf.has_error()) return leaf.error();
    if (ffi::Error e = CheckLeaf(i, *leaf, *row, rows, counts[i], lengths[i]); e.failure())
      return e;
    src[i] = static_cast<const uint8_t*>(leaf->untyped_data());
  }
  auto* out = static_cast<uint8_t*>(row->untyped_data());
  Walk(
      lengths, padded, counts, rows, width, eb,
      [&](size_t i, int64_t, int64_t, int64_t from, int64_t to, int64_t bytes) {
        std::memcpy(out + to, src[i] + from, bytes);
      },
      [&](int64_t to, int64_t bytes) { std::memset(out + to, 0, bytes); });
  return ffi::Error::Success();
}

ffi::Error UnpackImpl(ffi::AnyBuffer row, ffi::RemainingRets leaves, Lens lengths, Lens padded,
                      Lens counts, int64_t rows) {
  const int64_t described = Described(lengths, padded, counts);
  if (described < 0 || leaves.size() != lengths.size() || rows <= 0)
    return Invalid("one (length, padded, count) per leaf, padded >= length, rows > 0");
  const int64_t total = static_cast<int64_t>(row.element_count());
  if (total % rows != 0 || total / rows < described)
    return Invalid("the packed row is narrower than its leaves");
  const int64_t width = total / rows;
  const size_t eb = row.size_bytes() / (total ? total : 1);
  std::vector<uint8_t*> dst(leaves.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    auto leaf = leaves.get<ffi::AnyBuffer>(i);
    if (leaf.has_error()) return leaf.error();
    if (ffi::Error e = CheckLeaf(i, **leaf, row, rows, counts[i], lengths[i]); e.failure())
      return e;
    dst[i] = static_cast<uint8_t*>((*leaf)->untyped_data());
  }
  const auto* in = static_cast<const uint8_t*>(row.untyped_data());
  Walk(
      lengths, padded, counts, rows, width, eb,
      [&](size_t i, int64_t, int64_t, int64_t to, int64_t from, int64_t bytes) {
        std::memcpy(dst[i] + to, in + from, bytes);
      },
      [](int64_t, int64_t) {});
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jcoccl::pack

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclPackRows, jcoccl::pack::PackImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("lengths")
                                  .Attr<ffi::Span<const int64_t>>("padded")
                                  .Attr<ffi::Span<const int64_t>>("counts")
                                  .Attr<int64_t>("rows"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclUnpackRows, jcoccl::pack::UnpackImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("lengths")
                                  .Attr<ffi::Span<const int64_t>>("padded")
                                  .Attr<ffi::Span<const int64_t>>("counts")
                                  .Attr<int64_t>("rows"));
JCOCCL_REGISTER_HANDLER(JcocclPackRows, "jcoccl_pack_rows");
JCOCCL_REGISTER_HANDLER(JcocclUnpackRows, "jcoccl_unpack_rows");
