// Parquet files through Apache Arrow's own C++ reader (libparquet + libarrow from the pyarrow wheel), for the data
// formats stored in Parquet (LeRobot datasets: data/*.parquet frames, meta/ episodes and tasks). The one file that
// includes Arrow's headers is parquet.cpp; this header is Arrow-free. A build without Arrow (CMake found no pyarrow)
// still has these functions: opening a file throws one line saying so (parquet_available() tells which).
//
// Columns are top-level fields of the file's Arrow schema, named as the file names them ("observation.state").
// Numeric columns (int8/16/32/64, uint8, float16/32/64, bool) and lists of them (list, large_list,
// fixed_size_list, nested: a LeRobot stats column list<list<list<double>>>) read into one tensor [rows, ...] whose
// trailing sizes are the lists' sizes (every row of a variable-size list must have the same length). Binary and
// string columns, and image structs {bytes: binary, path: string} (how LeRobot / Hugging Face datasets store image
// features), read as one byte string per row; lists of strings as one list of byte strings per row. Nulls are
// rejected: an error naming the file, column and row.
// Errors are one-line lf::Error naming the file (and the column): a missing, truncated or non-Parquet file, an
// absent column, a column of another kind, a row range outside the file.
//
// Reads are row-group aware: a row range [begin, end) decodes only the row groups it overlaps. A ParquetFile may
// be shared by threads (reads are serialised inside); decode threads that want parallel reads open one each.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lf::data {

// Whether this build has Apache Arrow (LF_HAVE_ARROW), and what it is ("Apache Arrow 26.0.1 (pyarrow wheel in
// DIR)", or "none: this build has no Apache Arrow ..."), for `loongforge env`.
bool parquet_available();
std::string parquet_backend_description();

// What read functions a column allows.
enum class ParquetColumnKind {
  numeric,  // read_tensor: numbers / bools, or lists of them
  bytes,    // read_bytes: binary, large_binary, string, large_string
  image,    // read_bytes: a struct with a binary field "bytes" (Hugging Face's Image feature: {bytes, path})
  byte_lists,  // read_byte_lists: a list of binary / string (LeRobot's episodes "tasks": list<string>)
  other,    // none of these (e.g. a struct of numbers): listed in the schema, not readable here
};

struct ParquetColumn {
  std::string name;
  std::string type;  // Arrow's spelling: "int64", "fixed_size_list<element: float>[6]", "struct<bytes: binary, ...>"
  ParquetColumnKind kind = ParquetColumnKind::other;
  // numeric: the tensor read_tensor gives is [rows, shape...] of dtype (bool -> kBool, float -> kFloat, ...).
  // shape: {} for a scalar column, one size per list level: N for fixed_size_list<_, N>, -1 for a variable-size
  // list (its size is in the data: row_shape() reads it from the first row).
  at::ScalarType dtype = at::ScalarType::Undefined;
  std::vector<int64_t> shape;
  bool nullable = true;  // the schema allows nulls (reads still fail on an actual null)
};

class ParquetFile {
 public:
  // Opens PATH and reads its footer (schema, row groups, metadata); no column data is read.
  explicit ParquetFile(const std::string& path);
  ~ParquetFile();
  ParquetFile(ParquetFile&&) noexcept;
  ParquetFile& operator=(ParquetFile&&) noexcept;
  ParquetFile(const ParquetFile&) = delete;
  ParquetFile& operator=(const ParquetFile&) = delete;

  const std::string& path() const;
  int64_t num_rows() const;
  // Row groups: the rows of group g are [row_group_starts()[g], row_group_starts()[g + 1]) (num_row_groups + 1
  // entries, the last one num_rows()).
  int num_row_groups() const;
  const std::vector<int64_t>& row_group_starts() const;

  // The top-level columns in file order.
  const std::vector<ParquetColumn>& columns() const;
  bool has_column(const std::string& name) const;
  // The column NAME; an error naming the file and the column when the file has none.
  const ParquetColumn& column(const std::string& name) const;
  // A numeric column's per-row shape with variable list sizes resolved from the first row (reads one row group);
  // the schema's shape when the file has no rows.
  std::vector<int64_t> row_shape(const std::string& name) const;

  // The file's key-value metadata (the footer's; pyarrow stores "ARROW:schema" there, Hugging Face datasets
  // "huggingface"), and one key of it.
  const std::map<std::string, std::string>& metadata() const;
  std::optional<std::string> metadata(const std::string& key) const;

  // Rows [begin, end) of numeric columns as tensors [end - begin, shape...] (contiguous, CPU), in the order given.
  // end = -1: to the last row; an empty range gives [0, row_shape(name)...]. Reading several columns at once
  // decodes each row group once.
  std::vector<at::Tensor> read_tensors(const std::vector<std::string>& names, int64_t begin = 0,
                                       int64_t end = -1) const;
  at::Tensor read_tensor(const std::string& name, int64_t begin = 0, int64_t end = -1) const;
  // Rows [begin, end) of a bytes or image column: one byte string per row (an image's encoded PNG / JPEG bytes).
  std::vector<std::string> read_bytes(const std::string& name, int64_t begin = 0, int64_t end = -1) const;
  // Rows [begin, end) of a byte_lists column: each row's list of byte strings.
  std::vector<std::vector<std::string>> read_byte_lists(const std::string& name, int64_t begin = 0,
                                                        int64_t end = -1) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lf::data
