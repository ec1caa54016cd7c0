// lf::JsonReader (core/json.h): typed fields with errors naming the file and the field.
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "loongforge/core/error.h"
#include "loongforge/core/json.h"
#include "test_util.h"

namespace {

using nlohmann::json;

using lf::test::error_of;

TEST(JsonReader, TypedFieldsAndDefaults) {
  json j = json::parse(R"({"n": 3, "x": 2.5, "b": true, "s": "hi", "l": [1, 2], "one": 7, "nul": null,
                           "o": {"k": 1}})");
  lf::JsonReader rd(j, "cfg.json");
  EXPECT_EQ(rd.integer("n"), 3);
  EXPECT_EQ(rd.integer("absent", 5), 5);
  EXPECT_EQ(rd.integer("nul", 6), 6);  // null = absent
  EXPECT_DOUBLE_EQ(rd.number("x"), 2.5);
  EXPECT_DOUBLE_EQ(rd.number("n"), 3.0);  // an integer is a number
  EXPECT_FALSE(rd.opt_number("nul").has_value());
  EXPECT_TRUE(rd.boolean("b"));
  EXPECT_FALSE(rd.boolean("absent", false));
  EXPECT_EQ(rd.string("s"), "hi");
  EXPECT_EQ(rd.string("absent", std::string("d")), "d");
  EXPECT_EQ(rd.int_list("l"), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(rd.int_list("one"), (std::vector<int64_t>{7}));
  EXPECT_TRUE(rd.int_list("absent").empty());
  EXPECT_TRUE(rd.has("n"));
  EXPECT_FALSE(rd.has("nul"));
  EXPECT_TRUE(rd.get("nul").is_null());  // get: present, null included
  EXPECT_EQ(rd.object("o").integer("k"), 1);
}

TEST(JsonReader, ErrorsNameFileAndField) {
  json j = json::parse(R"({"n": 2.5, "s": 5, "b": "yes", "l": [1, "a"], "m": "x", "nul": null,
                           "o": {"k": "v"}, "flat": 3})");
  lf::JsonReader rd(j, "cfg.json");
  EXPECT_EQ(error_of([&] { rd.integer("n"); }), "cfg.json: field 'n': expected an integer, got 2.5");
  EXPECT_EQ(error_of([&] { rd.number("b"); }), "cfg.json: field 'b': expected a number, got \"yes\"");
  EXPECT_EQ(error_of([&] { rd.string("s"); }), "cfg.json: field 's': expected a string, got 5");
  EXPECT_EQ(error_of([&] { rd.boolean("b"); }), "cfg.json: field 'b': expected true or false, got \"yes\"");
  EXPECT_EQ(error_of([&] { rd.integer("absent"); }), "cfg.json: field 'absent': missing");
  EXPECT_EQ(error_of([&] { rd.string("nul"); }), "cfg.json: field 'nul': missing");
  EXPECT_EQ(error_of([&] { rd.get("absent"); }), "cfg.json: field 'absent': missing");
  EXPECT_EQ(error_of([&] { rd.int_list("l"); }), "cfg.json: field 'l': expected a list of integers");
  EXPECT_EQ(error_of([&] { rd.int_list("m"); }), "cfg.json: field 'm': expected an integer or a list of integers");
  EXPECT_EQ(error_of([&] { rd.object("flat"); }), "cfg.json: field 'flat': expected an object");
  EXPECT_EQ(error_of([&] { rd.object("o").integer("k"); }), "cfg.json: field 'o.k': expected an integer, got \"v\"");
  EXPECT_EQ(error_of([&] { rd.expected("n", "an integer >= 1"); }), "cfg.json: field 'n': expected an integer >= 1, got 2.5");
  EXPECT_EQ(error_of([&] { rd.fail("", "broken"); }), "cfg.json: broken");

  // Nested path, values left out of the messages, and a required field of something that is not an object.
  json arr = json::array({1});
  lf::JsonReader quiet(j, "tok.json", "model");
  quiet.quote_values(false);
  EXPECT_EQ(error_of([&] { quiet.string("s"); }), "tok.json: field 'model.s': expected a string");
  EXPECT_EQ(error_of([&] { quiet.integer("n", 0); }), "tok.json: field 'model.n': expected an integer");
  EXPECT_EQ(error_of([&] { lf::JsonReader(arr, "tok.json", "model").get("k"); }), "tok.json: field 'model': expected an object");
  EXPECT_EQ(error_of([&] { lf::JsonReader(arr, "tok.json", "model").string("k"); }), "tok.json: field 'model': expected an object");
  EXPECT_EQ(lf::JsonReader(arr, "tok.json", "model").string("k", std::string("d")), "d");  // optional: absent
}

}  // namespace
