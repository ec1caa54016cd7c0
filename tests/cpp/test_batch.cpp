// Batches as named tensors (models/batch.h): row splits keep item fields (images of the rows, patches) with their
// rows and renumber them; rows without items get none.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "loongforge/models/batch.h"

namespace {

TEST(Batch, RowSplitsKeepItemFieldsWithTheirRows) {
  using lf::models::Batch;
  Batch b{{"input_ids", at::arange(12, at::kLong).view({4, 3})}};
  // rows 0 and 2 have one image each, row 3 two; row 1 none
  at::Tensor images = at::arange(4, at::kFloat).view({4, 1, 1, 1}).expand({4, 3, 2, 2}).contiguous();
  b.set_items("pixel_values", images, at::tensor({0, 2, 3, 3}, at::kLong));
  EXPECT_EQ(b.num_rows(), 4);
  EXPECT_TRUE(b.is_item_field("pixel_values"));
  EXPECT_FALSE(b.is_item_field("input_ids"));

  Batch tail = b.rows(2, 2);
  EXPECT_EQ(tail.num_rows(), 2);
  EXPECT_TRUE(at::equal(tail.at("input_ids"), b.at("input_ids").narrow(0, 2, 2)));
  EXPECT_TRUE(at::equal(tail.at("pixel_values"), images.narrow(0, 1, 3)));
  EXPECT_TRUE(at::equal(tail.at("pixel_values.row"), at::tensor({0, 1, 1}, at::kLong)));

  Batch middle = b.rows(1, 1);  // the row without images
  EXPECT_EQ(middle.at("pixel_values").size(0), 0);
  EXPECT_EQ(middle.at("pixel_values.row").size(0), 0);
  Batch head = b.rows(0, 2);
  EXPECT_TRUE(at::equal(head.at("pixel_values"), images.narrow(0, 0, 1)));
  EXPECT_TRUE(at::equal(head.at("pixel_values.row"), at::tensor({0}, at::kLong)));

  EXPECT_THROW(b.set_items("bad", images, at::tensor({0, 1}, at::kLong)), c10::Error);
}

}  // namespace
