// parquet.h through Apache Arrow's C++ Parquet reader (the one file that includes Arrow's headers; LF_HAVE_ARROW and
// Arrow's include folder come from CMake, for this file only).
#include "loongforge/data/parquet.h"

#include <ATen/ATen.h>

#include <filesystem>

#include "loongforge/core/error.h"

#ifdef LF_HAVE_ARROW

#include <arrow/api.h>
#include <arrow/config.h>
#include <arrow/io/file.h>
#include <parquet/arrow/reader.h>
#include <parquet/arrow/schema.h>
#include <parquet/exception.h>
#include <parquet/file_reader.h>
#include <parquet/metadata.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string_view>

namespace lf::data {

bool parquet_available() { return true; }

std::string parquet_backend_description() {
  return "Apache Arrow " + arrow::GetBuildInfo().version_string + " (libarrow + libparquet of the pyarrow wheel in " +
         LF_ARROW_LIB_DIR + ")";
}

namespace {

// Arrow's messages may span lines (a status detail, a thrift error): ours are one line.
std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  while (!s.empty() && (s.back() == ' ' || s.back() == '.')) s.pop_back();
  return s;
}

bool list_type(arrow::Type::type id) {
  return id == arrow::Type::LIST || id == arrow::Type::LARGE_LIST || id == arrow::Type::FIXED_SIZE_LIST;
}

bool bytes_type(arrow::Type::type id) {
  return id == arrow::Type::BINARY || id == arrow::Type::LARGE_BINARY || id == arrow::Type::STRING ||
         id == arrow::Type::LARGE_STRING;
}

std::optional<at::ScalarType> numeric_dtype(arrow::Type::type id) {
  switch (id) {
    case arrow::Type::BOOL: return at::kBool;
    case arrow::Type::INT8: return at::kChar;
    case arrow::Type::INT16: return at::kShort;
    case arrow::Type::INT32: return at::kInt;
    case arrow::Type::INT64: return at::kLong;
    case arrow::Type::UINT8: return at::kByte;
    case arrow::Type::HALF_FLOAT: return at::kHalf;
    case arrow::Type::FLOAT: return at::kFloat;
    case arrow::Type::DOUBLE: return at::kDouble;
    default: return std::nullopt;
  }
}

ParquetColumn describe(const arrow::Field& f) {
  ParquetColumn c;
  c.name = f.name();
  c.type = f.type()->ToString();
  c.nullable = f.nullable();
  const arrow::DataType* t = f.type().get();
  while (list_type(t->id())) {
    if (t->id() == arrow::Type::FIXED_SIZE_LIST)
      c.shape.push_back(static_cast<const arrow::FixedSizeListType*>(t)->list_size());
    else
      c.shape.push_back(-1);
    t = t->field(0)->type().get();
  }
  if (auto dt = numeric_dtype(t->id())) {
    c.kind = ParquetColumnKind::numeric, c.dtype = *dt;
    return c;
  }
  const bool one_list = t != f.type().get() && t == f.type()->field(0)->type().get();
  c.shape.clear();
  if (one_list && bytes_type(t->id())) c.kind = ParquetColumnKind::byte_lists;
  if (t != f.type().get()) return c;  // a list of something else
  if (bytes_type(t->id())) {
    c.kind = ParquetColumnKind::bytes;
  } else if (t->id() == arrow::Type::STRUCT) {
    const auto& st = static_cast<const arrow::StructType&>(*t);
    auto bytes = st.GetFieldByName("bytes");
    if (bytes && (bytes->type()->id() == arrow::Type::BINARY || bytes->type()->id() == arrow::Type::LARGE_BINARY))
      c.kind = ParquetColumnKind::image;
  }
  return c;
}

// What a column holds, for errors: "holds bytes (string)".
std::string holds(const ParquetColumn& c) {
  const char* what = "values of a type this reader does not handle";
  switch (c.kind) {
    case ParquetColumnKind::numeric: what = "numbers"; break;
    case ParquetColumnKind::bytes: what = "bytes"; break;
    case ParquetColumnKind::image: what = "images"; break;
    case ParquetColumnKind::byte_lists: what = "lists of strings"; break;
    default: break;
  }
  return std::string("holds ") + what + " (" + c.type + ")";
}

void collect_leaves(const parquet::arrow::SchemaField& f, std::vector<int>& out) {
  if (f.is_leaf()) out.push_back(f.column_index);
  for (const auto& c : f.children) collect_leaves(c, out);
}

// The first null of A in [s, e), or -1.
int64_t first_null(const arrow::Array& a, int64_t s, int64_t e) {
  if (a.null_count() == 0) return -1;
  for (int64_t i = s; i < e; ++i)
    if (a.IsNull(i)) return i;
  return -1;
}

// The leaf values under rows [s, e) of one chunk of a numeric column.
struct LeafRange {
  const arrow::Array* leaf;
  int64_t begin, end;
};

std::string_view bytes_at(const arrow::Array& a, int64_t i) {
  const arrow::Type::type id = a.type_id();
  return id == arrow::Type::LARGE_BINARY || id == arrow::Type::LARGE_STRING
             ? static_cast<const arrow::LargeBinaryArray&>(a).GetView(i)
             : static_cast<const arrow::BinaryArray&>(a).GetView(i);
}

}  // namespace

