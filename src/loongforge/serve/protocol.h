// openpi's policy-server messages (the websocket + msgpack protocol of openpi-client's WebsocketClientPolicy), as
// msgpack_numpy encodes them:
// - a NumPy array is a map {b"__ndarray__": True, b"data": <bytes>, b"dtype": "<f4", b"shape": [..]} (keys as
//   msgpack bin), a NumPy scalar {b"__npgeneric__": True, b"data": <number>, b"dtype": "<f8"};
// - the server's first message on a connection is its metadata (a map, binary frame);
// - a request is a map of observations; the reply a map with "actions" (an array) and the server's timings; an
//   error is answered with a text frame (the client raises with its text).
// Decoding is the server's input from the network: every malformed message is a one-line lf::Error naming the field,
// within bounds on sizes and nesting (protocol.cpp), never a crash.
#pragma once
#include <ATen/core/Tensor.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <map>
#include <string>

namespace lf::serve {

struct Request {
  std::map<std::string, at::Tensor> observation;  // by feature name (nested maps joined with '.'), CPU tensors
  std::string prompt;                              // the "prompt" field ("" when absent)
};

// A request's msgpack bytes -> its observations. Values: NumPy arrays (bool, int8..64, uint8..64, float16/32/64,
// little-endian or one byte), NumPy scalars, numbers, rectangular lists of numbers; the text field "prompt"; maps
// (flattened: {"observation": {"state": x}} is "observation.state"). Errors: lf::Error "request: ...".
Request decode_request(const char* data, size_t size);

// The reply to a request: {"actions": ACTIONS as a NumPy array (its dtype), ...EXTRA's fields (JSON values)}.
std::string encode_reply(const at::Tensor& actions, const nlohmann::json& extra);

// A JSON value as msgpack (maps with str keys): the metadata message.
std::string encode_json(const nlohmann::json& value);

// A msgpack_numpy array for tests and the fuzz seeds: the map encode_reply writes for T.
std::string encode_array(const at::Tensor& t);

}  // namespace lf::serve
