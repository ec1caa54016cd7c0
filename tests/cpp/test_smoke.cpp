#include <gtest/gtest.h>
#include "loongforge/core/error.h"
TEST(Error, FileErrorNamesFileAndField) {
  lf::Error e = lf::file_error("config.json", "rope_scaling.type", "unsupported value 'foo'");
  EXPECT_STREQ(e.what(), "config.json: field 'rope_scaling.type': unsupported value 'foo'");
}