struct ParquetFile::Impl {
  std::string path;
  std::unique_ptr<parquet::arrow::FileReader> reader;
  std::vector<ParquetColumn> columns;
  std::map<std::string, size_t> by_name;
  std::vector<std::vector<int>> leaves;  // per column: its Parquet leaf column indices
  std::vector<int64_t> starts;
  std::map<std::string, std::string> metadata;
  mutable std::mutex mu;

  [[noreturn]] void fail(const std::string& what) const { throw Error(path + ": " + what); }
  [[noreturn]] void fail(const std::string& column, const std::string& what) const {
    throw Error(path + ": column '" + column + "': " + what);
  }

  size_t index(const std::string& name) const {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      std::string known;
      for (const auto& c : columns) known += (known.empty() ? "" : ", ") + c.name;
      fail(name, "no such column (the file has: " + known + ")");
    }
    return it->second;
  }

  int64_t resolve_end(int64_t begin, int64_t end) const {
    const int64_t n = starts.back();
    if (end == -1) end = n;
    if (begin < 0 || end < begin || end > n)
      fail("rows [" + std::to_string(begin) + ", " + std::to_string(end) + ") are outside the file's " +
           std::to_string(n) + " rows");
    return end;
  }

  // Columns COLS (indices) of rows [begin, end), decoding only the row groups the range overlaps.
  std::shared_ptr<arrow::Table> read(const std::vector<size_t>& cols, int64_t begin, int64_t end) const {
    std::vector<int> groups;
    for (int g = 0; g + 1 < static_cast<int>(starts.size()); ++g)
      if (starts[g] < end && starts[g + 1] > begin) groups.push_back(g);
    std::vector<int> leaf;
    for (size_t c : cols) leaf.insert(leaf.end(), leaves[c].begin(), leaves[c].end());
    std::sort(leaf.begin(), leaf.end());
    leaf.erase(std::unique(leaf.begin(), leaf.end()), leaf.end());
    const std::string where = "rows [" + std::to_string(begin) + ", " + std::to_string(end) + "): ";
    arrow::Result<std::shared_ptr<arrow::Table>> table;
    {
      std::lock_guard<std::mutex> lock(mu);
      try {
        table = reader->ReadRowGroups(groups, leaf);
      } catch (const std::exception& e) {
        fail(where + one_line(e.what()));
      }
    }
    if (!table.ok()) fail(where + one_line(table.status().message()));
    // a corrupt column chunk can decode to fewer values than its row group's rows (found by the lerobot fuzz target)
    const int64_t rows = groups.empty() ? 0 : starts[groups.back() + 1] - starts[groups.front()];
    for (int i = 0; i < (*table)->num_columns(); ++i)
      if ((*table)->column(i)->length() != rows)
        fail((*table)->field(i)->name(), where + "decodes to " + std::to_string((*table)->column(i)->length()) +
                                             " values, its row groups hold " + std::to_string(rows) + " rows");
    return (*table)->Slice(begin - (groups.empty() ? begin : starts[groups.front()]), end - begin);
  }

  std::shared_ptr<arrow::ChunkedArray> chunks(const arrow::Table& t, const std::string& name) const {
    auto col = t.GetColumnByName(name);
    if (!col) fail(name, "missing from what Arrow read");
    return col;
  }

  at::Tensor to_tensor(const ParquetColumn& c, const arrow::ChunkedArray& col, int64_t begin) const {
    // Pass 1: walk the list levels of every chunk, checking nulls and that each level has one size.
    std::vector<int64_t> sizes = c.shape;
    std::vector<LeafRange> ranges;
    int64_t row0 = begin;
    for (const auto& chunk : col.chunks()) {
      const arrow::Array* a = chunk.get();
      int64_t s = 0, e = a->length();
      for (size_t level = 0;; ++level) {
        if (int64_t i = first_null(*a, s, e); i >= 0) {
          if (level == 0) fail(c.name, "row " + std::to_string(row0 + i) + " is null (nulls are not supported)");
          fail(c.name, "a null value inside the lists of rows [" + std::to_string(row0) + ", " +
                           std::to_string(row0 + chunk->length()) + ") (nulls are not supported)");
        }
        if (!list_type(a->type_id())) break;
        int64_t ns = 0, ne = 0;
        auto length_at = [&](int64_t i) -> int64_t {
          switch (a->type_id()) {
            case arrow::Type::LIST: return static_cast<const arrow::ListArray*>(a)->value_length(i);
            case arrow::Type::LARGE_LIST: return static_cast<const arrow::LargeListArray*>(a)->value_length(i);
            default: return static_cast<const arrow::FixedSizeListArray*>(a)->value_length(i);
          }
        };
        const arrow::Array* values = nullptr;
        if (a->type_id() == arrow::Type::LIST) {
          const auto* l = static_cast<const arrow::ListArray*>(a);
          ns = l->value_offset(s), ne = l->value_offset(e), values = l->values().get();
        } else if (a->type_id() == arrow::Type::LARGE_LIST) {
          const auto* l = static_cast<const arrow::LargeListArray*>(a);
          ns = l->value_offset(s), ne = l->value_offset(e), values = l->values().get();
        } else {
          const auto* l = static_cast<const arrow::FixedSizeListArray*>(a);
          ns = l->value_offset(s), ne = l->value_offset(e), values = l->values().get();
        }
        for (int64_t i = s; i < e; ++i) {
          const int64_t len = length_at(i);
          if (sizes[level] < 0) sizes[level] = len;
          if (len != sizes[level]) {
            if (level == 0)
              fail(c.name, "row " + std::to_string(row0 + i) + " holds " + std::to_string(len) +
                               " values where earlier rows hold " + std::to_string(sizes[level]) +
                               " (a tensor needs lists of one size)");
            fail(c.name, "rows [" + std::to_string(row0) + ", " + std::to_string(row0 + chunk->length()) +
                             ") hold nested lists of " + std::to_string(len) + " and " +
                             std::to_string(sizes[level]) + " values (a tensor needs one size per list level)");
          }
        }
        a = values, s = ns, e = ne;
      }
      ranges.push_back({a, s, e});
      row0 += chunk->length();
    }
    for (auto& s : sizes)
      if (s < 0) s = 0;  // no rows: a variable size never seen
    std::vector<int64_t> shape{col.length()};
    shape.insert(shape.end(), sizes.begin(), sizes.end());
    at::Tensor out = at::empty(shape, at::TensorOptions().dtype(c.dtype));
    // Pass 2: copy the leaf values.
    auto* dst = static_cast<uint8_t*>(out.data_ptr());
    const size_t width = out.element_size();
    size_t at_byte = 0;
    for (const LeafRange& r : ranges) {
      const int64_t n = r.end - r.begin;
      if (n == 0) continue;
      if (r.leaf->type_id() == arrow::Type::BOOL) {
        const auto* b = static_cast<const arrow::BooleanArray*>(r.leaf);
        for (int64_t i = 0; i < n; ++i) dst[at_byte + i] = b->Value(r.begin + i) ? 1 : 0;
      } else {
        const auto& data = *r.leaf->data();
        const uint8_t* src = data.buffers[1]->data() + (data.offset + r.begin) * static_cast<int64_t>(width);
        std::memcpy(dst + at_byte, src, n * width);
      }
      at_byte += n * width;
    }
    if (at_byte != out.nbytes()) fail(c.name, "internal: leaf values do not fill the tensor");
    return out;
  }
};

ParquetFile::ParquetFile(const std::string& path) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = path;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) m.fail("no such file");
  if (!std::filesystem::is_regular_file(path, ec)) m.fail("not a file");
  try {
    auto file = arrow::io::ReadableFile::Open(path);
    if (!file.ok()) m.fail("cannot open: " + one_line(file.status().message()));
    parquet::arrow::FileReaderBuilder builder;
    arrow::Status st = builder.Open(*file);
    if (!st.ok()) m.fail("not a readable Parquet file (" + one_line(st.message()) + ")");
    auto reader = builder.Build();
    if (!reader.ok()) m.fail("not a readable Parquet file (" + one_line(reader.status().message()) + ")");
    m.reader = std::move(*reader);
    std::shared_ptr<arrow::Schema> schema;
    st = m.reader->GetSchema(&schema);
    if (!st.ok()) m.fail("unreadable schema (" + one_line(st.message()) + ")");
    const auto& fields = m.reader->manifest().schema_fields;
    for (int i = 0; i < schema->num_fields(); ++i) {
      m.columns.push_back(describe(*schema->field(i)));
      m.by_name.emplace(m.columns.back().name, m.columns.size() - 1);
      m.leaves.emplace_back();
      collect_leaves(fields.at(static_cast<size_t>(i)), m.leaves.back());
    }
    const auto meta = m.reader->parquet_reader()->metadata();
    m.starts.push_back(0);
    for (int g = 0; g < meta->num_row_groups(); ++g) m.starts.push_back(m.starts.back() + meta->RowGroup(g)->num_rows());
    if (m.starts.back() != meta->num_rows())
      m.fail("the row groups hold " + std::to_string(m.starts.back()) + " rows, the footer says " +
             std::to_string(meta->num_rows()));
    if (const auto& kv = meta->key_value_metadata())
      for (int64_t i = 0; i < kv->size(); ++i) m.metadata[kv->key(i)] = kv->value(i);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // parquet::ParquetException from a corrupt footer
    m.fail("not a readable Parquet file (" + one_line(e.what()) + ")");
  }
}

ParquetFile::~ParquetFile() = default;
ParquetFile::ParquetFile(ParquetFile&&) noexcept = default;
ParquetFile& ParquetFile::operator=(ParquetFile&&) noexcept = default;

const std::string& ParquetFile::path() const { return impl_->path; }
int64_t ParquetFile::num_rows() const { return impl_->starts.back(); }
int ParquetFile::num_row_groups() const { return static_cast<int>(impl_->starts.size()) - 1; }
const std::vector<int64_t>& ParquetFile::row_group_starts() const { return impl_->starts; }
const std::vector<ParquetColumn>& ParquetFile::columns() const { return impl_->columns; }
bool ParquetFile::has_column(const std::string& name) const { return impl_->by_name.count(name) > 0; }
const ParquetColumn& ParquetFile::column(const std::string& name) const {
  return impl_->columns[impl_->index(name)];
}
const std::map<std::string, std::string>& ParquetFile::metadata() const { return impl_->metadata; }
std::optional<std::string> ParquetFile::metadata(const std::string& key) const {
  auto it = impl_->metadata.find(key);
  if (it == impl_->metadata.end()) return std::nullopt;
  return it->second;
}

std::vector<int64_t> ParquetFile::row_shape(const std::string& name) const {
  const ParquetColumn& c = column(name);
  if (c.kind != ParquetColumnKind::numeric)
    impl_->fail(name, holds(c) + ", not numbers");
  if (num_rows() == 0 || std::none_of(c.shape.begin(), c.shape.end(), [](int64_t s) { return s < 0; }))
    return c.shape;
  const at::Tensor first = read_tensor(name, 0, 1);
  return std::vector<int64_t>(first.sizes().begin() + 1, first.sizes().end());
}

std::vector<at::Tensor> ParquetFile::read_tensors(const std::vector<std::string>& names, int64_t begin,
                                                  int64_t end) const {
  const Impl& m = *impl_;
  end = m.resolve_end(begin, end);
  std::vector<size_t> cols;
  for (const auto& n : names) {
    cols.push_back(m.index(n));
    const ParquetColumn& c = m.columns[cols.back()];
    if (c.kind != ParquetColumnKind::numeric)
      m.fail(n, holds(c) + ", not numbers or lists of numbers");
  }
  std::vector<at::Tensor> out;
  if (names.empty()) return out;
  if (begin == end) {
    for (size_t c : cols) {  // [0, sizes of a row] (variable sizes: those of the first row; none: 0)
      std::vector<int64_t> shape{0};
      for (int64_t s : row_shape(m.columns[c].name)) shape.push_back(std::max<int64_t>(s, 0));
      out.push_back(at::empty(shape, at::TensorOptions().dtype(m.columns[c].dtype)));
    }
    return out;
  }
  const auto table = m.read(cols, begin, end);
  for (size_t c : cols) out.push_back(m.to_tensor(m.columns[c], *m.chunks(*table, m.columns[c].name), begin));
  return out;
}

at::Tensor ParquetFile::read_tensor(const std::string& name, int64_t begin, int64_t end) const {
  return read_tensors({name}, begin, end).front();
}

std::vector<std::string> ParquetFile::read_bytes(const std::string& name, int64_t begin, int64_t end) const {
  const Impl& m = *impl_;
  end = m.resolve_end(begin, end);
  const size_t ci = m.index(name);
  const ParquetColumn& c = m.columns[ci];
  if (c.kind != ParquetColumnKind::bytes && c.kind != ParquetColumnKind::image)
    m.fail(name, holds(c) + ", not binary, string or an image struct {bytes, path}");
  std::vector<std::string> out;
  if (begin == end) return out;
  out.reserve(static_cast<size_t>(end - begin));
  const auto table = m.read({ci}, begin, end);
  int64_t row0 = begin;
  for (const auto& chunk : m.chunks(*table, name)->chunks()) {
    std::shared_ptr<arrow::Array> values = chunk;
    if (int64_t i = first_null(*chunk, 0, chunk->length()); i >= 0)
      m.fail(name, "row " + std::to_string(row0 + i) + " is null (nulls are not supported)");
    if (c.kind == ParquetColumnKind::image) {
      values = static_cast<const arrow::StructArray&>(*chunk).GetFieldByName("bytes");
      if (int64_t i = first_null(*values, 0, values->length()); i >= 0)
        m.fail(name, "row " + std::to_string(row0 + i) + " has no image bytes (a null 'bytes' field)");
    }
    for (int64_t i = 0; i < values->length(); ++i) out.emplace_back(bytes_at(*values, i));
    row0 += chunk->length();
  }
  return out;
}

std::vector<std::vector<std::string>> ParquetFile::read_byte_lists(const std::string& name, int64_t begin,
                                                                   int64_t end) const {
  const Impl& m = *impl_;
  end = m.resolve_end(begin, end);
  const size_t ci = m.index(name);
  const ParquetColumn& c = m.columns[ci];
  if (c.kind != ParquetColumnKind::byte_lists)
    m.fail(name, holds(c) + ", not lists of strings");
  std::vector<std::vector<std::string>> out;
  if (begin == end) return out;
  out.reserve(static_cast<size_t>(end - begin));
  const auto table = m.read({ci}, begin, end);
  int64_t row0 = begin;
  for (const auto& chunk : m.chunks(*table, name)->chunks()) {
    if (int64_t i = first_null(*chunk, 0, chunk->length()); i >= 0)
      m.fail(name, "row " + std::to_string(row0 + i) + " is null (nulls are not supported)");
    for (int64_t i = 0; i < chunk->length(); ++i) {
      int64_t s = 0, e = 0;
      const arrow::Array* values = nullptr;
      if (chunk->type_id() == arrow::Type::LIST) {
        const auto& l = static_cast<const arrow::ListArray&>(*chunk);
        s = l.value_offset(i), e = l.value_offset(i + 1), values = l.values().get();
      } else if (chunk->type_id() == arrow::Type::LARGE_LIST) {
        const auto& l = static_cast<const arrow::LargeListArray&>(*chunk);
        s = l.value_offset(i), e = l.value_offset(i + 1), values = l.values().get();
      } else {
        const auto& l = static_cast<const arrow::FixedSizeListArray&>(*chunk);
        s = l.value_offset(i), e = l.value_offset(i + 1), values = l.values().get();
      }
      if (first_null(*values, s, e) >= 0)
        m.fail(name, "row " + std::to_string(row0 + i) + " holds a null string (nulls are not supported)");
      std::vector<std::string>& row = out.emplace_back();
      for (int64_t k = s; k < e; ++k) row.emplace_back(bytes_at(*values, k));
    }
    row0 += chunk->length();
  }
  return out;
}

}  // namespace lf::data

#else  // no Apache Arrow in this build

namespace lf::data {

namespace {
const char* kNoArrow = "this build has no Apache Arrow (pip install pyarrow==26.0.1 in the venv and rebuild)";
[[noreturn]] void no_arrow(const std::string& path) { throw Error(path + ": " + kNoArrow); }
}  // namespace

bool parquet_available() { return false; }
std::string parquet_backend_description() { return std::string("none: ") + kNoArrow; }

struct ParquetFile::Impl {};

ParquetFile::ParquetFile(const std::string& path) { no_arrow(path); }
ParquetFile::~ParquetFile() = default;
ParquetFile::ParquetFile(ParquetFile&&) noexcept = default;
ParquetFile& ParquetFile::operator=(ParquetFile&&) noexcept = default;
// Unreachable: no ParquetFile can be constructed.
const std::string& ParquetFile::path() const { no_arrow(""); }
int64_t ParquetFile::num_rows() const { no_arrow(""); }
int ParquetFile::num_row_groups() const { no_arrow(""); }
const std::vector<int64_t>& ParquetFile::row_group_starts() const { no_arrow(""); }
const std::vector<ParquetColumn>& ParquetFile::columns() const { no_arrow(""); }
bool ParquetFile::has_column(const std::string&) const { no_arrow(""); }
const ParquetColumn& ParquetFile::column(const std::string&) const { no_arrow(""); }
std::vector<int64_t> ParquetFile::row_shape(const std::string&) const { no_arrow(""); }
const std::map<std::string, std::string>& ParquetFile::metadata() const { no_arrow(""); }
std::optional<std::string> ParquetFile::metadata(const std::string&) const { no_arrow(""); }
std::vector<at::Tensor> ParquetFile::read_tensors(const std::vector<std::string>&, int64_t, int64_t) const {
  no_arrow("");
}
at::Tensor ParquetFile::read_tensor(const std::string&, int64_t, int64_t) const { no_arrow(""); }
std::vector<std::string> ParquetFile::read_bytes(const std::string&, int64_t, int64_t) const { no_arrow(""); }
std::vector<std::vector<std::string>> ParquetFile::read_byte_lists(const std::string&, int64_t, int64_t) const {
  no_arrow("");
}

}  // namespace lf::data

#endif
